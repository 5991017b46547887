"""Algorithm tests against hand-computed values, including the edge cases that produce NaN when done
carelessly: a group whose rewards are all equal, single-token responses, fully masked samples."""

from __future__ import annotations

import math

import pytest
import torch

from slipstream.trainer.algos import (
    ADVANTAGES,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    REJECTIONS,
    AdvantageInputs,
    PolicyLossInputs,
    aggregate,
    entropy_from_logits,
    global_counts,
    truncated_is_weights,
)
from slipstream.trainer.algos.segments import from_padded, segment_ids, to_padded, token_positions


def _inputs(rewards, groups, lengths, masks, **kw) -> AdvantageInputs:
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return AdvantageInputs(
        rewards=torch.tensor(rewards, dtype=torch.float32),
        group_index=torch.tensor(groups),
        loss_mask=torch.tensor([bool(x) for m in masks for x in m]),
        cu_seqlens=cu,
        **kw,
    )


def _per_sample(adv: torch.Tensor, inp: AdvantageInputs) -> list[float]:
    """The advantage on each sample's first policy token (0 if none)."""
    out = []
    for s in range(len(inp.rewards)):
        a, b = int(inp.cu_seqlens[s]), int(inp.cu_seqlens[s + 1])
        m = inp.loss_mask[a:b]
        out.append(float(adv[a:b][m][0]) if m.any() else 0.0)
    return out


# ------------------------------------------------------------------ advantages


def test_grpo_hand_computed_and_edge_cases():
    # group 0: rewards 1, 0, 0, 1 -> mean 0.5, unbiased std sqrt(1/3); group 1: all equal; group 2: alone.
    inp = _inputs(
        [1, 0, 0, 1, 2, 2, 2, 0.7],
        [0, 0, 0, 0, 1, 1, 1, 2],
        [3, 2, 2, 3, 2, 2, 2, 2],
        [[0, 1, 1], [0, 1], [0, 1], [0, 1, 1], [0, 1], [0, 1], [0, 1], [0, 1]],
    )
    out = ADVANTAGES.get("grpo")(inp)
    std = math.sqrt(1 / 3)
    want = [0.5 / (std + 1e-6), -0.5 / (std + 1e-6)] * 1
    got = _per_sample(out.advantages, inp)
    assert got[:4] == pytest.approx([want[0], want[1], want[1], want[0]], rel=1e-5)
    assert got[4:7] == [0.0, 0.0, 0.0]  # all equal: zero, not NaN
    assert got[7] == pytest.approx(0.7 / (1 + 1e-6))  # a group of one: mean 0, std 1
    assert (out.advantages[~inp.loss_mask] == 0).all()
    assert torch.isfinite(out.advantages).all()

    inp.norm_by_std = False
    got = _per_sample(ADVANTAGES.get("grpo")(inp).advantages, inp)
    assert got[:4] == pytest.approx([0.5, -0.5, -0.5, 0.5])


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_plus_plus_baseline"])
def test_an_episode_trained_as_several_segments_counts_once_in_its_group(estimator):
    """Episodes a (reward 1, three segments), b (0), c (0), d (1): each of a's segments gets the advantage a
    would get as one sequence, and b, c, d get what they would get beside an unsegmented a."""
    whole = _inputs([1, 0, 0, 1], [0, 0, 0, 0], [2, 2, 2, 2], [[0, 1]] * 4)
    segmented = _inputs(
        [1, 1, 1, 0, 0, 1], [0] * 6, [2] * 6, [[0, 1]] * 6, episode_index=torch.tensor([0, 0, 0, 1, 2, 3])
    )
    want = _per_sample(ADVANTAGES.get(estimator)(whole).advantages, whole)
    got = _per_sample(ADVANTAGES.get(estimator)(segmented).advantages, segmented)
    if estimator == "reinforce_plus_plus_baseline":  # whitened over tokens: a's tokens weigh 3x there
        assert got[0] == got[1] == got[2] > 0 > got[3] == got[4] and got[5] == got[0]
    else:
        assert got == pytest.approx([want[0]] * 3 + want[1:], rel=1e-5)


