"""HF ↔ Megatron weight maps on CPU: every (TP, PP) shard of a tiny Llama and Qwen2 converts back to the
exact HF tensors, shards have Megatron's shapes, and the QKV interleave puts each KV group together."""

from __future__ import annotations

import pytest
import torch

from slipstream.trainer.engine.megatron_convert import (
    ArchSpec,
    hf_to_mcore,
    mcore_to_hf,
    qkv_from_mcore,
    qkv_to_mcore,
    stage_rules,
    unshard,
)


def _hf_model(kind: str):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=False))
    return Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=True))


def test_qkv_interleave_groups_heads():
    spec = ArchSpec(1, 8, 4, 2, 2, 8, 10, False, False)
    q = torch.arange(8).float()[:, None].expand(8, 8)  # 4 heads x head_dim 2
    k = 100 + torch.arange(4).float()[:, None].expand(4, 8)
    v = 200 + torch.arange(4).float()[:, None].expand(4, 8)
    fused = qkv_to_mcore(q, k, v, spec)
    # group 0: q heads 0,1 (rows 0..3), k head 0, v head 0; then group 1
    assert fused[:, 0].tolist() == [0, 1, 2, 3, 100, 101, 200, 201, 4, 5, 6, 7, 102, 103, 202, 203]
    for a, b in zip(qkv_from_mcore(fused, spec), (q, k, v), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 2)])
@pytest.mark.parametrize("te", [True, False])
def test_round_trip_over_every_shard(kind, tp, pp, te):
    model = _hf_model(kind)
    hf = {k: v.detach() for k, v in model.state_dict().items()}
    spec = ArchSpec.from_hf_config(model.config)
    assert spec.qkv_bias == (kind == "qwen2") and spec.tied == (kind == "qwen2")
    shards = {
        (t, p): hf_to_mcore(hf, spec, tp_rank=t, tp_size=tp, pp_rank=p, pp_size=pp, te=te)
        for t in range(tp)
        for p in range(pp)
    }
    back: dict[str, torch.Tensor] = {}
    for p in range(pp):
        for rule in stage_rules(spec, p, pp, te=te):
            full = unshard([shards[(t, p)][rule.mcore] for t in range(tp)], rule.kind)
            back.update(mcore_to_hf(rule, full))
    expected = set(hf) - ({"lm_head.weight"} if spec.tied else set())
    assert set(back) == expected
    for name in expected:
        assert torch.equal(back[name], hf[name]), name
    # Megatron shapes on TP rank 0 of the first stage
    first = shards[(0, 0)]
    qkv_rows = (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim
    assert first["decoder.layers.0.self_attention.linear_qkv.weight"].shape == (qkv_rows // tp, spec.hidden)
    assert first["decoder.layers.0.mlp.linear_fc1.weight"].shape == (2 * spec.ffn_hidden // tp, spec.hidden)
    assert first["decoder.layers.0.mlp.linear_fc2.weight"].shape == (spec.hidden, spec.ffn_hidden // tp)
    assert first["embedding.word_embeddings.weight"].shape == (spec.vocab_size // tp, spec.hidden)


def test_unsupported_architecture_is_named():
    class Cfg:
        model_type = "gpt2"

    with pytest.raises(ValueError, match="gpt2"):
        ArchSpec.from_hf_config(Cfg())
