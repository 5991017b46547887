"""``slipstream bench weightsync``: the transports between processes (``--target processes``, the default:
``slipstream.system.bench_transport``), or a version pushed into a real vLLM server while it generates
(``--target vllm``).

``--target vllm`` launches vLLM (its CPU build here) on the quickstart model, served in the dtype
``rollout.vllm.dtype: auto`` chooses on this machine, keeps it busy with ``--requests`` concurrent requests
that are re-submitted as they end, and pushes ``--reps`` versions of the same weights (the trainer's, cast to
the served dtype) through the publisher the pipeline uses, in ``--pause-mode`` (the quickstart's ``abort``).
One warm-up version goes first, with the server idle (it builds the group). Per version:

  * ``transfer_s``: the push, from ``publish`` to its return (group already joined);
  * ``pause_s``: how long the push kept vLLM from generating: from its pause to its resume, as the publisher
    timed it; ``longest_stall_s`` is the same seen from vLLM's side, the longest time inside the push during
    which its generated-token counter (``/metrics``) did not move, which includes one ordinary engine step;
  * ``tokens_during_push``: tokens vLLM generated between the push's start and its end;
  * ``send_s``: of the push, the buckets on their way (the publisher's send, packing pipelined with the wire),
    without vLLM's calls, its preparation of the version (the reload into its shadow copy,
    ``rollouter/vllm_shadow.py``) or the switch;
  * ``raw_s``: the same number of bytes as one broadcast of one buffer over the same transport (gloo on
    loopback, to a receiver process), the physical limit, measured in the same run with the server idle.

Versions alternate between ``weightsync.verify`` on and off (the digests, ``weightsync/digest.py``), ``--reps``
of each; ``verify_overhead`` is the median verified send over the median unverified one, less one (the
digests are computed while packing and checked while staging, both inside ``send_s``; the whole push's
spread, vLLM's reload on a shared core, would hide them), and ``verify_push_overhead`` the same for the
whole push. Those two differences of medians are as noisy as the pushes; ``verify_share`` times the checks
themselves, in every verified push: the trainer's digests (``PublishReport.verify_s``) plus vLLM's digest
checks and read-back of the version (from its log's switch line), over the push's ``transfer_s``. It is an
upper bound of what verification adds to a push: it counts the receiver's checks as if none overlapped the
trainer's packing of the next bucket.

Figures are medians over the verified versions. The last line of ``--json`` is one object: ``{"transfer_s",
"pause_s", "send_s", "longest_stall_s", "tokens_during_push", "raw_s", "raw_over_transfer", "raw_over_send",
"pause_over_transfer", "verify_share", "verify_overhead", "verify_push_overhead", "unverified_send_s", "bytes",
"dtype", ...}``.

    slipstream bench weightsync --target vllm --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

from slipstream.cli_args import add_json_flag, add_key_option, command_parser, doc_paragraph
from slipstream.serverkinds import server_kind
from slipstream.weightsync.config import WeightSyncConfig

TARGETS = ("processes", "vllm")


def main(argv: list[str]) -> int:
    target = argparse.ArgumentParser(add_help=False)
    target.add_argument("--target", choices=TARGETS, default="processes")
    known, rest = target.parse_known_args(argv)
    if known.target == "processes":
        from slipstream.system.bench_transport import main as processes_main

        return processes_main(rest)
    return vllm_main(rest)


def _parser() -> argparse.ArgumentParser:
    """``--bucket-mb``, ``--timeout-s`` and ``--pause-mode`` are ``weightsync.*`` keys, generated from them;
    the rest are the bench's own sizes."""
    p = command_parser("slipstream bench weightsync --target vllm", doc_paragraph(__doc__))
    p.add_argument("--target", choices=TARGETS, default="vllm", help="vllm: this bench")
    p.add_argument("--model", default="smollm2-135m-instruct", help="known model name or HF directory")
    p.add_argument("--requests", type=int, default=16, help="concurrent requests kept running on the server")
    p.add_argument("--reps", type=int, default=3, help="versions pushed under load (after one warm-up)")
    p.add_argument("--threads", type=int, default=1, help="vLLM's OpenMP threads (rollout.vllm.cpu_threads)")
    add_key_option(p, WeightSyncConfig, "bucket_mb", section="weightsync", default=64)
    add_key_option(p, WeightSyncConfig, "timeout_s", section="weightsync", default=300.0)
    add_key_option(p, WeightSyncConfig, "pause_mode", section="weightsync", default="abort")
    p.add_argument(
        "--double-buffer",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="rollout.vllm.double_buffer: versions load into a shadow copy, the switch swaps it in",
    )
    p.add_argument("--log", default="", help="vLLM's log file (default: a temporary file)")
    add_json_flag(p)
    return p