def test_rloo_leave_one_out():
    inp = _inputs([1, 0, 0, 5], [0, 0, 0, 1], [2, 2, 2, 2], [[0, 1]] * 4)
    got = _per_sample(ADVANTAGES.get("rloo")(inp).advantages, inp)
    # r_i - mean(others): 1 - 0 = 1, 0 - 0.5 = -0.5, -0.5; group of one keeps its reward.
    assert got == pytest.approx([1.0, -0.5, -0.5, 5.0])


def test_reinforce_plus_plus_whitens_discounted_returns():
    # Two samples, one policy token gap (tool token) in the second: returns carry across it.
    inp = _inputs([1.0, 0.0], [0, 1], [3, 4], [[0, 1, 1], [0, 1, 0, 1]], gamma=0.5)
    out = ADVANTAGES.get("reinforce_plus_plus")(inp)
    # returns on policy tokens: sample 0: [0.5, 1]; sample 1: [0, 0]
    assert out.returns.tolist() == pytest.approx([0, 0.5, 1, 0, 0, 0, 0])
    vals = torch.tensor([0.5, 1.0, 0.0, 0.0])
    want = (vals - vals.mean()) / torch.sqrt(vals.var(unbiased=True) + 1e-8)
    assert out.advantages[inp.loss_mask].tolist() == pytest.approx(want.tolist(), rel=1e-5)


def test_reinforce_plus_plus_baseline():
    inp = _inputs([1, 0, 3], [0, 0, 1], [2, 2, 3], [[0, 1], [0, 1], [0, 1, 1]])
    out = ADVANTAGES.get("reinforce_plus_plus_baseline")(inp)
    vals = torch.tensor([0.5, -0.5, 3.0, 3.0])  # group 1 has one sample: baseline 0
    want = (vals - vals.mean()) / torch.sqrt(vals.var(unbiased=True) + 1e-8)
    assert out.advantages[inp.loss_mask].tolist() == pytest.approx(want.tolist(), rel=1e-5)


def test_gae_hand_computed():
    # One sample: prompt token then 2 policy tokens; reward 1 at the last one.
    inp = _inputs([1.0], [0], [3], [[0, 1, 1]], values=torch.tensor([9.0, 0.5, 0.25]), gamma=0.9, lam=0.8)
    out = ADVANTAGES.get("gae")(inp)
    d2 = 1.0 + 0.9 * 0 - 0.25
    a2 = d2
    d1 = 0 + 0.9 * 0.25 - 0.5
    a1 = d1 + 0.9 * 0.8 * a2
    assert out.returns.tolist() == pytest.approx([0.0, a1 + 0.5, a2 + 0.25])
    raw = torch.tensor([a1, a2])
    want = (raw - raw.mean()) / torch.sqrt(raw.var(unbiased=True) + 1e-8)
    assert out.advantages[1:].tolist() == pytest.approx(want.tolist(), rel=1e-5)
    with pytest.raises(ValueError, match="critic"):
        ADVANTAGES.get("gae")(_inputs([1.0], [0], [2], [[0, 1]]))


@pytest.mark.parametrize(
    "name", ["grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gae"]
)
def test_estimators_no_nan_on_degenerate_batches(name):
    # single-token responses, a fully masked sample, all rewards equal
    inp = _inputs(
        [1, 1, 1],
        [0, 0, 0],
        [2, 2, 2],
        [[0, 1], [0, 0], [0, 1]],
        values=torch.zeros(6),
    )
    out = ADVANTAGES.get(name)(inp)
    assert torch.isfinite(out.advantages).all() and torch.isfinite(out.returns).all()
    assert (out.advantages[2:4] == 0).all()  # the fully masked sample gets nothing


def test_packed_layout_helpers():
    cu = torch.tensor([0, 2, 5, 5, 6])  # the third sample is empty
    assert segment_ids(cu).tolist() == [0, 0, 1, 1, 1, 3]
    assert token_positions(cu).tolist() == [0, 1, 0, 1, 2, 0]
    values = torch.arange(6.0)
    padded = to_padded(values, cu, fill=-1.0)
    assert padded.tolist() == [[0, 1, -1], [2, 3, 4], [-1, -1, -1], [5, -1, -1]]
    assert torch.equal(from_padded(padded, cu), values)


