"""Model engines behind one interface (``base.ModelEngine``): FSDP2 (``fsdp.FSDPEngine``, CPU gloo or GPU
NCCL) and Megatron-core (``megatron.MegatronEngine``, GPU only).

``make_engine(settings)`` (a :class:`~slipstream.trainer.settings.TrainerSettings`) picks one by
``trainer.engine``; to add a backend, implement ``ModelEngine`` in a new module here, taking the settings,
and add a ``name: "module:Class"`` row to ``ENGINES``'s ``lazy`` table.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from slipstream.trainer.engine.base import EngineOutput, LossFn, ModelEngine
from slipstream.utils.registry import Registry

if TYPE_CHECKING:
    from slipstream.trainer.settings import TrainerSettings

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


def make_engine(settings: TrainerSettings, **kwargs: Any) -> ModelEngine:
    """The engine ``trainer.engine`` names; an unknown name raises ValueError listing the known ones."""
    return ENGINES.get(settings.trainer.engine)(settings, **kwargs)


def make_aux_engines(settings: TrainerSettings, policy: ModelEngine | None = None) -> dict[str, ModelEngine]:
    """The engines a trainer rank runs beside the policy, initialised: ``critic`` (a value head, for
    ``gae``) and ``reference`` (the frozen initial policy, for ``kl_reference: reference``).

    With ``trainer.lora`` and a reference of model.path, the reference is ``policy`` (the initialised
    policy engine) with its adapters off: its frozen base weights are the initial policy, so no second
    copy of the model is built. Without ``policy`` a separate frozen copy is built as for full models."""
    algo, engines = settings.trainer.algorithm, {}
    reference = None
    if algo.adv_estimator == "gae":
        engines["critic"] = make_engine(settings, value_head=True)
    if algo.kl_type is not None and algo.kl_reference == "reference":
        if settings.trainer.engine != "fsdp":
            raise ValueError(
                "trainer.algorithm.kl_reference `reference` is supported with trainer.engine fsdp"
            )
        path = algo.reference_path or settings.model.path
        if settings.trainer.lora.enabled and path == settings.model.path and policy is not None:
            reference = policy.base_reference()  # already initialised: it is the policy
        else:
            engines["reference"] = make_engine(settings, model_path=path, frozen=True)
    for engine in engines.values():
        engine.initialize()
    if reference is not None:
        engines["reference"] = reference
    return engines


__all__ = ["ENGINES", "EngineOutput", "LossFn", "ModelEngine", "make_aux_engines", "make_engine"]
