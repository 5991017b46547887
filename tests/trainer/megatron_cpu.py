"""Running megatron-core 0.16.1 on a CPU-only torch, for tests.

megatron-core names ``"cuda"`` directly in code the engine reaches: the pipeline schedules, the optimizers
(``FP32Optimizer``'s loss scale, ``clip_grads``' dtype checks ask for ``torch.cuda.FloatTensor``), the grad
buffers and RoPE (``torch.cuda.current_device()``), the tied-embedding sync (``.cuda()``). Inside
:func:`cuda_on_cpu` those requests land on the CPU: a torch function mode rewrites ``device="cuda"`` to the
CPU, makes ``Tensor.cuda()`` a no-op and reports CPU tensors' ``type()`` as their CUDA names, and
``torch.cuda.current_device`` returns the CPU device. Nothing else changes, so what runs is megatron-core's
own code.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode


def _cpu(device: Any) -> Any:
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


class _CudaToCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        name = getattr(func, "__name__", "")
        if name == "cuda":
            return args[0]
        if name == "type" and len(args) == 1 and not kwargs:
            out = func(*args)
            return out.replace("torch.", "torch.cuda.", 1) if ".cuda." not in out else out
        if name == "to":
            args = tuple(_cpu(a) for a in args)
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_on_cpu() -> Iterator[None]:
    saved = torch.cuda.current_device
    torch.cuda.current_device = lambda: torch.device("cpu")
    try:
        with _CudaToCpu():
            yield
    finally:
        torch.cuda.current_device = saved
