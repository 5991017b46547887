"""``slipstream bench served-dtype``: vLLM's decode speed in each dtype on this CPU, and whether the dtype
``rollout.vllm.dtype: auto`` picks here is the faster one.

One invocation starts vLLM (its CPU build, as the quickstart runs it: ``--enforce-eager``, ``--cpu-threads``
OpenMP threads, the native generate route) on the quickstart model once per ``--dtypes`` entry, one after the
other, and times the same wave on each: ``--concurrency`` requests of the quickstart's arithmetic prompts,
``--max-new-tokens`` tokens each (``ignore_eos``, so every dtype makes the same number of tokens), after one
warm-up wave; the best of ``--repeats`` waves counts (``--spin`` adds runs of the first dtype with other
settings of how long vLLM's processes busy-wait for each other). What it prints: ``<dtype>_tok_s`` for each dtype,
``bfloat16_over_float32``, the CPU's native bf16 (``native_bf16``: AVX512-BF16 or AMX on x86), the dtype
``auto`` resolves to here (``auto_dtype``) and ``auto_is_fastest``.

Why it exists: vLLM's own ``auto`` serves a float32 checkpoint in bfloat16 on every x86 CPU; on one without
native bf16 that decodes 4.5x slower than float32, which made the quickstart 6.6x slower than its promise.

    slipstream bench served-dtype --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

from slipstream.cli_args import add_json_flag, add_key_option, command_parser, doc_paragraph
from slipstream.rollouter.config import SamplingConfig, VLLMServerConfig
from slipstream.rollouter.vllm_idle import SPIN_ENV


def _parser() -> argparse.ArgumentParser:
    """``--max-new-tokens`` and ``--cpu-threads`` are run config keys, generated from them; the rest are the
    bench's own sizes."""
    p = command_parser("slipstream bench served-dtype", doc_paragraph(__doc__))
    p.add_argument("--model", default="smollm2-135m-instruct", help="known model name or HF directory")
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated, timed in this order")
    p.add_argument("--concurrency", type=int, default=32, help="requests at once")
    p.add_argument("--repeats", type=int, default=2, help="waves per dtype; the best counts")
    add_key_option(p, SamplingConfig, "max_new_tokens", section="rollout.sampling", default=64)
    add_key_option(p, VLLMServerConfig, "cpu_threads", section="rollout.vllm", default=1)
    p.add_argument(
        "--spin",
        default="",
        help="also time these comma-separated settings of how long vLLM's processes spin while waiting for "
        "each other ($SLIPSTREAM_VLLM_SPIN_S; `vllm` for vLLM's own 1 s), in the first dtype; the launcher "
        "leaves vLLM's own (rollouter/vllm_idle.py says why)",
    )
    p.add_argument("--log-dir", default="", help="vLLM's logs go here (default: a temporary directory)")
    add_json_flag(p)
    return p


async def _wave(url: str, prompts: list[list[int]], max_new_tokens: int) -> float:
    from slipstream.agents.protocol import SamplingParams
    from slipstream.serverkinds.vllm import VLLMClient

    client = VLLMClient(url, api="generate", timeout_s=900)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, ignore_eos=True)
    try:
        start = time.perf_counter()
        outs = await asyncio.gather(*(client.generate(p, params) for p in prompts))
        return sum(len(o.output_ids) for o in outs) / (time.perf_counter() - start)
    finally:
        await client.aclose()


def _time_dtype(
    path: Path, dtype: str, args: argparse.Namespace, prompts, log_dir: Path, spin: str | None = None
) -> float:
    from slipstream.rollouter.config import RolloutConfig
    from slipstream.rollouter.launch import launch_server
    from slipstream.serverkinds import server_kind

    v = VLLMServerConfig(
        dtype=dtype, max_model_len=512, max_num_seqs=args.concurrency, cpu_threads=args.cpu_threads
    )
    cfg = RolloutConfig(backend="vllm", vllm=v)
    env = {} if spin is None else {SPIN_ENV: "" if spin == "vllm" else spin}  # "": vLLM's own
    log = log_dir / f"vllm-{dtype}{'' if spin is None else '-spin-' + spin}.log"
    with launch_server(server_kind("vllm"), path, cfg=cfg, env=env, log_path=log) as server:
        server.wait_healthy(900)
        asyncio.run(_wave(server.url, prompts[:4], 8))  # warm-up
        rates = [asyncio.run(_wave(server.url, prompts, args.max_new_tokens)) for _ in range(args.repeats)]
    what = dtype if spin is None else f"{dtype}, spin {spin}"
    print(f"{what}: " + ", ".join(f"{r:.1f}" for r in rates) + " tokens/s", file=sys.stderr, flush=True)
    return max(rates)


def main(argv: list[str]) -> int:
    import tempfile

    from transformers import AutoTokenizer

    from slipstream.rollouter.models import resolve_model_path
    from slipstream.serverkinds.vllm import auto_dtype, checkpoint_dtype
    from slipstream.system.bench_rollout import make_prompts
    from slipstream.utils.cpu import native_bf16

    args = _parser().parse_args(argv)
    path = resolve_model_path(args.model)
    prompts = make_prompts(AutoTokenizer.from_pretrained(path), args.concurrency)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="slipstream-dtype-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    dtypes = [d for d in args.dtypes.split(",") if d]
    rates = {d: _time_dtype(path, d, args, prompts, log_dir) for d in dtypes}
    auto = auto_dtype(checkpoint_dtype(str(path)), cpu=True)
    out: dict = {f"{d}_tok_s": round(r, 1) for d, r in rates.items()}
    if "float32" in rates and "bfloat16" in rates:
        out["bfloat16_over_float32"] = round(rates["bfloat16"] / rates["float32"], 3)
    out |= {"native_bf16": native_bf16(), "auto_dtype": auto, "concurrency": args.concurrency}
    out |= {"max_new_tokens": args.max_new_tokens, "cpu_threads": args.cpu_threads}
    for spin in (x for x in args.spin.split(",") if x):
        out[f"{dtypes[0]}_spin_{spin}_tok_s"] = round(
            _time_dtype(path, dtypes[0], args, prompts, log_dir, spin), 1
        )
    if auto in rates:
        out["auto_is_fastest"] = rates[auto] == max(rates.values())
    print(json.dumps(out) if args.json else "\n".join(f"{k:>24}: {v}" for k, v in out.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
