"""Mixture-of-experts pieces of the FSDP engine: the load-balancing auxiliary loss, and routing replay
(:class:`RouteReplay`: the engine replays a micro-batch's ``routed_experts`` when it carries them; no server
returns them yet).

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

from slipstream.utils.moe import is_moe, routers

__all__ = ["ROUTES_KEY", "RouteReplay", "RouterRecorder", "forward_routes", "is_moe", "record_routes"]


class RouterRecorder:
    """Forward hooks on every router of an HF MoE model that keep its logits while armed.

    Lifecycle: built once after the model is loaded; ``armed()`` around a forward (never around a backward:
    activation checkpointing re-runs the forward there, which must not record twice); ``take_aux_loss()``
    after it, which also forgets what was recorded.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        found = routers(model)
        if not found:
            raise ValueError(
                f"trainer.moe.aux_loss_coef > 0 needs a mixture-of-experts model; {type(model).__name__} "
                "has no router whose logits it records"
            )
        self.num_experts = int(model.num_experts)
        self.top_k = int(model.num_experts_per_tok)
        self._loss_fn = sys.modules[type(model).__module__].load_balancing_loss_func
        self._armed = False
        self._logits: list[torch.Tensor] = []
        for router in found:
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


class RouteReplay:
    """Forward hooks that make every router of an HF MoE model pick given experts: routing replay (R3).

    ``routes`` is an integer tensor [rows, layers, experts_per_token]: for each row the routers see (the
    forward's tokens, flattened in the order the model runs them) and each MoE layer, the experts the
    inference server used, in its order. While routes are set, each router still computes its logits (so
    the policy gradient reaches its weight), but its top-k is replaced: the experts are the given ones and
    their weights are the router's own softmax probabilities at them, renormalised over the k as the family's
    router does (``norm_topk_prob``; routers without the flag, such as Mixtral's, renormalise). With the
    routes the router itself picks, outputs are unchanged to the bit.

    A row whose routes hold a -1 is routed by the router itself (prompt tokens the server returned no routes
    for, the padding of a padded batch).

    Lifecycle: :meth:`set` before the forward, :meth:`clear` after the backward (activation checkpointing
    re-runs the forward inside backward, which must replay the same routes).

    Worked example::

        replay = RouteReplay(model)
        replay.set(routes)                # [tokens, num_hidden_layers, num_experts_per_tok]
        loss = model(input_ids=ids[None]).logits.sum(); loss.backward()
        replay.clear()
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.routers = routers(model)
        if not self.routers:
            raise ValueError(
                f"routing replay needs a mixture-of-experts model; {type(model).__name__} has none"
            )
        self.top_k = int(model.num_experts_per_tok)
        self.num_experts = int(model.num_experts)
        self._routes: torch.Tensor | None = None
        self._layer = {router: i for i, router in enumerate(self.routers)}
        for router in self.routers:
            router.register_forward_hook(self._hook)

    def set(self, routes: torch.Tensor) -> None:
        want = (len(self.routers), self.top_k)
        if routes.dim() != 3 or tuple(routes.shape[1:]) != want:
            raise ValueError(f"routes: shape {list(routes.shape)}, want [rows, {want[0]}, {want[1]}]")
        if routes.numel() and (int(routes.min()) < -1 or int(routes.max()) >= self.num_experts):
            raise ValueError(f"routes: an expert index outside 0..{self.num_experts - 1} (or -1: free)")
        self._routes = routes.long()

    def clear(self) -> None:
        self._routes = None

    def _hook(self, module: torch.nn.Module, args: tuple, output):  # noqa: ANN001, ANN202
        if self._routes is None:
            return None
        logits = output[0]
        idx = self._routes[:, self._layer[module]].to(logits.device)
        if idx.shape[0] != logits.shape[0]:
            raise ValueError(f"routes: {idx.shape[0]} rows, but the router sees {logits.shape[0]} tokens")
        idx = torch.where((idx < 0).any(-1, keepdim=True), output[2], idx)
        weights = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, idx)
        if getattr(module, "norm_topk_prob", True):
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (logits, weights.to(logits.dtype), idx, *output[3:])


def record_routes(model: torch.nn.Module, **forward_kwargs) -> torch.Tensor:
    """Run ``model(**forward_kwargs)`` without gradients and return the experts each router picked:
    [rows, layers, experts_per_token], as :class:`RouteReplay` takes them."""
    picked: list[torch.Tensor] = []
    handles = [r.register_forward_hook(lambda m, a, out: picked.append(out[2])) for r in routers(model)]
    try:
        with torch.no_grad():
            model(**forward_kwargs)
    finally:
        for h in handles:
            h.remove()
    if not picked:
        raise ValueError(f"{type(model).__name__} has no router to record")
    return torch.stack(picked, dim=1)


ROUTES_KEY = "routed_experts"  # per-token [tokens, layers, experts_per_token] int routes in a batch


def forward_routes(routes: torch.Tensor, *, layout=None, grid_mask: torch.Tensor | None = None):  # noqa: ANN001, ANN201
    """A packed micro-batch's per-token ``routes`` laid out on the rows the model runs, and the shared-prompt
    layout to run them on: as they are; on the shared-prompt row (``layout``, ``engine/prefix.py``) when
    every sample sharing a row has the same routes there, else (the samples' prompts were routed differently,
    e.g. one's are unknown) the layout is dropped and the micro-batch runs packed; or on the padded grid
    (``grid_mask`` [samples, pad_to]), padding rows free (-1). Returns ``(routes, layout)``."""
    if layout is not None:
        out = routes.new_full((layout.ids.numel(), *routes.shape[1:]), -1).index_copy_(
            0, layout.index, routes
        )
        if torch.equal(out.index_select(0, layout.index), routes):
            return out, layout
        return routes, None
    if grid_mask is not None:
        out = routes.new_full((grid_mask.numel(), *routes.shape[1:]), -1)
        out[grid_mask.flatten()] = routes
        return out, None
    return routes, None
