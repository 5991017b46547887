"""Request bodies of the embedded server, as msgspec Structs that reject unknown fields.

Field names and defaults follow SGLang 0.5.23 (``GenerateReqInput``, ``AbortReq``, pause/continue) and the
OpenAI completions/chat APIs. A field we accept is a field we honour: anything else is a 400 that names
it, rather than a silently ignored option (an RL run that asked for ``min_p`` and did not get it would
train on the wrong behaviour policy).
"""

from __future__ import annotations

from typing import Any

import msgspec


class _Body(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


class SamplingParamsIn(_Body, kw_only=True):
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    # Only affect the decoded "text" field.
    skip_special_tokens: bool = True
    no_stop_trim: bool = False


class GenerateReqInput(_Body, kw_only=True):
    """``POST /generate`` (one prompt per request; ``text`` is tokenized with the server's tokenizer)."""

    input_ids: list[int] | None = None
    text: str | None = None
    sampling_params: SamplingParamsIn = msgspec.field(default_factory=SamplingParamsIn)
    rid: str | None = None
    return_logprob: bool = False
    # SGLang's default -1: log-probabilities of the output tokens only (the only mode supported here).
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    stream: bool = False
    # SGLang's name; MoE models only: ``meta_info.routed_experts`` in vLLM's encoding (app.py).
    return_routed_experts: bool = False


class AbortReq(_Body, kw_only=True):
    rid: str = ""
    abort_all: bool = False


class PauseReq(_Body, kw_only=True):
    mode: str = "abort"


class ContinueReq(_Body, kw_only=True):
    torch_empty_cache: bool = True


class StreamOptions(_Body, kw_only=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _OpenAISampling(_Body):
    model: str | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    seed: int | None = None
    user: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM's extension: return prompt_token_ids and token_ids in each choice.
    return_token_ids: bool = False
    # Names the request for /abort_request (with n > 1, each sample gets "<request_id>-<i>").
    request_id: str | None = None


class CompletionRequest(_OpenAISampling, kw_only=True):
    """``POST /v1/completions``: ``prompt`` is text or a list of token ids."""

    prompt: str | list[int]
    max_tokens: int = 16
    logprobs: int | None = None
    echo: bool = False


class ChatCompletionRequest(_OpenAISampling, kw_only=True):
    """``POST /v1/chat/completions``: messages are rendered with the model's chat template."""

    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | None = None
    # A Jinja template to render with instead of the model's; refused unless the server trusts it.
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
