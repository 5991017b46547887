"""The sampling-mask replay (``trainer/logprobs.py``, "Sampling masks"): with top-k / top-p on, the trainer's
logprobs are of the distribution the servers sampled from, in both paths, with the right gradients.

References: vLLM's own filter (``apply_top_k_top_p_pytorch``, what its CPU build and the native GPU sampler
with processed logprobs run) and transformers' continuous-batching warpers (what the embedded server runs).
"""

from __future__ import annotations

import pytest
import torch

from slipstream.trainer.logprobs import (
    Truncation,
    full_token_logprobs,
    sampling_truncation,
    token_logprobs,
    truncate_logits,
)

N, H, V = 41, 16, 301
SETTINGS = [Truncation(top_k=20), Truncation(top_p=0.8), Truncation(top_k=20, top_p=0.8), Truncation(top_k=1)]


def _inputs(seed=0, scale=0.6):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g).requires_grad_()
    weight = (torch.randn(V, H, generator=g) * scale).requires_grad_()
    return hidden, weight, g


def _sampled(hidden, weight, temperature, trunc, g):
    """Targets drawn the way a server draws them: from the truncated distribution (so always kept)."""
    with torch.no_grad():
        z = _vllm_filtered((hidden @ weight.t()) / temperature, trunc)
        return torch.multinomial(torch.softmax(z, -1), 1, generator=g)[:, 0]


def _vllm_filtered(z: torch.Tensor, trunc: Truncation) -> torch.Tensor:
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    k = torch.full((z.shape[0],), trunc.top_k, dtype=torch.int32) if trunc.top_k > 0 else None
    p = torch.full((z.shape[0],), trunc.top_p, dtype=torch.float32) if trunc.top_p < 1 else None
    return apply_top_k_top_p_pytorch(z.clone(), k, p, allow_cpu_sync=True)


def _hf_filtered(z: torch.Tensor, trunc: Truncation) -> torch.Tensor:
    """transformers' continuous-batching top-k then top-p warpers, in the embedded server's order."""
    from transformers.generation.continuous_batching.cb_logits_processors import (
        ContinuousBatchingTopKLogitsWarper,
        ContinuousBatchingTopPLogitsWarper,
    )
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    n = z.shape[0]
    if trunc.top_k > 0:
        warper = ContinuousBatchingTopKLogitsWarper(TopKLogitsWarper(top_k=trunc.top_k))
        z = warper(z, torch.full((n,), trunc.top_k, dtype=torch.int32))
    if trunc.top_p < 1:
        warper = ContinuousBatchingTopPLogitsWarper(TopPLogitsWarper(top_p=trunc.top_p))
        z = warper(z, torch.full((n,), trunc.top_p, dtype=torch.float32).view(torch.int32))
    return z


@pytest.mark.parametrize("trunc", SETTINGS, ids=str)
@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("reference", [_vllm_filtered, _hf_filtered], ids=["vllm", "transformers"])
def test_logprobs_equal_the_servers_processed_logprobs(trunc, temperature, reference):
    hidden, weight, g = _inputs()
    targets = _sampled(hidden, weight, temperature, trunc, g)
    with torch.no_grad():
        z = (hidden @ weight.t()) / temperature
        want = torch.log_softmax(reference(z, trunc), -1).gather(1, targets[:, None])[:, 0]
        full, _ = full_token_logprobs(hidden, weight, targets, temperature=temperature, truncation=trunc)
        chunked, _ = token_logprobs(
            hidden, weight, targets, temperature=temperature, chunk=7, truncation=trunc
        )
        plain, _ = token_logprobs(hidden, weight, targets, temperature=temperature, chunk=7)
    assert (full - want).abs().max().item() <= 1e-5
    assert (chunked - want).abs().max().item() <= 1e-5
    # teeth: the filter binds here, so the untruncated logprobs are far off
    assert (plain - want).abs().max().item() > 0.1


