"""Config of the data (and of the files `slipstream data make` generates), the agent loops, their tools and the
reward functions."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from slipstream.config_base import ConfigStruct
from slipstream.serverapi import KindName


class DataConfig(ConfigStruct):
    """The prompts a run trains and evaluates on."""

    train_files: Annotated[
        list[str],
        Meta(
            description="Training prompts: verl-format parquet or jsonl files (`prompt` as chat messages, "
            "`data_source`, `reward_model.ground_truth`, `extra_info`).",
        ),
    ] = []
    val_files: Annotated[
        list[str],
        Meta(description="Held-out prompts in the same format, for evaluation during training (see `eval`)."),
    ] = []
    max_prompt_tokens: Annotated[
        int,
        Meta(
            ge=1,
            description="Prompts longer than this many tokens (after the chat template) are skipped with a "
            "warning.",
        ),
    ] = 1024
    shuffle: Annotated[
        bool,
        Meta(description="Shuffle the training prompts, each epoch in its own order drawn from run.seed."),
    ] = True
    epochs: Annotated[
        int,
        Meta(ge=1, description="Passes over the training prompts (the run also stops at run.total_steps)."),
    ] = 1


class DataGenConfig(ConfigStruct):
    """Training files made offline before a run starts (`slipstream data make`), so a preset such as the
    quickstart runs on a fresh clone. Only files of `data.train_files` and `data.val_files` that do not exist
    are made. With `data.val_files` set, the training files leave out a fixed tenth of the problems and the
    validation files hold only those (agents/datagen.py, `--split`), so the evaluation is on held-out data."""

    task: Annotated[
        Literal["arithmetic", "multiply", "countdown", "shapes"] | None,
        Meta(
            description="Generator of agents/datagen.py (`arithmetic`, `multiply`, `countdown`, `shapes`); null never "
            "makes a file (a missing file is then a config error).",
        ),
    ] = None
    n: Annotated[int, Meta(ge=1, description="Prompts per file.")] = 2000
    seed: Annotated[
        int, Meta(description="Seed of the training files (the same seed makes the same problems).")
    ] = 0
    val_n: Annotated[
        int, Meta(ge=1, description="Prompts per file of data.val_files (made with seed + 1).")
    ] = 32


class RewardServerLaunchConfig(ConfigStruct):
    """Judge or reward-model servers the pipeline starts for the run: a pool of their own on the rollout
    nodes, placed like the rollout servers and launched by the same code, never sent a weight push nor a
    rollout request. Server settings not named here (the embedded server's `rollout.embedded`) are the
    rollout servers'; `server_args` overrides them per flag."""

    model_path: Annotated[
        str,
        Meta(
            description="The judge or reward model (an HF checkpoint directory or a name the backend loads); "
            'setting it has the pipeline start the judge servers ("": none, use `urls`).',
        ),
    ] = ""
    backend: Annotated[
        KindName,
        Meta(description="Server of the judge: embedded (our server), vllm or sglang, as rollout.backend."),
    ] = "embedded"
    num_servers: Annotated[int, Meta(ge=1, description="Judge servers to start.")] = 1
    gpus_per_server: (
        Annotated[
            int,
            Meta(
                ge=0,
                description="GPUs per judge server (its tensor-parallel size); null takes "
                "cluster.gpus_per_server.",
            ),
        ]
        | None
    ) = None
    server_args: Annotated[
        list[str],
        Meta(
            description="Extra command-line arguments of the judge servers (for the embedded server, flags "
            "of `slipstream serve`, which override rollout.embedded's).",
        ),
    ] = []
    launch_timeout_s: Annotated[
        float, Meta(gt=0, description="Seconds to wait for a judge server to become healthy.")
    ] = 600.0
    max_position_embeddings: (
        Annotated[
            int,
            Meta(
                ge=1,
                description="Raise the judge model's position limit on vLLM/SGLang, as "
                "rollout.max_position_embeddings does for the policy (null keeps the checkpoint's).",
            ),
        ]
        | None
    ) = None


class RewardServiceConfig(ConfigStruct):
    """A served judge or reward model, used by data sources mapped to `service` in reward.sources
    (agents/rewards/service.py states both wire protocols). Either servers you run (`urls`) or servers the
    pipeline starts (`launch`); either way no weight push reaches them."""

    urls: Annotated[
        list[str],
        Meta(
            description="Base URLs of servers you run (`http://host:port`); requests go round-robin, a retry "
            "to the next one. Exclusive with `launch`.",
        ),
    ] = []
    # Servers the pipeline starts (and stops) for the run, when launch.model_path is set; exclusive with `urls`.
    launch: RewardServerLaunchConfig = msgspec.field(default_factory=RewardServerLaunchConfig)
    protocol: Annotated[
        Literal["judge", "score"],
        Meta(
            description="`judge`: OpenAI-compatible POST /v1/chat/completions, one sample per request, the "
            'score read from the reply text. `score`: POST /score with a batch of samples, {"scores": '
            "[...]} back.",
        ),
    ] = "judge"
    model: Annotated[
        str, Meta(description="Model name sent in each request (servers that serve one model ignore it).")
    ] = "judge"
    api_key_env: Annotated[
        str, Meta(description='Environment variable holding a bearer token for the servers ("": none).')
    ] = ""
    max_concurrent: Annotated[
        int, Meta(ge=1, description="Requests in flight at once, over all servers.")
    ] = 8
    batch_size: Annotated[
        int,
        Meta(ge=1, description="Samples per request of the `score` protocol (the judge protocol sends one)."),
    ] = 16
    timeout_s: Annotated[
        float,
        Meta(
            gt=0,
            description="Seconds one request may take; then it is retried. reward.timeout_s bounds a "
            "sample's whole call (waiting for a slot, every retry), so it must be at least this.",
        ),
    ] = 10.0
    retries: Annotated[
        int,
        Meta(
            ge=0,
            description="Retries of a request that timed out, could not connect, got 408/429/5xx or a "
            "malformed reply. A sample still failing scores `failure_score` with its reason recorded as a "
            "reward error.",
        ),
    ] = 3
    backoff_s: Annotated[
        float,
        Meta(
            ge=0,
            description="Wait before the first retry, in seconds; the n-th retry waits backoff_s * 2**(n-1) "
            "(at most backoff_max_s).",
        ),
    ] = 0.5
    backoff_max_s: Annotated[float, Meta(ge=0, description="Longest wait before one retry, in seconds.")] = (
        8.0
    )
    failure_score: Annotated[
        float,
        Meta(
            description="Score of a sample whose request still fails after every retry (recorded as a "
            "reward error).",
        ),
    ] = 0.0
    judge_template: Annotated[
        str,
        Meta(
            description="Judge prompt, formatted with {question} (extra_info's `question` or `prompt`), "
            "{response} and {ground_truth}; the judge's reply must end with `Score: <number>` in [0, "
            "judge_max_score].",
        ),
    ] = (
        "Grade the response to the question against the reference answer.\n\nQuestion:\n{question}\n\n"
        "Reference answer:\n{ground_truth}\n\nResponse:\n{response}\n\nReply with one line "
        "`Score: <number>`, from 0 (wrong) to 1 (fully correct)."
    )
    judge_max_score: Annotated[
        float,
        Meta(
            gt=0,
            description="Largest score the judge may give; its score is divided by this, so rewards are in "
            "[0, 1].",
        ),
    ] = 1.0
    judge_max_tokens: Annotated[int, Meta(ge=1, description="Longest judge reply, in tokens.")] = 512
    judge_temperature: Annotated[
        float, Meta(ge=0, description="Sampling temperature of the judge (0: greedy).")
    ] = 0.0


class RewardConfig(ConfigStruct):
    """How responses are scored: reward functions per data source, run in worker processes off the
    rollouter's event loop, with optional overlong shaping and a served judge."""

    num_workers: Annotated[
        int, Meta(ge=1, description="Worker processes scoring responses off the event loop.")
    ] = 2
    timeout_s: Annotated[
        float,
        Meta(
            gt=0, description="A reward call taking longer than this scores 0 and counts as a reward error."
        ),
    ] = 10.0
    sources: Annotated[
        dict[str, str],
        Meta(
            description="data_source -> reward function (a name registered in agents/rewards, "
            "`package.module:function` for your own, or `service` for the served judge / reward model "
            "below). Sources not listed here use the function registered under their own name or alias.",
        ),
    ] = {}
    overlong_buffer_len: Annotated[
        int,
        Meta(
            ge=0,
            description="Overlong reward shaping (DAPO): a response longer than "
            "rollout.sampling.max_new_tokens minus this many tokens gets a penalty growing linearly from 0 "
            "to `overlong_penalty_factor` at max_new_tokens, added to its reward "
            "(agents/rewards/overlong.py). 0 turns shaping off.",
        ),
    ] = 0
    overlong_penalty_factor: Annotated[
        float,
        Meta(
            ge=0,
            description="Largest overlong penalty, reached at rollout.sampling.max_new_tokens (see "
            "overlong_buffer_len).",
        ),
    ] = 1.0
    # The judge / reward-model service that scores data sources mapped to `service` in `sources`.
    service: RewardServiceConfig = msgspec.field(default_factory=RewardServiceConfig)


class ExternalAgentConfig(ConfigStruct):
    """The `external` loop: users' own agent harness, talking to the policy through the OpenAI gateway."""

    command: Annotated[
        list[str],
        Meta(
            description="The harness as a command (argv, no shell; `{python}` is this interpreter) run once "
            "per episode. Set this or `callable`, not both.",
        ),
    ] = []
    callable: Annotated[
        str,
        Meta(
            description="The harness as `package.module:function`, called as function(task, base_url, "
            "api_key). Set this or `command`, not both.",
        ),
    ] = ""
    reward: Annotated[
        Literal["harness", "exit_status", "function"],
        Meta(
            description="Where the reward comes from: `harness` (the callable's return value, or what the "
            'command writes to $SLIPSTREAM_REWARD_FILE: a number or {"reward": x, "components": {...}}), '
            "`exit_status` (0 scores 1.0, 1 scores 0.0, anything else fails the episode) or `function` (the "
            "data source's reward function scores the final assistant message).",
        ),
    ] = "harness"
    timeout_s: Annotated[
        float,
        Meta(
            gt=0,
            description="Seconds an episode may take; then its process group is killed and the episode "
            "fails.",
        ),
    ] = 600.0
    max_concurrent: Annotated[
        int, Meta(ge=0, description="Harnesses running at once (0: as many as episodes in flight).")
    ] = 0
    failure_reward: Annotated[
        float,
        Meta(
            description="Reward of a failed episode (crashed, hung, no reward); its tokens are not trained "
            "(loss_mask 0).",
        ),
    ] = 0.0
    host: Annotated[
        str,
        Meta(
            description="Address of the gateway; loopback unless you mean it (session keys then are the "
            "only protection).",
        ),
    ] = "127.0.0.1"
    port: Annotated[int, Meta(ge=0, description="Port of the gateway; 0 picks a free one.")] = 0
    env: Annotated[
        dict[str, str],
        Meta(description="Extra environment variables of the harness."),
    ] = {}
    cwd: Annotated[str, Meta(description='Working directory of the harness ("": inherited).')] = ""


class AgentConfig(ConfigStruct):
    """The agent loop that turns one prompt into a trajectory, and the tools it may call."""

    name: Annotated[
        str,
        Meta(
            description="Agent loop (registry in agents/): single_turn, tool, external, or "
            "`package.module:Class` (an AgentLoop).",
        ),
    ] = "single_turn"
    tools: Annotated[
        list[str],
        Meta(
            description="Tools offered to the `tool` loop (registry in agents/tools): python, calculator, "
            "or `package.module:Class` (a Tool subclass).",
        ),
    ] = []
    max_turns: Annotated[
        int, Meta(ge=1, description="Most assistant turns in one episode of a multi-turn loop.")
    ] = 4
    max_total_tokens: Annotated[
        int, Meta(ge=1, description="Prompt + every generated and tool token of one episode.")
    ] = 4096
    max_tool_output_chars: Annotated[
        int, Meta(ge=1, description="Tool output beyond this many characters is truncated.")
    ] = 2048
    sandbox_cpu_s: Annotated[
        float,
        Meta(
            gt=0,
            description="CPU seconds one call of the `python` tool may use. The tool runs each call behind "
            "a kernel boundary (new user, pid, mount, network, IPC and UTS namespaces; uid 65534 without "
            "capabilities; a read-only file system but /tmp; seccomp; no environment; "
            "agents/tools/sandbox.py). It needs user namespaces and libseccomp; where they are missing, "
            "building the tool fails with what to enable.",
        ),
    ] = 5.0
    sandbox_wall_s: Annotated[
        float, Meta(gt=0, description="Wall-clock seconds one call of the `python` tool may take.")
    ] = 10.0
    sandbox_memory_mb: Annotated[
        int, Meta(ge=16, description="Memory one call of the `python` tool may use, in MiB.")
    ] = 512
    sandbox_unsafe_no_isolation: Annotated[
        bool,
        Meta(
            description="UNSAFE: run the python tool's code with the limits above but no boundary (it can "
            "read and write whatever the run's user can, reach the network, signal its processes). Only for "
            "trusted code on a machine without user namespaces; never for a policy's code.",
        ),
    ] = False
    external: ExternalAgentConfig = msgspec.field(default_factory=ExternalAgentConfig)
