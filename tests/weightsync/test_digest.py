"""The pushed weights' digests: equal bytes give equal digests, and the corruptions seen in practice (a
flipped bit, the first bytes overwritten, words moved) give different ones, for both algorithms."""

from __future__ import annotations

import pytest
import torch

from slipstream.weightsync.digest import ALGORITHMS, algorithm_for, digest


def _bytes(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("algo", ALGORITHMS)
@pytest.mark.parametrize("n", [0, 1, 7, 8, 4096 * 8, 4096 * 8 * 3 + 13])
def test_equal_bytes_give_equal_digests_and_each_corruption_a_different_one(algo, n):
    data = _bytes(n)
    stamp = digest(data, algo)
    assert isinstance(stamp, int) and -(1 << 63) <= stamp < 1 << 63
    assert digest(data.clone(), algo) == stamp
    if n == 0:
        return
    flipped = data.clone()
    flipped[n // 2] ^= 1  # one bit
    assert digest(flipped, algo) != stamp
    marker = data.clone()
    marker[: min(n, 8)] = torch.tensor(list(b"DONE\x00\x00\x00\x00"[: min(n, 8)]), dtype=torch.uint8) ^ 0x55
    if not torch.equal(marker, data):
        assert digest(marker, algo) != stamp  # a completion marker written over the first bytes
    if n >= 4096 * 8 * 2:
        moved = data.clone().view(-1)
        row = 4096 * 8
        moved[:row], moved[row : 2 * row] = data[row : 2 * row].clone(), data[:row].clone()
        assert digest(moved, algo) != stamp  # two rows of words swapped


def test_a_view_at_any_offset_digests_like_a_copy_of_its_bytes():
    data = _bytes(4096 * 8 + 100, seed=3)
    for algo in ALGORITHMS:
        for start in (0, 1, 3, 8):
            view = data[start:]
            assert digest(view, algo) == digest(view.clone(), algo)


def test_host_memory_takes_xxh3_and_device_memory_the_word_sum():
    assert algorithm_for(torch.device("cpu")) == "xxh3"
    assert algorithm_for(torch.device("cuda", 0)) == "sum64"
    with pytest.raises(ValueError, match="unknown digest algorithm `md5`"):
        digest(_bytes(8), "md5")
