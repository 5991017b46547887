"""Megatron-core engine on the CPU (megatron-core's local layer spec, TP=PP=1, fp32, a 1-rank gloo group):
logprobs equal Hugging Face's on a tied Qwen2 with rope_theta 1e6, the exported weights are the checkpoint's,
and training steps change the weights and lower the loss. megatron-core's own CUDA-by-name allocations are
redirected to the CPU (``megatron_cpu.py``). Skipped when megatron-core is not installed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip(
    "megatron.core", reason="megatron-core not installed (pip install 'slipstream[megatron]')"
)

VOCAB = 112  # apart from every other width of the model (fc1 is 96), so a [rows, VOCAB] block is logits


def _tiny_qwen2(path: Path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    model.save_pretrained(path)
    return model


def _hf_logprobs(model, batch) -> torch.Tensor:
    out, cu = [], batch["cu_seqlens"].tolist()
    with torch.no_grad():
        for a, b in zip(cu[:-1], cu[1:], strict=True):
            ids = batch["input_ids"][a:b]
            logp = torch.log_softmax(model(ids[None]).logits[0].float(), dim=-1)
            out.append(torch.cat([torch.zeros(1), logp[:-1].gather(1, ids[1:, None])[:, 0]]))
    return torch.cat(out)


@pytest.fixture
def engine_on_cpu(tmp_path):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from slipstream.trainer.engine.megatron import MegatronEngine
    from tests.trainer.conftest import trainer_settings
    from tests.trainer.megatron_cpu import cuda_on_cpu

    hf_model = _tiny_qwen2(tmp_path / "qwen2")
    cfg = trainer_settings(
        tmp_path / "qwen2",
        "trainer.engine=megatron",
        "trainer.megatron_layer_spec=local",
        "trainer.lr=1e-2",
        "trainer.micro_batch_tokens=12",
    )
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with cuda_on_cpu():
            engine = MegatronEngine(cfg)
            engine.initialize()
            yield engine, hf_model
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


def _nll(outputs, mb):
    mask = mb["loss_mask"].float()
    return -(outputs["logprobs"] * mask).sum() / 17.0, {"tokens": mask.sum() / 17.0}


def test_megatron_cpu_logprobs_match_hf_and_training_moves_weights(engine_on_cpu):
    from safetensors.torch import load_file

    from slipstream.trainer.synthetic import make_packed_batch

    engine, hf_model = engine_on_cpu
    assert not engine.te
    inv_freq = engine.model.module.rotary_pos_emb.inv_freq
    assert inv_freq[1].item() == pytest.approx(1e6 ** (-2 / 8))  # head_dim 8, theta from rope_parameters
    hf = load_file(str(next(Path(engine.settings.model.path).glob("*.safetensors"))))
    exported = dict(engine.get_per_tensor_param())
    assert set(exported) == set(hf) - {"lm_head.weight"}
    for name, tensor in exported.items():
        assert torch.equal(tensor, hf[name]), name

    # 7, 11 and 9 tokens under a 12-token budget: three micro-batches, padded rows of different lengths
    batch = make_packed_batch([3, 5, 2], [4, 6, 7], vocab_size=VOCAB, seed=0)
    out = engine.forward_backward_batch(batch, None, forward_only=True)
    assert out.num_micro_batches == 3
    torch.testing.assert_close(out.tokens["logprobs"], _hf_logprobs(hf_model, batch), atol=1e-5, rtol=1e-5)

    losses = []
    for _ in range(4):
        result = engine.forward_backward_batch(batch, _nll)
        assert result.metrics["tokens"] == pytest.approx(1.0)
        losses.append(result.metrics["loss"])
        grad_norm = engine.optimizer_step()
        assert 0 < grad_norm < float("inf")
    assert losses[-1] < losses[0]
    after = dict(engine.get_per_tensor_param())
    name = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(after[name], hf[name])


class _EntropyOnly:
    """An entropy-bonus-only loss, flagged as the policy loss flags it when ``entropy_coef > 0``."""

    needs_entropy = True
    entropy_grad = True

    def __call__(self, outputs, mb):
        mask = mb["loss_mask"].float()
        return -(outputs["entropy"] * mask).sum() / 17.0, {}


def _megatron_grads(engine) -> dict[str, torch.Tensor]:
    named = dict(engine.model.module.named_parameters())
    return {
        "embed": named["embedding.word_embeddings.weight"].main_grad.detach().clone(),
        "down_proj": named["decoder.layers.0.mlp.linear_fc2.weight"].main_grad.detach().clone(),
        "o_proj": named["decoder.layers.1.self_attention.linear_proj.weight"].main_grad.detach().clone(),
    }


def test_megatron_entropy_gradient_equals_fsdp(engine_on_cpu):
    """The entropy bonus trains under Megatron: an entropy-only loss gives the FSDP engine's gradient."""
    from slipstream.trainer.engine.fsdp import FSDPEngine
    from slipstream.trainer.synthetic import make_packed_batch

    engine, _ = engine_on_cpu
    batch = make_packed_batch([3, 5, 2], [4, 6, 7], vocab_size=VOCAB, seed=1)
    engine.forward_backward_batch(batch, _EntropyOnly())
    got = _megatron_grads(engine)
    assert got["down_proj"].abs().sum() > 0

    fsdp = FSDPEngine(engine.settings)  # same model, same settings (12-token micro-batches, chunked head)
    fsdp.initialize()
    fsdp.forward_backward_batch(batch, _EntropyOnly())
    grads = {n: p.grad.full_tensor() for n, p in fsdp.model.named_parameters()}
    want = {
        "embed": grads["model.embed_tokens.weight"],
        "down_proj": grads["model.layers.0.mlp.down_proj.weight"],
        "o_proj": grads["model.layers.1.self_attn.o_proj.weight"],
    }
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=2e-6, rtol=1e-4, msg=name)


