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

    python -m slipstream.system.bench_send_less --model ~/.cache/slipstream/models/smollm2-135m-instruct \
        --lr 1e-6 2e-5 --steps 10 --json

``measure_changed_fraction`` is what ``slipstream bench weightsync --send-less`` reports as
``delta_changed_fraction``, ``delta_bytes_ratio`` and ``delta_exact``; :func:`lora_bytes_ratio` is the
adapter's share of the model's elements, the bound on ``lora_bytes_ratio`` in one dtype.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Iterable

import torch

from slipstream.cli_args import add_json_flag, add_key_option, command_parser, doc_paragraph
from slipstream.serverkinds import server_kind
from slipstream.weightsync.config import WeightSyncConfig
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
    parser = command_parser("python -m slipstream.system.bench_send_less", doc_paragraph(__doc__))
    parser.add_argument("--model", required=True, help="local HF model directory")
    # Several values of trainer.lr, one measurement each (and weightsync/ does not import the trainer's config).
    parser.add_argument(
        "--lr", type=float, nargs="+", default=[1e-6, 2e-5], help="learning rates, one run each"
    )
    parser.add_argument("--steps", type=int, default=10)
    add_key_option(
        parser, WeightSyncConfig, "push_dtype", section="weightsync", flags=["--dtype"], choices=sorted(_DTYPES),
        default="bfloat16", note="Here: the dtype the weights are compared in, as a server receives them.",
    )  # fmt: skip
    parser.add_argument("--threads", type=int, default=1)
    add_json_flag(parser, "one JSON object per learning rate")
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


# ------------------------------------------------------------------------ through the publisher and a server


