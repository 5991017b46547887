"""dtype names <-> torch dtypes and byte sizes: the one helper every role uses."""

from __future__ import annotations

import pytest
import torch

from slipstream.utils.tensors import dtype_bytes, dtype_name, nbytes, parse_dtype, shape_nbytes, total_nbytes


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int64, torch.bool])
def test_names_round_trip(dtype):
    assert parse_dtype(dtype_name(dtype)) is dtype
    assert parse_dtype(str(dtype)) is dtype  # "torch.bfloat16" too


def test_server_spellings_and_unknown_names():
    assert parse_dtype("bf16") is torch.bfloat16 and parse_dtype("half") is torch.float16
    assert parse_dtype("fp32") is torch.float32
    with pytest.raises(ValueError, match="^model.dtype: unknown dtype `float33`"):
        parse_dtype("float33", key="model.dtype")
    with pytest.raises(ValueError, match="unknown dtype `nn`"):
        parse_dtype("nn")  # an attribute of torch that is not a dtype


def test_byte_sizes():
    assert dtype_bytes("bfloat16") == 2 and dtype_bytes(torch.float32) == 4
    assert shape_nbytes([3, 5], "float16") == 30 and shape_nbytes([], torch.int64) == 8
    with pytest.raises(ValueError, match="negative dimension"):
        shape_nbytes([2, -1], torch.float32)
    t = torch.zeros(4, 6, dtype=torch.bfloat16)
    assert nbytes(t) == 48 and nbytes(t[:, :2]) == 16  # a view counts its own elements
    assert total_nbytes([t, None, torch.zeros(3)]) == 60
