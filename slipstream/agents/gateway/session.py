"""One episode seen through the gateway: its requests, recorded token for token, as segments.

A *segment* is a linear token sequence the model really saw: the prompt the gateway rendered for the
segment's first request, then every later request's new messages (rendered as a chat-template suffix
delta, ``loss_mask`` 0) and every reply (the server's ids, logprobs and versions, ``loss_mask`` 1). It is an
:class:`~slipstream.agents.base.AgentLoopOutput`, the type every agent loop produces.

A request *extends* the segment when its messages start with the messages the segment stands for (the
earlier history plus the assistant reply the gateway returned, compared after normalisation: text parts
joined, tool-call arguments parsed) and its tools are the same. Anything else (an edited or dropped
message, a rewritten assistant reply, other tools) means the harness's history no longer renders to the
recorded tokens; training on a re-rendering would train on tokens the model never saw, so the gateway
starts a new segment from a fresh rendering and counts a divergence. The episode's trajectory is its last
segment (the one that produced the final answer), and every earlier segment is trained too, as its own
sequence with the episode's reward (``AgentLoopOutput.earlier_segments``, filled by the external loop).

An ``n`` > 1 request's replies wait (:meth:`Session.offer_choices`) until the next request shows which one the
harness used, and only that one is recorded: a reply the harness did not use had no part in what the
episode's reward scores, so training it with that reward would credit it with another reply's outcome.
The harness *used* a reply when its next request continues it: for chat, the message after the earlier
history is that reply (compared after normalisation); for completions, the prompt starts with the recorded
text (or ids) followed by that reply's. A next request that continues none of them records none (and, for
chat, starts a new segment). When the episode ends with replies pending, which one the harness used cannot
be seen, and the first is recorded: it is the one ``final_text`` holds, so the ``function`` reward scores it.

Worked example (a tool round-trip extends one segment)::

    s = Session("e0-p3-0", api_key)
    seg, prompt_ids = s.begin(messages, tools_key, render_full, render_delta)   # a new segment
    seg.add_generated(out); s.replied(messages, reply)                          # turn 1
    seg, prompt_ids = s.begin(messages + [reply, tool_msg], ...)                # extends: delta appended
    s.divergences   # 0
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from typing import Any

from slipstream.agents.base import AgentLoopOutput
from slipstream.agents.gateway.images import image_key
from slipstream.agents.multimodal import Image
from slipstream.agents.protocol import GenerateOutput


def _text(content: Any) -> str:
    """A message's content as one string (OpenAI allows a list of text parts)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if isinstance(p, dict))


def _arguments(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value) if value.strip() else {}
        except json.JSONDecodeError:
            return value
    return value


def _image_keys(content: Any) -> tuple[str, ...]:
    if not isinstance(content, list):
        return ()
    return tuple(image_key(p) for p in content if isinstance(p, dict) and p.get("type") == "image_url")


def canonical(message: dict[str, Any]) -> tuple:
    """What decides whether two messages render the same for the model (ids of tool calls do not; images,
    by a digest of their URLs, do)."""
    calls = tuple(
        (
            (c.get("function") or {}).get("name", ""),
            json.dumps(_arguments((c.get("function") or {}).get("arguments")), sort_keys=True),
        )
        for c in message.get("tool_calls") or []
    )
    name = message.get("name", "") if message.get("role") == "tool" else ""
    content = message.get("content")
    return (message.get("role"), _text(content).strip(), calls, name, _image_keys(content))


def _continues(prompt: list[int], recorded: list[int]) -> bool:
    return prompt[: len(recorded)] == recorded


class Choice:
    """One sampled reply: the tokens forced before it (``tool_choice``), the server's output, the message."""

    def __init__(self, prefill: list[int], out: GenerateOutput, reply: dict[str, Any], ended: bool) -> None:
        self.prefill = prefill
        self.out = out
        self.reply = reply
        self.ended = ended
        self.finish = "stop"  # the OpenAI finish_reason: stop | length | tool_calls


def record(seg: AgentLoopOutput, prefill: list[int], out: GenerateOutput) -> None:
    """Append one reply to ``seg``: forced tokens (loss_mask 0), then the generated ones."""
    if prefill:
        seg.add_inserted(prefill)
    seg.add_generated(out)
    seg.num_turns += 1


