"""An agent harness of the kind users bring: the official ``openai`` client, one calculator tool.

It knows nothing about Slipstream beyond the task it is given: it reads ``OPENAI_BASE_URL`` and
``OPENAI_API_KEY`` (the ``external`` loop sets them to a gateway session), asks the model, runs the
calculator for every tool call the model makes, sends the results back, and scores the final answer: 1.0
when its first integer is the task's ground truth, else 0.0. Run by the loop as a command
(``agent.external.command: ["{python}", "-m", "slipstream.agents.examples.calculator_harness"]``: the task
comes as JSON on stdin, the reward goes to ``$SLIPSTREAM_REWARD_FILE``) or as a callable
(``agent.external.callable: slipstream.agents.examples.calculator_harness:episode``).

The agentic quickstart (configs/quickstart_agent.yaml) trains on products of two three-digit numbers
(``slipstream data make multiply``), which a 135M-parameter model cannot compute by itself but can with the
calculator. Three worked exchanges precede the question: without them SmolLM2-135M-Instruct never wrote a
well-formed call in 16 tries; with them about half of its first attempts are right, which leaves RL room.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

SYSTEM = (
    "You are a careful assistant with a calculator tool. For any arithmetic, call the calculator first, "
    "then reply with only the number it returned."
)


# Worked exchanges before the question (few-shot prompting): small models copy their shape.
def _exchange(a: int, b: int) -> list[dict[str, Any]]:
    call = {"name": "calculator", "arguments": json.dumps({"expression": f"{a} * {b}"})}
    return [
        {"role": "user", "content": f"What is {a} * {b}?"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": f"call_{a}", "type": "function", "function": call}]},
        {"role": "tool", "tool_call_id": f"call_{a}", "content": str(a * b)},
        {"role": "assistant", "content": str(a * b)},
    ]  # fmt: skip


EXAMPLES = [m for a, b in ((12, 34), (56, 78), (91, 23)) for m in _exchange(a, b)]
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
    messages: list[Any] = [{"role": "system", "content": SYSTEM}, *EXAMPLES, *task["messages"]]
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


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    task = json.load(sys.stdin)
    result = episode(task, os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"])
    Path(os.environ["SLIPSTREAM_REWARD_FILE"]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
