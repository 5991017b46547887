"""Synthetic packed batches in the queue's collate layout, for tests and ``slipstream bench train``.

Real batches come from ``slipstream.queue.batch.collate``; these have the same keys, dtypes and invariants
(see ``trainer/batching.py``) with random token ids, so the engine and the trainer can be exercised
without a queue or an inference server.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tensordict import TensorDict


def long_tail_lengths(n: int, *, median: int, max_len: int, seed: int = 0) -> list[int]:
    """``n`` response lengths with a long tail (log-normal, capped): most short, a few near ``max_len``.

    The shape RL rollouts have: reasoning samples that hit the length cap next to many short answers.
    """
    g = torch.Generator().manual_seed(seed)
    raw = torch.exp(torch.randn(n, generator=g) * 0.9) * median
    lengths = raw.round().clamp(min=1, max=max_len).long().tolist()
    lengths[0] = max_len  # at least one sample at the cap, as in practice
    return lengths


def make_packed_batch(
    prompt_lens: Sequence[int],
    response_lens: Sequence[int],
    *,
    vocab_size: int,
    group_size: int = 1,
    seed: int = 0,
    version: int = 0,
    uid_prefix: str = "s",
    shared_prompts: bool = False,
) -> TensorDict:
    """A batch of ``len(prompt_lens)`` samples; consecutive runs of ``group_size`` samples form a group.

    Behaviour logprobs are random negatives, rewards random in {0, 1}, every response token is a policy
    token and carries ``version``. ``shared_prompts``: the samples of a group have the same prompt tokens
    (as rollouts of one prompt do; ``prompt_lens`` must then agree within each group).
    """
    if len(prompt_lens) != len(response_lens):
        raise ValueError("prompt_lens and response_lens must have one entry per sample")
    g = torch.Generator().manual_seed(seed)
    n = len(prompt_lens)
    ids, pos, mask, old, ver = [], [], [], [], []
    prompt = torch.empty(0, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompt_lens, response_lens, strict=True)):
        if not shared_prompts or i % group_size == 0:
            prompt = torch.randint(0, vocab_size, (p,), generator=g)
        elif prompt.numel() != p:
            raise ValueError(f"shared_prompts: sample {i} has a {p}-token prompt, its group {prompt.numel()}")
        ids.append(torch.cat([prompt, torch.randint(0, vocab_size, (r,), generator=g)]))
        pos.append(torch.arange(p + r))
        mask.append(torch.cat([torch.zeros(p, dtype=torch.bool), torch.ones(r, dtype=torch.bool)]))
        old.append(torch.cat([torch.zeros(p), -torch.rand(r, generator=g) * 3]))
        ver.append(torch.cat([torch.full((p,), -1), torch.full((r,), version)]))
    lengths = torch.tensor([p + r for p, r in zip(prompt_lens, response_lens, strict=True)])
    cu = torch.zeros(n + 1, dtype=torch.int32)
    cu[1:] = lengths.cumsum(0)
    td = TensorDict(
        {
            "input_ids": torch.cat(ids).long(),
            "position_ids": torch.cat(pos).long(),
            "loss_mask": torch.cat(mask),
            "old_logprobs": torch.cat(old).float(),
            "versions": torch.cat(ver).int(),
            "cu_seqlens": cu,
            "prompt_lens": torch.tensor(list(prompt_lens), dtype=torch.int32),
            "response_lens": torch.tensor(list(response_lens), dtype=torch.int32),
            "rewards": torch.randint(0, 2, (n,), generator=g).float(),
            "min_versions": torch.full((n,), version, dtype=torch.int32),
            "group_index": torch.arange(n, dtype=torch.int64) // group_size,
        },
        batch_size=[],
    )
    td.set_non_tensor("uids", [f"{uid_prefix}{i}" for i in range(n)])
    td.set_non_tensor("group_ids", [f"{uid_prefix}g{i // group_size}" for i in range(n)])
    return td
