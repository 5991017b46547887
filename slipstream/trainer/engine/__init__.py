"""Model engines behind one interface (``base.ModelEngine``): FSDP2 (``fsdp.FSDPEngine``, CPU gloo or GPU
NCCL) and Megatron-core (``megatron.MegatronEngine``, GPU only).

``make_engine(cfg)`` picks one by ``trainer.engine``; to add a backend, implement ``ModelEngine`` in a new
module here and add a row to ``ENGINES``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from slipstream.trainer.engine.base import EngineOutput, LossFn, ModelEngine

if TYPE_CHECKING:
    from slipstream.config import Config

# trainer.engine -> (module, class); imported lazily so CPU-only installs never import megatron.
ENGINES: dict[str, tuple[str, str]] = {
    "fsdp": ("slipstream.trainer.engine.fsdp", "FSDPEngine"),
    "megatron": ("slipstream.trainer.engine.megatron", "MegatronEngine"),
}


def make_engine(cfg: Config, **kwargs: Any) -> ModelEngine:
    try:
        module, cls = ENGINES[cfg.trainer.engine]
    except KeyError:
        raise KeyError(
            f"unknown engine {cfg.trainer.engine!r} (trainer.engine); choose one of {sorted(ENGINES)}"
        ) from None
    return getattr(importlib.import_module(module), cls)(cfg, **kwargs)


def make_aux_engines(cfg: Config) -> dict[str, ModelEngine]:
    """The engines a trainer rank runs beside the policy, initialised: ``critic`` (a value head, for
    ``gae``) and ``reference`` (the frozen initial policy, for ``kl_reference: reference``)."""
    algo, engines = cfg.trainer.algorithm, {}
    if algo.adv_estimator == "gae":
        engines["critic"] = make_engine(cfg, value_head=True)
    if algo.kl_type is not None and algo.kl_reference == "reference":
        if cfg.trainer.engine != "fsdp":
            raise ValueError(
                "trainer.algorithm.kl_reference `reference` is supported with trainer.engine fsdp"
            )
        engines["reference"] = make_engine(cfg, model_path=algo.reference_path or cfg.model.path, frozen=True)
    for engine in engines.values():
        engine.initialize()
    return engines


__all__ = ["ENGINES", "EngineOutput", "LossFn", "ModelEngine", "make_aux_engines", "make_engine"]
