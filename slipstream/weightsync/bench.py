"""`slipstream bench weightsync`: bucketed, pipelined weight sync against the raw transport and naive sync.

One sender (this process) and 1 or 3 receiver processes on loopback share one torch.distributed group.
For each tensor set and receiver count, interleaved over ``--reps`` repetitions after one warm-up:

  * ``raw``: one broadcast of a single pre-allocated buffer holding as many bytes as the set: the
    transport's physical limit here;
  * ``bucketed``: ``TorchDistEngine.send_weights`` (packing bucket *i+1* while bucket *i* is on the wire),
    receivers staging each version and then applying it to their own copy of the model;
  * ``naive``: ``NaiveEngine.send_weights``: one tensor at a time, each waited for.

Every timing runs from a barrier of all ranks to a barrier after the last byte landed; the figure is the
median over repetitions, and ``of_raw``/``x_naive`` are medians of per-repetition ratios. ``pause_s`` is
what receivers spend applying a staged version (the only time generation stops on a staging server);
``transfer_s`` the bucketed transfer, during which they keep serving.

Tensor sets are model-shaped: SmolLM2-135M-Instruct (the quickstart model), its shapes derived from its
config on the meta device (no weights), in bf16 (how a GPU serves it, 0.27 GB) and in fp32 (the CPU
quickstart, 0.54 GB).

    slipstream bench weightsync --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import sys
import time

import msgspec
import torch

from slipstream.weightsync.base import SendStats
from slipstream.weightsync.config import WeightSyncConfig
from slipstream.weightsync.groups import DistGroup
from slipstream.weightsync.naive import NaiveEngine
from slipstream.weightsync.torch_dist import TorchDistEngine
from slipstream.weightsync.types import InitInfo, Rendezvous

# SmolLM2-135M-Instruct's config.json (the fields that decide parameter shapes).
SMOLLM2_135M = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    tie_word_embeddings=True,
)
SETS = {"smollm2-135m-bf16": torch.bfloat16, "smollm2-135m-fp32": torch.float32}
# A 2-layer miniature of the same architecture, for smoke tests of the bench itself.
TINY = dict(SMOLLM2_135M, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16)  # fmt: skip
SMOKE_SETS = {"tiny-fp32": (TINY, torch.float32)}


def model_shapes(config: dict) -> list[tuple[str, tuple[int, ...]]]:
    """Parameter names and shapes of a Llama model with ``config``, built on the meta device."""
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**config))
    return [(name, tuple(p.shape)) for name, p in model.named_parameters()]


def make_set(name: str, fill: float = 0.0) -> list[tuple[str, torch.Tensor]]:
    config, dtype = SMOKE_SETS[name] if name in SMOKE_SETS else (SMOLLM2_135M, SETS[name])
    return [(n, torch.full(shape, fill, dtype=dtype)) for n, shape in model_shapes(config)]


def set_bytes(tensors: list[tuple[str, torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for _, t in tensors)


class Cmd(msgspec.Struct):
    op: str  # setup | raw | sync | stop
    set: str = ""
    nbytes: int = 0


class Reply(msgspec.Struct):
    ok: bool = True
    apply_s: float = 0.0
    version: int = 0
    error: str = ""


def _barrier(group: DistGroup) -> None:
    group.pg.allreduce([torch.zeros(1)]).wait()


# ------------------------------------------------------------------------------------------- receivers


def _receiver(conn, cfg_raw: bytes) -> None:
    torch.set_num_threads(1)
    cfg = msgspec.msgpack.decode(cfg_raw, type=WeightSyncConfig)
    engine = TorchDistEngine(cfg, is_sender=False, device="cpu")
    conn.send_bytes(msgspec.msgpack.encode(engine.prepare()))
    engine.init_process_group(msgspec.msgpack.decode(conn.recv_bytes(), type=InitInfo))
    group = engine.group
    model: dict[str, torch.Tensor] = {}
    raw = torch.empty(0, dtype=torch.uint8)
    while True:
        cmd = msgspec.msgpack.decode(conn.recv_bytes(), type=Cmd)
        reply = Reply()
        if cmd.op == "stop":
            break
        if cmd.op == "setup":
            model = dict(make_set(cmd.set))
            raw = torch.zeros(cmd.nbytes, dtype=torch.uint8)
        elif cmd.op == "raw":
            _barrier(group)
            group.broadcast(raw, cfg.timeout_s)
            _barrier(group)
        elif cmd.op == "sync":
            _barrier(group)
            stream = engine.receive_weights()
            staged = asyncio.run(stream.collect())
            _barrier(group)
            start = time.perf_counter()
            for name, tensor in staged.items():  # the apply: what a staging server pauses for
                model[name].copy_(tensor)
            reply = Reply(apply_s=time.perf_counter() - start, version=stream.version or 0)
        conn.send_bytes(msgspec.msgpack.encode(reply))
    engine.finalize()


# ----------------------------------------------------------------------------------------------- sender


class Bench:
    def __init__(self, cfg: WeightSyncConfig, receivers: int) -> None:
        ctx = mp.get_context("spawn")
        self.cfg = cfg
        self.conns, self.procs = [], []
        for _ in range(receivers):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=_receiver, args=(theirs, msgspec.msgpack.encode(cfg)), daemon=True)
            proc.start()
            self.conns.append(mine)
            self.procs.append(proc)
        self.engine = TorchDistEngine(cfg, is_sender=True, device="cpu")
        self.naive = NaiveEngine(cfg, is_sender=True, device="cpu")
        rdvs = [msgspec.msgpack.decode(c.recv_bytes(), type=Rendezvous) for c in self.conns]
        mine_info, infos = TorchDistEngine.build_topology(self.engine.prepare(), rdvs, "bench")
        for conn, info in zip(self.conns, infos, strict=True):
            conn.send_bytes(msgspec.msgpack.encode(info))
        self.engine.init_process_group(mine_info)
        # Same group and metadata channel, same receive path: only the sender differs.
        self.naive.group, self.naive.meta = self.engine.group, self.engine.meta
        self.version = 0

    def command(self, cmd: Cmd) -> list[Reply]:
        for conn in self.conns:
            conn.send_bytes(msgspec.msgpack.encode(cmd))
        return []

    def replies(self) -> list[Reply]:
        out = [msgspec.msgpack.decode(c.recv_bytes(), type=Reply) for c in self.conns]
        bad = [r.error for r in out if not r.ok]
        if bad:
            raise RuntimeError(f"receiver failed: {bad}")
        return out

    def raw(self, buf: torch.Tensor) -> float:
        self.command(Cmd(op="raw"))
        group = self.engine.group
        _barrier(group)
        start = time.perf_counter()
        group.broadcast(buf, self.cfg.timeout_s)
        _barrier(group)
        elapsed = time.perf_counter() - start
        self.replies()
        return elapsed

    def sync(self, engine, tensors) -> tuple[float, float, SendStats]:
        self.version += 1
        self.command(Cmd(op="sync"))
        group = self.engine.group
        _barrier(group)
        start = time.perf_counter()
        stats = asyncio.run(engine.send_weights(tensors, self.version))
        _barrier(group)
        elapsed = time.perf_counter() - start
        pause = max(r.apply_s for r in self.replies())
        return elapsed, pause, stats

    def close(self) -> None:
        self.command(Cmd(op="stop"))
        self.engine.finalize()
        for proc in self.procs:
            proc.join(timeout=30)


def run_set(bench: Bench, set_name: str, reps: int) -> dict:
    tensors = make_set(set_name, fill=1.0)
    nbytes = set_bytes(tensors)
    bench.command(Cmd(op="setup", set=set_name, nbytes=nbytes))
    bench.replies()
    buf = torch.ones(nbytes, dtype=torch.uint8)
    times: dict[str, list[float]] = {"raw": [], "bucketed": [], "naive": [], "pause": []}
    for rep in range(reps + 1):  # repetition 0 warms buffers and staging up and is not counted
        raw_s = bench.raw(buf)
        bucketed_s, pause_s, _ = bench.sync(bench.engine, tensors)
        naive_s, _, _ = bench.sync(bench.naive, tensors)
        if rep:
            times["raw"].append(raw_s)
            times["bucketed"].append(bucketed_s)
            times["naive"].append(naive_s)
            times["pause"].append(pause_s)
    med = {k: statistics.median(v) for k, v in times.items()}
    gbps = {k: nbytes / med[k] / 1e9 for k in ("raw", "bucketed", "naive")}
    # Ratios pair the measurements of one repetition (taken seconds apart), so that the load other
    # processes put on a shared machine, which drifts over minutes, cancels out of them.
    of_raw = statistics.median(r / b for r, b in zip(times["raw"], times["bucketed"], strict=True))
    x_naive = statistics.median(n / b for n, b in zip(times["naive"], times["bucketed"], strict=True))
    return {
        "set": set_name,
        "tensors": len(tensors),
        "receivers": len(bench.conns),
        "bytes": nbytes,
        "bucket_mb": bench.cfg.bucket_mb,
        "effective_gbps": round(gbps["bucketed"], 3),
        "raw_gbps": round(gbps["raw"], 3),
        "naive_gbps": round(gbps["naive"], 3),
        "pause_s": round(med["pause"], 4),
        "transfer_s": round(med["bucketed"], 4),
        "of_raw": round(of_raw, 3),
        "x_naive": round(x_naive, 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="slipstream bench weightsync", description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="end with one JSON line of results")
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--receivers", default="1,3", help="comma-separated receiver counts")
    parser.add_argument("--sets", default=",".join(SETS), help=f"comma-separated, from {list(SETS)}")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--timeout-s", type=float, default=120.0)
    args = parser.parse_args(argv)
    sets = [s for s in args.sets.split(",") if s]
    unknown = [s for s in sets if s not in SETS and s not in SMOKE_SETS]
    if unknown:
        parser.error(f"unknown tensor set(s) {unknown}; known: {list(SETS)}")
    torch.set_num_threads(1)
    cfg = WeightSyncConfig(bucket_mb=args.bucket_mb, timeout_s=args.timeout_s, device="cpu")
    rows = []
    for receivers in [int(x) for x in args.receivers.split(",") if x]:
        bench = Bench(cfg, receivers)
        try:
            for set_name in sets:
                row = run_set(bench, set_name, args.reps)
                rows.append(row)
                print(
                    f"{set_name:20s} receivers={receivers} {row['bytes'] / 1e9:.2f} GB  "
                    f"bucketed {row['effective_gbps']:.2f} GB/s  raw {row['raw_gbps']:.2f}  "
                    f"naive {row['naive_gbps']:.2f}  ({row['of_raw']:.0%} of raw, {row['x_naive']:.1f}x naive)  "
                    f"pause {row['pause_s']:.3f} s / transfer {row['transfer_s']:.3f} s",
                    file=sys.stderr if args.json else sys.stdout,
                    flush=True,
                )
        finally:
            bench.close()
    if args.json:
        print(json.dumps({"rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
