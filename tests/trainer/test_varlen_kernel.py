"""The ``sdpa_varlen`` kernel: packed rows attend per sample, and the boundaries are read once per forward."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from slipstream.trainer.engine import varlen


def _packed(lengths: list[int], vocab: int):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab, (sum(lengths),), generator=gen)
    pos = torch.cat([torch.arange(n) for n in lengths])
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return ids, pos, cu


def test_boundaries_are_read_once_per_forward_and_logits_equal_per_sample(tiny_model_path, monkeypatch):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, attn_implementation=varlen.NAME).eval()
    assert model.config.num_hidden_layers >= 2
    reads = []
    monkeypatch.setattr(varlen, "read_bounds", lambda cu: reads.append(1) or cu.tolist())
    lengths = [5, 3, 7]
    ids, pos, cu = _packed(lengths, model.config.vocab_size)
    kwargs = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": 7, "max_length_k": 7}
    with torch.no_grad():
        packed = model(input_ids=ids[None], position_ids=pos[None], use_cache=False, **kwargs).logits[0]
        assert len(reads) == 1  # one read for all layers
        model(
            input_ids=ids[None],
            position_ids=pos[None],
            use_cache=False,
            **{**kwargs, "cu_seq_lens_q": cu.clone()},
        )
        assert len(reads) == 2  # a new forward (new boundaries tensor) reads again
        alone = [
            model(input_ids=ids[None, a:b], use_cache=False).logits[0]
            for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)
        ]
    torch.testing.assert_close(packed, torch.cat(alone), atol=2e-5, rtol=1e-5)


def test_changed_boundaries_in_the_same_tensor_are_read_again():
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    assert varlen.sample_lengths(cu) == [2, 3]
    cu[2] = 6
    assert varlen.sample_lengths(cu) == [2, 4]
