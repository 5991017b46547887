"""The ``tool`` agent loop: multi-turn ReAct with tools, token in, token out.

Each turn generates from ``prompt + response so far``; when the reply contains ``<tool_call>`` blocks, the
tools run (concurrently) and their results are appended through the chat template as tokens with
``loss_mask`` 0 (a suffix delta, :class:`~slipstream.agents.chat.ChatRenderer`); the episode ends on a
reply without tool calls, a non-``stop`` finish, or a limit:

* ``agent.max_turns`` assistant turns (a reply still asking for tools on the last turn ends with
  ``finish_reason = "length"``);
* ``agent.max_total_tokens`` for prompt + every response token: each request is capped to what is left,
  and a tool result that would not fit ends the episode (``length``) rather than being cut mid-template.

Malformed tool calls, unknown tools, bad arguments and failing tools all become an ``Error: ...`` tool
message; the model reads it next turn. Nothing the model writes can crash the loop.

Worked example (metrics of one episode)::

    out = await ToolAgentLoop(cfg, client, tok).run(sample, SamplingParams(max_new_tokens=256), uid="p3-0")
    out.num_turns, out.metrics      # 2, {"tool_calls": 1.0, "tool_errors": 0.0}
"""

from __future__ import annotations

import asyncio
from typing import Any

from slipstream.agents.base import AgentLoop, AgentLoopOutput, request_params
from slipstream.agents.chat import ChatRenderer
from slipstream.agents.data import Sample
from slipstream.agents.protocol import GenerateOutput, SamplingParams
from slipstream.agents.tool_parser import ToolCall, parse_tool_calls
from slipstream.agents.tools import Tool, ToolArgumentError, make_tools
from slipstream.agents.tools.base import truncate_middle

# Seconds a tool call may take beyond its own limits before the loop gives up on it.
TOOL_GRACE_S = 5.0


class ToolAgentLoop(AgentLoop):
    name = "tool"

    def __init__(self, cfg, client, tokenizer, tools: dict[str, Tool] | None = None) -> None:
        super().__init__(cfg, client, tokenizer)
        self.tools = tools if tools is not None else make_tools(cfg.tools, cfg)
        self.renderer = ChatRenderer(tokenizer, tools=[t.schema() for t in self.tools.values()])

    def prompt_ids(self, sample: Sample) -> list[int]:
        return self.renderer.prompt_ids(sample.messages)

    async def run(self, sample: Sample, sampling_params: SamplingParams, *, uid: str = "") -> AgentLoopOutput:
        prompt_ids = self.prompt_ids(sample)
        out = AgentLoopOutput(prompt_ids=prompt_ids, finish_reason="length")
        calls_made = errors = 0
        for turn in range(self.cfg.max_turns):
            budget = self.token_budget(len(prompt_ids) + len(out.response_ids), sampling_params)
            if budget <= 0:
                break
            result = await self.client.generate(
                prompt_ids + out.response_ids,
                request_params(sampling_params, budget, self.renderer.stop_ids),
                rid=f"{uid}-t{turn}" if uid else None,
                session_id=uid or None,
            )
            out.add_generated(result)
            out.num_turns = turn + 1
            out.response_text = self.decode(result.output_ids)
            if result.finish_reason != "stop":
                out.finish_reason = result.finish_reason
                break
            calls = parse_tool_calls(self.decode(result.output_ids, skip_special_tokens=False))
            if not calls:
                out.finish_reason = "stop"
                break
            if turn + 1 == self.cfg.max_turns:
                break  # the model still wants tools but has no turn left: "length"
            replies = await asyncio.gather(*(self._answer(call) for call in calls))
            calls_made += len(calls)
            errors += sum(reply.startswith("Error:") for reply in replies)
            delta = self.renderer.tool_turn_ids(
                [self._tool_message(call, reply) for call, reply in zip(calls, replies, strict=True)],
                ended_turn=_ended_turn(result, self.renderer.stop_ids),
            )
            if len(prompt_ids) + len(out.response_ids) + len(delta) >= self.cfg.max_total_tokens:
                break
            out.add_inserted(delta)
        out.metrics = {"tool_calls": float(calls_made), "tool_errors": float(errors)}
        return out

    async def _answer(self, call: ToolCall) -> str:
        """The text the model sees for one call: the tool's output or an ``Error: ...`` line."""
        if call.error:
            return f"Error: {call.error}"
        tool = self.tools.get(call.name)
        if tool is None:
            known = ", ".join(self.tools) or "none"
            return f"Error: unknown tool `{call.name}`; available tools: {known}"
        try:
            reply = await asyncio.wait_for(tool.call(call.arguments), self.cfg.sandbox_wall_s + TOOL_GRACE_S)
        except ToolArgumentError as err:
            return f"Error: bad arguments for `{call.name}`: {err}"
        except TimeoutError:
            return f"Error: tool `{call.name}` did not answer in time"
        except Exception as err:  # a tool's own failure is the model's feedback, not the run's end
            return f"Error: tool `{call.name}` failed: {type(err).__name__}: {err}"
        return truncate_middle(reply, self.cfg.max_tool_output_chars)

    @staticmethod
    def _tool_message(call: ToolCall, reply: str) -> dict[str, Any]:
        message = {"role": "tool", "content": reply}
        if call.name:
            message["name"] = call.name
        return message


def _ended_turn(result: GenerateOutput, stop_ids: set[int]) -> bool:
    return bool(result.output_ids) and result.output_ids[-1] in stop_ids
