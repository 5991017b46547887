"""Train–inference mismatch: how far the trainer's log-probabilities of the sampled tokens are from the ones
the inference server returned for them, at the same weights, measured every step.

Why: the server and the trainer run the same weights through different kernels, dtypes (a bf16 push of fp32
weights), attention implementations and sampling settings; each difference moves the logprobs apart, and the
loss's importance ratios absorb it silently. Measured on tokens both sides scored with the same weights, the
gap is the mismatch alone, without the staleness that ``trainer/approx_kl_behaviour`` (the trained policy
against the behaviour one, whatever version sampled the tokens) mixes in.

Which pair (``trainer.py``): server = the behaviour logprobs (``old_logprobs``); trainer = its logprobs of the
same tokens at the weights it holds before the step, that is the proximal pass when the run makes one
(the whole batch), else the forward of the step's first update (its first mini-batch; nothing has stepped
yet). Only response tokens (``loss_mask``) stamped with the trainer's version count: those the server
generated with the weights the trainer holds. Older tokens are left out; with ``sync_every`` > 1, on the
steps where the trainer holds weights it never pushed, no token counts.

Figures, with ``d = trainer - server`` and ``r = exp(d)`` (the importance ratio; ``d`` clamped to
[-20, 20] inside ``r`` as the KL estimators do) over the counted tokens:

    mismatch/k3              mean(r - 1 - d) >= 0: k3 estimate of KL(server || trainer) (tokens sampled by
                             the server; verl's rollout-correction ``k3_kl``)
    mismatch/abs_diff_mean   mean |d|
    mismatch/abs_diff_max    max |d|
    mismatch/ratio_p1, _p50, _p99   quantiles of r (linear interpolation, ``torch.quantile``)
    mismatch/ratio_outside   share of tokens with r outside [0.8, 1.25]
    mismatch/measured_frac   counted tokens / response tokens looked at

Only ``measured_frac`` is reported (as 0) when no token counts.

Across ranks: sums and counts are all-reduced, the maximum is all-reduced with MAX, and the quantiles come
from a systematic sample: every rank takes every s-th of its values, with one stride s for all ranks chosen
so that the gathered sample holds about ``sample_per_rank`` x world size values; exact when all values
fit. A rank that holds a copy of another's tokens (sequence- or tensor-parallel peers) or none (a pipeline
stage that runs no loss) changes none of the figures: every token then has the same number of copies, and
all figures are ratios, maxima or quantiles. Everything runs without gradient in one pass over the values.

Example::

    c = MismatchCollector(version=3)
    c.add(trainer_logp, server_logp, loss_mask, versions)   # per micro-batch, or once for the whole batch
    c.reduce()                    # {"mismatch/k3": ..., ...}; c.reduce(world_size=n, device=...) on n ranks
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

RATIO_BAND = (0.8, 1.25)  # a token outside it moved the ratio by more than 20-25 %
QUANTILES = {"ratio_p1": 0.01, "ratio_p50": 0.50, "ratio_p99": 0.99}
_LOG_RATIO_CLAMP = 20.0


class MismatchCollector:
    """Collects ``d = trainer - server`` at the counted tokens of one step; :meth:`reduce` gives the figures.

    ``version``: the trainer's weight version; tokens stamped with another are not counted (None: count
    every response token). ``sample_per_rank`` bounds the values each rank sends for the quantiles.
    """

    def __init__(self, version: int | None, *, sample_per_rank: int = 1 << 15) -> None:
        self.version = version
        self.sample_per_rank = sample_per_rank
        self._parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (d, counted, response)

    @torch.no_grad()
    def add(
        self,
        trainer_logp: torch.Tensor,
        server_logp: torch.Tensor,
        mask: torch.Tensor,
        versions: torch.Tensor | None = None,
    ) -> None:
        """Flat per-token tensors of equal length; ``mask``: response tokens (the loss mask). The selection
        waits for :meth:`reduce`, so adding never waits on the device."""
        dev = trainer_logp.device
        mask = mask.to(dev).bool()
        counted = mask
        if self.version is not None and versions is not None:
            counted = mask & (versions.to(dev) == self.version)
        f64 = torch.float64  # identical logprobs give exactly 0, and sums over many tokens stay exact
        self._parts.append((trainer_logp.detach().to(f64) - server_logp.detach().to(dev, f64), counted, mask))

    @torch.no_grad()
    def reduce(
        self,
        *,
        world_size: int = 1,
        device: torch.device | str = "cpu",
        group: dist.ProcessGroup | None = None,
    ) -> dict[str, float]:
        """The figures over every rank's values. Collective when ``world_size`` > 1: every rank of ``group``
        (``world_size`` ranks) calls it, a rank with no values too."""
        d, seen = torch.zeros(0, dtype=torch.float64, device=device), 0
        if self._parts:
            diffs, counted, response = (torch.cat(x).to(device) for x in zip(*self._parts, strict=True))
            d, seen = diffs[counted], int(response.sum())
        clamped = d.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
        ratio = torch.exp(clamped)
        low, high = RATIO_BAND
        count = torch.tensor([float(d.numel()), float(seen)], dtype=torch.float64, device=device)
        sums = torch.cat(
            [
                count,
                torch.stack([(ratio - 1.0 - clamped).sum(), d.abs().sum()]),
                ((ratio < low) | (ratio > high)).sum().to(torch.float64)[None],
            ]
        )
        peaks = torch.stack([d.abs().max() if d.numel() else d.new_zeros(()), count[0]])
        if world_size > 1:
            dist.all_reduce(sums, group=group)
            dist.all_reduce(peaks, op=dist.ReduceOp.MAX, group=group)
        n, seen, k3_sum, abs_sum, outside = sums.tolist()
        out = {"mismatch/measured_frac": n / seen if seen else 0.0}
        if n == 0:
            return out
        stride = max(1, math.ceil(n / (self.sample_per_rank * world_size)))
        sample = _gather_sample(ratio[::stride], math.ceil(peaks[1].item() / stride), world_size, group)
        qs = torch.quantile(
            sample, torch.tensor(list(QUANTILES.values()), dtype=torch.float64, device=device)
        )
        out["mismatch/k3"] = k3_sum / n
        out["mismatch/abs_diff_mean"] = abs_sum / n
        out["mismatch/abs_diff_max"] = peaks[0].item()
        out.update({f"mismatch/{k}": v for k, v in zip(QUANTILES, qs.tolist(), strict=True)})
        out["mismatch/ratio_outside"] = outside / n
        return out


def token_mismatch(
    trainer_logp: torch.Tensor, server_logp: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """The figures of one process's tokens: every ``mask`` token counts (see the module docstring)."""
    collector = MismatchCollector(None)
    collector.add(trainer_logp, server_logp, mask)
    return collector.reduce(device=trainer_logp.device)


def _gather_sample(
    local: torch.Tensor, width: int, world_size: int, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Every rank's ``local`` values (at most ``width`` each), NaN-padded for the all-gather, then unpadded."""
    if world_size == 1:
        return local
    padded = torch.full((width,), math.nan, dtype=local.dtype, device=local.device)
    padded[: local.numel()] = local
    parts = [torch.empty_like(padded) for _ in range(world_size)]
    dist.all_gather(parts, padded, group=group)
    flat = torch.cat(parts)
    return flat[~torch.isnan(flat)]
