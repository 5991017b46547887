"""Policy losses: ``POLICY_LOSSES.get(cfg.trainer.algorithm.policy_loss)(PolicyLossInputs) -> PolicyLossOutput``.

A policy loss turns per-token log-probabilities into a per-token loss; aggregation over tokens and
sequences (``algos/aggregation.py``), off-policy weights (``algos/correction.py``), the KL penalty and the
entropy bonus are composed around it by the trainer (``trainer/loss.py``). Formulas follow verl's
``core_algos.py``; each module's docstring names its paper and formula.

``old_logp`` is the policy the ratio is taken against: the behaviour logprobs from the inference server
when the trainer does not recompute (verl's "bypass mode"), or the proximal logprobs the trainer
recomputed at the start of the step. ``behav_logp`` is only read by ``decoupled_ppo``.

To add a loss: write ``losses/<name>.py`` with a function decorated by ``@POLICY_LOSSES.register("<name>")``
and import it at the bottom of this file.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slipstream.utils.registry import Registry

# Bound on |log ratio| before exponentiating (verl clamps to the same range).
LOG_RATIO_BOUND = 20.0


@dataclass
class PolicyLossInputs:
    logp: torch.Tensor  # float [T] under the current parameters (differentiable)
    old_logp: torch.Tensor  # float [T] the ratio's denominator (behaviour or proximal)
    advantages: torch.Tensor  # float [T]
    mask: torch.Tensor  # bool/float [T] policy tokens
    seg: torch.Tensor  # int64 [T] sample index of each token
    num_seqs: int
    clip_low: float = 0.2
    clip_high: float = 0.2
    clip_c: float | None = None  # dual-clip bound (> 1) for negative advantages; None disables
    behav_logp: torch.Tensor | None = None  # float [T] behaviour logprobs (decoupled_ppo)
    behav_cap: float | None = None  # decoupled_ppo: drop tokens whose pi_prox / pi_behav exceeds this


@dataclass
class PolicyLossOutput:
    loss: torch.Tensor  # float [T] per-token loss (before masking and aggregation)
    clipped: torch.Tensor  # float [T] 1 where the clip was active (for the clip-fraction metric)
    weight: torch.Tensor | None = None  # float [T] extra per-token weight/mask the loss applies (decoupled)
    agg_mode: str | None = None  # an aggregation the loss requires, overriding the configured one
    clipped_lower: torch.Tensor | None = None  # float [T] 1 where the dual clip bound the loss (A < 0)


POLICY_LOSSES: Registry = Registry("policy loss", "trainer.algorithm.policy_loss", plural="policy losses")


def log_ratio(inp: PolicyLossInputs) -> torch.Tensor:
    return torch.clamp(inp.logp - inp.old_logp, min=-LOG_RATIO_BOUND, max=LOG_RATIO_BOUND)


def clipped_surrogate(
    ratio: torch.Tensor, adv: torch.Tensor, clip_low: float, clip_high: float, clip_c: float | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """PPO's pessimistic clipped surrogate with optional dual clip; returns (loss [T], clipped [T],
    dual-clipped [T] or None: where A < 0 and the dual bound replaced the loss, verl's pg_clipfrac_lower)."""
    loss1 = -adv * ratio
    loss2 = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(loss1, loss2)
    clipped = (loss2 > loss1).float()
    lower = None
    if clip_c is not None:
        loss3 = -adv * clip_c
        lower = ((loss > loss3) & (adv < 0)).float()
        loss = torch.where(adv < 0, torch.minimum(loss, loss3), loss)
    return loss, clipped, lower


from slipstream.trainer.algos.losses import cispo, decoupled_ppo, gspo, ppo_clip  # noqa: E402,F401

__all__ = ["POLICY_LOSSES", "PolicyLossInputs", "PolicyLossOutput", "clipped_surrogate", "log_ratio"]
