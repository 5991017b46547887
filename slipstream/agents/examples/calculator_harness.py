"""An agent harness of the kind users bring: the official ``openai`` client, one calculator tool.

It knows nothing about Slipstream beyond the task it is given: it reads ``OPENAI_BASE_URL`` and
``OPENAI_API_KEY`` (the ``external`` loop sets them to a gateway session), asks the model, runs the
calculator for every tool call the model makes, sends the results back, and scores the final answer: 1.0
when its first integer is the task's ground truth, else 0.0. Run by the loop as a command
(``agent.external.command: ["{python}", "-m", "slipstream.agents.examples.calculator_harness"]``: the task
comes as JSON on stdin, the reward goes to ``$SLIPSTREAM_REWARD_FILE``) or as a callable
(``agent.external.callable: slipstream.agents.examples.calculator_harness:episode``).

``make_data`` writes the agentic quickstart's prompts: products of two three-digit numbers, which a
135M-parameter model cannot compute by itself but can with the calculator::

    python -m slipstream.agents.examples.calculator_harness --make-data data/multiply_train.jsonl --n 2000
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
from pathlib import Path
from typing import Any

SYSTEM = (
    "You are a careful assistant with a calculator tool. For any arithmetic, call the calculator first, "
    'for example <tool_call>{"name": "calculator", "arguments": {"expression": "12 * 34"}}</tool_call>, '
    "then reply with only the number it returned."
)
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression such as 12 * 34.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}
MAX_TURNS = 3
_INT = re.compile(r"-?\d+")


def calculate(arguments: str) -> str:
    """The tool: the value of ``{"expression": ...}``, or an error line the model reads."""
    from slipstream.agents.expr import ExpressionError, safe_eval

    try:
        expression = json.loads(arguments)["expression"]
        value = safe_eval(str(expression))
    except (ValueError, KeyError, TypeError, ExpressionError) as err:
        return f"Error: {err}"
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def score(answer: str, ground_truth: Any) -> float:
    match = _INT.search(answer.replace(",", ""))
    return float(match is not None and int(match.group()) == int(str(ground_truth)))


def episode(task: dict[str, Any], base_url: str | None = None, api_key: str | None = None) -> dict[str, Any]:
    """Run one episode; returns ``{"reward", "components"}``."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=600)
    messages: list[Any] = [{"role": "system", "content": SYSTEM}, *task["messages"]]
    calls = 0
    answer = ""
    for _ in range(MAX_TURNS):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR])
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            answer = message.content or ""
            break
        for call in message.tool_calls:
            calls += 1
            result = calculate(call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    correct = score(answer, task["ground_truth"])
    return {"reward": correct, "components": {"correct": correct, "tool_calls": float(calls)}}


def make_data(out: Path, n: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        rows.append({
            "prompt": [{"role": "user", "content": f"What is {a} * {b}?"}],
            "data_source": "arithmetic",
            "reward_model": {"style": "rule", "ground_truth": str(a * b)},
            "extra_info": {"index": i, "a": a, "b": b},
        })  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--make-data", type=Path, help="write the quickstart's prompts (jsonl) and exit")
    parser.add_argument("--n", type=int, default=2000)
    args = parser.parse_args(argv)
    if args.make_data:
        make_data(args.make_data, args.n)
        return 0
    task = json.load(sys.stdin)
    result = episode(task, os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"])
    Path(os.environ["SLIPSTREAM_REWARD_FILE"]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
