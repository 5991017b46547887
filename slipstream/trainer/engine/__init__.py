"""Model engines behind one interface (``base.ModelEngine``): FSDP2 (``fsdp.FSDPEngine``, CPU gloo or GPU
NCCL) and Megatron-core (``megatron.MegatronEngine``, GPU only).

``make_engine(cfg)`` picks one by ``trainer.engine``; to add a backend, implement ``ModelEngine`` in a new
module here and add a ``name: "module:Class"`` row to ``ENGINES``'s ``lazy`` table.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from slipstream.trainer.engine.base import EngineOutput, LossFn, ModelEngine
from slipstream.utils.registry import Registry

if TYPE_CHECKING:
    from slipstream.config import Config

# Imported only when chosen, so CPU-only installs never import megatron.
ENGINES: Registry[type[ModelEngine]] = Registry(
    "trainer engine",
    "trainer.engine",
    base=ModelEngine,
    lazy={
        "fsdp": "slipstream.trainer.engine.fsdp:FSDPEngine",
        "megatron": "slipstream.trainer.engine.megatron:MegatronEngine",
    },
)


def make_engine(cfg: Config, **kwargs: Any) -> ModelEngine:
    """The engine ``trainer.engine`` names; an unknown name raises ValueError listing the known ones."""
    return ENGINES.get(cfg.trainer.engine)(cfg, **kwargs)


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
