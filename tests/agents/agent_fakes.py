"""A scripted stand-in for an inference server, for agent-loop unit tests (the real server is exercised in
tests/rollouter): each generate call returns the next scripted reply, encoded with the test tokenizer."""

from __future__ import annotations

from collections.abc import Callable

from slipstream.agents.protocol import GenerateOutput, SamplingParams


class ScriptedClient:
    """Replies are text (encoded byte by byte, plus an end-of-turn token unless ``eot=False``) or a
    callable ``(input_ids, sampling) -> GenerateOutput``. Records every request."""

    def __init__(self, tokenizer, replies: list, *, version: int = 0, eot: bool = True):
        self.tokenizer = tokenizer
        self.replies = list(replies)
        self.version = version
        self.eot = eot
        self.requests: list[tuple[list[int], SamplingParams, str | None]] = []

    async def generate(self, input_ids, sampling, *, rid=None, session_id=None) -> GenerateOutput:
        self.requests.append((list(input_ids), sampling, rid))
        reply = self.replies.pop(0)
        if isinstance(reply, Callable):
            return reply(input_ids, sampling)
        ids = self.tokenizer.encode(reply, add_special_tokens=False)
        if self.eot:
            ids.append(self.tokenizer.convert_tokens_to_ids("<|im_end|>"))
        finish = "stop"
        if len(ids) > sampling.max_new_tokens:
            ids, finish = ids[: sampling.max_new_tokens], "length"
        return GenerateOutput(
            output_ids=ids,
            logprobs=[-0.5] * len(ids),
            versions=[self.version] * len(ids),
            finish_reason=finish,
            rid=rid or "",
        )

    async def abort(self, rid: str) -> None:
        pass