def test_unknown_names_fail_loudly():
    with pytest.raises(
        ValueError,
        match="^trainer.algorithm.adv_estimator: unknown advantage estimator `grpoo`; known .*grpo",
    ):
        ADVANTAGES.get("grpoo")
    with pytest.raises(
        ValueError, match="^trainer.algorithm.policy_loss: .* known policy losses: .*ppo_clip"
    ):
        POLICY_LOSSES.get("ppo")


# ------------------------------------------------------------------ policy losses


def _loss_inputs(logp, old, adv, mask=None, lengths=None, **kw) -> PolicyLossInputs:
    logp = torch.tensor(logp, dtype=torch.float32, requires_grad=True)
    n = logp.numel()
    lengths = lengths or [n]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return PolicyLossInputs(
        logp=logp,
        old_logp=torch.tensor(old, dtype=torch.float32),
        advantages=torch.tensor(adv, dtype=torch.float32),
        mask=torch.tensor(mask if mask is not None else [1] * n, dtype=torch.bool),
        seg=segment_ids(cu),
        num_seqs=len(lengths),
        **kw,
    )


def test_ppo_clip_asymmetric_and_dual_clip():
    r = [1.5, 0.5, 1.1, 5.0]
    inp = _loss_inputs(
        [math.log(x) for x in r], [0.0] * 4, [1.0, 1.0, -1.0, -1.0], clip_low=0.2, clip_high=0.28
    )
    out = POLICY_LOSSES.get("ppo_clip")(inp)
    # A>0, r=1.5: min(1.5, 1.28) -> loss -1.28 (clipped); A>0, r=0.5: min(0.5, 0.8) -> -0.5 (not clipped)
    # A<0, r=1.1: max(1.1, 1.1)*... loss = max(1.1, 1.1) = 1.1; A<0, r=5: loss = max(5, 1.28) = 5
    assert out.loss.tolist() == pytest.approx([-1.28, -0.5, 1.1, 5.0], rel=1e-5)
    assert out.clipped.tolist() == [1.0, 0.0, 0.0, 0.0]
    inp.clip_c = 3.0
    out = POLICY_LOSSES.get("ppo_clip")(inp)
    assert out.loss.tolist() == pytest.approx([-1.28, -0.5, 1.1, 3.0], rel=1e-5)
    assert out.clipped_lower.tolist() == [0.0, 0.0, 0.0, 1.0]  # verl's pg_clipfrac_lower counts the last
    # gradient flows only through unclipped tokens
    out.loss.sum().backward()
    assert inp.logp.grad.tolist() == pytest.approx([0.0, -0.5, 1.1, 0.0], rel=1e-5)


def test_gspo_sequence_ratio():
    # one sequence of two tokens with log ratios 0.2 and -0.1: s = exp(0.05)
    inp = _loss_inputs(
        [0.2, -0.1, 0.3], [0.0, 0.0, 0.0], [1.0, 1.0, -2.0], lengths=[2, 1], clip_low=0.01, clip_high=0.01
    )
    out = POLICY_LOSSES.get("gspo")(inp)
    s0 = math.exp(0.05)
    assert out.agg_mode is None  # the configured loss_agg_mode applies, as verl's GSPO
    assert out.loss[:2].tolist() == pytest.approx([-min(s0, 1.01)] * 2, rel=1e-5)
    assert out.loss[2].item() == pytest.approx(2.0 * math.exp(0.3), rel=1e-5)  # A<0: max(2r, 2*1.01)


def test_cispo_stop_gradient_clipped_weight():
    inp = _loss_inputs([math.log(2.0), math.log(0.9)], [0.0, 0.0], [1.0, 1.0], clip_low=0.2, clip_high=0.28)
    out = POLICY_LOSSES.get("cispo")(inp)
    assert out.loss.tolist() == pytest.approx([-1.28 * math.log(2.0), -0.9 * math.log(0.9)], rel=1e-5)
    out.loss.sum().backward()
    assert inp.logp.grad.tolist() == pytest.approx([-1.28, -0.9], rel=1e-5)  # no token dropped
    assert out.clipped.tolist() == [1.0, 0.0]


