"""The measurement of ``slipstream bench train``: training tokens/s with packed sequences vs padding to the
longest sample, and with each group's shared prompt run once (``trainer.share_prompt_prefix``) vs once per
sample. The command (its options, and each mode's trainer settings from a run's config, which no role
imports) is ``slipstream/system/bench_train.py``.

All modes train the same model from the same initial weights on the same long-tail batch (log-normal
response lengths capped at ``--max-len``, the shape RL rollouts have; the ``--group-size`` samples of a group
share their prompt, as rollouts of one prompt do) with the same micro-batch token budget and the trainer's
real loss (GRPO advantages, PPO clip, token-mean). Packed micro-batches hold samples end to end with
restarting position ids; padded ones hold rows padded to the batch's longest sample, the layout trainers use
without "remove padding"; shared ones are packed micro-batches whose groups keep one copy of their prompt
(``trainer/engine/prefix.py``). Throughput counts real (non-padding) tokens of the packed batch in full
training steps (forward, backward, optimizer), after one warm-up step per mode; the modes' timed steps
alternate, so a change of machine load during the run affects them alike.

:func:`run` returns the command's JSON object: ``{"packed_tok_s", "padded_tok_s", "speedup",
"shared_tok_s", "shared_speedup", "real_tokens", "padded_tokens", "samples", ...}`` (``speedup``: packed
over padded; ``shared_speedup``: shared over packed).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from slipstream.trainer.algos import ADVANTAGES, AdvantageInputs, global_counts
from slipstream.trainer.loss import GlobalCounts, PolicyLoss
from slipstream.trainer.settings import TrainerSettings
from slipstream.trainer.synthetic import long_tail_lengths, make_packed_batch

MODES = ("packed", "padded", "shared")


def _model_path(arg: str | None, workdir: Path) -> str:
    if arg:
        return arg
    from slipstream.utils.tiny_models import make_tiny_model

    return str(
        make_tiny_model(
            workdir / "bench-model",
            hidden_size=256,
            num_layers=4,
            num_heads=8,
            num_kv_heads=4,
            intermediate_size=688,
        )
    )


def _batch(args: argparse.Namespace, vocab_size: int):
    responses = long_tail_lengths(args.samples, median=args.median, max_len=args.max_len, seed=args.seed)
    batch = make_packed_batch(
        [args.prompt_len] * args.samples,
        responses,
        vocab_size=vocab_size,
        group_size=args.group_size,
        seed=args.seed,
        shared_prompts=True,
    )
    adv = ADVANTAGES.get("grpo")(
        AdvantageInputs(batch["rewards"], batch["group_index"], batch["loss_mask"], batch["cu_seqlens"])
    )
    batch["advantages"] = adv.advantages
    return batch, responses


def _make_runner(settings: TrainerSettings, batch):
    """A closure running one full training step of one mode (a fresh engine from the same weights)."""
    from slipstream.trainer.engine.fsdp import FSDPEngine

    engine = FSDPEngine(settings)
    engine.initialize()
    tokens, seqs = global_counts(batch["loss_mask"], batch["cu_seqlens"])
    loss = PolicyLoss(settings.trainer.algorithm, GlobalCounts(tokens, seqs, 1.0))

    def step() -> int:
        out = engine.forward_backward_batch(batch, loss)
        engine.optimizer_step()
        if engine.device.type == "cuda":
            torch.cuda.synchronize(engine.device)  # the step is timed to its last kernel
        return out.num_micro_batches

    step.flops = engine.model_flops  # type: ignore[attr-defined]
    return step


def _time_modes(runners: dict, steps: int) -> dict[str, tuple[float, int]]:
    """Seconds per step and micro-batches per step of each mode, timed step by step in alternation so a
    machine whose load changes during the run slows every mode alike."""
    micro = {mode: run() for mode, run in runners.items()}  # warm-up step of each mode
    spent = dict.fromkeys(runners, 0.0)
    for _ in range(steps):
        for mode, run in runners.items():
            t0 = time.perf_counter()
            run()
            spent[mode] += time.perf_counter() - t0
    return {mode: (spent[mode] / steps, micro[mode]) for mode in runners}


def run(args: argparse.Namespace, settings_for: Callable[[str, str], TrainerSettings]) -> dict:
    """Time every mode; ``settings_for(model_path, mode)`` is a mode's trainer settings (``mode`` one of
    :data:`MODES`: ``packed``, ``padded``, ``shared``)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_path = _model_path(args.model, Path(tmp))
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(model_path).vocab_size
        batch, responses = _batch(args, vocab)
        lengths = [args.prompt_len + r for r in responses]
        real = sum(lengths)
        runners = {m: _make_runner(settings_for(model_path, m), batch) for m in MODES}
        results = _time_modes(runners, args.steps)
        flops = runners["packed"].flops(lengths)
        for mode, (sec, micro) in results.items():
            print(
                f"{mode:>6}: {sec:7.3f} s/step, {micro:3d} micro-batches, {real / sec:9.1f} real tok/s",
                flush=True,
            )
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    packed_tok_s, padded_tok_s = real / results["packed"][0], real / results["padded"][0]
    shared_tok_s = real / results["shared"][0]
    return {
        "packed_tok_s": round(packed_tok_s, 1),
        "padded_tok_s": round(padded_tok_s, 1),
        "speedup": round(packed_tok_s / padded_tok_s, 3),
        "shared_tok_s": round(shared_tok_s, 1),
        "shared_speedup": round(shared_tok_s / packed_tok_s, 3),
        "samples": args.samples,
        "real_tokens": real,
        "padded_tokens": len(lengths) * max(lengths),
        "response_len_median": sorted(responses)[len(responses) // 2],
        "response_len_max": max(responses),
        "micro_batches_packed": results["packed"][1],
        "micro_batches_padded": results["padded"][1],
        "micro_batch_tokens": args.micro_batch_tokens,
        "model": args.model or "tiny-llama-256x4",
        "threads": torch.get_num_threads(),
        "device": _device_name(args.device),
        **_mfu(flops, results["packed"][0], args.device),
    }


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else "cpu"


def _mfu(flops: float, seconds: float, device: str) -> dict:
    """Model FLOP utilisation of the packed mode on a GPU whose peak is known (trainer.peak_tflops table)."""
    if device != "cuda":
        return {}
    from slipstream.trainer.trainer import _lookup_peak_tflops

    peak = _lookup_peak_tflops(torch.cuda.get_device_name())
    achieved = flops / seconds / 1e12
    return {"tflops": round(achieved, 1), "mfu": round(achieved / peak, 4) if peak else None}
