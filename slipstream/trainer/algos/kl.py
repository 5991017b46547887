"""KL estimators between the trained policy and a reference, per token.

Schulman, "Approximating KL Divergence" (2020, http://joschu.net/blog/kl-approx.html), with
``log_ratio = logp - ref_logp`` for tokens sampled from the trained policy:

    k1 = log_ratio                                  (unbiased, high variance, can be negative)
    k2 = 0.5 * log_ratio**2                          (biased, low variance; its gradient is the KL's)
    k3 = exp(-log_ratio) - 1 + log_ratio             (unbiased, low variance, always >= 0; "low_var_kl")

    abs = |log_ratio|                                (verl's ``abs``)

As verl's ``kl_penalty_forward``: k3's exponent is clamped to [-20, 20] and its value to [-10, 10].

``k1+`` and ``k3+`` are straight-through: the value of k1 (k3), the gradient of k2, whose gradient is the
KL's own (as verl's ``+`` estimators): ``k2 - sg(k2) + sg(k)``.
"""

from __future__ import annotations

import torch

from slipstream.utils.registry import Registry

KL_ESTIMATORS: Registry = Registry("KL estimator", "trainer.algorithm.kl_type")


@KL_ESTIMATORS.register("k1")
def k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return logp - ref_logp


@KL_ESTIMATORS.register("k2")
def k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return 0.5 * (logp - ref_logp).square()


@KL_ESTIMATORS.register("k3")
def k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    kl = torch.clamp(ref_logp - logp, min=-20.0, max=20.0)
    return torch.clamp(torch.exp(kl) - kl - 1.0, min=-10.0, max=10.0)


@KL_ESTIMATORS.register("abs")
def abs_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return (logp - ref_logp).abs()


def _straight_through(value_of):
    def estimator(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
        grad_path = k2(logp, ref_logp)
        return grad_path - grad_path.detach() + value_of(logp, ref_logp).detach()

    return estimator


KL_ESTIMATORS.register("k1+")(_straight_through(k1))
KL_ESTIMATORS.register("k3+")(_straight_through(k3))


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Categorical entropy per row: logsumexp(z) - sum softmax(z) * z (no log(0) anywhere)."""
    logits = logits.float()
    return torch.logsumexp(logits, dim=-1) - (torch.softmax(logits, dim=-1) * logits).sum(dim=-1)