def test_decoupled_ppo_behaviour_weight_and_cap():
    prox = [math.log(0.5), math.log(0.5)]
    inp = _loss_inputs(
        prox, prox, [1.0, 1.0], behav_logp=torch.tensor([math.log(0.25), math.log(0.05)]), behav_cap=5.0
    )
    out = POLICY_LOSSES.get("decoupled_ppo")(inp)
    # r = 1 (theta == prox); w = 2 (kept) and 10 (> cap: dropped)
    assert out.weight.tolist() == pytest.approx([2.0, 0.0])
    assert out.loss.tolist() == pytest.approx([-2.0, 0.0])
    with pytest.raises(ValueError, match="behaviour"):
        POLICY_LOSSES.get("decoupled_ppo")(_loss_inputs([0.0], [0.0], [1.0]))


# ------------------------------------------------------------------ correction, KL, entropy


def test_truncated_is_token_and_sequence():
    lr = torch.tensor([math.log(3.0), math.log(0.5), math.log(1.5)])
    mask = torch.tensor([True, True, False])
    seg = torch.tensor([0, 0, 1])
    w = truncated_is_weights(lr, mask, seg, 2, "token", cap=2.0)
    assert w.tolist() == pytest.approx([2.0, 0.5, 0.0])
    w = truncated_is_weights(lr, mask, seg, 2, "sequence", cap=2.0)
    assert w.tolist() == pytest.approx([1.5, 1.5, 0.0])  # 3 * 0.5 on both tokens of sequence 0


def test_rejection_masks():
    lr = torch.tensor([0.0, math.log(3.0), 0.0, 0.0])  # token 1 is far off-policy
    mask = torch.ones(4, dtype=torch.bool)
    seg = torch.tensor([0, 0, 1, 1])
    keep = REJECTIONS.get("token_k1")(lr, mask, seg, 2, None, 2.0)
    assert keep.tolist() == [1, 0, 1, 1]
    keep = REJECTIONS.get("seq_max_k3")(lr, mask, seg, 2, None, 0.5)  # k3 of ratio 3 = 3-1-log3 = 0.90
    assert keep.tolist() == [0, 0, 1, 1]
    keep = REJECTIONS.get("seq_mean_k1")(lr, mask, seg, 2, None, 2.0)  # geometric mean sqrt(3) < 2: kept
    assert keep.tolist() == [1, 1, 1, 1]


def test_kl_estimators_hand_computed():
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    d = math.log(2.0)
    assert KL_ESTIMATORS.get("k1")(logp, ref).item() == pytest.approx(d)
    assert KL_ESTIMATORS.get("k2")(logp, ref).item() == pytest.approx(0.5 * d * d)
    assert KL_ESTIMATORS.get("k3")(logp, ref).item() == pytest.approx(0.5 - 1 + d)
    assert KL_ESTIMATORS.get("abs")(ref, logp).item() == pytest.approx(d)
    for name in ("k1", "k2", "k3", "abs", "k1+", "k3+"):
        assert KL_ESTIMATORS.get(name)(ref, ref).item() == 0.0


@pytest.mark.parametrize("name,base", [("k1+", "k1"), ("k3+", "k3")])
def test_straight_through_kl_has_its_estimators_value_and_k2s_gradient(name, base):
    ref = torch.tensor([math.log(0.25), math.log(0.6)])
    logp = torch.tensor([math.log(0.5), math.log(0.3)], requires_grad=True)
    value = KL_ESTIMATORS.get(name)(logp, ref)
    assert value.tolist() == pytest.approx(KL_ESTIMATORS.get(base)(logp, ref).tolist())
    value.sum().backward()
    assert logp.grad.tolist() == pytest.approx((logp - ref).detach().tolist())  # d(k2)/d(logp)


def test_the_dual_clip_is_on_by_default_at_verls_value():
    from slipstream.trainer.config import AlgorithmConfig

    assert AlgorithmConfig().clip_c == 3.0


def test_entropy_from_logits():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [100.0, -100.0, -100.0, -100.0]])
    assert entropy_from_logits(logits).tolist() == pytest.approx([math.log(4), 0.0], abs=1e-5)


# ------------------------------------------------------------------ aggregation