class Session:
    """An episode's record: its segments, the messages the current one stands for, and its counters.

    Lifecycle: created by :meth:`Gateway.open_session`, fed by the gateway's handlers (one request at a time:
    ``lock``), ended by :meth:`Gateway.close_session`, after which requests with its key get a 404.
    """

    def __init__(self, uid: str, api_key: str) -> None:
        self.uid = uid
        self.api_key = api_key
        self.sid = ""  # the URL's session part (set by the gateway)
        self.base_url = ""  # what the harness gets as OPENAI_BASE_URL
        self.segments: list[AgentLoopOutput] = []
        self.kind = ""  # "chat" or "completion": the route the current segment was built by
        self.history: list[tuple] = []  # canonical messages (chat) the current segment stands for
        self.text = ""  # prompt + completion text (completions) the current segment stands for
        self.tools_key = ""
        self.ended_turn = True
        self.divergences = 0
        self.requests = 0
        self.errors = 0  # requests answered with an error status
        self.resumes = 0
        self.final_text = ""  # the last reply's visible text (what reward functions score)
        self.closed = False
        self.aborted = False
        self.lock = asyncio.Lock()
        self.active_rids: list[str] = []  # requests on the server now (n of them for an n > 1 request)
        # The replies of the last n > 1 request, until the next request shows which one the harness used,
        # and whether that request's prompt was text (completions).
        self._choices: list[Choice] = []
        self._choices_text = False
        # Segments with images (by index): the prompt as rendered, one pad per image, which every request
        # sends (the server expands the pads itself; an expanded prompt would be expanded again), and
        # whether the server's expansion replaced it in the record yet.
        self._compact: dict[int, list[int]] = {}
        self._expanded: set[int] = set()

    @property
    def turns(self) -> int:
        """Replies generated in this episode, all segments together."""
        return sum(seg.num_turns for seg in self.segments)

    @property
    def current(self) -> AgentLoopOutput | None:
        return self.segments[-1] if self.segments else None

    def context_ids(self) -> list[int]:
        """The ids a request sends: the current segment's prompt (compact where it has images) and its
        response so far."""
        seg = self.current
        if seg is None:
            return []
        return self._compact.get(len(self.segments) - 1, seg.prompt_ids) + seg.response_ids

    def expand(self, server_prompt: list[int], sent: list[int]) -> None:
        """Record the current segment's prompt as the server expanded its image pads (``server_prompt``: the
        ``sent`` ids, expanded; what followed the compact prompt comes back unchanged). The trainer scores
        the expanded prompt; requests keep sending the compact one. ValueError when the server's ids do not
        end with what was sent after the prompt."""
        index, seg = len(self.segments) - 1, self.current
        tail = sent[len(self._compact[index]) :]
        cut = len(server_prompt) - len(tail)
        if cut <= 0 or server_prompt[cut:] != tail:
            raise ValueError("the server's expanded prompt does not end with the ids sent after the prompt")
        seg.prompt_ids = list(server_prompt[:cut])
        self._expanded.add(index)

    def drop_unsent(self) -> None:
        """At the episode's end: segments with images whose prompt never reached a server (no turn or token
        was left) are dropped; their compact prompt holds pads the trainer could not match to images."""
        keep = [i for i in range(len(self.segments)) if i not in self._compact or i in self._expanded]
        if len(keep) < len(self.segments):
            self.segments = [self.segments[i] for i in keep]
            self._compact, self._expanded = {}, set()

    def begin_chat(
        self,
        messages: list[dict[str, Any]],
        tools_key: str,
        render_full: Callable[[list[dict[str, Any]]], list[int]],
        render_delta: Callable[[list[dict[str, Any]], bool], list[int]],
        images: Sequence[Image] = (),
    ) -> list[int]:
        """The prompt ids for a chat request: the segment extended by the new messages' delta, or a new
        segment rendered from scratch (a divergence when a segment existed). ``images``: those of the
        messages' image parts, in order. New messages with images start a new segment too: a trained
        sequence's images sit in its prompt (a pad in a response cannot be scored)."""
        canon = [canonical(m) for m in messages]
        k = len(self.history)
        nxt = canon[k] if len(canon) > k and canon[:k] == self.history else None
        kept = self._settle_choices(lambda c: canonical(c.reply) == nxt)
        k = len(self.history)  # the kept reply is history now
        extends = (
            kept
            and self.kind == "chat"
            and tools_key == self.tools_key
            and len(canon) > k
            and canon[:k] == self.history
            and not any(c[-1] for c in canon[k:])
        )
        if extends:
            delta = render_delta(messages[k:], self.ended_turn)
            self.current.add_inserted(delta)
        else:
            self._new_segment(render_full(messages), "chat", images)
            self.tools_key = tools_key
        self.history = canon
        return self.context_ids()

    def begin_completion(self, prompt: str | list[int], encode: Callable[[str], list[int]]) -> list[int]:
        """The prompt ids for a completions request (text extends when it starts with the recorded text;
        token ids when they start with the recorded ids)."""
        if isinstance(prompt, list):
            ctx = self.context_ids()
            self._settle_choices(lambda c: _continues(prompt, ctx + c.prefill + c.out.output_ids))
        else:
            text = self.text if self._choices_text else None
            self._settle_choices(lambda c: text is not None and prompt.startswith(text + c.reply["text"]))
        if isinstance(prompt, list):
            ctx = self.context_ids()
            if self.kind == "completion" and ctx and len(prompt) > len(ctx) and prompt[: len(ctx)] == ctx:
                self.current.add_inserted(prompt[len(ctx) :])
            else:
                self._new_segment(list(prompt), "completion")
            self.text = ""
            return self.context_ids()
        if self.kind == "completion" and self.text and prompt.startswith(self.text) and prompt != self.text:
            self.current.add_inserted(encode(prompt[len(self.text) :]))
        else:
            self._new_segment(encode(prompt), "completion")
        self.text = prompt
        return self.context_ids()

    def replied_chat(self, reply: dict[str, Any], ended_turn: bool) -> None:
        self.history.append(canonical(reply))
        self.ended_turn = ended_turn

    def offer_choices(self, choices: list[Choice], *, prompt_was_text: bool = False) -> None:
        """The replies of an n > 1 request: the one the harness continues in its next request is recorded,
        the others never are (module docstring)."""
        self._choices, self._choices_text = choices, prompt_was_text

    def _settle_choices(self, used: Callable[[Choice], bool] | None) -> bool:
        """Record the first pending choice ``used`` accepts (None: the episode ended, the first) and drop
        the others; False when the harness used none of them (a chat segment cannot go on)."""
        if not self._choices:
            return True
        choices, self._choices = self._choices, []
        kept = choices[0] if used is None else next((c for c in choices if used(c)), None)
        if kept is None:
            return False
        record(self.current, kept.prefill, kept.out)
        if self.kind == "chat":
            self.replied_chat(kept.reply, kept.ended)
        else:
            self.replied_completion(kept.reply["text"], self._choices_text)
        return True

    def settle(self) -> None:
        """At the episode's end: of pending choices, the first is recorded (which one the harness used cannot
        be seen; it is the one ``final_text`` holds)."""
        self._settle_choices(None)

    def replied_completion(self, text: str, prompt_was_text: bool) -> None:
        self.text = self.text + text if prompt_was_text else ""

    def checkpoint(self) -> tuple:
        """What :meth:`rollback` restores when a request fails after it began (nothing is recorded)."""
        seg = self.current
        size = (len(seg.response_ids), seg.num_turns) if seg is not None else (0, 0)
        fields = (self.kind, list(self.history), self.text, self.tools_key, self.ended_turn, self.divergences,
                  list(self._choices), self._choices_text)  # fmt: skip
        return len(self.segments), size, fields

    def rollback(self, state: tuple) -> None:
        count, (size, turns), fields = state
        del self.segments[count:]
        self._compact = {i: ids for i, ids in self._compact.items() if i < count}
        self._expanded = {i for i in self._expanded if i < count}
        seg = self.current
        if seg is not None:
            seg.num_turns = turns
            for name in ("response_ids", "loss_mask", "logprobs", "versions"):
                del getattr(seg, name)[size:]
        (self.kind, self.history, self.text, self.tools_key, self.ended_turn, self.divergences,
         self._choices, self._choices_text) = fields  # fmt: skip

    def _new_segment(self, prompt_ids: list[int], kind: str, images: Sequence[Image] = ()) -> None:
        if self.segments:
            self.divergences += 1
        if images:
            self._compact[len(self.segments)] = list(prompt_ids)
        self.segments.append(AgentLoopOutput(prompt_ids=list(prompt_ids), images=list(images)))
        self.kind = kind
        self.history = []
        self.text = ""
        self.ended_turn = True

    def metrics(self) -> dict[str, float]:
        return {
            "gateway_requests": float(self.requests),
            "gateway_segments": float(len(self.segments)),
            "gateway_divergences": float(self.divergences),
            "gateway_errors": float(self.errors),
        }
