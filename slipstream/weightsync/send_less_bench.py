"""How much of a bf16 model changes per Adam step: the measurement behind delta pushes (``weightsync/delta.py``).

A real model (the quickstart's SmolLM2-135M-Instruct: ``slipstream models prepare smollm2-135m-instruct``
writes it to ``~/.cache/slipstream/models/smollm2-135m-instruct``) is trained in fp32, as the trainer's
master weights are, with AdamW (betas 0.9/0.999, no weight decay, grad-norm clip 1.0: the trainer's
defaults) on next-token cross-entropy over fixed random token rows. After every step each parameter is
cast to the serving dtype and compared bit by bit with its cast after the step before; the delta is
encoded by :func:`~slipstream.weightsync.delta.compute_delta`, applied to the previous cast and checked to
rebuild the new one exactly.

Why this loss: an Adam step's size is about ``lr`` per element whatever the gradient's scale (the update
is ``m / sqrt(v)``), and whether a bf16 value changes depends on that size against the value's ulp, so the
fraction measured here is the one an RL loss at the same learning rate gives; it needs no sampler and no
data.

The quickstart checkpoint is de-quantised from Q4_1, so 8.1% of its fp32 weights sit exactly halfway
between two bf16 values (20.7% exactly on one); the first step's nudge breaks those ties and changes about
half of them, so step 1 changes several times more elements than the steps after it (measured here at lr
1e-6: 4.5% at step 1, about 0.6% per step after). A checkpoint trained in fp32 or bf16 has no such ties.

    python -m slipstream.weightsync.send_less_bench --model ~/.cache/slipstream/models/smollm2-135m-instruct \
        --lr 1e-6 2e-5 --steps 10 --json

``measure_changed_fraction`` is what ``slipstream bench weightsync --send-less`` reports as
``delta_changed_fraction``, ``delta_bytes_ratio`` and ``delta_exact``; :func:`lora_bytes_ratio` is the
adapter's share of the model's elements, the bound on ``lora_bytes_ratio`` in one dtype.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Iterable

import torch

from slipstream.weightsync.delta import adapter_shapes, apply_delta, bits_view, compute_delta

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _snapshot(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {name: p.detach().to(dtype).clone() for name, p in model.named_parameters()}


def _compare(prev: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> dict:
    """Changed elements, delta bytes, dense bytes, encodings used and exactness of one step's deltas."""
    changed = numel = delta_bytes = dense_bytes = 0
    encodings: dict[str, int] = {}
    exact = True
    for name, tensor in new.items():
        d = compute_delta(prev[name], tensor)
        rebuilt = apply_delta(prev[name], d)
        exact = exact and torch.equal(bits_view(rebuilt), bits_view(tensor))
        n_changed = int((bits_view(prev[name]) != bits_view(tensor)).sum())
        changed += n_changed
        numel += tensor.numel()
        delta_bytes += d.nbytes
        dense_bytes += d.dense_nbytes
        encodings[d.encoding] = encodings.get(d.encoding, 0) + 1
    return {
        "changed_fraction": changed / numel,
        "bytes_ratio": delta_bytes / dense_bytes,
        "delta_bytes": delta_bytes,
        "dense_bytes": dense_bytes,
        "encodings": encodings,
        "exact": exact,
    }


def measure_changed_fraction(
    model_path: str,
    lr: float,
    steps: int = 10,
    *,
    serve_dtype: torch.dtype = torch.bfloat16,
    batch: int = 4,
    seq_len: int = 64,
    seed: int = 0,
) -> dict:
    """Train ``steps`` AdamW steps at ``lr``; per step, the fraction of serving-dtype elements that changed.

    Returns ``{"lr", "steps": [per-step dict], "changed_fraction", "bytes_ratio", "exact", "step_s"}`` with
    the fraction and the bytes ratio (delta bytes / dense bytes, smallest encoding per tensor) averaged over
    the steps, and ``exact`` true when every step's delta rebuilt the new weights bit for bit.
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.train()
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq_len), generator=gen)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), weight_decay=0.0)
    prev = _snapshot(model, serve_dtype)
    rows, t0 = [], time.perf_counter()
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        new = _snapshot(model, serve_dtype)
        rows.append({"loss": float(loss.detach()), **_compare(prev, new)})
        prev = new
    return {
        "lr": lr,
        "serve_dtype": str(serve_dtype).removeprefix("torch."),
        "steps": rows,
        "changed_fraction": sum(r["changed_fraction"] for r in rows) / len(rows),
        "bytes_ratio": sum(r["bytes_ratio"] for r in rows) / len(rows),
        "exact": all(r["exact"] for r in rows),
        "step_s": (time.perf_counter() - t0) / len(rows),
    }


def lora_bytes_ratio(
    base_shapes: list[tuple[str, tuple[int, ...]]],
    rank: int = 16,
    target_modules: Iterable[str] = LORA_TARGETS,
) -> float:
    """Elements (so bytes, in one dtype) of a rank-``rank`` adapter on ``target_modules`` over the model's.

    SmolLM2-135M (``bench.model_shapes(bench.SMOLLM2_135M)``), rank 16 on the attention and MLP projections:
    4,884,480 / 134,515,008 = 0.0363."""
    full = sum(math.prod(shape) for _, shape in base_shapes)
    adapter = sum(math.prod(shape) for _, shape in adapter_shapes(base_shapes, rank, target_modules))
    return adapter / full


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="local HF model directory")
    parser.add_argument("--lr", type=float, nargs="+", default=[1e-6, 2e-5])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="bfloat16")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="one JSON object per learning rate")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    for lr in args.lr:
        res = measure_changed_fraction(args.model, lr, args.steps, serve_dtype=_DTYPES[args.dtype])
        if args.json:
            print(json.dumps(res), flush=True)
            continue
        per_step = " ".join(f"{r['changed_fraction']:.4f}" for r in res["steps"])
        print(
            f"lr {lr:g}: changed {res['changed_fraction']:.4%} of {args.dtype} elements per step "
            f"(per step: {per_step}); delta/dense bytes {res['bytes_ratio']:.4f}; exact {res['exact']}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
