"""Chunked per-token logprobs and entropy over a vocabulary split across a tensor-parallel group.

Why: Megatron's output layer (``ColumnParallelLinear``) hands back full fp32 ``[tokens, vocab / tp]``
logits, and autograd keeps several such copies alive (the upcast, the softmax, the entropy's product): at
32K tokens and a 152K vocabulary that is tens of GB per rank. This module is ``trainer/logprobs.py``'s
chunked computation made vocab-parallel, so the Megatron engine trains long responses as FSDP does: each
chunk's local logits are reduced to three numbers per token (row max, sum of exponentials, the target's
logit) with one all-reduce each over the TP group, then freed; backward recomputes them chunk by chunk.

Values and gradients are the plain path's (``megatron.core.tensor_parallel.vocab_parallel_cross_entropy``
for the logprobs, ``-sum p log p`` for the entropy), with ``z = h W_local^T / temperature`` in fp32::

    d logprob / dz = onehot(target) - p           d entropy / dz = -p * (log p + entropy)

Both are local to the rank's vocabulary slice, so backward needs no communication: the hidden-state
gradient of this slice is partial, and the TP mapping the caller put in front (``copy_to_...`` or, under
sequence parallelism, ``gather_from_sequence_parallel_region``) sums it over the group, exactly as
``ColumnParallelLinear`` does for its own input. The entropy is differentiable (``entropy_coef`` trains).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F


def _all_reduce(t: torch.Tensor, op: Any, group: Any) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


class _VocabParallelTokenLogprobs(torch.autograd.Function):
    """(hidden [N, H], weight [V/tp, H], targets [N]) -> (logprobs [N] fp32, entropy [N] fp32 or [0])."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk, with_entropy, group, vocab_start):  # noqa: ANN001, ANN205
        n, v_local = hidden.shape[0], weight.shape[0]
        f32 = dict(dtype=torch.float32, device=hidden.device)
        logz, logp = torch.empty(n, **f32), torch.empty(n, **f32)
        ent = torch.empty(n if with_entropy else 0, **f32)
        local_t = targets - vocab_start
        owned = (local_t >= 0) & (local_t < v_local)
        local_t = local_t.clamp(0, v_local - 1)
        step = chunk if chunk > 0 else max(n, 1)
        for s in range(0, n, step):
            e = min(n, s + step)
            z = _logits(hidden[s:e], weight, temperature)
            m = _all_reduce(z.amax(dim=-1), dist.ReduceOp.MAX, group)
            z.sub_(m[:, None])
            total = _all_reduce(z.exp().sum(dim=-1), dist.ReduceOp.SUM, group)
            z.sub_(total.log()[:, None])  # z is now log p on this slice
            picked = z.gather(-1, local_t[s:e, None])[:, 0] * owned[s:e]
            logp[s:e] = _all_reduce(picked, dist.ReduceOp.SUM, group)
            logz[s:e] = m + total.log()
            if with_entropy:
                ent[s:e] = _all_reduce(-(z.exp() * z).sum(dim=-1), dist.ReduceOp.SUM, group)
            del z
        ctx.save_for_backward(hidden, weight, local_t, owned, logz, ent)
        ctx.temperature, ctx.step = temperature, step
        ctx.set_materialize_grads(False)
        if not with_entropy:
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_logp, g_ent):  # noqa: ANN001, ANN205
        hidden, weight, local_t, owned, logz, ent = ctx.saved_tensors
        none = (None,) * 8
        if g_ent is not None and ent.numel() == 0:
            g_ent = None
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (g_logp is None and g_ent is None) or not (need_h or need_w):
            return none
        gh = torch.empty_like(hidden) if need_h else None
        gw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        for s in range(0, hidden.shape[0], ctx.step):
            e = min(hidden.shape[0], s + ctx.step)
            logsm = _logits(hidden[s:e], weight, ctx.temperature).sub_(logz[s:e, None])
            p = logsm.exp()
            grad = torch.zeros_like(p)
            if g_ent is not None:
                grad = logsm.add_(ent[s:e, None]).mul_(p).mul_(-g_ent[s:e, None])
            if g_logp is not None:
                grad.addcmul_(p, g_logp[s:e, None], value=-1.0)
                hit = (g_logp[s:e] * owned[s:e]).to(grad.dtype)
                grad.scatter_add_(1, local_t[s:e, None], hit[:, None])
            del p, logsm
            if ctx.temperature != 1.0:
                grad.div_(ctx.temperature)
            grad = grad.to(hidden.dtype)
            if need_h:
                gh[s:e] = grad @ weight
            if need_w:
                gw.add_((grad.t() @ hidden[s:e]).float())
            del grad
        return gh, (gw.to(weight.dtype) if need_w else None), *none[2:]