class Load:
    """``requests`` workers, each generating one request after another until :meth:`stop` (a thread of its
    own, with its event loop), so the server is never idle while a version is pushed."""

    PROMPT = [1, 2, 3, 4, 5, 6, 7, 8] * 6

    def __init__(self, url: str, requests: int, max_new_tokens: int) -> None:
        self.url, self.requests, self.max_new_tokens = url, requests, max_new_tokens
        self._stop = threading.Event()
        self.errors: list[str] = []
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self._thread.start()

    async def _run(self) -> None:
        from slipstream.agents.protocol import SamplingParams
        from slipstream.serverkinds.vllm import VLLMClient

        client = VLLMClient(self.url, api="generate", timeout_s=600)
        params = SamplingParams(max_new_tokens=self.max_new_tokens, ignore_eos=True, temperature=1.0)

        async def worker(i: int) -> None:
            while not self._stop.is_set():
                try:
                    await client.generate([*self.PROMPT, 100 + i], params)
                except Exception as err:  # noqa: BLE001 - reported with the figures, the load goes on
                    self.errors.append(f"{type(err).__name__}: {err}")

        async def stopper() -> None:  # requests in flight end at once, with their partial tokens
            await asyncio.to_thread(self._stop.wait)
            await client.abort_all()

        try:
            await asyncio.gather(stopper(), *(worker(i) for i in range(self.requests)))
        finally:
            await client.aclose()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=600)


class TokenCounter:
    """Samples vLLM's ``vllm:generation_tokens_total`` every ``period_s`` on a thread: (time, count) pairs."""

    def __init__(self, url: str, period_s: float = 0.02) -> None:
        import httpx

        self._http = httpx.Client(base_url=url, timeout=10)
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._period = period_s
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def count(self) -> float:
        text = self._http.get("/metrics").text
        return sum(
            float(line.rpartition(" ")[2])
            for line in text.splitlines()
            if line.startswith("vllm:generation_tokens_total")
        )

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.monotonic(), self.count()))
            self._stop.wait(self._period)

    def wait_for_tokens(self, timeout_s: float = 600.0) -> None:
        """Until the server has generated tokens since this counter started."""
        first = self.count()
        deadline = time.monotonic() + timeout_s
        while self.count() <= first:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server generated nothing in {timeout_s} s")
            time.sleep(0.05)

    def window(self, start: float, end: float) -> tuple[float, float]:
        """(tokens generated, longest stall in seconds) between ``start`` and ``end``."""
        inside = [(t, c) for t, c in self.samples if start <= t <= end]
        if len(inside) < 2:
            return 0.0, end - start
        stall, last_t, last_c = 0.0, inside[0][0], inside[0][1]
        for t, c in inside[1:]:
            if c > last_c:
                last_t, last_c = t, c
            stall = max(stall, t - last_t)
        return inside[-1][1] - inside[0][1], stall

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._http.close()