def _grads(fn, hidden, weight, targets, entropy, temperature, trunc):
    g = torch.Generator().manual_seed(1)
    g_logp, g_ent = torch.randn(N, generator=g), torch.randn(N, generator=g)
    hidden.grad = weight.grad = None
    logp, ent = fn(
        hidden, weight, targets, temperature=temperature, entropy=entropy is not None, truncation=trunc
    )
    loss = (logp * g_logp).sum()
    if entropy == "grad":
        loss = loss + (ent * g_ent).sum()
    loss.backward()
    return (
        logp.detach(),
        (ent.detach() if ent is not None else None),
        hidden.grad.clone(),
        weight.grad.clone(),
    )


@pytest.mark.parametrize("trunc", SETTINGS, ids=str)
@pytest.mark.parametrize("chunk", [0, 5, 41])
@pytest.mark.parametrize("entropy", [None, "metric", "grad"])
def test_chunked_equals_plain_path_values_and_grads(trunc, chunk, entropy):
    hidden, weight, g = _inputs()
    targets = _sampled(hidden, weight, 0.7, trunc, g)
    want = _grads(full_token_logprobs, hidden, weight, targets, entropy, 0.7, trunc)
    got = _grads(
        lambda *a, **kw: token_logprobs(*a, chunk=chunk, **kw), hidden, weight, targets, entropy, 0.7, trunc
    )
    for w, o in zip(want, got, strict=True):
        if w is None:
            assert o is None
            continue
        assert torch.isfinite(w).all() and torch.isfinite(o).all()
        assert (w - o).abs().max().item() <= 1e-5


def test_gradient_is_the_renormalised_distributions():
    """d logp / d z = onehot(target) - p over the kept tokens and 0 on dropped ones; entropy of kept only."""
    hidden, weight, g = _inputs()
    trunc = Truncation(top_k=20, top_p=0.8)
    targets = _sampled(hidden, weight, 1.0, trunc, g)
    z = (hidden @ weight.t()).detach().requires_grad_()
    eye = torch.eye(V)
    logp, ent = token_logprobs(z, eye, targets, chunk=8, entropy=True, truncation=trunc)
    logp.sum().backward()
    kept = _vllm_filtered(z.detach(), trunc) > float("-inf")
    p = torch.softmax(z.detach().masked_fill(~kept, float("-inf")), -1)
    want = torch.nn.functional.one_hot(targets, V).float() - p
    assert (z.grad - want).abs().max().item() <= 1e-6
    assert (z.grad[~kept] == 0).all()
    assert (ent - -(p * p.clamp_min(1e-45).log()).sum(-1)).abs().max().item() <= 1e-5


def test_a_target_below_the_rebuilt_cut_is_kept():
    """A sampled token the rebuilt set would drop (a near-tie at the cut) is scored in kept + itself, finite."""
    hidden, weight, _ = _inputs()
    trunc = Truncation(top_k=5)
    with torch.no_grad():
        z = hidden @ weight.t()
        outside = z.argsort(-1)[:, 0]  # each row's least likely token
        kept = z >= z.topk(5, -1).values[:, -1:]
        kept.scatter_(1, outside[:, None], True)
        want = torch.log_softmax(z.masked_fill(~kept, float("-inf")), -1).gather(1, outside[:, None])[:, 0]
        got, _ = token_logprobs(hidden, weight, outside, chunk=9, truncation=trunc)
    assert torch.isfinite(got).all()
    assert (got - want).abs().max().item() <= 1e-5


def test_ties_at_the_top_k_cut_are_kept_like_the_servers():
    z = torch.tensor([[3.0, 2.0, 2.0, 2.0, 1.0, 0.0]])
    trunc = Truncation(top_k=2)
    kept = truncate_logits(z, torch.tensor([0]), trunc) > float("-inf")
    assert kept.tolist() == [[True, True, True, True, False, False]]
    assert (_vllm_filtered(z, trunc) > float("-inf")).tolist() == kept.tolist()
    assert (_hf_filtered(z, trunc) > float("-inf")).tolist() == kept.tolist()


