"""Finding the routers of a Hugging Face mixture-of-experts model, for every role that hooks them (the
trainer's aux loss and routing replay, the embedded server's route recording).

transformers names the module whose first output is a layer's router logits in the model's
``_can_record_outputs["router_logits"]`` (the hook ``output_router_logits`` uses); in 5.x every MoE router
(Qwen3-MoE's ``Qwen3MoeTopKRouter``, OLMoE's, Mixtral's, ...) returns ``(logits, top-k weights, top-k
expert indices)``. A dense model names none.
"""

from __future__ import annotations

import torch


def router_class(model: torch.nn.Module) -> type[torch.nn.Module] | None:
    """The module class whose first output is a layer's router logits, or None for a dense model."""
    record = getattr(model, "_can_record_outputs", None) or {}
    spec = record.get("router_logits")
    if spec is None:
        return None
    return getattr(spec, "target_class", spec)


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's routers in layer order (module order is the decoder layers' order)."""
    cls = router_class(model)
    return [m for m in model.modules() if cls is not None and isinstance(m, cls)]


def is_moe(model: torch.nn.Module) -> bool:
    """True when ``model`` is an HF mixture-of-experts model with routers we can hook."""
    return bool(routers(model))


# config.json keys whose positive value marks a mixture-of-experts model (Qwen-MoE/OLMoE, Mixtral, DeepSeek).
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def config_is_moe(config: dict) -> bool:
    """True when an HF ``config.json`` (as a dict) describes a mixture-of-experts model."""
    return any(int(config.get(key) or 0) > 0 for key in EXPERT_COUNT_KEYS)
