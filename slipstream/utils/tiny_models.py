"""Tiny, random-initialised models for benchmarks and tests: nothing is ever downloaded.

A shared utility (``utils/``), so a role's measurement (``trainer/bench.py``), the bench commands
(``system/``) and the tests all take it from here.

:func:`make_tiny_model` writes a normal HF checkpoint directory (config, safetensors weights, tokenizer with a
ChatML chat template that understands tools) that every part of Slipstream accepts as a model path. The
tokenizer is byte-level with no merges: every UTF-8 byte is one token, plus the special tokens below, so any
text round-trips exactly and token counts are predictable (one per byte).

Worked example::

    path = make_tiny_model(tmp_path / "tiny")
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
"""

from __future__ import annotations

import json
from pathlib import Path

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
]

# ChatML, with tools rendered in the system turn and tool results as <tool_response> blocks in a user turn
# (the Hermes/Qwen convention the `tool` agent loop parses).
CHAT_TEMPLATE = (
    "{% if tools %}"
    "<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "You may call tools. Available tools:\n"
    "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}{{ '\\n' }}"
    'Call one as <tool_call>{"name": ..., "arguments": {...}}</tool_call>.<|im_end|>\n'
    "{% elif messages[0]['role'] == 'system' %}"
    "<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{% elif message['role'] == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ message['content'] }}\n</tool_response><|im_end|>\n"
    "{% else %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tiny_tokenizer(path: str | Path):
    """Write a byte-level tokenizer (256 byte tokens + SPECIAL_TOKENS) to ``path`` and return it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        additional_special_tokens=SPECIAL_TOKENS[1:],
    )
    tok.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS[1:]})
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(path))
    return tok


def make_tiny_model(
    path: str | Path,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 2048,
    seed: int = 0,
    dtype: str = "float32",
) -> Path:
    """Write a random-initialised Llama causal LM with the tiny tokenizer to ``path``; return the path.

    Calling it twice with the same arguments gives bit-identical weights (seeded initialisation).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = make_tiny_tokenizer(path)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.pad_token_id,
        torch_dtype=dtype,
    )
    return _save_seeded(LlamaForCausalLM, config, path, seed=seed, dtype=dtype, kind="tiny-llama")


# The MoE families tiny tests run: model_type -> (config class, causal-LM class, the config's name for the
# expert count). Both keep transformers 5.x's fused expert tensors in memory (``mlp.experts.gate_up_proj``
# [experts, 2 * moe_intermediate, hidden] and ``mlp.experts.down_proj`` [experts, hidden, moe_intermediate])
# and save one tensor per expert (``mlp.experts.E.gate_proj.weight`` ...), as the released checkpoints do.
MOE_FAMILIES = ("qwen3_moe", "olmoe")


def make_tiny_moe_model(
    path: str | Path,
    family: str = "qwen3_moe",
    *,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    head_dim: int = 64,
    num_experts: int = 4,
    experts_per_token: int = 2,
    moe_intermediate_size: int = 32,
    max_position_embeddings: int = 2048,
    seed: int = 0,
    dtype: str = "float32",
) -> Path:
    """Write a random-initialised mixture-of-experts causal LM (``family`` in :data:`MOE_FAMILIES`) with the
    tiny tokenizer to ``path``; return the path.

    Every layer is sparse (``experts_per_token`` of ``num_experts`` experts), top-k weights are renormalised
    (Qwen3-MoE's ``norm_topk_prob``; OLMoE's default leaves them as softmax shares), and ``head_dim`` is 64 by
    default because vLLM's CPU attention refuses smaller heads. OLMoE has no ``head_dim`` key: its heads are
    ``hidden_size / num_heads`` wide, so the default 128 / 2 gives 64 as well. Seeded: calling it twice with
    the same arguments gives bit-identical weights.

    Worked example::

        path = make_tiny_moe_model(tmp_path / "moe", "olmoe")
        model = AutoModelForCausalLM.from_pretrained(path)   # model.layers[0].mlp.experts.gate_up_proj
    """

    if family not in MOE_FAMILIES:
        raise ValueError(f"unknown MoE family {family!r}; known: {', '.join(MOE_FAMILIES)}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = make_tiny_tokenizer(path)
    common = dict(
        vocab_size=len(tok),
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        num_experts_per_tok=experts_per_token,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.pad_token_id,
        torch_dtype=dtype,
    )
    config, model_cls = _moe_config(family, common, head_dim, num_experts, moe_intermediate_size)
    return _save_seeded(model_cls, config, path, seed=seed, dtype=dtype, kind=f"tiny-{family}")


def _save_seeded(model_cls, config, path: Path, *, seed: int, dtype: str, kind: str) -> Path:  # noqa: ANN001
    """``model_cls(config)`` initialised from ``seed`` (the global RNG left as it was), saved to ``path`` with
    the generation config's end and pad ids and a ``slipstream_tiny.json`` marker; returns ``path``."""
    import torch

    from slipstream.utils.tensors import parse_dtype

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config).to(parse_dtype(dtype))
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    model.save_pretrained(str(path))
    (path / "slipstream_tiny.json").write_text(json.dumps({"seed": seed, "kind": kind}))
    return path


def _moe_config(family: str, common: dict, head_dim: int, num_experts: int, moe_intermediate: int):  # noqa: ANN202
    if family == "qwen3_moe":
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        config = Qwen3MoeConfig(
            **common,
            head_dim=head_dim,
            intermediate_size=4 * moe_intermediate,  # dense MLPs: none here (every layer is sparse)
            moe_intermediate_size=moe_intermediate,
            num_experts=num_experts,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
            router_aux_loss_coef=0.001,
        )
        return config, Qwen3MoeForCausalLM
    from transformers import OlmoeConfig, OlmoeForCausalLM

    if common["hidden_size"] // common["num_attention_heads"] != head_dim:
        raise ValueError(f"olmoe: head_dim is hidden_size / num_heads, not {head_dim}")
    config = OlmoeConfig(
        **common, intermediate_size=moe_intermediate, num_experts=num_experts, router_aux_loss_coef=0.01
    )
    return config, OlmoeForCausalLM
