"""The ``single_turn`` agent loop: render the prompt, generate once, keep the tokens."""

from __future__ import annotations

from slipstream.agents.base import AgentLoop, AgentLoopOutput, request_params
from slipstream.agents.chat import ChatRenderer
from slipstream.agents.data import Sample
from slipstream.agents.protocol import SamplingParams


class SingleTurnAgentLoop(AgentLoop):
    """One request per episode; ``finish_reason`` is the server's (stop, length or abort)."""

    name = "single_turn"

    def __init__(self, cfg, client, tokenizer) -> None:
        super().__init__(cfg, client, tokenizer)
        self.renderer = ChatRenderer(tokenizer)
        # The group's rollout.n episodes start one after the other with the same Sample object: its prompt
        # is rendered and tokenized once, not n times (the chat template is most of the rollouter's CPU
        # per request after HTTP).
        self._last: tuple[Sample, list[int]] | None = None

    def prompt_ids(self, sample: Sample) -> list[int]:
        if self._last is None or self._last[0] is not sample:
            self._last = (sample, self.renderer.prompt_ids(sample.messages))
        return list(self._last[1])

    async def run(self, sample: Sample, sampling_params: SamplingParams, *, uid: str = "") -> AgentLoopOutput:
        prompt_ids = self.prompt_ids(sample)
        out = AgentLoopOutput(prompt_ids=prompt_ids)
        budget = self.token_budget(len(prompt_ids), sampling_params)
        if budget <= 0:
            out.finish_reason = "length"
            return out
        params = request_params(sampling_params, budget, self.renderer.stop_ids)
        # images only where the prompt has some, so text-only clients need not take the keyword
        media = {"images": sample.images} if sample.images else {}
        result = await self.client.generate(
            prompt_ids, params, rid=uid or None, session_id=uid or None, **media
        )
        if result.prompt_ids:  # the server expanded the image pads: the trainer scores that prompt
            out.prompt_ids = list(result.prompt_ids)
        out.add_generated(result)
        out.num_turns = 1
        out.finish_reason = result.finish_reason
        out.response_text = self.decode(result.output_ids)
        return out
