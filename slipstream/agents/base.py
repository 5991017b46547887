"""The agent-loop interface: one sample in, one token-level trajectory out.

An agent loop turns a prompt into the tokens a trajectory is made of, talking to an inference server
through an :class:`~slipstream.agents.protocol.InferenceClient`. It works in token ids end to end: the
ids the server generated are kept exactly (re-tokenising decoded text can give different ids, and the
trainer would then compute log-probabilities of tokens the policy never sampled); text is decoded only to
parse tool calls and for the reward.

Lifecycle: the rollouter builds one loop per run (:func:`slipstream.agents.registry.make_agent_loop`) and
calls :meth:`AgentLoop.run` concurrently for every sample of every group; a loop keeps no per-episode
state on ``self``.

Invariants of an :class:`AgentLoopOutput`: ``response_ids``, ``loss_mask``, ``logprobs`` and
``versions`` have one entry per response token; ``loss_mask`` is 1 exactly for the tokens the server
generated and 0 for tokens the loop inserted (chat-template glue, tool results), whose ``logprobs`` are
0.0 and whose ``versions`` repeat the version of the last generated token before them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import msgspec

from slipstream.agents.config import AgentConfig
from slipstream.agents.data import Sample
from slipstream.agents.multimodal import Image
from slipstream.agents.protocol import GenerateOutput, InferenceClient, SamplingParams


class AgentLoopOutput(msgspec.Struct, kw_only=True):
    """Everything one episode produced (see the module docstring for the invariants)."""

    prompt_ids: list[int]
    response_ids: list[int] = []
    loss_mask: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    # stop | length (a token, turn or total budget ran out) | abort (the run is stopping)
    finish_reason: str = "stop"
    num_turns: int = 0
    # The text the reward function scores: the final assistant turn without special tokens.
    response_text: str = ""
    # Times a weight update interrupted a request of this episode and it was resumed.
    num_resumes: int = 0
    metrics: dict[str, float] = {}
    # Set by loops whose episodes score themselves (the `external` loop: the harness's reward); the
    # rollouter then trains on it instead of calling the reward function. A non-empty `reward_error`
    # records why the episode failed (the trajectory carries it as `SampleOutcome.reward_error`).
    reward: float | None = None
    reward_components: dict[str, float] = {}
    reward_error: str = ""
    # Earlier sequences of the same episode, in order, when it was not one linear token sequence (the
    # `external` loop: a harness that compacted or edited its history started a new one). The rollouter
    # trains each as its own trajectory in the episode's group, with the episode's reward.
    earlier_segments: list[AgentLoopOutput] = []
    # The images the prompt's pads stand for, in order, when the loop got them from its requests rather than
    # from the sample (the gateway's image parts); the rollouter carries them as the group's images.
    images: list[Image] = []
    # MoE routing replay: the last generate's routes (``GenerateOutput.routed_experts``), which cover the
    # whole sequence it was given plus its output but the last token; None without routes.
    routed_experts: Any = None

    def validate(self) -> None:
        n = len(self.response_ids)
        for name in ("loss_mask", "logprobs", "versions"):
            if len(getattr(self, name)) != n:
                raise ValueError(
                    f"agent loop output: `{name}` has {len(getattr(self, name))} entries, expected {n}"
                )
        for seg in self.earlier_segments:
            seg.validate()

    def add_generated(self, out: GenerateOutput) -> None:
        """Append the server's tokens exactly as generated (loss_mask 1)."""
        if not (len(out.output_ids) == len(out.logprobs) == len(out.versions)):
            raise ValueError(
                f"server returned {len(out.output_ids)} tokens but {len(out.logprobs)} logprobs and "
                f"{len(out.versions)} versions"
            )
        self.response_ids.extend(out.output_ids)
        self.loss_mask.extend([1] * len(out.output_ids))
        self.logprobs.extend(out.logprobs)
        self.versions.extend(out.versions)
        self.num_resumes += out.num_resumes
        if out.routed_experts is not None:
            self.routed_experts = out.routed_experts

    def add_inserted(self, token_ids: list[int]) -> None:
        """Append tokens the loop inserted (template glue, tool output): loss_mask 0, logprob 0.0, and the
        version of the last generated token."""
        version = self.versions[-1] if self.versions else -1
        self.response_ids.extend(token_ids)
        self.loss_mask.extend([0] * len(token_ids))
        self.logprobs.extend([0.0] * len(token_ids))
        self.versions.extend([version] * len(token_ids))


class AgentLoop(ABC):
    """Base of the agent loops; subclasses set ``name`` and implement :meth:`run`."""

    name: ClassVar[str]

    def __init__(self, cfg: AgentConfig, client: InferenceClient, tokenizer: Any) -> None:
        self.cfg = cfg
        self.client = client
        self.tokenizer = tokenizer

    @abstractmethod
    def prompt_ids(self, sample: Sample) -> list[int]:
        """The prompt's token ids as the loop will send them (the rollouter checks their length)."""

    @abstractmethod
    async def run(self, sample: Sample, sampling_params: SamplingParams, *, uid: str = "") -> AgentLoopOutput:
        """Run one episode. ``uid`` names the trajectory: requests use it as rid prefix and session id."""

    def metrics(self) -> dict[str, float]:
        """Running totals of the loop itself (the rollouter reports them as ``rollouter/<name>``)."""
        return {}

    def decode(self, token_ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_budget(self, used: int, sampling: SamplingParams) -> int:
        """New tokens the next request may generate: its own cap and what is left of max_total_tokens."""
        return min(sampling.max_new_tokens, self.cfg.max_total_tokens - used)


def request_params(sampling: SamplingParams, budget: int, stop_ids: set[int]) -> SamplingParams:
    """``sampling`` for one request: ``budget`` new tokens, and generation also stops at the chat
    template's end-of-turn token (``stop_ids``), which for some models (a base model with a chat template)
    is not the model's own EOS."""
    stops = list(sampling.stop_token_ids) + sorted(stop_ids - set(sampling.stop_token_ids))
    return msgspec.structs.replace(sampling, max_new_tokens=budget, stop_token_ids=stops)
