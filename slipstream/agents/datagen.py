"""`slipstream data make`: verifiable synthetic datasets, made offline in verl's format.

Runs never download data, so the quickstart and the tests need tasks whose answers a program can check.
Four generators:

* ``arithmetic``: "What is a + b? Reply with only the number." with a, b in 1..20; the ground truth is
  the sum (the quickstart task, see design.md §4).
* ``multiply``: "What is a * b?" with a, b in 100..999 (the agentic quickstart: a small model solves it
  only with a calculator tool).
* ``countdown``: reach a target with +, -, *, / using each of 3-4 given numbers once (TinyZero's task);
  the target is the value of a random expression over the numbers, so every prompt has a solution.
* ``shapes``: count the circles, squares and triangles drawn in a small PNG (agents/shapes.py), in verl's
  multi-modal format (an ``images`` column, a ``<image>`` placeholder); parquet only, as JSON has no bytes.

Held-out sets: ``--split heldout`` makes prompts from a fixed tenth of the task's problems (chosen by a
hash of the prompt text, or of ``extra_info.problem`` where a task sets it, as ``shapes`` does: so by
content, whatever the seed) and ``--split train`` never makes one of them, so
a validation file is disjoint from a training file made with any seed. ``all`` (the default) draws from
every problem. Held-out prompts are distinct from each other (``arithmetic`` has about 40 such sums).

Worked example::

    slipstream data make arithmetic --n 1000 --out data/arith_train.parquet --seed 0
    slipstream data make arithmetic --n 32 --split heldout --out data/arith_heldout.parquet
    slipstream data make countdown --n 200 --out data/countdown.jsonl
"""

from __future__ import annotations

import json
import random
import sys
import zlib
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from typing import Any

from slipstream.agents.config import DataGenConfig
from slipstream.agents.shapes import shapes_row
from slipstream.cli_args import add_key_option, command_parser, doc_paragraph

ARITHMETIC_PROMPT = "What is {a} + {b}? Reply with only the number."
COUNTDOWN_PROMPT = (
    "Using the numbers {numbers}, create an equation that equals {target}. You can use +, -, * and /, "
    "and each number exactly once. Show your final equation in <answer> </answer> tags, "
    "for example <answer>(1 + 2) * 3</answer>."
)


def arithmetic_row(rng: random.Random, index: int) -> dict[str, Any]:
    a, b = rng.randint(1, 20), rng.randint(1, 20)
    return {
        "prompt": [{"role": "user", "content": ARITHMETIC_PROMPT.format(a=a, b=b)}],
        "data_source": "arithmetic",
        "reward_model": {"style": "rule", "ground_truth": str(a + b)},
        "extra_info": {"index": index, "a": a, "b": b},
    }


def countdown_row(rng: random.Random, index: int) -> dict[str, Any]:
    while True:
        numbers = [rng.randint(1, 50) for _ in range(rng.choice((3, 4)))]
        value, expression = _random_expression(rng, [Fraction(n) for n in numbers])
        # Whole, positive, not trivially one of the inputs: a target a person would pose.
        if value.denominator == 1 and 1 <= value <= 999 and int(value) not in numbers:
            break
    return {
        "prompt": [{"role": "user", "content": COUNTDOWN_PROMPT.format(numbers=numbers, target=int(value))}],
        "data_source": "countdown",
        "reward_model": {"style": "rule", "ground_truth": {"target": int(value), "numbers": numbers}},
        "extra_info": {"index": index, "solution": expression},
    }


def _random_expression(rng: random.Random, values: list[Fraction]) -> tuple[Fraction, str]:
    """Combine all ``values`` pairwise in random order with random operators; return (value, text)."""
    items = [(v, str(v)) for v in values]
    while len(items) > 1:
        (a, ta), (b, tb) = items.pop(rng.randrange(len(items))), items.pop(rng.randrange(len(items)))
        ops = ["+", "-", "*"] + (["/"] if b != 0 else [])
        op = rng.choice(ops)
        value = {"+": a + b, "-": a - b, "*": a * b, "/": a / b if b else a}[op]
        items.append((value, f"({ta} {op} {tb})"))
    value, text = items[0]
    return value, text[1:-1] if text.startswith("(") and text.endswith(")") else text


