"""Reward functions, chosen per prompt by its ``data_source``.

A reward function is a plain, picklable-by-name function ``fn(response, ground_truth, extra_info)`` that
returns a float, or a dict of named components with the trained value under ``"score"``. It runs in a
worker process (:class:`~slipstream.agents.rewards.runner.RewardRunner`), so it may be slow or crash
without stalling the rollouter.

Lookup (:func:`resolve`) is explicit and fails loudly: the run's ``reward.sources`` mapping first
(``data_source -> name``), then :data:`REWARD_FNS` by name, then :data:`DATA_SOURCE_ALIASES` (common dataset
names). A name ``package.module:function`` imports a user's own function; the name ``service`` sends the
response to the served judge or reward model of ``reward.service`` (:mod:`.service`) instead of a worker.

To add a reward: write ``fn(response: str, ground_truth, extra_info: dict) -> float | dict[str, float]``
in a small module here and add it to :data:`REWARD_FNS` (``REWARD_FNS.add(name, fn)``).

Worked example::

    resolve("arithmetic")("The answer is 7.", "7", {})      # 1.0
    resolve("openai/gsm8k")                                  # the `math` reward (alias)
    resolve("my_source")                                     # KeyError: no reward function for ...
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from slipstream.agents.rewards.arithmetic import arithmetic_reward
from slipstream.agents.rewards.countdown import countdown_reward
from slipstream.agents.rewards.exact_match import exact_match_reward
from slipstream.agents.rewards.math_answer import math_reward, math_signed_reward
from slipstream.utils.registry import PluginError, Registry

RewardFn = Callable[[str, Any, dict[str, Any]], float | dict[str, float]]

REWARD_FNS: Registry[RewardFn] = Registry("reward function", "reward.sources", plugins=True)
REWARD_FNS.add("arithmetic", arithmetic_reward)
REWARD_FNS.add("countdown", countdown_reward)
REWARD_FNS.add("exact_match", exact_match_reward)
REWARD_FNS.add("math", math_reward)
REWARD_FNS.add("math_signed", math_signed_reward)
# `slipstream data make shapes` asks for a count: the last integer of the reply, as for a sum.
REWARD_FNS.add("shapes", arithmetic_reward)

# The name (in reward.sources) of the served judge / reward model of reward.service (rewards/service.py).
SERVICE_REWARD = "service"

# Dataset names seen in verl-format data, mapped to the reward that scores them.
DATA_SOURCE_ALIASES: dict[str, str] = {
    "openai/gsm8k": "math",
    "gsm8k": "math",
    "lighteval/MATH": "math",
    "DigitalLearningGmbH/MATH-lighteval": "math",
    "HuggingFaceH4/MATH-500": "math",
    "math_dapo": "math",
    "aime24": "math",
    "aime25": "math",
    "countdown_tasks": "countdown",
}


def reward_name(data_source: str, sources: Mapping[str, str] | None = None) -> str:
    """The registered (or ``module:function``) name that scores ``data_source``."""
    if sources and data_source in sources:
        return sources[data_source]
    if data_source in REWARD_FNS or ":" in data_source:
        return data_source
    if data_source in DATA_SOURCE_ALIASES:
        return DATA_SOURCE_ALIASES[data_source]
    raise KeyError(
        f"no reward function for data_source `{data_source}`; registered: {', '.join(REWARD_FNS)}; "
        "map it with reward.sources={" + data_source + ": <name>} or name a `module:function`"
    )


def resolve(data_source: str, sources: Mapping[str, str] | None = None) -> RewardFn:
    """The reward function for ``data_source`` (see the module docstring for the lookup order)."""
    name = reward_name(data_source, sources)
    if name == SERVICE_REWARD:
        raise KeyError(f"`{SERVICE_REWARD}` is scored by reward.service's servers, not by a function")
    try:  # an unknown name raises UnknownNameError, a KeyError too
        return REWARD_FNS.get(name, key=f"reward.sources.{data_source}")
    except PluginError as err:
        raise KeyError(str(err)) from None


__all__ = ["DATA_SOURCE_ALIASES", "REWARD_FNS", "SERVICE_REWARD", "RewardFn", "resolve", "reward_name"]
