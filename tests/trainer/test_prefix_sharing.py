"""Shared-prompt micro-batches (trainer/engine/prefix.py): the compressed layout maps every packed token to
a row holding the same token at the same position, and a training step on it gives the packed row's
logprobs, entropy, metrics and gradients."""

from __future__ import annotations

import pytest
import torch

from slipstream.trainer.algos import ADVANTAGES, AdvantageInputs, global_counts
from slipstream.trainer.engine.fsdp import FSDPEngine
from slipstream.trainer.engine.prefix import build_layout
from slipstream.trainer.loss import GlobalCounts, PolicyLoss
from slipstream.trainer.synthetic import make_packed_batch
from tests.trainer.conftest import trainer_settings


def _batch(shared: bool = True):
    # groups of 3: a 4-token prompt, a 6-token prompt and a lone sample; response lengths 1..7
    batch = make_packed_batch(
        [4, 4, 4, 6, 6, 6, 3],
        [2, 5, 1, 7, 3, 4, 2],
        vocab_size=200,
        seed=5,
        group_size=3,
        shared_prompts=shared,
    )
    batch["advantages"] = ADVANTAGES.get("grpo")(
        AdvantageInputs(batch["rewards"], batch["group_index"], batch["loss_mask"], batch["cu_seqlens"])
    ).advantages
    return batch


def test_layout_keeps_one_copy_of_each_group_prompt():
    batch = _batch()
    layout = build_layout(batch)
    assert layout is not None
    # every packed token is found in its row, at the same position
    assert torch.equal(layout.ids[layout.index], batch["input_ids"])
    assert torch.equal(layout.positions[layout.index], batch["position_ids"])
    assert layout.saved_tokens == 2 * 4 + 2 * 6  # two extra copies of each shared prompt
    assert [(b.prefix, b.suffix_lens) for b in layout.blocks] == [(4, (2, 5, 1)), (6, (7, 3, 4)), (5, ())]
    mask = layout.blocks[0].mask
    assert mask.shape == (8, 12)
    assert mask[:, :4].all()  # every suffix token sees the whole prompt
    assert mask[2, 4:].tolist() == [False, False, True, False, False, False, False, False]  # own token only
    assert mask[6, 4:].tolist() == [
        False,
        False,
        True,
        True,
        True,
        True,
        True,
        False,
    ]  # not the next sample's


def test_layout_shares_the_common_prefix_of_token_ids_only():
    assert build_layout(_batch(shared=False)) is None  # random prompts: nothing in common
    assert build_layout(_batch().exclude("group_index")) is None  # no groups known
    same = make_packed_batch([3, 3], [1, 1], vocab_size=50, group_size=2, shared_prompts=True)
    same["input_ids"][4:8] = same["input_ids"][0:4]  # identical samples: each keeps its last token apart
    layout = build_layout(same)
    assert [(b.prefix, b.suffix_lens) for b in layout.blocks] == [(3, (1, 1))]
    # the same first response token (the same token at the same position) is shared too
    partly = make_packed_batch([3, 3], [2, 2], vocab_size=50, group_size=2, shared_prompts=True)
    partly["input_ids"][8] = partly["input_ids"][3]
    partly["input_ids"][9] = (partly["input_ids"][4] + 1) % 50
    assert [(b.prefix, b.suffix_lens) for b in build_layout(partly).blocks] == [(4, (1, 1))]


def _step(model_path, share: bool, *overrides):
    cfg = trainer_settings(
        model_path,
        f"trainer.share_prompt_prefix={str(share).lower()}",
        "trainer.algorithm.entropy_coef=0.01",
        "trainer.logits_chunk_tokens=5",
        *overrides,
    )
    engine = FSDPEngine(cfg)
    engine.initialize()
    batch = _batch()
    tokens, seqs = global_counts(batch["loss_mask"], batch["cu_seqlens"])
    loss_fn = PolicyLoss(cfg.trainer.algorithm, GlobalCounts(tokens, seqs, 1.0))
    out = engine.forward_backward_batch(batch, loss_fn)
    grads = {n: p.grad.full_tensor().clone() for n, p in engine.model.named_parameters()}
    engine.optimizer.zero_grad(set_to_none=True)
    fwd = engine.forward_backward_batch(batch, loss_fn, forward_only=True)
    return out, fwd.tokens, grads


@pytest.mark.parametrize("budget", ["64", "24"])  # one micro-batch, or groups split over several
def test_shared_prefix_step_equals_packed_step(tiny_model_path, single_process_group, budget):
    packed = _step(tiny_model_path, False, f"trainer.micro_batch_tokens={budget}")
    shared = _step(tiny_model_path, True, f"trainer.micro_batch_tokens={budget}")
    assert packed[0].num_micro_batches == shared[0].num_micro_batches
    mask = _batch()["loss_mask"].float()
    for key in ("logprobs", "entropy"):
        assert ((packed[1][key] - shared[1][key]) * mask).abs().max().item() <= 1e-5, key
    for key, value in packed[0].metrics.items():
        assert shared[0].metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    for name, grad in packed[2].items():
        torch.testing.assert_close(shared[2][name], grad, atol=1e-6, rtol=1e-4)
