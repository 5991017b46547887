"""Config of the rollouter and the inference servers it drives."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from slipstream.config_base import ConfigStruct


class SamplingConfig(ConfigStruct):
    max_new_tokens: Annotated[int, msgspec.Meta(ge=1)] = 256
    temperature: Annotated[float, msgspec.Meta(ge=0)] = 1.0
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] = 1.0
    # -1 disables top-k.
    top_k: Annotated[int, msgspec.Meta(ge=-1)] = -1


class EmbeddedServerConfig(ConfigStruct):
    """The embedded server (transformers continuous batching) used on CPU, in tests and the quickstart."""

    # Largest number of tokens processed in one forward step of the batch.
    max_batch_tokens: Annotated[int, msgspec.Meta(ge=16)] = 2048
    # Torch threads for the server process; 0 leaves torch's default.
    num_threads: Annotated[int, msgspec.Meta(ge=0)] = 0
    # Largest prompt + response the server accepts, in tokens. Longer prompts get a 400; a larger
    # max_new_tokens is clamped to what fits (the request then finishes with `length`).
    max_model_len: Annotated[int, msgspec.Meta(ge=16)] = 4096
    device: str = "cpu"
    # Weights and KV cache dtype. float32 keeps returned logprobs within 1e-3 of a teacher-forced pass.
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    # Attention kernel: sdpa on CPU; flash_attention_2 on GPUs that have it.
    attn_implementation: Literal["sdpa", "paged|eager", "flash_attention_2", "flash_attention_3"] = "sdpa"
    # Tokens the paged KV cache holds in total (all requests together); at least max_model_len. When full,
    # the scheduler evicts a request's cache and recomputes it later, so this bounds memory, not correctness.
    kv_cache_tokens: Annotated[int, msgspec.Meta(ge=16)] = 32768
    # Tokens per KV cache page.
    kv_page_size: Annotated[int, msgspec.Meta(ge=4)] = 128
    # Most requests decoded together in one step.
    max_running_requests: Annotated[int, msgspec.Meta(ge=1)] = 256
    # Sampling seed of the server; -1 picks a random one.
    seed: int = -1
    # Watchdog: with requests in flight (not paused in place) and no token generated for this many seconds,
    # GET /health answers 503 with the reason, so the pipeline restarts the server after
    # `cluster.unhealthy_checks` failed checks. 0 turns the watchdog off.
    stall_timeout_s: Annotated[float, msgspec.Meta(ge=0)] = 120.0
    # Largest HTTP request body accepted, in bytes; a larger one gets a 413 before it is read in full.
    max_request_bytes: Annotated[int, msgspec.Meta(ge=1024)] = 4 * 1024 * 1024
    # Largest `n` (samples per request) of the OpenAI routes; more gets a 400.
    max_n: Annotated[int, msgspec.Meta(ge=1)] = 128
    # Render a chat template sent with a request (`chat_template`, or `chat_template` inside
    # `chat_template_kwargs`). Templates are Jinja code run by the server, so by default such requests get a
    # 400 and only the model's own template is used (vLLM's --trust-request-chat-template).
    trust_request_chat_template: bool = False

    def __post_init__(self) -> None:
        if self.kv_cache_tokens < self.max_model_len:
            raise ValueError(
                f"kv_cache_tokens ({self.kv_cache_tokens}) must be at least max_model_len ({self.max_model_len}):"
                " one request of the longest allowed length has to fit in the cache"
            )


class DynamicSamplingConfig(ConfigStruct):
    """DAPO's dynamic sampling: a group whose samples all score the same (reward std 0) gives GRPO-style
    estimators no advantage, so the rollouter drops it before the put and frees its admission slot; the
    trainer's batch fills with informative groups only."""

    enable: bool = False
    # What must differ within a group: `score` (the reward function's score, before overlong shaping),
    # `reward` (the trained reward, after it), or the name of a component the reward function returns.
    metric: str = "score"
    # Generations of one prompt per pass over the data: a prompt whose group is dropped this many times in a
    # row is skipped until the next pass (counted in rollouter/prompts_filtered_out), so a data set of
    # prompts the policy always (or never) solves cannot keep generation spinning. 1 is DAPO's rule: a
    # dropped prompt is not retried and the next prompt takes its slot.
    max_attempts: Annotated[int, msgspec.Meta(ge=1)] = 1


class RolloutConfig(ConfigStruct):
    # Inference backend: embedded (our server), vllm or sglang.
    backend: Literal["embedded", "vllm", "sglang"] = "embedded"
    # Servers to launch; ignored when `server_urls` lists running servers to use instead.
    num_servers: Annotated[int, msgspec.Meta(ge=1)] = 1
    server_urls: list[str] = []
    # Extra command-line arguments for launched vllm/sglang servers.
    server_args: list[str] = []
    # Seconds to wait for a launched server to become healthy.
    launch_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 600.0
    # Samples per prompt; they form one group.
    n: Annotated[int, msgspec.Meta(ge=1)] = 8
    sampling: SamplingConfig = msgspec.field(default_factory=SamplingConfig)
    # Requests in flight per server at most.
    max_concurrent_per_server: Annotated[int, msgspec.Meta(ge=1)] = 64
    # Seconds a single generate request may take before it is retried on another server.
    request_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 3600.0
    embedded: EmbeddedServerConfig = msgspec.field(default_factory=EmbeddedServerConfig)
    # Raise the model's position limit (its config.json `max_position_embeddings`) for launched vLLM/SGLang
    # servers: passed as `--hf-overrides` (vLLM) or `--json-model-override-args` (SGLang). Needed when
    # prompt + response is longer than the checkpoint says it supports (e.g. Qwen2.5-Math-7B: 4096); the
    # config check names this key when that happens. Null keeps the checkpoint's value.
    max_position_embeddings: Annotated[int, msgspec.Meta(ge=1)] | None = None
    # Drop groups whose rewards are all equal and generate others instead (DAPO).
    dynamic_sampling: DynamicSamplingConfig = msgspec.field(default_factory=DynamicSamplingConfig)


class EvalConfig(ConfigStruct):
    """Evaluation on `data.val_files` while training runs: the rollouter sends the held-out prompts through the
    same servers between weight pushes, beside training generation, and reports mean@n and pass@n. Nothing
    it generates is put into the queue or trained on (rollouter/evaluation.py)."""

    # Weight versions between evaluations: version 0 (before training) and then the first version at or past
    # each multiple of `every`. 0 turns evaluation off. An evaluation still running when the next is due is
    # finished and the due one skipped (eval/skipped counts them).
    every: Annotated[int, msgspec.Meta(ge=0)] = 0
    # Samples per prompt: mean@n averages the reward over all of them, pass@n counts a prompt solved when one
    # of its n samples is correct (the reward's `acc` component when it has one, else reward > 0).
    n: Annotated[int, msgspec.Meta(ge=1)] = 4
    # Sampling of evaluation requests; null takes the training value of rollout.sampling.
    temperature: Annotated[float, msgspec.Meta(ge=0)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None
    max_new_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    # Evaluation requests in flight at most (over all servers): the bound that keeps evaluation from taking
    # the servers away from training generation.
    max_concurrent: Annotated[int, msgspec.Meta(ge=1)] = 8
