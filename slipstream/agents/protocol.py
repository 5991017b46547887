"""What an agent loop needs from an inference server: token ids in, token ids out.

Agent loops import no other role (design.md §2); they receive an object that satisfies
:class:`InferenceClient`. The rollouter hands them its load-balanced client (embedded, SGLang or vLLM
servers behind it), wrapped so that partial rollouts are invisible: when a weight update aborts a request,
the wrapper waits for the new weights, re-submits prompt + partial output with the remaining budget and
returns the concatenation, each token stamped with the version that produced it. An agent loop therefore
only sees ``finish_reason`` ``stop`` or ``length``; ``abort`` reaches it only when the run is shutting
down, and it should then end the episode.

Worked example::

    out = await client.generate(prompt_ids, SamplingParams(max_new_tokens=64), rid="p7-0",
                                session_id="p7-0")
    out.output_ids     # [523, 91, 2]
    out.logprobs       # [-0.41, -1.2, -0.03]   behaviour log-probabilities, one per output token
    out.versions       # [3, 3, 4]              weight version of each output token
    out.finish_reason  # "stop"
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import Any, Literal, Protocol, runtime_checkable

import msgspec

FinishReason = Literal["stop", "length", "abort"]


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Per-request sampling, with SGLang's names (`top_k` -1 and `top_p` 1.0 disable those filters)."""

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    # Generation stops after any of these (the server's EOS tokens always stop it too).
    stop_token_ids: list[int] = []
    # Keep generating past EOS until max_new_tokens (benchmarks and tests of long requests).
    ignore_eos: bool = False
    # Mixture-of-experts models: ask the server for the experts each token was routed to (routing replay).
    return_routed_experts: bool = False


class GenerateOutput(msgspec.Struct, kw_only=True, omit_defaults=True):
    """The result of one generate call, always with per-token behaviour log-probabilities and versions."""

    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: FinishReason
    prompt_tokens: int = 0
    rid: str = ""
    # Base URL of the server that produced the last token (for metrics and stickiness).
    server: str = ""
    # How many times the request was interrupted by a weight update and resumed.
    num_resumes: int = 0
    # A request with images: the prompt as the server expanded it (each image pad repeated once per image
    # token), the prompt the trainer scores; empty when the server took the prompt as sent.
    prompt_ids: list[int] = []
    # With ``SamplingParams.return_routed_experts``: a numpy array ``[prompt + output - 1, layers, k]`` of
    # the experts every token but the last was routed to (uint8; int16 with -1 for rows never forwarded),
    # vLLM's layout; None when the server returned none. In-process only (never encoded).
    routed_experts: Any = None


# Streaming, where a client can: while a caller's task has set this to a callable, a client that can stream
# asks its server to, and calls it with the ids each chunk adds, as the server makes them (every piece of a
# request resumed after an abort included, so the pieces arrive in order). ``generate`` still returns the
# whole output. A client that cannot stream ignores it; the caller then has the tokens at the end only. The
# gateway sets it for a streamed request (a ContextVar, so it follows the request down through the
# partial-rollout wrapper and the load balancer without either knowing, and never leaks to another request).
TOKEN_SINK: contextvars.ContextVar[Callable[[list[int]], None] | None] = contextvars.ContextVar(
    "slipstream_token_sink", default=None
)


@runtime_checkable
class InferenceClient(Protocol):
    """Token-in/token-out generation against one or many inference servers."""

    async def generate(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        *,
        rid: str | None = None,
        session_id: str | None = None,
    ) -> GenerateOutput:
        """Generate a continuation of ``input_ids``.

        ``rid`` names the request (for abort); ``session_id`` keeps the turns of one trajectory on one
        server so multi-turn episodes reuse its KV cache. Clients that serve vision-language models also
        take ``images=[...]`` (``agents.multimodal.Image``, one per image pad of ``input_ids``, in order) and
        answer the expanded prompt in ``GenerateOutput.prompt_ids``; a caller passes it only when it has
        images, so text-only clients need not take it.
        """
        ...

    async def abort(self, rid: str) -> None:
        """Stop request ``rid``; its pending ``generate`` returns the partial output (finish ``abort``)."""
        ...
