"""The interface every training backend implements (design.md §3), so the trainer loop, the algorithms and
weight sync never see FSDP or Megatron.

Lifecycle (every data-parallel rank runs the same calls in the same order)::

    engine = FSDPEngine(settings)         # or MegatronEngine(settings) (trainer/settings.py); nothing heavy
    engine.initialize()                   # process group (if needed), model, sharding, optimizer, scheduler
    for step ...:
        for mini_batch ...:
            out = engine.forward_backward_batch(shard, loss_fn)       # grads accumulate over micro-batches
            grad_norm = engine.optimizer_step()                        # clip, step, zero grads
        engine.lr_scheduler_step()
        if publish: for name, tensor in engine.get_per_tensor_param(): ...   # all ranks iterate together
    engine.save_checkpoint(path) / engine.load_checkpoint(path)

Data contract of ``forward_backward_batch``: ``data`` is this rank's share of a mini-batch in the packed
layout of ``slipstream.queue.batch.collate`` (flat token tensors, ``cu_seqlens``, per-sample tensors; see
``trainer/batching.py``). The engine cuts it into micro-batches by token budget, runs them, and calls
``loss_fn(outputs, micro_batch) -> (loss, metrics)`` on each, where ``outputs`` holds flat ``logprobs`` [t]
(log-probability of each token given the tokens before it, under logits divided by the sampling
temperature; 0 at each sample's first token), ``entropy`` [t] when ``loss_fn.needs_entropy`` is true, or
``values`` [t] for a value-head engine. ``logprobs`` and ``entropy`` are defined at the tokens of the data's
``loss_mask`` (where it has one); an engine may skip the others (0 there), since every loss, metric and
reference or proximal pass reads them through that mask. The loss a micro-batch returns must already be its share of the
*global* mini-batch loss (``algos/aggregation.py``); the engine handles data-parallel averaging.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tensordict import TensorDict

# loss_fn(outputs, micro_batch) -> (scalar loss, {metric name: scalar tensor}); metrics are summed over
# micro-batches and ranks, so they too must be shares of a global value. An optional attribute
# `needs_entropy = True` asks the engine for per-token entropy.
LossFn = Callable[[dict[str, torch.Tensor], TensorDict], tuple[torch.Tensor, dict[str, torch.Tensor]]]


@dataclass
class EngineOutput:
    """What ``forward_backward_batch`` returns on every rank."""

    # Sums over micro-batches and ranks of the loss_fn metrics, plus "loss" (identical on every rank).
    metrics: dict[str, float] = field(default_factory=dict)
    # Per-token outputs of this rank's data in its original order (forward_only): logprobs / values / entropy.
    tokens: dict[str, torch.Tensor] = field(default_factory=dict)
    num_micro_batches: int = 0
    num_tokens: int = 0


class ModelEngine(ABC):
    """A model with its optimizer and scheduler, sharded over the data-parallel ranks of one process group."""

    rank: int = 0
    world_size: int = 1

    @abstractmethod
    def initialize(self) -> None:
        """Build the model, shard it, build the optimizer and scheduler. Collective: all ranks call it."""

    @abstractmethod
    def forward_backward_batch(
        self, data: TensorDict, loss_fn: LossFn | None, forward_only: bool = False
    ) -> EngineOutput:
        """Run every micro-batch of ``data``; accumulate gradients unless ``forward_only``. Collective."""

    @abstractmethod
    def optimizer_step(self) -> float:
        """Clip gradients to ``trainer.grad_clip``, step, zero grads; return the pre-clip global grad norm.

        A non-finite norm skips the update (gradients are dropped) and is returned as is.
        """

    @abstractmethod
    def lr_scheduler_step(self) -> float:
        """Advance the learning-rate schedule by one trainer step; return the new learning rate."""

    @abstractmethod
    def get_per_tensor_param(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (HF parameter name, full unsharded tensor) one at a time.

        Memory stays bounded by one full tensor: each is gathered only when the consumer asks for it and
        dropped when the consumer moves on. Collective: every rank must iterate it to the end, together;
        non-zero ranks may simply discard what they receive.
        """

    @abstractmethod
    def to(
        self, device: str | torch.device, model: bool = True, optimizer: bool = True, grad: bool = True
    ) -> None:
        """Move parameters / optimizer state / gradients (e.g. offload to CPU while another job uses the GPU)."""

    @abstractmethod
    def save_checkpoint(self, path: str | Path) -> None:
        """Write model, optimizer, scheduler and RNG state under ``path`` (a directory). Collective."""

    @abstractmethod
    def load_checkpoint(self, path: str | Path) -> None:
        """Restore what :meth:`save_checkpoint` wrote; the next step equals the one the saver would run."""

    # ---------------------------------------------------------------- parallel layout
    # The trainer shards batches over data-parallel replicas; the ranks of one replica (Megatron's TP/PP
    # peers) receive the same shard and return the same outputs. FSDP: every rank is a replica.
    @property
    def dp_rank(self) -> int:
        return self.rank

    @property
    def dp_size(self) -> int:
        return self.world_size

    @property
    def dp_group(self):  # noqa: ANN201  (a torch ProcessGroup; None = the default group)
        return None

    # ---------------------------------------------------------------- optional introspection
    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def model_flops(self, lengths: list[int]) -> float:
        """Model FLOPs of one forward+backward over samples of these lengths (for MFU); 0 if unknown."""
        return 0.0
