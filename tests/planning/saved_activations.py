"""What autograd keeps for backward: the yardstick the memory plan's activation formulas are held against."""

from __future__ import annotations

from collections.abc import Callable

import torch


def saved_bytes(module: torch.nn.Module, forward: Callable[[], object]) -> int:
    """Bytes of the distinct storages autograd saves while ``forward()`` runs, ``module``'s parameters aside."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    kept, sizes = [], {}

    def pack(t):
        kept.append(t)  # alive until the end, so no storage is freed and reused under another tensor
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            sizes[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return sum(sizes.values())
