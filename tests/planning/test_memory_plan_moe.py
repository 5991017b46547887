"""The memory plan of mixture-of-experts models: total, active and expert parameter counts against a hand
count of a tiny config (and the HF model's own tensors), the experts' optimizer state on the trainer GPU,
and the published sizes of Qwen3-30B-A3B."""

from __future__ import annotations

import json

import pytest

from slipstream.planning.memory import KNOWN, ModelShape, main, model_shape, shape_from_hf
from slipstream.utils.tiny_models import make_tiny_moe_model

# make_tiny_moe_model's defaults: hidden 128, 2 layers, 2 heads of 64 (1 KV head), 4 experts of width 32,
# top-2, untied, the tiny tokenizer's 263-token vocabulary
VOCAB, HIDDEN, LAYERS = 263, 128, 2
ATTENTION = HIDDEN * 2 * 64 + 2 * HIDDEN * 64 + 2 * 64 * HIDDEN  # q, k, v, o: 49,152
EXPERT = 3 * HIDDEN * 32  # gate, up and down of one expert: 12,288
ROUTER, NORMS = HIDDEN * 4, 2 * HIDDEN
EMBEDDINGS = 2 * VOCAB * HIDDEN + HIDDEN  # input and output (untied), final norm
HAND_TOTAL = EMBEDDINGS + LAYERS * (ATTENTION + 4 * EXPERT + ROUTER + NORMS)  # 265,600
HAND_EXPERTS = LAYERS * 4 * EXPERT  # 98,304
HAND_ACTIVE = HAND_TOTAL - LAYERS * 2 * EXPERT  # two of four experts a token does not reach: 216,448


@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe"])
def test_a_tiny_moe_is_counted_as_by_hand_and_as_its_tensors(tmp_path, family):
    from transformers import AutoModelForCausalLM

    path = make_tiny_moe_model(tmp_path / family, family)
    shape = model_shape(str(path))
    assert (shape.experts, shape.experts_per_token, shape.expert_intermediate) == (4, 2, 32)
    assert (shape.params, shape.expert_params, shape.active_params) == (HAND_TOTAL, HAND_EXPERTS, HAND_ACTIVE)
    named = dict(AutoModelForCausalLM.from_pretrained(path).named_parameters())
    experts = sum(p.numel() for n, p in named.items() if ".mlp.experts." in n)
    # the planner leaves out the per-head q/k norms (Qwen3: 64 each; OLMoE: over q's and k's widths)
    qk_norms = sum(p.numel() for n, p in named.items() if n.endswith(("q_norm.weight", "k_norm.weight")))
    assert experts == HAND_EXPERTS
    assert sum(p.numel() for p in named.values()) - qk_norms == HAND_TOTAL


def test_a_dense_model_has_no_experts_and_every_parameter_active():
    dense = KNOWN["Qwen2.5-7B"]
    assert dense.expert_params == 0 and dense.active_params == dense.params


def test_mixtral_and_olmoe_name_their_experts_as_their_configs_do():
    base = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "vocab_size": 100}
    mixtral = shape_from_hf(
        {**base, "num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 96}
    )
    assert (mixtral.experts, mixtral.experts_per_token, mixtral.expert_intermediate) == (8, 2, 96)
    assert mixtral.expert_params == 2 * 8 * 3 * 64 * 96
    dense = shape_from_hf({**base, "num_experts_per_tok": 2, "intermediate_size": 96})
    assert (dense.experts, dense.experts_per_token, dense.expert_intermediate) == (0, 0, 0)


def test_qwen3_30b_a3b_has_its_published_total_and_active_parameters():
    shape: ModelShape = KNOWN["Qwen3-30B-A3B"]
    assert shape.params == pytest.approx(30.5e9, rel=0.01)
    assert shape.active_params == pytest.approx(3.3e9, rel=0.03)


def test_the_plan_holds_every_experts_weights_and_adamw_moments_sharded(tmp_path, capsys):
    path = make_tiny_moe_model(tmp_path / "moe", "qwen3_moe")
    keys = [f"model.path={path}", "trainer.num_ranks=2", "trainer.device=cuda", "rollout.backend=vllm"]
    assert main(["configs/quickstart.yaml", *keys, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["params"], out["active_params"], out["expert_params"]) == (
        HAND_TOTAL,
        HAND_ACTIVE,
        HAND_EXPERTS,
    )
    items = out["trainer_gpu"]["items_gib"]
    assert "sharded experts: parameters, AdamW moments" in items
    main(["configs/quickstart.yaml", *keys])
    text = capsys.readouterr().out
    assert (
        "B active per token; routed experts" in text and "sharded experts: parameters, AdamW moments" in text
    )


def _hf_params(config: dict) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    keys = {k: v for k, v in config.items() if k not in ("architectures", "transformers_version")}
    return dict(AutoModelForCausalLM.from_config(AutoConfig.for_model(**keys)).named_parameters())


def test_dense_layers_and_a_shared_expert_are_counted_as_transformers_builds_them(tmp_path):
    # Qwen3-MoE with a dense layer among three (mlp_only_layers): one layer of attention + a dense MLP
    config = json.loads(
        (make_tiny_moe_model(tmp_path / "q", "qwen3_moe", num_layers=3) / "config.json").read_text()
    )
    config["mlp_only_layers"] = [1]
    shape = shape_from_hf(config)
    dense_layer = ATTENTION + 3 * HIDDEN * config["intermediate_size"] + NORMS
    assert shape.dense_layers == 1
    assert shape.params == EMBEDDINGS + 2 * (ATTENTION + 4 * EXPERT + ROUTER + NORMS) + dense_layer
    named = _hf_params(config)
    qk_norms = sum(p.numel() for n, p in named.items() if n.endswith(("q_norm.weight", "k_norm.weight")))
    assert sum(p.numel() for p in named.values()) - qk_norms == shape.params
    assert shape_from_hf({**config, "mlp_only_layers": [], "decoder_sparse_step": 3}).dense_layers == 2
    # Qwen2-MoE: a shared expert (and its gate) every token runs through, beside the routed ones
    qwen2 = {"model_type": "qwen2_moe", "vocab_size": VOCAB, "hidden_size": HIDDEN, "num_hidden_layers": 2,
             "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 96,
             "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48, "num_experts": 4,
             "num_experts_per_tok": 2, "tie_word_embeddings": False}  # fmt: skip
    shape = shape_from_hf(qwen2)
    shared = 3 * HIDDEN * 48 + HIDDEN
    assert shape.params == HAND_TOTAL + LAYERS * shared and shape.expert_params == HAND_EXPERTS
    assert shape.active_params == HAND_ACTIVE + LAYERS * shared
    named = _hf_params(qwen2)
    biases = sum(p.numel() for n, p in named.items() if n.endswith("bias"))  # q, k, v biases: not planned
    assert sum(p.numel() for p in named.values()) - biases == shape.params
