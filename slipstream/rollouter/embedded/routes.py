"""The experts the embedded engine's MoE routers picked for each request's tokens (routing replay's source).

transformers' continuous batching runs one packed step of many requests; each router sees the step's rows
in the order of ``batch_processor.inputs_and_outputs.requests_in_batch``, each request its
``query_length`` rows (a prefill chunk, or the last token it generated). A forward hook on every router
(``utils/moe.py``) slices the step's top-k expert indices by request and files them under the request's id
at the positions those rows hold (``position_offset`` has already moved past them when the forward runs), so a
request recomputed from scratch overwrites its routes instead of adding to them. Prefix caching is off in this
engine, so every prompt token runs through the routers.

What a request gets (:meth:`RouteRecorder.take`): ``[tokens - 1, layers, experts_per_token]`` uint8 expert
ids for its prompt and generated tokens but the last (which no forward has seen), the layout of vLLM's
``routed_experts``; rows a forward has not reached are -1 in an int16 tensor instead (an abort cut short).

Hand-written because transformers' continuous batching records no routes (its ``output_router_logits``
path is for ``generate``), and hooks keep this out of the engine's generation loop.

Worked example::

    rec = RouteRecorder(model)                 # raises for a dense model
    rec.attach(manager)                        # the started ContinuousBatchingManager
    rec.open(cb_id)                            # before the request is added: only opened ids are kept
    ...                                        # requests run
    routes = rec.take(cb_id, tokens=len(input_ids) + len(output_ids) - 1)
"""

from __future__ import annotations

import threading

import torch

from slipstream.utils.moe import routers


class RouteRecorder:
    """Per request id, the routers' picks of its tokens; written by the generation thread, taken by the loop."""

    def __init__(self, model: torch.nn.Module) -> None:
        found = routers(model)
        if not found:
            raise ValueError(f"{type(model).__name__} has no router: no routes to record")
        self.num_layers = len(found)
        self.top_k = int(model.config.num_experts_per_tok)
        self._layer = {router: i for i, router in enumerate(found)}
        self._manager = None
        self._lock = threading.Lock()
        # request id -> layer -> [(first position, [rows, k] indices)] in the order they ran
        self._pieces: dict[str, list[list[tuple[int, torch.Tensor]]]] = {}
        for router in found:
            router.register_forward_hook(self._hook)

    def attach(self, manager) -> None:  # noqa: ANN001 - transformers' ContinuousBatchingManager
        self._manager = manager

    def open(self, request_id: str) -> None:
        """Keep the routes of ``request_id`` from now until :meth:`take` (steps that still run a request
        after it was taken, such as an abort's, leave nothing behind)."""
        with self._lock:
            self._pieces[request_id] = [[] for _ in range(self.num_layers)]

    def _batch(self) -> list | None:
        processor = getattr(self._manager, "batch_processor", None)
        io = getattr(processor, "inputs_and_outputs", None)
        return getattr(io, "requests_in_batch", None)

    def _hook(self, module: torch.nn.Module, args: tuple, output) -> None:  # noqa: ANN001
        batch = self._batch() if self._manager is not None else None
        if not batch:
            return  # not a continuous-batching step (e.g. a warm-up or a plain forward)
        idx = output[2].detach().to("cpu", torch.int16)
        layer, row = self._layer[module], 0
        with self._lock:
            for future in batch:
                state, n = future.state, future.query_length
                pieces = self._pieces.get(state.request_id)
                if pieces is not None:
                    pieces[layer].append((state.position_offset - n, idx[row : row + n]))
                row += n

    def take(self, request_id: str, tokens: int) -> torch.Tensor:
        """The routes of ``request_id``'s first ``tokens`` tokens, forgotten here afterwards."""
        with self._lock:
            pieces = self._pieces.pop(request_id, None)
        out = torch.full((max(tokens, 0), self.num_layers, self.top_k), -1, dtype=torch.int16)
        for layer, runs in enumerate(pieces or []):
            for start, idx in runs:
                stop = min(start + idx.shape[0], tokens)
                if stop > start:
                    out[start:stop, layer] = idx[: stop - start]
        return out.to(torch.uint8) if (out >= 0).all() else out
