"""One plug-in of each kind, named by import path in a run's config (no registry edit)::

    agent:
      name: slipstream.agents.examples.plugins:AnswerFirstLoop
      tools: [calculator, "slipstream.agents.examples.plugins:WordCountTool"]
    reward:
      sources: {my_data: "slipstream.agents.examples.plugins:short_answer_reward"}

The config check imports each path and checks its kind (an ``AgentLoop`` subclass, a ``Tool`` subclass, a
callable) before anything starts. Your own module must be importable by the rollouter's processes (an
installed package, or on ``PYTHONPATH``).
"""

from __future__ import annotations

from typing import Any

from slipstream.agents.data import Sample
from slipstream.agents.single_turn import SingleTurnAgentLoop
from slipstream.agents.tools.base import Tool


class AnswerFirstLoop(SingleTurnAgentLoop):
    """A single-turn loop whose system message asks for the answer first (the prompt the loop sends is
    whatever :meth:`prompt_ids` renders; :meth:`run` is the single-turn loop's)."""

    name = "answer_first"
    SYSTEM = {"role": "system", "content": "Give the answer first, then at most one sentence."}

    def prompt_ids(self, sample: Sample) -> list[int]:
        return self.renderer.prompt_ids([self.SYSTEM, *sample.messages])


class WordCountTool(Tool):
    """Counts the words of a text."""

    name = "word_count"
    description = "Count the words in a text."
    parameters = {
        "type": "object",
        "properties": {"text": {"type": "string", "description": "the text"}},
        "required": ["text"],
    }

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg

    async def call(self, arguments: dict[str, Any]) -> str:
        self.check_arguments(arguments)
        return str(len(arguments["text"].split()))


def short_answer_reward(response: str, ground_truth: Any, extra_info: dict[str, Any]) -> dict[str, float]:
    """1 when the reply starts with the ground truth, with a `brevity` component (1 for <= 20 words)."""
    correct = float(response.strip().startswith(str(ground_truth)))
    brevity = float(len(response.split()) <= 20)
    return {"score": correct, "brevity": brevity}
