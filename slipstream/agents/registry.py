"""The agent loops, by the name ``agent.name`` gives.

To add a loop: subclass :class:`~slipstream.agents.base.AgentLoop` in a small module of this package
(constructor ``(cfg, client, tokenizer)``, ``prompt_ids(sample)``, ``async run(sample, sampling_params,
*, uid)``) and add it to :data:`AGENT_LOOPS`.
"""

from __future__ import annotations

from typing import Any

from slipstream.agents.base import AgentLoop
from slipstream.agents.config import AgentConfig
from slipstream.agents.external import ExternalAgentLoop
from slipstream.agents.protocol import InferenceClient
from slipstream.agents.single_turn import SingleTurnAgentLoop
from slipstream.agents.tool_agent import ToolAgentLoop

AGENT_LOOPS: dict[str, type[AgentLoop]] = {
    "single_turn": SingleTurnAgentLoop,
    "tool": ToolAgentLoop,
    "external": ExternalAgentLoop,
}


def make_agent_loop(cfg: AgentConfig, client: InferenceClient, tokenizer: Any) -> AgentLoop:
    """The loop ``cfg.name`` names; an unknown name raises ValueError listing the known ones."""
    if cfg.name not in AGENT_LOOPS:
        raise ValueError(
            f"agent.name: unknown agent loop `{cfg.name}`; known loops: {', '.join(AGENT_LOOPS)}"
        )
    return AGENT_LOOPS[cfg.name](cfg, client, tokenizer)