def test_aggregation_modes_hand_computed():
    # seq 0: losses 1, 2 (both policy); seq 1: 3 (policy), 4 (masked); seq 2: fully masked
    values = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    mask = torch.tensor([1, 1, 1, 0, 0], dtype=torch.bool)
    cu = torch.tensor([0, 2, 4, 5])
    seg = segment_ids(cu)
    tokens, seqs = global_counts(mask, cu)
    assert (tokens, seqs) == (3, 2)
    kw = dict(global_tokens=tokens, global_seqs=seqs)
    assert aggregate(values, mask, seg, 3, "token-mean", **kw).item() == pytest.approx(2.0)
    assert aggregate(values, mask, seg, 3, "seq-mean-token-sum", **kw).item() == pytest.approx(3.0)
    assert aggregate(values, mask, seg, 3, "seq-mean-token-mean", **kw).item() == pytest.approx(2.25)
    assert aggregate(
        values, mask, seg, 3, "seq-mean-token-sum-norm", scale=4.0, **kw
    ).item() == pytest.approx(0.75)
    with pytest.raises(ValueError, match="token-mean"):
        aggregate(values, mask, seg, 3, "sum", **kw)


@pytest.mark.parametrize(
    "mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
)
def test_aggregation_split_invariance(mode):
    """Summing micro-batch contributions with global counts equals aggregating the whole batch at once."""
    g = torch.Generator().manual_seed(0)
    lengths = [3, 1, 5, 2, 4]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    values = torch.randn(int(cu[-1]), generator=g)
    mask = torch.rand(int(cu[-1]), generator=g) > 0.3
    mask[3] = False  # the single-token sample is fully masked
    tokens, seqs = global_counts(mask, cu)
    kw = dict(global_tokens=tokens, global_seqs=seqs, scale=7.0)
    whole = aggregate(values, mask, segment_ids(cu), len(lengths), mode, **kw)
    parts = 0.0
    for a, b in ((0, 2), (2, 3), (3, 5)):  # samples [0,1], [2], [3,4]
        lo, hi = int(cu[a]), int(cu[b])
        sub_cu = cu[a : b + 1] - cu[a]
        parts += aggregate(values[lo:hi], mask[lo:hi], segment_ids(sub_cu), b - a, mode, **kw)
    assert float(parts) == pytest.approx(float(whole), rel=1e-6)
    assert torch.isfinite(whole)


def test_fully_masked_batch_aggregates_to_zero():
    values = torch.tensor([1.0, 2.0])
    mask = torch.zeros(2, dtype=torch.bool)
    cu = torch.tensor([0, 1, 2])
    tokens, seqs = global_counts(mask, cu)
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        out = aggregate(values, mask, segment_ids(cu), 2, mode, global_tokens=tokens, global_seqs=seqs)
        assert out.item() == 0.0


def test_policy_loss_reports_the_dual_clip_fraction_and_a_straight_through_kl():
    from tensordict import TensorDict

    from slipstream.trainer.config import AlgorithmConfig
    from slipstream.trainer.loss import GlobalCounts, PolicyLoss

    ratios = torch.tensor([1.5, 0.5, 1.1, 5.0])
    mb = TensorDict(
        {
            "loss_mask": torch.ones(4, dtype=torch.bool),
            "old_logprobs": torch.zeros(4),
            "advantages": torch.tensor([1.0, 1.0, -1.0, -1.0]),
            "ref_logprobs": torch.full((4,), -0.1),
            "cu_seqlens": torch.tensor([0, 4], dtype=torch.int32),
        },
        batch_size=[],
    )
    outputs = {"logprobs": ratios.log(), "entropy": torch.zeros(4)}
    algo = AlgorithmConfig(kl_type="k3+", kl_coef=0.1)
    _, metrics = PolicyLoss(algo, GlobalCounts(4, 1, 1.0))(outputs, mb)
    assert metrics["pg_clipfrac_lower"].item() == pytest.approx(0.25)  # the A<0, r=5 token
    expected_kl = KL_ESTIMATORS.get("k3")(ratios.log(), mb["ref_logprobs"]).mean()
    assert metrics["kl"].item() == pytest.approx(expected_kl.item(), rel=1e-5)
    _, metrics = PolicyLoss(AlgorithmConfig(clip_c=None), GlobalCounts(4, 1, 1.0))(outputs, mb)
    assert "pg_clipfrac_lower" not in metrics
