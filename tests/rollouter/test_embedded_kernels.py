"""The embedded engine's attention and sampling kernels, alone: equal results, and no reads of device values.

A tensor on the ``meta`` device has no data, so any host read of it (``.tolist()``, ``.item()``, ``bool()``)
raises: a kernel that runs on meta inputs cannot make a step wait for the device.
"""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from slipstream.rollouter.embedded.attention import batched_varlen_sdpa, looped_varlen_sdpa
from slipstream.rollouter.embedded.sampling import FastTopKWarper, FastTopPWarper, FilterUse


def _ragged(seed: int, decode: bool, pad_rows: int):
    """Requests with q new tokens after a cached prefix; empty (padding) requests and padded rows too."""
    gen = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 7, (), generator=gen))
    lens_q = torch.ones(n, dtype=torch.long) if decode else torch.randint(0, 8, (n,), generator=gen)
    lens_q[0] = max(int(lens_q[0]), 1)
    lens_k = lens_q + torch.randint(0, 10, (n,), generator=gen)
    lens_k[lens_q == 0] = 0
    cu_q = torch.cat([torch.zeros(1, dtype=torch.long), lens_q.cumsum(0)]).int()
    cu_k = torch.cat([torch.zeros(1, dtype=torch.long), lens_k.cumsum(0)]).int()
    # token-major storage underneath, as the model's projections and the paged cache lay it out
    q = torch.randn(1, int(cu_q[-1]) + pad_rows, 6, 8, generator=gen).transpose(1, 2)
    k = torch.randn(int(cu_k[-1]), 2, 8, generator=gen).transpose(0, 1)[None]
    v = torch.randn(int(cu_k[-1]), 2, 8, generator=gen).transpose(0, 1)[None]
    return q, k, v, cu_q, cu_k, int(lens_q.max()), int(lens_k.max())


@pytest.mark.parametrize("decode", [True, False])
@pytest.mark.parametrize("pad_rows", [0, 3])
def test_batched_attention_equals_the_per_request_loop(decode, pad_rows):
    for seed in range(40):
        q, k, v, cu_q, cu_k, max_q, max_k = _ragged(seed, decode, pad_rows)
        batched = batched_varlen_sdpa(q, k, v, cu_q, cu_k, max_q, max_k, 0.35, True)
        looped = looped_varlen_sdpa(q, k, v, cu_q, cu_k, 0.35, True)
        assert batched.shape == looped.shape == q.shape
        torch.testing.assert_close(batched, looped, atol=1e-5, rtol=1e-5)


def test_batched_attention_never_reads_the_device():
    q, k, v, cu_q, cu_k, max_q, max_k = (
        t.to("meta") if isinstance(t, torch.Tensor) else t for t in _ragged(3, True, 2)
    )
    out = batched_varlen_sdpa(q, k, v, cu_q, cu_k, max_q, max_k, 0.35, True)
    assert out.shape == q.shape
    with pytest.raises(NotImplementedError):  # the loop reads the boundaries: the probe can fail
        looped_varlen_sdpa(q, k, v, cu_q, cu_k, 0.35, True)


def _warper(cls, base, use: FilterUse):
    from transformers.generation.continuous_batching.cb_logits_processors import (
        ContinuousBatchingTopKLogitsWarper,
        ContinuousBatchingTopPLogitsWarper,
    )

    parent = (
        ContinuousBatchingTopKLogitsWarper if cls is FastTopKWarper else ContinuousBatchingTopPLogitsWarper
    )
    fast = cls.__new__(cls)
    fast.__dict__.update(parent(base).__dict__)
    fast.use = use
    return fast


def test_unused_filters_are_skipped_without_reading_the_batch():
    use = FilterUse()
    top_k = _warper(FastTopKWarper, TopKLogitsWarper(top_k=5), use)
    top_p = _warper(FastTopPWarper, TopPLogitsWarper(top_p=0.5), use)
    scores = torch.empty(4, 32, device="meta")
    args = torch.empty(4, dtype=torch.int32, device="meta")
    assert top_k(scores, args) is scores
    assert top_p(scores, args) is scores


def test_filters_apply_while_a_request_uses_them():
    use = FilterUse()
    top_k = _warper(FastTopKWarper, TopKLogitsWarper(top_k=5), use)
    top_p = _warper(FastTopPWarper, TopPLogitsWarper(top_p=0.5), use)
    scores = torch.randn(2, 16, generator=torch.Generator().manual_seed(0))
    ks = torch.tensor([3, 16], dtype=torch.int32)
    ps = torch.tensor([0.3, 1.0], dtype=torch.float32).view(torch.int32)
    used = use.acquire(True, True)
    filtered = top_k(scores, ks)
    assert int(torch.isfinite(filtered[0]).sum()) == 3 and bool(torch.isfinite(filtered[1]).all())
    assert int(torch.isfinite(top_p(scores, ps)[0]).sum()) < 16
    use.release(used)
    assert (use.top_k, use.top_p) == (0, 0) and top_k(scores, ks) is scores


def test_this_transformers_routes_continuous_batching_to_the_per_request_kernel():
    from slipstream.rollouter.embedded import attention

    attention.install()
    assert attention.is_routed("sdpa")