def multiply_row(rng: random.Random, index: int) -> dict[str, Any]:
    """A product of two three-digit numbers: too hard for a small model alone, easy with a calculator tool
    (the agentic quickstart, configs/quickstart_agent.yaml)."""
    a, b = rng.randint(100, 999), rng.randint(100, 999)
    return {
        "prompt": [{"role": "user", "content": f"What is {a} * {b}?"}],
        "data_source": "arithmetic",
        "reward_model": {"style": "rule", "ground_truth": str(a * b)},
        "extra_info": {"index": index, "a": a, "b": b},
    }


GENERATORS: dict[str, Callable[[random.Random, int], dict[str, Any]]] = {
    "arithmetic": arithmetic_row,
    "multiply": multiply_row,
    "countdown": countdown_row,
    "shapes": shapes_row,
}


SPLITS = ("all", "train", "heldout")
# Draws per requested row before a split gives up (the held-out tenth of a small task can run out).
MAX_DRAWS_PER_ROW = 1000


def problem_key(row: dict[str, Any]) -> str:
    """What makes ``row``'s problem itself: ``extra_info.problem`` when set (a picture's content, where
    every prompt text is alike), else the prompt text."""
    problem = row.get("extra_info", {}).get("problem")
    return json.dumps(row["prompt"] if problem is None else problem, sort_keys=True)


def held_out(row: dict[str, Any]) -> bool:
    """Whether ``row``'s problem belongs to the held-out tenth (by a hash of :func:`problem_key`)."""
    return zlib.crc32(problem_key(row).encode()) % 10 == 0


def make_rows(task: str, n: int, seed: int = 0, split: str = "all") -> list[dict[str, Any]]:
    if task not in GENERATORS:
        raise ValueError(f"unknown task `{task}`; known tasks: {', '.join(GENERATORS)}")
    if split not in SPLITS:
        raise ValueError(f"unknown split `{split}`; use one of {', '.join(SPLITS)}")
    rng = random.Random(seed)
    if split == "all":
        return [GENERATORS[task](rng, i) for i in range(n)]
    rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    for _ in range(n * MAX_DRAWS_PER_ROW):
        if len(rows) == n:
            return rows
        row = GENERATORS[task](rng, len(rows))
        if held_out(row) != (split == "heldout"):
            continue
        if split == "heldout":
            key = problem_key(row)
            if key in seen:
                continue
            seen.add(key)
        rows.append(row)
    if len(rows) == n:
        return rows
    raise ValueError(f"the {split} split of `{task}` gave only {len(rows)} distinct prompts, not {n}")


def write_rows(rows: list[dict[str, Any]], out: Path) -> None:
    """Write ``rows`` as parquet or jsonl, chosen by the suffix of ``out``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    suffix = out.suffix.lower()
    if suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), out)
    elif suffix in (".jsonl", ".json"):
        if any("images" in row for row in rows):
            raise ValueError(f"{out}: rows with images need a .parquet file (JSON cannot hold their bytes)")
        with out.open("w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    else:
        raise ValueError(f"{out}: unknown output format `{suffix}`; use .parquet or .jsonl")


def main(argv: list[str]) -> int:
    parser = command_parser("slipstream data make", doc_paragraph(__doc__))
    # A positional (the generator's name), so hand-written; its choices are the registry's.
    parser.add_argument("task", choices=sorted(GENERATORS), help="which task to generate")
    add_key_option(parser, DataGenConfig, "n", section="datagen")
    parser.add_argument("--out", type=Path, required=True, help="output file (.parquet or .jsonl)")
    add_key_option(parser, DataGenConfig, "seed", section="datagen")
    parser.add_argument(
        "--split", choices=SPLITS, default="all", help="held-out problems only, none of them, or any"
    )
    args = parser.parse_args(argv)
    try:
        write_rows(make_rows(args.task, args.n, args.seed, args.split), args.out)
    except ValueError as err:
        print(f"slipstream data make: {err}", file=sys.stderr)
        return 2
    print(f"wrote {args.n} {args.task} prompts to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