def _trainer_tensors(path: Path, dtype: str) -> list[tuple[str, Any]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    cast = getattr(torch, dtype)
    return [(n, p.detach().to(cast).contiguous()) for n, p in model.named_parameters()]


def _raw_s(cfg: WeightSyncConfig, nbytes: int, reps: int) -> float:
    import torch

    from slipstream.system.bench_transport import Bench, Cmd

    bench = Bench(cfg, receivers=1)
    try:
        bench.command(Cmd(op="setup", set="tiny-fp32", nbytes=nbytes))  # the receiver's buffer of nbytes
        bench.replies()
        buf = torch.empty(nbytes, dtype=torch.uint8)
        bench.raw(buf)  # warm-up
        return statistics.median(bench.raw(buf) for _ in range(reps))
    finally:
        bench.close()


def vllm_main(argv: list[str]) -> int:
    import tempfile

    from slipstream.rollouter.config import RolloutConfig, VLLMServerConfig
    from slipstream.rollouter.launch import launch_server
    from slipstream.rollouter.models import resolve_model_path
    from slipstream.serverkinds.vllm import vllm_dtype
    from slipstream.weightsync.publisher import WeightPublisher

    args = _parser().parse_args(argv)
    path = resolve_model_path(args.model)
    v = VLLMServerConfig(
        max_model_len=512, max_num_seqs=args.requests, cpu_threads=args.threads, double_buffer=args.double_buffer
    )
    rollout = RolloutConfig(backend="vllm", vllm=v)
    dtype = vllm_dtype(rollout, str(path))
    tensors = _trainer_tensors(path, dtype)
    nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
    cfg = WeightSyncConfig(
        backend="torch_dist",
        bucket_mb=args.bucket_mb,
        timeout_s=args.timeout_s,
        device="cpu",
        pause_mode=args.pause_mode,
        keep_last=False,
    )
    log = Path(args.log) if args.log else Path(tempfile.mkdtemp(prefix="slipstream-push-")) / "vllm.log"
    rows: list[dict[str, float]] = []
    with launch_server(server_kind("vllm"), path, cfg=rollout, log_path=log) as server:
        server.wait_healthy(900)
        publisher = WeightPublisher(cfg, [server.url], server_kind("vllm"), token="")
        try:
            _check(publisher.publish(1, tensors))  # warm-up: joins the group, server idle
            counter = TokenCounter(server.url)
            load = Load(server.url, args.requests, max_new_tokens=400)
            try:
                for version in range(2, 2 + 2 * args.reps):
                    cfg.verify = version % 2 == 0  # the link's transport reads it at each version
                    counter.wait_for_tokens()
                    start = time.monotonic()
                    report = _check(publisher.publish(version, tensors))
                    end = time.monotonic()
                    time.sleep(0.1)  # the counter's next sample
                    tokens, stall = counter.window(start, end)
                    row = {"transfer_s": end - start, "pause_s": report.paused_s, "send_s": report.send_s}
                    row |= {"verify": cfg.verify, "sender_verify_s": report.verify_s}
                    row |= {"longest_stall_s": stall, "tokens_during_push": tokens, "bytes": report.bytes}
                    rows.append(row)
                    print(f"version {version}: " + json.dumps(_rounded(row)), file=sys.stderr, flush=True)
            finally:
                load.stop()
                counter.stop()
        finally:
            publisher.close()
    checks = receiver_checks(log.read_text(errors="replace"))[1:]  # after the warm-up version's
    if len(checks) != len(rows):
        raise RuntimeError(f"vLLM's log has {len(checks)} switches for {len(rows)} pushes: {log}")
    for row, (digests_s, read_back_s) in zip(rows, checks, strict=True):
        row |= {"receiver_verify_s": digests_s + read_back_s}
        row |= {"verify_share": (row["sender_verify_s"] + digests_s + read_back_s) / row["transfer_s"]}
    raw = _raw_s(cfg, nbytes, reps=max(3, args.reps))
    unverified = {k: statistics.median(r[k] for r in rows if not r["verify"]) for k in ("transfer_s", "send_s")}
    rows = [r for r in rows if r.pop("verify")]
    out = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    out |= {"unverified_send_s": unverified["send_s"], "verify_overhead": out["send_s"] / unverified["send_s"] - 1}
    out |= {"verify_push_overhead": out["transfer_s"] / unverified["transfer_s"] - 1}
    out |= {"raw_s": raw, "raw_over_transfer": raw / out["transfer_s"], "raw_over_send": raw / out["send_s"]}
    out |= {"pause_over_transfer": out["pause_s"] / out["transfer_s"], "dtype": dtype}
    out |= {"requests": args.requests, "pause_mode": args.pause_mode, "bucket_mb": args.bucket_mb}
    out |= {"double_buffer": args.double_buffer}
    out |= {"load_errors": len(load.errors), "versions": 2 * len(rows)}
    out = _rounded(out)
    if args.json:
        print(json.dumps(out))
    else:
        for key, value in out.items():
            print(f"{key:>20}: {value}")
    return 0


_SWITCH = re.compile(
    r"switched to the staged version in \S+ s \(digests checked in (\S+) s; (?:read back .*? in (\S+) s|not read back)\)"
)


def receiver_checks(log: str) -> list[tuple[float, float]]:
    """Per switch in vLLM's log, in order: the seconds its receiver spent checking digests and reading the
    version back (``rollouter/vllm_weights.py``'s switch line)."""
    return [(float(m.group(1)), float(m.group(2) or 0.0)) for m in _SWITCH.finditer(log)]


def _check(report):
    if report.failed:
        raise RuntimeError(f"the push failed: {report.failed}")
    return report


def _rounded(row: dict[str, Any]) -> dict[str, Any]:
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