def _largest_vocab_block(fn) -> int:
    """Rows of the largest [rows, VOCAB] tensor any op creates while ``fn`` runs (forward and backward)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Watch(TorchDispatchMode):
        rows = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.is_view:  # no allocation (e.g. the weight's transpose inside a linear)
                return out
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == VOCAB:
                    Watch.rows = max(Watch.rows, t.numel() // VOCAB)
            return out

    with Watch():
        fn()
    return Watch.rows


def test_megatron_logits_path_is_chunked(engine_on_cpu):
    """No [tokens, vocab] logits: the output layer's largest vocabulary-wide block is one chunk of rows,
    forward and backward, and the chunked results equal the whole-block ones."""
    from slipstream.trainer.synthetic import make_packed_batch

    engine, hf_model = engine_on_cpu
    engine.tcfg.micro_batch_tokens = 64
    batch = make_packed_batch([3, 5, 2, 6], [12, 10, 9, 11], vocab_size=VOCAB, seed=2)  # 58 tokens, 1 mb
    engine._head.chunk = 8
    rows = _largest_vocab_block(lambda: engine.forward_backward_batch(batch, _EntropyOnly()))
    assert rows == 8
    chunked = _megatron_grads(engine)
    engine.model.zero_grad_buffer()
    engine._head.chunk = 0  # one block of every token: what the plain logits path holds
    rows = _largest_vocab_block(lambda: engine.forward_backward_batch(batch, _EntropyOnly()))
    assert rows >= 58
    for name, grad in _megatron_grads(engine).items():
        torch.testing.assert_close(chunked[name], grad, atol=1e-6, rtol=1e-5, msg=name)
    logp = engine.forward_backward_batch(batch, None, forward_only=True).tokens["logprobs"]
    torch.testing.assert_close(logp, _hf_logprobs(hf_model, batch), atol=1e-5, rtol=1e-5)


def test_memory_plan_of_megatron_is_its_own_state(engine_on_cpu):
    """`plan memory` plans a Megatron rank with Megatron's formulas: its parameters, fp32 gradient buffer
    and distributed optimizer state come within 20% of the bytes the engine really holds after a step."""
    from slipstream.config import load_config
    from slipstream.planning.memory import model_shape, trainer_gpu
    from slipstream.trainer.synthetic import make_packed_batch

    engine, _ = engine_on_cpu
    engine.forward_backward_batch(make_packed_batch([3], [4], vocab_size=VOCAB, seed=0), _nll)
    engine.optimizer_step()  # Adam's moments exist from the first step
    storages: dict[int, int] = {}

    def hold(t):
        if isinstance(t, torch.Tensor) and t.numel():
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()

    for p in engine.model.module.parameters():
        hold(p)
        hold(getattr(p, "main_grad", None))
    inner = engine.optimizer.optimizer
    for group in inner.param_groups:
        for p in group["params"]:
            hold(p)
            for value in inner.state.get(p, {}).values():
                hold(value)
    measured = sum(storages.values())

    path = engine.settings.model.path
    cfg = load_config(None, [f"model.path={path}", "trainer.engine=megatron", "trainer.device=cpu",
                             "trainer.num_ranks=1"])  # fmt: skip
    part = trainer_gpu(model_shape(path), cfg, 0)
    assert "fp32 gradient buffer" in part.items and "sharded gradients" not in part.items
    planned = sum(v for k, v in part.items.items() if k not in ("activations", "logits", "reserve"))
    assert 1 / 1.2 <= measured / planned <= 1.2, (measured, part.items)
