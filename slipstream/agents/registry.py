"""The agent loops, by the name ``agent.name`` gives.

To add a loop: subclass :class:`~slipstream.agents.base.AgentLoop` in a small module of this package
(constructor ``(cfg, client, tokenizer)``, ``prompt_ids(sample)``, ``async run(sample, sampling_params,
*, uid)``) and add it to :data:`AGENT_LOOPS`. A user's own loop needs no edit here: ``agent.name:
package.module:ClassName`` names any subclass of ``AgentLoop`` (imported and checked by
:class:`~slipstream.utils.registry.Registry` when the config is checked; ``slipstream/agents/examples/plugins.py``
has one).
"""

from __future__ import annotations

from typing import Any

from slipstream.agents.base import AgentLoop
from slipstream.agents.config import AgentConfig
from slipstream.agents.external import ExternalAgentLoop
from slipstream.agents.protocol import InferenceClient
from slipstream.agents.single_turn import SingleTurnAgentLoop
from slipstream.agents.tool_agent import ToolAgentLoop
from slipstream.utils.registry import Registry

AGENT_LOOPS: Registry[type[AgentLoop]] = Registry(
    "agent loop", "agent.name", plural="loops", plugins=True, base=AgentLoop
)
AGENT_LOOPS.add("single_turn", SingleTurnAgentLoop)
AGENT_LOOPS.add("tool", ToolAgentLoop)
AGENT_LOOPS.add("external", ExternalAgentLoop)


def agent_loop_class(name: str) -> type[AgentLoop]:
    """The loop class ``name`` names: a key of :data:`AGENT_LOOPS` or ``package.module:ClassName``.
    Raises a ValueError naming ``agent.name`` (:class:`~slipstream.utils.registry.UnknownNameError` or
    :class:`~slipstream.utils.registry.PluginError`)."""
    return AGENT_LOOPS.get(name)


def make_agent_loop(cfg: AgentConfig, client: InferenceClient, tokenizer: Any) -> AgentLoop:
    """The loop ``cfg.name`` names; an unknown name raises ValueError listing the known ones."""
    return agent_loop_class(cfg.name)(cfg, client, tokenizer)
