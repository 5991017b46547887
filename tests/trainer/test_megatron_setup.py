"""HF config → megatron-core arguments: the RoPE base and scaling are read from transformers 5's
``rope_parameters`` (and from legacy attributes), rope types megatron-core cannot reproduce are refused, the
llama3 mapping gives HF's inverse frequencies, and the layer spec is the local one without Transformer
Engine. The last pipeline stage of a tied model loads the embedding into its output layer."""

from __future__ import annotations

import types

import pytest
import torch

from slipstream.trainer.engine.megatron_setup import layer_spec_kind, rope_kwargs, rope_settings

LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _llama(**rope):
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=64, num_attention_heads=4, max_position_embeddings=16384, rope_parameters=rope or None
    )


def test_qwen2_rope_theta_from_rope_parameters():
    from transformers import Qwen2Config

    config = Qwen2Config(rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    assert not hasattr(config, "rope_theta")  # transformers 5 keeps it in rope_parameters only
    assert rope_kwargs(config) == {"position_embedding_type": "rope", "rotary_base": 1e6}


def test_llama3_scaling_maps_to_gptmodel_arguments():
    assert rope_kwargs(_llama(**LLAMA3)) == {
        "position_embedding_type": "rope",
        "rotary_base": 500000.0,
        "rope_scaling": True,
        "rope_scaling_factor": 8.0,
    }


def test_legacy_attributes_and_linear_scaling():
    legacy = types.SimpleNamespace(rope_theta=2e5, rope_scaling={"type": "linear", "factor": 4.0})
    assert rope_settings(legacy)["rope_type"] == "linear"
    assert rope_kwargs(legacy) == {
        "position_embedding_type": "rope",
        "rotary_base": 2e5,
        "seq_len_interpolation_factor": 4.0,
    }
    assert rope_kwargs(types.SimpleNamespace())["rotary_base"] == 10000.0


@pytest.mark.parametrize("rope_type", ["yarn", "dynamic", "longrope"])
def test_unsupported_rope_type_is_refused(rope_type):
    config = types.SimpleNamespace(rope_parameters={"rope_type": rope_type, "rope_theta": 1e6, "factor": 4.0})
    with pytest.raises(ValueError, match=f"rope_type='{rope_type}' cannot be reproduced"):
        rope_kwargs(config)


def test_llama3_with_other_fixed_fields_is_refused():
    config = types.SimpleNamespace(rope_parameters={**LLAMA3, "high_freq_factor": 2.0})
    with pytest.raises(ValueError, match="high_freq_factor"):
        rope_kwargs(config)


def test_megatron_rope_equals_hf_inverse_frequencies():
    """The mapped arguments give megatron-core's RotaryEmbedding the inverse frequencies HF computes."""
    pytest.importorskip("megatron.core", reason="megatron-core not installed")
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for config, kind in ((_llama(**LLAMA3), "llama3"), (_llama(rope_type="default", rope_theta=5e5), None)):
        kwargs = rope_kwargs(config)
        kwargs.pop("position_embedding_type")
        mcore = RotaryEmbedding(kv_channels=16, rotary_percent=1.0, use_cpu_initialization=True, **kwargs)
        if kind is None:
            expected = 1.0 / (5e5 ** (torch.arange(0, 16, 2).float() / 16))
        else:
            expected = ROPE_INIT_FUNCTIONS[kind](config, "cpu")[0]
        torch.testing.assert_close(mcore.inv_freq, expected.float())


def test_local_spec_without_transformer_engine(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "transformer_engine" else real(name, *a)
    )
    assert layer_spec_kind("auto") == "local"
    assert layer_spec_kind("local") == "local"
    with pytest.raises(RuntimeError, match="transformer_engine is not installed"):
        layer_spec_kind("te")


def test_local_spec_modules():
    pytest.importorskip("megatron.core", reason="megatron-core not installed")
    from slipstream.trainer.engine.megatron_setup import layer_spec

    sub = layer_spec("local").submodules  # plain torch modules: loads as the te=False name map expects
    assert sub.self_attention.submodules.q_layernorm.__name__ == "IdentityOp"
    assert sub.self_attention.submodules.core_attention.__name__ == "DotProductAttention"


def test_tied_last_stage_loads_embedding_into_output_layer():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from slipstream.trainer.engine.megatron_convert import ArchSpec, hf_to_mcore

    config = Qwen2Config(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    hf = {k: v.detach() for k, v in Qwen2ForCausalLM(config).state_dict().items()}
    spec = ArchSpec.from_hf_config(config)
    embed = hf["model.embed_tokens.weight"]
    for tp_rank in range(2):
        last = hf_to_mcore(hf, spec, tp_rank=tp_rank, tp_size=2, pp_rank=1, pp_size=2, te=False)
        assert torch.equal(last["output_layer.weight"], embed.chunk(2)[tp_rank])
    first = hf_to_mcore(hf, spec, tp_rank=0, tp_size=1, pp_rank=0, pp_size=2, te=False)
    assert "output_layer.weight" not in first
    single = hf_to_mcore(hf, spec, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, te=False)
    assert "output_layer.weight" not in single  # one stage: the output layer uses the embedding itself
