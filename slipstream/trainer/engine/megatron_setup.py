"""How a Hugging Face config becomes megatron-core ``GPTModel`` arguments: RoPE and the layer spec.

Pure functions (megatron-core is imported only to build a spec), so the mapping is unit-tested on CPU.

RoPE. transformers 5 keeps the rotary settings in ``config.rope_parameters`` (``rope_theta``,
``rope_type`` and the type's own fields); older configs carried ``rope_theta`` and ``rope_scaling`` as
attributes. Both places are read, ``rope_parameters`` first. megatron-core 0.16.1's ``RotaryEmbedding``
reproduces three HF rope types:

- ``default``: ``rotary_base`` only;
- ``linear``: positions divided by ``factor`` (``seq_len_interpolation_factor``), which is what HF's
  division of the inverse frequencies by ``factor`` amounts to;
- ``llama3``: ``rope_scaling=True`` with ``rope_scaling_factor``; megatron-core fixes the other three
  llama3 fields at ``low_freq_factor=1``, ``high_freq_factor=4``, ``original_max_position_embeddings=8192``
  (the values of every Llama 3.1/3.2 release), so other values are refused.

Any other type (yarn, dynamic, longrope, ...) is refused: training with the wrong positions would look like
a working run that learns a different model.

Layer spec. Transformer Engine's spec (fused layer norm + linear, packed THD attention) is used when
``transformer_engine`` is importable; otherwise megatron-core's local spec (plain torch modules, padded
attention). ``gpt_layer_specs`` imports Transformer Engine inside try/except, so importing the TE spec
function succeeds without it: the choice has to look for the package itself.
"""

from __future__ import annotations

import importlib.util
from typing import Any

# megatron-core 0.16.1 RotaryEmbedding._apply_scaling's fixed llama3 parameters.
_MCORE_LLAMA3 = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_settings(hf_config: Any) -> dict[str, Any]:
    """The HF config's RoPE as one flat dict with at least ``rope_theta`` and ``rope_type``."""
    params = getattr(hf_config, "rope_parameters", None)
    params = dict(params) if isinstance(params, dict) else {}
    if params and all(isinstance(v, dict) for v in params.values()):
        raise ValueError(
            f"rope_parameters per attention type ({sorted(params)}) are not supported by the megatron engine"
        )
    legacy = getattr(hf_config, "rope_scaling", None)
    if not params and isinstance(legacy, dict):
        params = dict(legacy)
    if "rope_type" not in params and "type" in params:
        params["rope_type"] = params.pop("type")
    params.setdefault("rope_type", "default")
    theta = params.get("rope_theta")
    if theta is None:
        theta = getattr(hf_config, "rope_theta", None)
    params["rope_theta"] = float(theta if theta is not None else 10000.0)
    return params


def rope_kwargs(hf_config: Any) -> dict[str, Any]:
    """``GPTModel`` keyword arguments that reproduce the HF model's rotary embedding.

    Example: Llama-3.1 (``rope_type=llama3``, theta 5e5, factor 8) gives
    ``{"position_embedding_type": "rope", "rotary_base": 500000.0, "rope_scaling": True,
    "rope_scaling_factor": 8.0}``.
    """
    rope = rope_settings(hf_config)
    kind = rope["rope_type"]
    out: dict[str, Any] = {"position_embedding_type": "rope", "rotary_base": rope["rope_theta"]}
    partial = getattr(hf_config, "partial_rotary_factor", None)
    if partial is not None and float(partial) != 1.0:
        raise ValueError(f"partial_rotary_factor={partial} is not supported by the megatron engine")
    if kind == "default":
        return out
    if kind == "linear":
        out["seq_len_interpolation_factor"] = float(rope["factor"])
        return out
    if kind == "llama3":
        differs = {
            k: rope.get(k)
            for k, v in _MCORE_LLAMA3.items()
            if rope.get(k) is not None and float(rope[k]) != v
        }
        if differs:
            raise ValueError(
                f"llama3 rope scaling with {differs}: megatron-core fixes {_MCORE_LLAMA3}, so this model's "
                "positions cannot be reproduced"
            )
        out.update(rope_scaling=True, rope_scaling_factor=float(rope["factor"]))
        return out
    raise ValueError(
        f"rope_type={kind!r} cannot be reproduced by the megatron engine (supported: "
        f"{', '.join(SUPPORTED_ROPE_TYPES)}); training would use the wrong positions"
    )


def transformer_engine_available() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def layer_spec_kind(choice: str) -> str:
    """``te`` or ``local`` for ``trainer.megatron_layer_spec`` (auto: te when Transformer Engine imports)."""
    if choice == "auto":
        return "te" if transformer_engine_available() else "local"
    if choice == "te" and not transformer_engine_available():
        raise RuntimeError(
            "trainer.megatron_layer_spec=te but transformer_engine is not installed "
            "(install it, or use megatron_layer_spec=local)"
        )
    if choice not in ("te", "local"):
        raise ValueError(f"trainer.megatron_layer_spec must be auto, te or local, got {choice!r}")
    return choice


def layer_spec(kind: str) -> Any:
    """megatron-core's transformer layer spec for a Llama-family decoder (RMSNorm, no QK norm)."""
    from megatron.core.models.gpt import gpt_layer_specs

    if kind == "te":
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=False)
    return gpt_layer_specs.get_gpt_layer_local_spec(qk_layernorm=False, normalization="RMSNorm")