def tensors_digest(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """sha256 over every tensor's name, dtype, shape and bytes, in name order."""
    import hashlib

    h = hashlib.sha256()
    for name, t in sorted(named, key=lambda item: item[0]):
        h.update(f"{name}:{t.dtype}:{list(t.shape)}".encode())
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class _DictTarget:
    """A WeightTarget over a dict of tensors (what a server's model is, minus the model)."""

    def __init__(self, specs: list[tuple[str, list[int], str]]) -> None:
        self.tensors = {n: torch.zeros(shape, dtype=getattr(torch, dt)) for n, shape, dt in specs}
        self.weight_version = 0

    def weight_specs(self) -> dict:
        return {n: (tuple(t.shape), t.dtype) for n, t in self.tensors.items()}

    def apply_weights(self, named_tensors, version: int) -> None:
        staged = list(named_tensors)
        for name, tensor in staged:
            if name not in self.tensors or tensor.shape != self.tensors[name].shape:
                raise ValueError(f"unknown or misshaped parameter {name!r}")
        for name, tensor in staged:
            self.tensors[name].copy_(tensor)
        self.weight_version = version


def _digest_server(port: int, specs: list[tuple[str, list[int], str]]) -> None:
    """A receiving process that reports a digest of what it serves (``GET /digest``): our receiver routes
    (the ones the embedded server mounts) in front of a dict of tensors."""
    import uvicorn
    from fastapi import FastAPI

    from slipstream.weightsync.http_receiver import WeightReceiver

    torch.set_num_threads(1)
    target = _DictTarget(specs)
    app = FastAPI()
    app.include_router(WeightReceiver(target).router())
    app.get("/health")(lambda: {"ok": True})
    app.get("/digest")(
        lambda: {"version": target.weight_version, "digest": tensors_digest(target.tensors.items())}
    )
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def _served_digest(url: str) -> dict:
    import httpx

    return httpx.get(f"{url}/digest", timeout=300).json()


def _lora_adapters(
    base: list[tuple[str, torch.Tensor]], rank: int, targets: Iterable[str], seed: int
) -> list[tuple[str, torch.Tensor]]:
    """Random LoRA factors (B nonzero, so the merge changes every adapted weight) in the base's dtype."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for name, shape in adapter_shapes([(n, tuple(t.shape)) for n, t in base], rank, targets):
        out.append((name, (torch.randn(shape, generator=g) * 0.02).to(base[0][1].dtype)))
    return out


def send_less_figures(
    model_path: str, *, steps: int = 10, lr: float = 1e-6, rank: int = 16, threads: int = 1
) -> dict:
    """``slipstream bench weightsync --send-less``: whole, delta and LoRA versions of SmolLM2-135M in bf16,
    pushed by the real publisher (torch_dist over gloo) on one link to two receiving processes on loopback:
    an embedded server (serving bf16) and a digest server (the same receiver routes in front of a dict of
    tensors, reporting a sha256 of everything it serves, which the embedded server cannot).

    * whole: ``full_bytes``, ``full_push_s``;
    * delta: ``steps`` AdamW steps at ``lr`` of the fp32 model (the trainer's master weights; the loss of
      :func:`measure_changed_fraction`), each pushed with ``weightsync.delta``: ``delta_bytes_ratio`` (wire
      bytes / whole-version bytes, averaged over the steps), ``delta_changed_fraction``, ``delta_push_s``
      (median); ``delta_exact``: every step went as a delta to both servers and the digest server's
      tensors equal the step's bf16 weights bit for bit;
    * LoRA: rank ``rank`` on the 7 attention and MLP projections (random factors, B nonzero): one version
      with the base weights, then adapter-only versions: ``lora_bytes_ratio`` (adapter-only wire bytes /
      whole-version bytes), ``lora_push_s``; ``lora_exact``: the digest server serves ``merge_lora`` of the
      base and each version's adapters bit for bit. ``lora_elements_ratio``: the same ratio from shapes
      alone, for other ranks and targets.
    """
    import multiprocessing as mp

    from transformers import AutoModelForCausalLM

    from slipstream.rollouter.config import EmbeddedServerConfig, RolloutConfig
    from slipstream.rollouter.launch import launch_server
    from slipstream.utils.net import free_port
    from slipstream.weightsync.config import WeightSyncConfig
    from slipstream.weightsync.delta import lora_scale, merge_lora
    from slipstream.weightsync.publisher import WeightPublisher, publish_lora

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.train()

    def bf16(m: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
        return [(n, p.detach().to(torch.bfloat16)) for n, p in m.named_parameters()]

    specs = [(n, list(t.shape), "bfloat16") for n, t in bf16(model)]
    port = free_port()
    digest_proc = mp.get_context("spawn").Process(target=_digest_server, args=(port, specs), daemon=True)
    digest_proc.start()
    digest_url = f"http://127.0.0.1:{port}"
    engine_cfg = EmbeddedServerConfig(
        num_threads=threads, max_model_len=512, kv_cache_tokens=2048, dtype="bfloat16"
    )
    server = launch_server(server_kind("embedded"), model_path, cfg=RolloutConfig(embedded=engine_cfg))
    urls = [server.url, digest_url]

    def cfg(**kw) -> WeightSyncConfig:
        return WeightSyncConfig(backend="torch_dist", device="cpu", timeout_s=600, **kw)

    def exact(version: int, named) -> bool:
        return _served_digest(digest_url) == {"version": version, "digest": tensors_digest(named)}

    out: dict = {"model": model_path, "serve_dtype": "bfloat16", "lr": lr, "steps": steps, "lora_rank": rank,
                 "receivers": ["embedded", "digest"]}  # fmt: skip
    try:
        server.wait_healthy(600)
        _wait_health(digest_url)
        # -- delta: one publisher with weightsync.delta; its first version is whole
        pub = WeightPublisher(cfg(delta=True), urls, server_kind("embedded"), token="")
        try:
            first = pub.publish(1, iter(bf16(model)))
            out["full_bytes"], out["full_push_s"] = first.bytes, round(first.seconds, 4)
            out["full_exact"] = sorted(first.ok) == sorted(urls) and exact(1, bf16(model))
            gen = torch.Generator().manual_seed(0)
            ids = torch.randint(0, model.config.vocab_size, (4, 64), generator=gen)
            opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), weight_decay=0.0)
            rows = []
            for step in range(2, steps + 2):
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
                r = pub.publish(step, iter(bf16(model)))
                rows.append(
                    {"sent": r.sent, "bytes": r.bytes, "changed_fraction": round(r.changed_fraction, 5),
                     "seconds": round(r.seconds, 4), "ok": sorted(r.ok) == sorted(urls),
                     "exact": exact(step, bf16(model))}
                )  # fmt: skip
            again = pub.publish(steps + 2, iter(bf16(model)))  # nothing changed: the smallest delta
            out["delta_unchanged_bytes"] = again.bytes
        finally:
            pub.close()
        out["delta_steps"] = rows
        out["delta_bytes_ratio"] = round(sum(r["bytes"] / out["full_bytes"] for r in rows) / len(rows), 4)
        out["delta_changed_fraction"] = round(sum(r["changed_fraction"] for r in rows) / len(rows), 4)
        out["delta_push_s"] = round(statistics_median([r["seconds"] for r in rows]), 4)
        out["delta_exact"] = all(r["sent"] == "delta" and r["ok"] and r["exact"] for r in rows)
        # -- LoRA: the base weights and adapters once, then the adapters alone
        base = bf16(model)
        scale = lora_scale(2 * rank, rank)
        pub = WeightPublisher(cfg(group_name="lora"), urls, server_kind("embedded"), token="")
        only, exacts, v = [], [], steps + 3
        try:
            adapters = _lora_adapters(base, rank, LORA_TARGETS, 1)
            full = publish_lora(pub, v, lambda: iter(adapters), lambda: iter(base), scale)
            assert full is not None
            exacts.append(exact(v, _merged(base, adapters, scale, merge_lora)))
            for seed in (2, 3, 4):
                v += 1
                adapters = _lora_adapters(base, rank, LORA_TARGETS, seed)
                r = publish_lora(pub, v, lambda a=adapters: iter(a), lambda: iter(base), scale)
                assert r is not None
                only.append(r)
                exacts.append(r.sent == "adapters" and exact(v, _merged(base, adapters, scale, merge_lora)))
        finally:
            pub.close()
        out["lora_full_bytes"], out["lora_full_push_s"] = full.bytes, round(full.seconds, 4)
        out["lora_bytes"] = only[-1].bytes
        out["lora_bytes_ratio"] = round(only[-1].bytes / out["full_bytes"], 4)
        out["lora_push_s"] = round(statistics_median([r.seconds for r in only]), 4)
        out["lora_exact"] = all(exacts) and all(sorted(r.ok) == sorted(urls) for r in only)
        shapes = [(n, tuple(t.shape)) for n, t in base]
        out["lora_elements_ratio"] = {
            f"r{r}-{name}": round(lora_bytes_ratio(shapes, r, targets), 4)
            for r in (8, 16)
            for name, targets in (("all7", LORA_TARGETS), ("attn4", LORA_TARGETS[:4]), ("qv", ("q_proj", "v_proj")))
        }  # fmt: skip
    finally:
        server.stop()
        digest_proc.kill()
        digest_proc.join(timeout=10)
    return out


def _merged(base, adapters, scale: float, merge) -> list[tuple[str, torch.Tensor]]:
    ad = dict(adapters)
    out = []
    for name, w in base:
        a = ad.get(name.removesuffix(".weight") + ".lora_A.weight")
        if a is not None:
            w = merge(w, a, ad[name.removesuffix(".weight") + ".lora_B.weight"], scale)
        out.append((name, w))
    return out


def _wait_health(url: str, timeout_s: float = 300) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} did not start")


def statistics_median(values: list[float]) -> float:
    import statistics

    return statistics.median(values)
