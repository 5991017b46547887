"""``slipstream bench train``: training tokens/s with packed sequences vs padding to the longest sample, and
with each group's shared prompt run once (``trainer.share_prompt_prefix``) vs once per sample.

The measurement is the trainer's (``slipstream/trainer/bench.py``, which says what is timed and how); this
module is the command around it, above the roles because it reads a run's config: the group size is a run's
``rollout.n``, and each mode's trainer settings are a run's (:func:`slipstream.config.trainer_settings`),
which the trainer may not build itself (no role imports the root config).

The last line of ``--json`` output is one JSON object: ``{"packed_tok_s", "padded_tok_s", "speedup",
"shared_tok_s", "shared_speedup", "real_tokens", "padded_tokens", "samples", ...}`` (``speedup``: packed
over padded; ``shared_speedup``: shared over packed).
"""

from __future__ import annotations

import argparse
import functools
import json

from slipstream.cli_args import (
    add_device_flag,
    add_json_flag,
    add_key_option,
    add_seed_flag,
    command_parser,
    doc_paragraph,
)
from slipstream.config import Config, load_config, trainer_settings
from slipstream.trainer.settings import TrainerSettings


def _parser() -> argparse.ArgumentParser:
    p = command_parser("slipstream bench train", doc_paragraph(__doc__))
    p.add_argument("--model", help="HF checkpoint directory (default: a scaled-up tiny random Llama)")
    p.add_argument("--samples", type=int, default=48, help="samples in the batch")
    add_key_option(p, Config, "rollout.n", flags=["--group-size"], default=8)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--median", type=int, default=48, help="median response length")
    p.add_argument("--max-len", type=int, default=384, help="response length cap (the long tail)")
    add_key_option(p, Config, "trainer.micro_batch_tokens", default=2048)
    p.add_argument("--steps", type=int, default=2, help="timed steps per mode (after one warm-up step)")
    p.add_argument("--threads", type=int, default=0, help="torch threads; 0 keeps torch's default")
    add_seed_flag(p)
    add_device_flag(p, "where the trainer runs")
    add_json_flag(p)
    return p


def _settings(args: argparse.Namespace, model_path: str, mode: str) -> TrainerSettings:
    """One mode's trainer settings: a default run's with the bench's model, sizes and layout."""
    cfg = load_config(
        None,
        [
            f"model.path={model_path}",
            f"trainer.device={args.device}",
            f"trainer.micro_batch_tokens={args.micro_batch_tokens}",
            f"trainer.pack_sequences={str(mode != 'padded').lower()}",
            f"trainer.share_prompt_prefix={str(mode == 'shared').lower()}",
            f"run.seed={args.seed}",
        ],
    )
    return trainer_settings(cfg)


def main(argv: list[str] | None = None) -> int:
    from slipstream.trainer import bench

    args = _parser().parse_args(argv)
    result = bench.run(args, functools.partial(_settings, args))
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"packed {result['packed_tok_s']} tok/s vs padded {result['padded_tok_s']} tok/s: {result['speedup']}x"
        )
    return 0
