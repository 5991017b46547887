"""Mixture-of-experts pieces of the FSDP engine: the load-balancing auxiliary loss.

Hugging Face's MoE causal LMs (Qwen3-MoE, OLMoE, Mixtral, Qwen2-MoE, ...) compute Switch Transformer's
load-balancing loss themselves when called with ``output_router_logits``: each router's logits are recorded
by a forward hook (the model's ``_can_record_outputs["router_logits"]``) and the modelling module's
``load_balancing_loss_func`` turns them into one scalar, which ``forward`` adds to the language-modelling
loss as ``router_aux_loss_coef * aux_loss``. Our engine never asks the model for a loss (the logprob head
and the RL loss replace it) and runs the model through several paths (packed, padded, shared-prompt,
sequence-parallel), so instead of threading ``output_router_logits`` through each of them we record the same
router logits with our own hooks on the same modules and call the same HF function on them.

How the engine weights it (``trainer.moe.aux_loss_coef``): each micro-batch adds
``coef * aux_loss(micro-batch) * tokens(micro-batch) / tokens(mini-batch, all ranks)``, so a step's total is
the token-weighted mean of the micro-batches' aux losses times ``coef``, whatever the split over micro-batches
and ranks (the aux loss itself is of each micro-batch's routing, as in HF, where it is of each forward's).

Worked example::

    rec = RouterRecorder(model)          # raises when the model has no router to record
    with rec.armed():
        model(input_ids=ids)
    aux = rec.take_aux_loss()           # HF's load_balancing_loss_func over every layer's router logits
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch


def router_class(model: torch.nn.Module) -> type[torch.nn.Module] | None:
    """The module class whose first output is a layer's router logits, or None for a dense model."""
    record = getattr(model, "_can_record_outputs", None) or {}
    spec = record.get("router_logits")
    if spec is None:
        return None
    return getattr(spec, "target_class", spec)


def is_moe(model: torch.nn.Module) -> bool:
    """True when ``model`` is an HF mixture-of-experts model with routers we can record."""
    return router_class(model) is not None and any(
        isinstance(m, router_class(model)) for m in model.modules()
    )


class RouterRecorder:
    """Forward hooks on every router of an HF MoE model that keep its logits while armed.

    Lifecycle: built once after the model is loaded; ``armed()`` around a forward (never around a backward:
    activation checkpointing re-runs the forward there, which must not record twice); ``take_aux_loss()``
    after it, which also forgets what was recorded.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        cls = router_class(model)
        routers = [m for m in model.modules() if cls is not None and isinstance(m, cls)]
        if not routers:
            raise ValueError(
                f"trainer.moe.aux_loss_coef > 0 needs a mixture-of-experts model; {type(model).__name__} "
                "has no router whose logits it records"
            )
        self.num_experts = int(model.num_experts)
        self.top_k = int(model.num_experts_per_tok)
        self._loss_fn = sys.modules[type(model).__module__].load_balancing_loss_func
        self._armed = False
        self._logits: list[torch.Tensor] = []
        for router in routers:
            router.register_forward_hook(self._hook)

    def _hook(self, module: torch.nn.Module, args: tuple, output) -> None:  # noqa: ANN001
        if self._armed:
            logits = output[0] if isinstance(output, tuple) else output
            self._logits.append(logits.reshape(-1, logits.shape[-1]))

    @contextmanager
    def armed(self) -> Iterator[None]:
        self._logits.clear()
        self._armed = True
        try:
            yield
        finally:
            self._armed = False

    def take_aux_loss(self, token_mask: torch.Tensor | None = None) -> torch.Tensor:
        """HF's load-balancing loss over the routers recorded since ``armed()``; ``token_mask`` (the padded
        grid's attention mask) leaves padding out."""
        logits, self._logits = tuple(self._logits), []
        if not logits:
            raise RuntimeError("no router logits recorded: run the forward inside armed()")
        return self._loss_fn(logits, self.num_experts, self.top_k, token_mask)
