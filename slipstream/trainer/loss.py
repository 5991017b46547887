"""The per-micro-batch loss the engine back-propagates, composed from the pure pieces in ``algos/``:

    loss = agg(policy_loss * w)  +  kl_coef * agg(KL(pi_theta, ref))  -  entropy_coef * agg(H(pi_theta))

with ``w`` = loss mask x truncated-IS weights x rejection mask, ``agg`` the configured aggregation (or the
one a policy loss requires, e.g. GSPO's seq-mean-token-mean) over the *global* mini-batch counts, and the
ratio's denominator the proximal logprobs when the trainer recomputed them, else the behaviour ones.
Metrics (clip fraction, KL, entropy, ...) are token means over the same global counts, so the engine's
sums over micro-batches and ranks are exact global means. Given a ``MismatchCollector`` (the step's first
update, when the run makes no proximal pass), the policy loss also hands it each micro-batch's logprobs for
the train–inference mismatch figures (``trainer/mismatch.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tensordict import TensorDict

from slipstream.trainer.algos import (
    KL_ESTIMATORS,
    POLICY_LOSSES,
    REJECTIONS,
    PolicyLossInputs,
    aggregate,
    truncated_is_weights,
)
from slipstream.trainer.algos.segments import segment_ids
from slipstream.trainer.config import AlgorithmConfig
from slipstream.trainer.mismatch import MismatchCollector


@dataclass(frozen=True)
class GlobalCounts:
    """Denominators of one mini-batch over every rank: policy tokens and sequences with one or more."""

    tokens: int
    seqs: int
    scale: float  # seq-mean-token-sum-norm's constant


class PolicyLoss:
    """Callable ``(outputs, micro_batch) -> (loss, metrics)`` for one mini-batch (see module docstring).

    Reads from the micro-batch: ``loss_mask``, ``old_logprobs`` (behaviour), ``advantages``, ``cu_seqlens``,
    and when present ``prox_logprobs`` (recomputed proximal policy) and ``ref_logprobs`` (KL reference).
    With ``mismatch``, each micro-batch's logprobs, behaviour logprobs, mask and ``versions`` are added to it.
    """

    needs_entropy = True  # always measured; differentiated only when the bonus is on

    def __init__(
        self, algo: AlgorithmConfig, counts: GlobalCounts, mismatch: MismatchCollector | None = None
    ) -> None:
        self.algo = algo
        self.counts = counts
        self.mismatch = mismatch
        self.policy_loss = POLICY_LOSSES.get(algo.policy_loss)
        self.kl = KL_ESTIMATORS.get(algo.kl_type) if algo.kl_type else None
        self.rejection = REJECTIONS.get(algo.rejection) if algo.rejection else None
        self.entropy_grad = algo.entropy_coef > 0

    def _agg(self, values, weight, seg, n, mode, mask) -> torch.Tensor:
        c = self.counts
        return aggregate(
            values,
            weight,
            seg,
            n,
            mode,
            global_tokens=c.tokens,
            global_seqs=c.seqs,
            scale=c.scale,
            count_mask=mask,
        )

    def __call__(self, outputs: dict[str, torch.Tensor], mb: TensorDict) -> tuple[torch.Tensor, dict]:
        algo = self.algo
        logp, mask = outputs["logprobs"], mb["loss_mask"].bool()
        seg, n = segment_ids(mb["cu_seqlens"]), int(mb["cu_seqlens"].numel()) - 1
        behav = mb["old_logprobs"].float()
        prox = mb["prox_logprobs"].float() if "prox_logprobs" in mb.keys() else behav
        if self.mismatch is not None:
            self.mismatch.add(logp, behav, mask, mb.get("versions", None))
        out = self.policy_loss(
            PolicyLossInputs(
                logp=logp,
                old_logp=prox,
                advantages=mb["advantages"].float(),
                mask=mask,
                seg=seg,
                num_seqs=n,
                clip_low=algo.clip_low,
                clip_high=algo.clip_high,
                clip_c=algo.clip_c,
                behav_logp=behav,
                behav_cap=algo.decoupled_cap,
            )
        )
        weight = mask.float()
        if algo.tis_level is not None:
            weight = weight * truncated_is_weights(prox - behav, mask, seg, n, algo.tis_level, algo.tis_cap)
        if self.rejection is not None:
            weight = weight * self.rejection(
                prox - behav, mask, seg, n, algo.rejection_low, algo.rejection_high
            )
        mode = out.agg_mode or algo.loss_agg_mode
        pg = self._agg(out.loss, weight, seg, n, mode, mask)
        token_mean = lambda x: self._agg(x.detach().float(), mask.float(), seg, n, "token-mean", mask)  # noqa: E731
        metrics = {
            "pg_loss": pg.detach(),
            "clip_frac": token_mean(out.clipped),
            "approx_kl_behaviour": token_mean(KL_ESTIMATORS.get("k3")(logp.detach(), behav)),
            "entropy": token_mean(outputs["entropy"]),
            "kept_frac": token_mean((weight > 0).float()),
        }
        if out.clipped_lower is not None:
            metrics["pg_clipfrac_lower"] = token_mean(out.clipped_lower)
        total = pg
        if self.kl is not None:
            ref = mb["ref_logprobs"].float() if "ref_logprobs" in mb.keys() else behav
            kl_tok = self.kl(logp, ref)
            total = total + algo.kl_coef * self._agg(kl_tok, mask.float(), seg, n, mode, mask)
            metrics["kl"] = token_mean(kl_tok)
        if algo.entropy_coef > 0:
            total = total - algo.entropy_coef * self._agg(
                outputs["entropy"], mask.float(), seg, n, mode, mask
            )
        return total, metrics


class ValueLoss:
    """PPO's clipped value loss for the critic (verl ``compute_value_loss``):

    L = 0.5 * agg(max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2))

    Reads ``values`` (V_old, from the critic before the update) and ``returns`` (R) from the micro-batch.
    """

    def __init__(self, algo: AlgorithmConfig, counts: GlobalCounts) -> None:
        self.algo = algo
        self.counts = counts

    def __call__(self, outputs: dict[str, torch.Tensor], mb: TensorDict) -> tuple[torch.Tensor, dict]:
        v, old, ret = outputs["values"], mb["values"].float(), mb["returns"].float()
        mask = mb["loss_mask"].bool()
        seg, n = segment_ids(mb["cu_seqlens"]), int(mb["cu_seqlens"].numel()) - 1
        c = self.algo.value_clip
        clipped = old + torch.clamp(v - old, -c, c)
        l1, l2 = (v - ret).square(), (clipped - ret).square()
        kw = dict(global_tokens=self.counts.tokens, global_seqs=self.counts.seqs, scale=self.counts.scale)
        loss = 0.5 * aggregate(torch.maximum(l1, l2), mask.float(), seg, n, self.algo.loss_agg_mode, **kw)
        frac = aggregate((l2 > l1).float(), mask.float(), seg, n, "token-mean", **kw)
        return self.algo.value_coef * loss, {"vf_loss": loss.detach(), "vf_clip_frac": frac}