TIES = torch.tensor([[3.0, 2.0, 2.0, 2.0, 1.0, 0.0], [0.5, 2.5, 1.5, 1.0, 0.0, -1.0]])


@pytest.mark.parametrize("top_p", [0.4, 0.9, 0.99])
def test_ties_at_the_top_k_cut_count_in_top_p_like_the_servers(top_p):
    """A row keeping more than k tokens (three tie with the k-th) beside one keeping k, under top-p; the
    top-p cut drops the tied group whole (0.4) or keeps it whole (0.9, 0.99)."""
    trunc = Truncation(top_k=2, top_p=top_p)
    kept = truncate_logits(TIES, torch.tensor([0, 1]), trunc) > float("-inf")
    assert (_vllm_filtered(TIES, trunc) > float("-inf")).tolist() == kept.tolist()
    assert (_hf_filtered(TIES, trunc) > float("-inf")).tolist() == kept.tolist()


def test_an_exact_tie_split_by_the_top_p_cut_is_kept_whole():
    """Top-p 0.5 on row 0 drops two of the three tied 2.0s in the servers (by sort position); the rebuilt
    set is a threshold set and keeps all three (the documented difference)."""
    trunc = Truncation(top_k=2, top_p=0.5)
    kept = truncate_logits(TIES, torch.tensor([0, 1]), trunc) > float("-inf")
    server = _vllm_filtered(TIES, trunc) > float("-inf")
    assert kept[0].tolist() == [True, True, True, True, False, False]
    assert server[0].sum().item() == 2 and server[0, 0]
    assert kept[1].tolist() == server[1].tolist()


def test_no_filter_means_no_truncation():
    assert sampling_truncation(1.0, -1, 1.0) is None
    assert sampling_truncation(1.0, 0, 1.0) is None
    assert sampling_truncation(0.0, 20, 0.8) is None  # greedy: the argmax, no filter
    assert sampling_truncation(0.7, 20, 1.0) == Truncation(top_k=20, top_p=1.0)
    assert sampling_truncation(0.7, -1, 0.9) == Truncation(top_k=-1, top_p=0.9)
    hidden, weight, g = _inputs()
    targets = torch.randint(0, V, (N,), generator=g)
    a, _ = token_logprobs(hidden, weight, targets, chunk=7)
    b, _ = token_logprobs(hidden, weight, targets, chunk=7, truncation=None)
    assert torch.equal(a, b)
    # a top-k of the whole vocabulary keeps everything
    c, _ = token_logprobs(hidden, weight, targets, chunk=7, truncation=Truncation(top_k=V + 5))
    assert (a - c).abs().max().item() <= 1e-6


@pytest.mark.parametrize("pack", ["true", "false"])
def test_the_engine_follows_rollout_sampling_in_both_paths(tiny_model_path, single_process_group, pack):
    """FSDPEngine takes top_k / top_p from rollout.sampling: its chunked head and its full-logits path give the
    same truncated logprobs, entropy, loss and gradients, and they differ from the unfiltered ones."""
    from tests.trainer.test_logprobs_engine import _assert_same, _batch, _step

    filters = ("rollout.sampling.top_k=20", "rollout.sampling.top_p=0.8", f"trainer.pack_sequences={pack}")
    full = _step(tiny_model_path, "trainer.logits_chunk_tokens=0", *filters)
    chunked = _step(tiny_model_path, "trainer.logits_chunk_tokens=3", *filters)
    assert full[0].truncation == chunked[0].truncation == Truncation(top_k=20, top_p=0.8)
    assert chunked[0]._head.truncation == chunked[0].truncation
    _assert_same(full, chunked, atol=1e-5)
    unfiltered = _step(tiny_model_path, "trainer.logits_chunk_tokens=3", f"trainer.pack_sequences={pack}")
    assert unfiltered[0].truncation is None
    mask = _batch()["loss_mask"].float()
    gap = ((chunked[2]["logprobs"] - unfiltered[2]["logprobs"]) * mask).abs().max().item()
    assert gap > 0.5
