"""`slipstream bench weightsync`: bucketed, pipelined weight sync against the raw transport and naive sync.

One sender (this process) and 1 or 3 receiver processes on loopback share one torch.distributed group.
For each tensor set and receiver count, interleaved over ``--reps`` repetitions after one warm-up:

  * ``raw``: one broadcast of a single pre-allocated buffer holding as many bytes as the set: the
    transport's physical limit here;
  * ``bucketed``: ``TorchDistTransport.send_weights`` (packing bucket *i+1* while bucket *i* is on the
    wire), receivers staging each version and then applying it to their own copy of the model;
  * ``naive``: the same transport with ``layout=None``: one tensor at a time, each waited for;
  * ``ipc``: ``IpcTransport.send_weights`` to the same receivers through shared memory (``--device cpu``:
    POSIX shared memory; ``--device cuda``: CUDA IPC on one GPU, where NCCL cannot run and the
    torch_dist columns are not measured), against ``memcpy``: one copy of the set's bytes in this
    process, the limit for an engine that moves every byte by copying (``ipc`` copies twice: packing,
    then the receiver's copy out);
  * ``nixl`` (with ``--backends ...,nixl``): ``NixlTransport.send_weights``, receivers READing each bucket
    from the sender's registered memory (DRAM on ``--device cpu``, GPU memory on ``--device cuda``).

Every row drives the transports the publisher uses (``weightsync.base.Transport``), with in-band metadata.
``--backends`` picks the transports measured (default ``torch_dist,ipc`` on a CPU, ``ipc`` on a GPU);
``torch_dist`` brings ``raw``, ``bucketed`` and ``naive``.

Every timing runs from a barrier of all ranks to a barrier after the last byte landed; the figure is the
median over repetitions, and ``of_raw``/``x_naive`` are medians of per-repetition ratios. ``pause_s`` is
what receivers spend applying a staged version (the only time generation stops on a staging server);
``transfer_s`` the bucketed transfer, during which they keep serving.

Tensor sets are model-shaped: SmolLM2-135M-Instruct (the quickstart model), its shapes derived from its
config on the meta device (no weights), in bf16 (how a GPU serves it, 0.27 GB) and in fp32 (the CPU
quickstart, 0.54 GB).

    slipstream bench weightsync --json
    slipstream bench weightsync --device cuda --receivers 1 --json
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

from slipstream.cli_args import add_device_flag, add_json_flag, add_key_option, command_parser, doc_paragraph
from slipstream.utils.tensors import total_nbytes
from slipstream.weightsync.base import SendStats, Transport, build_topology, make_transport
from slipstream.weightsync.config import WeightSyncConfig
from slipstream.weightsync.groups import DistGroup
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
# The 1.17B bf16 model of the GPU measurements (2.35 GB): a GPU-sized push.
LLAMA_1B = dict(SMOLLM2_135M, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=False)  # fmt: skip
LARGE_SETS = {"llama-1b-bf16": (LLAMA_1B, torch.bfloat16)}


def model_shapes(config: dict) -> list[tuple[str, tuple[int, ...]]]:
    """Parameter names and shapes of a Llama model with ``config``, built on the meta device."""
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**config))
    return [(name, tuple(p.shape)) for name, p in model.named_parameters()]


def make_set(name: str, fill: float = 0.0, device: str = "cpu") -> list[tuple[str, torch.Tensor]]:
    extra = {**SMOKE_SETS, **LARGE_SETS}
    config, dtype = extra[name] if name in extra else (SMOLLM2_135M, SETS[name])
    return [(n, torch.full(shape, fill, dtype=dtype, device=device)) for n, shape in model_shapes(config)]


def set_bytes(tensors: list[tuple[str, torch.Tensor]]) -> int:
    return total_nbytes(t for _, t in tensors)


class Cmd(msgspec.Struct):
    op: str  # setup | raw | sync | ipc | stop
    set: str = ""
    nbytes: int = 0
    device: str = "cpu"


class Reply(msgspec.Struct):
    ok: bool = True
    apply_s: float = 0.0
    version: int = 0
    error: str = ""


def _barrier(group: DistGroup) -> None:
    group.pg.allreduce([torch.zeros(1)]).wait()


# ------------------------------------------------------------------------------------------- receivers


def _receiver(conn, cfg_raw: bytes, with_nixl: bool) -> None:
    torch.set_num_threads(1)
    cfg = msgspec.msgpack.decode(cfg_raw, type=WeightSyncConfig)
    engine = make_transport("torch_dist", cfg, is_sender=False, device="cpu")
    ipc = make_transport("ipc", cfg, is_sender=False)
    nixl = make_transport("nixl", cfg, is_sender=False) if with_nixl else None
    ends = [engine.prepare(), ipc.prepare()] + ([nixl.prepare()] if nixl else [])
    conn.send_bytes(msgspec.msgpack.encode(ends))
    infos = msgspec.msgpack.decode(conn.recv_bytes(), type=list[InitInfo])
    engine.connect(infos[0])
    ipc.connect(infos[1])
    if nixl:
        nixl.connect(infos[2])
    receivers = {"sync": engine, "ipc": ipc, "nixl": nixl}
    group = engine.group
    model: dict[str, torch.Tensor] = {}
    raw = torch.empty(0, dtype=torch.uint8)
    while True:
        cmd = msgspec.msgpack.decode(conn.recv_bytes(), type=Cmd)
        reply = Reply()
        if cmd.op == "stop":
            break
        if cmd.op == "setup":
            model = dict(make_set(cmd.set, device=cmd.device))
            raw = torch.zeros(cmd.nbytes, dtype=torch.uint8)
        elif cmd.op == "raw":
            _barrier(group)
            group.broadcast(raw, cfg.timeout_s)
            _barrier(group)
        elif cmd.op in receivers:
            _barrier(group)
            stream = receivers[cmd.op].receive_weights()
            staged = asyncio.run(stream.collect())
            _barrier(group)
            start = time.perf_counter()
            for name, tensor in staged.items():  # the apply: what a staging server pauses for
                model[name].copy_(tensor)
            reply = Reply(apply_s=time.perf_counter() - start, version=stream.version or 0)
        conn.send_bytes(msgspec.msgpack.encode(reply))
    for end in (nixl, ipc, engine):
        if end is not None:
            end.close()


# ----------------------------------------------------------------------------------------------- sender


class Bench:
    def __init__(self, cfg: WeightSyncConfig, receivers: int, with_nixl: bool = False) -> None:
        ctx = mp.get_context("spawn")
        self.cfg = cfg
        self.conns, self.procs = [], []
        for _ in range(receivers):
            mine, theirs = ctx.Pipe()
            args = (theirs, msgspec.msgpack.encode(cfg), with_nixl)
            proc = ctx.Process(target=_receiver, args=args, daemon=True)
            proc.start()
            self.conns.append(mine)
            self.procs.append(proc)
        self.engine = make_transport("torch_dist", cfg, is_sender=True, device="cpu")  # and the barriers
        self.ipc = make_transport("ipc", cfg, is_sender=True)
        rdvs = [msgspec.msgpack.decode(c.recv_bytes(), type=list[Rendezvous]) for c in self.conns]
        mine_info, infos = build_topology(self.engine.prepare(), [r[0] for r in rdvs], "bench")
        ipc_info, ipc_infos = build_topology(self.ipc.prepare(), [r[1] for r in rdvs], "bench")
        self.nixl = make_transport("nixl", cfg, is_sender=True) if with_nixl else None
        nixl_infos = [None] * receivers
        if self.nixl is not None:
            nixl_info, nixl_infos = build_topology(self.nixl.prepare(), [r[2] for r in rdvs], "bench")
        for conn, info, other, third in zip(self.conns, infos, ipc_infos, nixl_infos, strict=True):
            conn.send_bytes(msgspec.msgpack.encode([info, other] + ([third] if third else [])))
        self.engine.connect(mine_info)
        self.ipc.connect(ipc_info)
        if self.nixl is not None:
            self.nixl.connect(nixl_info)
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

    def sync(self, engine: Transport, tensors, naive: bool = False) -> tuple[float, float, SendStats]:
        """One version over ``engine`` (``naive``: one tensor per bucket, each waited for)."""
        self.version += 1
        op = "ipc" if engine is self.ipc else "nixl" if engine is self.nixl else "sync"
        self.command(Cmd(op=op))
        group = self.engine.group
        _barrier(group)
        start = time.perf_counter()
        layout = None if naive else "default"
        stats = asyncio.run(engine.send_weights(tensors, self.version, layout=layout))
        _barrier(group)
        elapsed = time.perf_counter() - start
        pause = max(r.apply_s for r in self.replies())
        return elapsed, pause, stats

    def close(self) -> None:
        self.command(Cmd(op="stop"))
        if self.nixl is not None:
            self.nixl.close()
        self.ipc.close()
        self.engine.close()
        for proc in self.procs:
            proc.join(timeout=30)


def memcpy_s(nbytes: int, device: str) -> float:
    """One copy of ``nbytes`` between two buffers of this process (already faulted in)."""
    src, dst = (
        torch.ones(nbytes, dtype=torch.uint8, device=device),
        torch.empty(nbytes, dtype=torch.uint8, device=device),
    )
    dst.copy_(src)
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    dst.copy_(src)
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def run_set(
    bench: Bench, set_name: str, reps: int, backends: frozenset[str] = frozenset({"ipc", "torch_dist"})
) -> dict:
    device = bench.cfg.device
    tensors = make_set(set_name, fill=1.0, device=device)
    nbytes = set_bytes(tensors)
    bench.command(Cmd(op="setup", set=set_name, nbytes=nbytes, device=device))
    bench.replies()
    buf = torch.ones(nbytes, dtype=torch.uint8)
    names = ["memcpy"] + (["ipc", "ipc_pause"] if "ipc" in backends else [])
    names += ["nixl"] if "nixl" in backends else []
    names += ["raw", "bucketed", "naive", "pause"] if "torch_dist" in backends else []
    times: dict[str, list[float]] = {k: [] for k in names}
    for rep in range(reps + 1):  # repetition 0 warms buffers and staging up and is not counted
        got = {"memcpy": memcpy_s(nbytes, device)}
        if "ipc" in backends:
            got["ipc"], got["ipc_pause"], _ = bench.sync(bench.ipc, tensors)
        if "nixl" in backends:
            got["nixl"], _, _ = bench.sync(bench.nixl, tensors)
        if "torch_dist" in backends:
            got["raw"] = bench.raw(buf)
            got["bucketed"], got["pause"], _ = bench.sync(bench.engine, tensors)
            got["naive"], _, _ = bench.sync(bench.engine, tensors, naive=True)
        if rep:
            for k in names:
                times[k].append(got[k])
    med = {k: statistics.median(v) for k, v in times.items()}

    def ratio(a: str, b: str) -> float | None:
        # Ratios pair the measurements of one repetition (taken seconds apart), so that the load other
        # processes put on a shared machine, which drifts over minutes, cancels out of them.
        if a not in times or b not in times:
            return None
        return round(statistics.median(x / y for x, y in zip(times[a], times[b], strict=True)), 3)

    def gbps(k: str) -> float | None:
        return round(nbytes / med[k] / 1e9, 3) if k in med else None

    def secs(k: str) -> float | None:
        return round(med[k], 4) if k in med else None

    return {
        "set": set_name,
        "device": device,
        "tensors": len(tensors),
        "receivers": len(bench.conns),
        "bytes": nbytes,
        "bucket_mb": bench.cfg.bucket_mb,
        "effective_gbps": gbps("bucketed"),
        "raw_gbps": gbps("raw"),
        "naive_gbps": gbps("naive"),
        "pause_s": secs("pause"),
        "transfer_s": secs("bucketed"),
        "of_raw": ratio("raw", "bucketed"),
        "x_naive": ratio("naive", "bucketed"),
        "ipc_gbps": gbps("ipc"),
        "memcpy_gbps": gbps("memcpy"),
        "ipc_pause_s": secs("ipc_pause"),
        "ipc_transfer_s": secs("ipc"),
        "ipc_of_memcpy": ratio("memcpy", "ipc"),
        "ipc_x_bucketed": ratio("bucketed", "ipc"),
        "nixl_gbps": gbps("nixl"),
        "nixl_of_memcpy": ratio("memcpy", "nixl"),
    }


def _line(row: dict) -> str:
    def fmt(key: str, spec: str) -> str:
        return "-" if row[key] is None else format(row[key], spec)

    return (
        f"{row['set']:20s} {row['device']} receivers={row['receivers']} {row['bytes'] / 1e9:.2f} GB  "
        f"bucketed {fmt('effective_gbps', '.2f')} GB/s  raw {fmt('raw_gbps', '.2f')}  "
        f"naive {fmt('naive_gbps', '.2f')}  ({fmt('of_raw', '.0%')} of raw, {fmt('x_naive', '.1f')}x naive)  "
        f"pause {fmt('pause_s', '.3f')} s / transfer {fmt('transfer_s', '.3f')} s  |  "
        f"ipc {fmt('ipc_gbps', '.2f')} GB/s  memcpy {fmt('memcpy_gbps', '.2f')}  "
        f"({fmt('ipc_of_memcpy', '.0%')} of memcpy, {fmt('ipc_x_bucketed', '.1f')}x bucketed)  "
        f"pause {fmt('ipc_pause_s', '.3f')} s / transfer {fmt('ipc_transfer_s', '.3f')} s  |  "
        f"nixl {fmt('nixl_gbps', '.2f')} GB/s"
    )


def build_parser() -> argparse.ArgumentParser:
    """The bench's parser: ``--bucket-mb`` and ``--timeout-s`` are the run config's ``weightsync.*`` keys,
    generated from them; the rest are the bench's own sizes (receivers, tensor sets, repetitions)."""
    parser = command_parser("slipstream bench weightsync", doc_paragraph(__doc__))
    add_json_flag(parser)
    add_key_option(parser, WeightSyncConfig, "bucket_mb", section="weightsync", default=64)
    parser.add_argument("--receivers", default="1,3", help="comma-separated receiver counts")
    parser.add_argument("--sets", default=",".join(SETS), help=f"comma-separated, from {list(SETS)}")
    parser.add_argument("--reps", type=int, default=7)
    add_key_option(parser, WeightSyncConfig, "timeout_s", section="weightsync", default=120.0)
    add_device_flag(parser, "where the pushed tensors live")
    # A list of transports to compare, so not the one weightsync.backend key.
    parser.add_argument(
        "--backends",
        default="",
        help="comma-separated from torch_dist, ipc, nixl (default torch_dist,ipc on cpu, ipc on cuda)",
    )
    parser.add_argument(
        "--send-less",
        action="store_true",
        help="full vs delta (weightsync.delta) vs LoRA adapter-only pushes of the quickstart model through the "
        "publisher to an embedded server (bench_send_less.send_less_figures)",
    )
    parser.add_argument("--model", default="~/.cache/slipstream/models/smollm2-135m-instruct",
                        help="--send-less: the HF checkpoint (slipstream models prepare smollm2-135m-instruct)")  # fmt: skip
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.send_less:
        from pathlib import Path

        from slipstream.system.bench_send_less import send_less_figures

        res = send_less_figures(str(Path(args.model).expanduser()))
        print(json.dumps(res) if args.json else json.dumps(res, indent=1))
        return 0
    sets = [s for s in args.sets.split(",") if s]
    unknown = [s for s in sets if s not in SETS and s not in SMOKE_SETS and s not in LARGE_SETS]
    if unknown:
        parser.error(f"unknown tensor set(s) {unknown}; known: {list(SETS) + list(LARGE_SETS)}")
    backends = frozenset(b for b in args.backends.split(",") if b) or frozenset(
        {"ipc"} if args.device == "cuda" else {"torch_dist", "ipc"}
    )
    if backends - {"torch_dist", "ipc", "nixl"}:
        parser.error(f"unknown backends {sorted(backends - {'torch_dist', 'ipc', 'nixl'})}")
    if args.device == "cuda" and "torch_dist" in backends:
        parser.error("torch_dist needs one GPU per rank (NCCL refuses two ranks on one GPU): drop it on cuda")
    torch.set_num_threads(1)
    cfg = WeightSyncConfig(bucket_mb=args.bucket_mb, timeout_s=args.timeout_s, device=args.device)
    rows = []
    for receivers in [int(x) for x in args.receivers.split(",") if x]:
        bench = Bench(cfg, receivers, with_nixl="nixl" in backends)
        try:
            for set_name in sets:
                row = run_set(bench, set_name, args.reps, backends)
                rows.append(row)
                print(_line(row), file=sys.stderr if args.json else sys.stdout, flush=True)
        finally:
            bench.close()
    if args.json:
        print(json.dumps({"rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
