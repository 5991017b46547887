"""Plug-ins by import path: agent loops, tools and reward functions named `module:name`, checked at config
time with one line naming the key, the module and the problem."""

from __future__ import annotations

import asyncio

import pytest

from slipstream.agents.base import AgentLoop
from slipstream.agents.config import AgentConfig
from slipstream.agents.examples.plugins import AnswerFirstLoop, WordCountTool, short_answer_reward
from slipstream.agents.registry import AGENT_LOOPS, agent_loop_class, make_agent_loop
from slipstream.agents.rewards import resolve
from slipstream.agents.tools import TOOLS, Tool, make_tools
from slipstream.config import Config, ConfigError, from_dict
from slipstream.pipeline.modes import _check_plugins
from slipstream.utils.registry import PluginError, load_plugin
from slipstream.utils.tiny_models import make_tiny_tokenizer

EXAMPLES = "slipstream.agents.examples.plugins"


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return make_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


def test_registered_names_and_messages_are_unchanged():
    assert agent_loop_class("tool") is AGENT_LOOPS["tool"]
    assert agent_loop_class("external") is AGENT_LOOPS["external"]
    with pytest.raises(
        ValueError, match="^agent.name: unknown agent loop `react`; known loops: single_turn, "
    ):
        agent_loop_class("react")
    with pytest.raises(
        ValueError, match="^agent.tools: unknown tool `shell`; known tools: python, calculator"
    ):
        make_tools(["shell"])
    assert TOOLS.get("calculator") is TOOLS["calculator"]
    with pytest.raises(KeyError, match="^agent.tools: unknown tool `shell`; .*or `package.module:name`$"):
        TOOLS["shell"]


def test_import_paths_resolve_to_the_example_plugins(tok):
    assert agent_loop_class(f"{EXAMPLES}:AnswerFirstLoop") is AnswerFirstLoop
    loop = make_agent_loop(AgentConfig(name=f"{EXAMPLES}:AnswerFirstLoop"), client=None, tokenizer=tok)
    assert isinstance(loop, AnswerFirstLoop)
    tools = make_tools(["calculator", f"{EXAMPLES}:WordCountTool"])
    assert list(tools) == ["calculator", "word_count"]  # keyed by the name the model calls
    assert isinstance(tools["word_count"], WordCountTool)
    assert asyncio.run(tools["word_count"].call({"text": "one two three"})) == "3"
    fn = resolve("mine", {"mine": f"{EXAMPLES}:short_answer_reward"})
    assert fn is short_answer_reward and fn("42, since 6*7", "42", {})["score"] == 1.0


@pytest.mark.parametrize(
    "path, kind, message",
    [
        ("no_such_pkg.mod:Loop", AgentLoop, "cannot import module `no_such_pkg.mod` (ModuleNotFoundError"),
        (f"{EXAMPLES}:Missing", AgentLoop, f"module `{EXAMPLES}` has no attribute `Missing`"),
        (f"{EXAMPLES}:WordCountTool", AgentLoop, "is not a subclass of slipstream.agents.base.AgentLoop"),
        (f"{EXAMPLES}:short_answer_reward", Tool, "is not a subclass of slipstream.agents.tools.base.Tool"),
        (f"{EXAMPLES}:__doc__", None, "is not callable (it is a str)"),
        ("just_a_module:", None, "expected `package.module:name`"),
        ("plugin_raises_at_import:anything", None, "(RuntimeError: broken at import time)"),
    ],
)
def test_bad_plugin_paths_fail_in_one_line(path, kind, message):
    with pytest.raises(PluginError) as err:
        load_plugin("some.key", path, kind=kind)
    text = str(err.value)
    assert text.startswith("some.key: ") and message in text and "\n" not in text


def _config(**agent_and_reward) -> Config:
    return from_dict(
        {"agent": agent_and_reward.get("agent", {}), "reward": agent_and_reward.get("reward", {})}
    )


def test_config_check_names_the_key():
    _check_plugins(
        _config(
            agent={"name": f"{EXAMPLES}:AnswerFirstLoop", "tools": [f"{EXAMPLES}:WordCountTool"]},
            reward={"sources": {"mine": f"{EXAMPLES}:short_answer_reward"}},
        )
    )
    cases = [
        ({"agent": {"name": f"{EXAMPLES}:WordCountTool"}}, "agent.name: `WordCountTool` in module"),
        (
            {"agent": {"tools": ["calculator", f"{EXAMPLES}:AnswerFirstLoop"]}},
            "agent.tools: `AnswerFirstLoop`",
        ),
        ({"agent": {"name": "react"}}, "agent.name: unknown agent loop `react`"),
        ({"reward": {"sources": {"mine": f"{EXAMPLES}:nope"}}}, "reward.sources.mine: module `"),
        (
            {"reward": {"sources": {"mine": "service"}}},
            "reward.service.urls, reward.service.launch.model_path: neither is set, but reward.sources maps",
        ),
        (
            {
                "reward": {
                    "sources": {"mine": "service"},
                    "service": {"urls": ["http://x"], "launch": {"model_path": "/judge"}},
                }
            },
            "reward.service.urls, reward.service.launch.model_path: both set",
        ),
        (
            {"reward": {"sources": {"mine": "service"}, "service": {"urls": ["127.0.0.1:1"]}}},
            "reward.service.urls: `127.0.0.1:1` is not an http",
        ),
        (
            {
                "reward": {
                    "sources": {"m": "service"},
                    "service": {"urls": ["http://x"], "judge_template": "{q}"},
                }
            },
            "reward.service.judge_template: does not format",
        ),
    ]
    for overrides, message in cases:
        with pytest.raises(ConfigError) as err:
            _check_plugins(_config(**overrides))
        assert str(err.value).startswith(message.split(":")[0] + ":") and message in str(err.value), str(
            err.value
        )