def _logits(h: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    z = F.linear(h, weight).float()
    return z.div_(temperature) if temperature != 1.0 else z


def vocab_parallel_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    group: Any = None,
    vocab_start: int = 0,
    temperature: float = 1.0,
    chunk: int = 4096,
    entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprob of ``targets`` (global ids) under the softmax of logits split over ``group``, and entropy.

    ``weight`` is this rank's rows ``[vocab_start, vocab_start + V/tp)`` of the output layer; ``hidden``
    the full (already gathered) rows to score. ``chunk`` rows at a time; 0 = all at once. Every rank of
    ``group`` gets the same results. Example (TP=1)::

        logp, ent = vocab_parallel_token_logprobs(h, w, ids, entropy=True)
    """
    logp, ent = _VocabParallelTokenLogprobs.apply(
        hidden, weight, targets.long(), float(temperature), int(chunk), bool(entropy), group, int(vocab_start)
    )
    return logp, (ent if entropy else None)


@dataclass
class _Request:
    src: torch.Tensor  # rows of the [batch * seq, H] (batch-major) hidden states to score
    targets: torch.Tensor
    entropy: str | None  # None, "metric" (no gradient) or "grad"


class OutputLayerHead:
    """Turns a ``GPTModel``'s output layer into a per-token logprob head for the duration of a request.

    The layer keeps its parameters and names (checkpoints, weight export and DDP's grad buffers are
    unchanged); only its bound ``forward`` is replaced. Outside :meth:`request` it is the plain layer. Inside,
    it returns ``([1, n, 2] stacked (logprob, entropy), None)`` in place of ``(logits, bias)``; GPTModel's
    ``[s, b, ...] -> [b, s, ...]`` transpose turns that into ``[n, 1, 2]``, read by :func:`split_outputs`.

    Example::

        head = OutputLayerHead(gpt_model.output_layer, chunk_tokens=4096, temperature=1.0)
        with head.request(src, targets, entropy="grad"):
            out = model(ids, pos, mask)
        logp, ent = split_outputs(out)
    """

    def __init__(self, layer: torch.nn.Module, chunk_tokens: int, temperature: float) -> None:
        from megatron.core import parallel_state as ps

        self.layer, self.chunk, self.temperature = layer, int(chunk_tokens), float(temperature)
        self.group = ps.get_tensor_model_parallel_group()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self._plain = layer.forward
        self._request: _Request | None = None
        layer.forward = types.MethodType(OutputLayerHead._forward_of(self), layer)

    @contextlib.contextmanager
    def request(self, src: torch.Tensor, targets: torch.Tensor, entropy: str | None) -> Iterator[None]:
        self._request = _Request(src, targets, entropy)
        try:
            yield
        finally:
            self._request = None

    @staticmethod
    def _forward_of(head: OutputLayerHead):  # noqa: ANN205
        def forward(layer, input_, weight=None, runtime_gather_output=None):  # noqa: ANN001, ANN202
            if head._request is None:
                return head._plain(input_, weight=weight, runtime_gather_output=runtime_gather_output)
            return head._score(input_, layer.weight if weight is None else weight), None

        return forward

    def _score(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import (
            copy_to_tensor_model_parallel_region,
            gather_from_sequence_parallel_region,
        )

        req = self._request
        if getattr(self.layer, "sequence_parallel", False):
            hidden = gather_from_sequence_parallel_region(hidden, group=self.group)
        else:
            hidden = copy_to_tensor_model_parallel_region(hidden, group=self.group)
        flat = hidden.transpose(0, 1).reshape(-1, hidden.shape[-1]).index_select(0, req.src)
        logp, ent = vocab_parallel_token_logprobs(
            flat,
            weight,
            req.targets,
            group=self.group,
            vocab_start=self.tp_rank * weight.shape[0],
            temperature=self.temperature,
            chunk=self.chunk,
            entropy=req.entropy is not None,
        )
        if ent is None:
            ent = torch.zeros_like(logp)
        elif req.entropy != "grad":
            ent = ent.detach()
        return torch.stack([logp, ent], dim=-1)[None]


def split_outputs(out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs [n], entropy [n]) from the model's output under a :class:`OutputLayerHead` request."""
    flat = out.reshape(-1, 2)
    return flat[:, 0], flat[:, 1]
