"""Config of the data, the agent loops, their tools and the reward functions."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from slipstream.config_base import ConfigStruct


class DataConfig(ConfigStruct):
    # verl-format parquet or jsonl files (`prompt` as chat messages, `data_source`,
    # `reward_model.ground_truth`, `extra_info`).
    train_files: list[str] = []
    val_files: list[str] = []
    # Prompts longer than this many tokens (after the chat template) are skipped with a warning.
    max_prompt_tokens: Annotated[int, msgspec.Meta(ge=1)] = 1024
    shuffle: bool = True
    # Passes over the training prompts (the run also stops at run.total_steps).
    epochs: Annotated[int, msgspec.Meta(ge=1)] = 1


class RewardServiceConfig(ConfigStruct):
    """A served judge or reward model, used by data sources mapped to `service` in reward.sources
    (agents/rewards/service.py states both wire protocols). The servers are yours: the run starts none and
    pushes no weights to them."""

    # Base URLs of the servers (`http://host:port`); requests go round-robin, a retry to the next one.
    urls: list[str] = []
    # `judge`: OpenAI-compatible POST /v1/chat/completions, one sample per request, the score read from the
    # reply text. `score`: POST /score with a batch of samples, {"scores": [...]} back.
    protocol: Literal["judge", "score"] = "judge"
    # Model name sent in each request (servers that serve one model ignore it).
    model: str = "judge"
    # Environment variable holding a bearer token for the servers ("": none).
    api_key_env: str = ""
    # Requests in flight at once, over all servers.
    max_concurrent: Annotated[int, msgspec.Meta(ge=1)] = 8
    # Samples per request of the `score` protocol (the judge protocol sends one).
    batch_size: Annotated[int, msgspec.Meta(ge=1)] = 16
    # Seconds one request may take; then it is retried. reward.timeout_s bounds a sample's whole call
    # (waiting for a slot, every retry), so it must be at least this.
    timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 10.0
    # Retries of a request that timed out, could not connect, got 408/429/5xx or a malformed reply; the
    # n-th waits backoff_s * 2**(n-1) seconds (at most backoff_max_s). A sample still failing scores
    # reward.service.failure_score with its reason recorded as a reward error.
    retries: Annotated[int, msgspec.Meta(ge=0)] = 3
    backoff_s: Annotated[float, msgspec.Meta(ge=0)] = 0.5
    backoff_max_s: Annotated[float, msgspec.Meta(ge=0)] = 8.0
    failure_score: float = 0.0
    # Judge prompt, formatted with {question} (extra_info's `question` or `prompt`), {response} and
    # {ground_truth}; the judge's reply must end with `Score: <number>` in [0, judge_max_score].
    judge_template: str = (
        "Grade the response to the question against the reference answer.\n\nQuestion:\n{question}\n\n"
        "Reference answer:\n{ground_truth}\n\nResponse:\n{response}\n\nReply with one line "
        "`Score: <number>`, from 0 (wrong) to 1 (fully correct)."
    )
    judge_max_score: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    judge_max_tokens: Annotated[int, msgspec.Meta(ge=1)] = 512
    judge_temperature: Annotated[float, msgspec.Meta(ge=0)] = 0.0


class RewardConfig(ConfigStruct):
    # Worker processes scoring responses off the event loop.
    num_workers: Annotated[int, msgspec.Meta(ge=1)] = 2
    # A reward call taking longer than this scores 0 and counts as a reward error.
    timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 10.0
    # data_source -> reward function (a name registered in agents/rewards, `package.module:function`
    # for your own, or `service` for the served judge / reward model below). Sources not listed here use
    # the function registered under their own name or alias.
    sources: dict[str, str] = {}
    # Overlong reward shaping (DAPO): a response longer than rollout.sampling.max_new_tokens minus
    # `overlong_buffer_len` tokens gets a penalty growing linearly from 0 to `overlong_penalty_factor` at
    # max_new_tokens, added to its reward (agents/rewards/overlong.py). 0 turns shaping off.
    overlong_buffer_len: Annotated[int, msgspec.Meta(ge=0)] = 0
    overlong_penalty_factor: Annotated[float, msgspec.Meta(ge=0)] = 1.0
    # The judge / reward-model service that scores data sources mapped to `service` in `sources`.
    service: RewardServiceConfig = msgspec.field(default_factory=RewardServiceConfig)


class ExternalAgentConfig(ConfigStruct):
    """The `external` loop: users' own agent harness, talking to the policy through the OpenAI gateway."""

    # The harness: a command (argv, no shell; `{python}` is this interpreter) run once per episode, or
    # `package.module:function` called as function(task, base_url, api_key). Exactly one of the two.
    command: list[str] = []
    callable: str = ""
    # Where the reward comes from: `harness` (the callable's return value, or what the command writes to
    # $SLIPSTREAM_REWARD_FILE: a number or {"reward": x, "components": {...}}), `exit_status` (0 scores 1.0,
    # 1 scores 0.0, anything else fails the episode) or `function` (the data source's reward function
    # scores the final assistant message).
    reward: Literal["harness", "exit_status", "function"] = "harness"
    # Seconds an episode may take; then its process group is killed and the episode fails.
    timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 600.0
    # Harnesses running at once (0: as many as episodes in flight).
    max_concurrent: Annotated[int, msgspec.Meta(ge=0)] = 0
    # Reward of a failed episode (crashed, hung, no reward); its tokens are not trained (loss_mask 0).
    failure_reward: float = 0.0
    # Address of the gateway; loopback unless you mean it (session keys then are the only protection).
    host: str = "127.0.0.1"
    port: Annotated[int, msgspec.Meta(ge=0)] = 0
    # Extra environment variables of the harness, and its working directory ("" inherits).
    env: dict[str, str] = {}
    cwd: str = ""


class AgentConfig(ConfigStruct):
    # Agent loop (registry in agents/): single_turn, tool, external, or `package.module:Class` (an AgentLoop).
    name: str = "single_turn"
    # Tools offered to the `tool` loop (registry in agents/tools): python, calculator, or
    # `package.module:Class` (a Tool subclass).
    tools: list[str] = []
    max_turns: Annotated[int, msgspec.Meta(ge=1)] = 4
    # Prompt + every generated and tool token of one episode.
    max_total_tokens: Annotated[int, msgspec.Meta(ge=1)] = 4096
    # Tool output beyond this many characters is truncated.
    max_tool_output_chars: Annotated[int, msgspec.Meta(ge=1)] = 2048
    # Python sandbox limits. The `python` tool runs each call behind a kernel boundary (new user, pid,
    # mount, network, IPC and UTS namespaces; uid 65534 without capabilities; a read-only file system
    # but /tmp; seccomp; no environment; agents/tools/sandbox.py). It needs user namespaces and
    # libseccomp; where they are missing, building the tool fails with what to enable.
    sandbox_cpu_s: Annotated[float, msgspec.Meta(gt=0)] = 5.0
    sandbox_wall_s: Annotated[float, msgspec.Meta(gt=0)] = 10.0
    sandbox_memory_mb: Annotated[int, msgspec.Meta(ge=16)] = 512
    # UNSAFE: run the python tool's code with the limits above but no boundary (it can read and write
    # whatever the run's user can, reach the network, signal its processes). Only for trusted code on
    # a machine without user namespaces; never for a policy's code.
    sandbox_unsafe_no_isolation: bool = False
    external: ExternalAgentConfig = msgspec.field(default_factory=ExternalAgentConfig)
