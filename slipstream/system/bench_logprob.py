"""``slipstream bench logprob``: peak memory of per-token logprobs + entropy, full logits vs chunked.

Both variants compute the same thing the trainer does for one micro-batch: from final hidden states [T, H]
and an output weight [V, H], each token's log-probability and entropy under the tempered softmax, then
back-propagate a token-mean loss over both (the entropy bonus's gradient included) to the hidden states and
the weight. "full" is the plain path (``full_token_logprobs``: all [T, V] fp32 logits at once, autograd's
own copies); "chunked" is ``token_logprobs`` with ``--chunk`` rows at a time.

How memory is measured: each variant runs in a fresh Python process (``--variant``, started by this one)
that builds its inputs, reads its resident set size from /proc/self/statm, runs forward and backward, then
reads the process's peak resident set size (``resource.getrusage(RUSAGE_SELF).ru_maxrss``). The figure is
the peak minus the resident size before the computation: the memory the computation itself needed at its
worst moment, as the operating system saw it (torch's CPU allocator keeps no peak statistics, and
tracemalloc does not see torch's allocations). Errors compare the two processes' outputs and gradients.

The last line of ``--json`` output is one JSON object:
``{"tokens", "vocab", "full_peak_mb", "chunked_peak_mb", "max_abs_err", "grad_max_abs_err", ...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from slipstream.cli_args import add_json_flag, add_key_option, add_seed_flag, command_parser, doc_paragraph
from slipstream.trainer.config import TrainerConfig


def _parser() -> argparse.ArgumentParser:
    p = command_parser("slipstream bench logprob", doc_paragraph(__doc__))
    p.add_argument("--tokens", type=int, default=8192, help="tokens in the micro-batch")
    p.add_argument("--vocab", type=int, default=49152, help="vocabulary size (SmolLM2's 49152; Qwen 151936)")
    p.add_argument("--hidden", type=int, default=128, help="hidden size")
    add_key_option(
        p,
        TrainerConfig,
        "logits_chunk_tokens",
        section="trainer",
        flags=["--chunk"],
        default=1024,
        note="Here: rows per chunk of the chunked variant.",
    )
    p.add_argument("--temperature", type=float, default=0.8)
    add_seed_flag(p)
    p.add_argument("--variant", choices=["full", "chunked"], help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    add_json_flag(p)
    return p


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def _run_variant(args: argparse.Namespace) -> None:
    """One variant in this (fresh) process; writes outputs, gradients and the peak to ``args.out``."""
    from slipstream.trainer.logprobs import full_token_logprobs, token_logprobs

    g = torch.Generator().manual_seed(args.seed)
    t, h, v = args.tokens, args.hidden, args.vocab
    hidden = torch.randn(t, h, generator=g).requires_grad_()
    weight = (torch.randn(v, h, generator=g) * (1.5 / h**0.5)).requires_grad_()  # logits of std ~1.5
    targets = torch.randint(0, v, (t,), generator=g)
    g_logp, g_ent = torch.randn(t, generator=g) / t, torch.randn(t, generator=g) * 0.01 / t
    before = _rss_mb()
    if args.variant == "full":
        logp, ent = full_token_logprobs(hidden, weight, targets, temperature=args.temperature, entropy=True)
    else:
        logp, ent = token_logprobs(
            hidden, weight, targets, temperature=args.temperature, chunk=args.chunk, entropy=True
        )
    ((logp * g_logp).sum() + (ent * g_ent).sum()).backward()
    peak = _peak_rss_mb() - before
    torch.save(
        {
            "peak_mb": peak,
            "logp": logp.detach(),
            "entropy": ent.detach(),
            "grad_hidden": hidden.grad,
            "grad_weight": weight.grad,
        },
        args.out,
    )


def _spawn(args: argparse.Namespace, variant: str, out: Path) -> dict:
    cmd = [sys.executable, "-m", "slipstream.system.bench_logprob", "--variant", variant, "--out", str(out)]
    for key in ("tokens", "vocab", "hidden", "chunk", "temperature", "seed"):
        cmd += [f"--{key}", str(getattr(args, key))]
    subprocess.run(cmd, check=True)
    return torch.load(out, weights_only=True)


def _max_err(a: dict, b: dict, keys: tuple[str, ...]) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in keys)


def run(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        full = _spawn(args, "full", Path(tmp) / "full.pt")
        chunked = _spawn(args, "chunked", Path(tmp) / "chunked.pt")
    logits_mb = args.tokens * args.vocab * 4 / 2**20
    return {
        "tokens": args.tokens,
        "vocab": args.vocab,
        "hidden": args.hidden,
        "chunk": args.chunk,
        "full_peak_mb": round(full["peak_mb"], 1),
        "chunked_peak_mb": round(chunked["peak_mb"], 1),
        "chunked_over_full": round(chunked["peak_mb"] / full["peak_mb"], 4),
        "fp32_logits_mb": round(logits_mb, 1),
        "max_abs_err": _max_err(full, chunked, ("logp", "entropy")),
        "grad_max_abs_err": _max_err(full, chunked, ("grad_hidden", "grad_weight")),
        "memory_measure": "peak RSS delta of a fresh process per variant (getrusage ru_maxrss)",
        "threads": torch.get_num_threads(),
    }


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.variant:
        _run_variant(args)
        return 0
    result = run(args)
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"{args.tokens} tokens x {args.vocab} vocab: full {result['full_peak_mb']} MB, chunked "
            f"{result['chunked_peak_mb']} MB ({result['chunked_over_full']:.1%}); max abs err "
            f"{result['max_abs_err']:.2e}, grad {result['grad_max_abs_err']:.2e}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
