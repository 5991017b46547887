"""The ``external`` agent loop: users' own agent harness, one run per episode, through the OpenAI gateway.

A harness is a command or a Python callable that talks to an OpenAI endpoint. Per episode the loop opens a
gateway session (:mod:`slipstream.agents.gateway`) and runs the harness with

* ``OPENAI_BASE_URL`` = the session's URL and ``OPENAI_API_KEY`` = its key (the official ``openai`` client
  reads both), ``SLIPSTREAM_TASK_FILE`` = a JSON file with the task (also on the command's stdin),
  ``SLIPSTREAM_REWARD_FILE`` = where a command may write its reward, ``SLIPSTREAM_EPISODE`` = the uid;
* for a callable: ``function(task, base_url, api_key)``, sync (run in a thread) or async, returning the
  reward (a number or ``{"reward": x, "components": {...}}``).

The task is ``{"uid", "messages", "data_source", "ground_truth", "extra_info"}`` from the prompt row. The
trajectory is what the gateway recorded: its last segment, with every earlier segment (a harness that
compacted or edited its history started a new one; see gateway/session.py) in ``earlier_segments``, each
trained as its own sequence in the episode's group with the episode's reward, from
``agent.external.reward``: ``harness`` (returned or written), ``exit_status`` (0 → 1.0, 1 → 0.0) or
``function`` (the rollouter's reward function on the final assistant message).

Bad input costs one episode, never the run: a harness that crashes, is killed, hangs past
``timeout_s`` (its whole process group is killed), reports no or a malformed reward, or raises, ends its
episode as *failed*: reward ``failure_reward``, every token ``loss_mask`` 0, and the reason in the
trajectory's ``outcome.reward_error`` (counted by the rollouter as a reward error) and in the log.
Malformed requests get a 400 from the gateway; what the harness does with it is up to it.
``max_concurrent`` bounds harnesses running at once.

Worked example (config)::

    agent:
      name: external
      external: {command: ["{python}", "-m", "slipstream.agents.examples.calculator_harness"], timeout_s: 120}
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

from slipstream.agents.base import AgentLoop, AgentLoopOutput
from slipstream.agents.chat import ChatRenderer
from slipstream.agents.data import Sample
from slipstream.agents.gateway import Gateway, Session
from slipstream.agents.protocol import SamplingParams
from slipstream.utils.logging import get_logger

log = get_logger(__name__)

# Characters of a failed command's stderr kept in the failure reason.
REASON_CHARS = 600
# Environment variables a harness never inherits (the servers' control token).
PRIVATE_ENV = ("SLIPSTREAM_SERVER_TOKEN",)


class EpisodeFailed(Exception):
    """The harness did not complete its episode; the message says why."""


class ExternalAgentLoop(AgentLoop):
    """Runs a harness per episode behind a gateway started on first use (see the module docstring)."""

    name = "external"

    def __init__(self, cfg, client, tokenizer) -> None:
        super().__init__(cfg, client, tokenizer)
        ext = cfg.external
        if bool(ext.command) == bool(ext.callable):
            raise ValueError(
                "agent.external: set exactly one of `command` (argv) and `callable` (module:function)"
            )
        if ext.reward == "exit_status" and ext.callable:
            raise ValueError("agent.external.reward: exit_status needs a `command`, not a callable")
        self.ext = ext
        self._function = _load_callable(ext.callable) if ext.callable else None
        self.renderer = ChatRenderer(tokenizer)
        self.gateway: Gateway | None = None
        self._starting = asyncio.Lock()
        self._slots = asyncio.Semaphore(ext.max_concurrent) if ext.max_concurrent else None
        self.failed_episodes = 0
        # Why the servers take no images (the gateway answers image parts with it); None where they do. The
        # rollouter sets it from the rollout config (agents.multimodal.images_refused).
        self.image_refusal: str | None = None

    def metrics(self) -> dict[str, float]:
        """Totals since the start: episodes failed, and the gateway's sessions, requests, errors (answered
        with an error status), divergences (new segments) and resumed aborts."""
        out = {"failed_episodes": float(self.failed_episodes)}
        if self.gateway is not None:
            out.update({f"gateway_{k}": float(v) for k, v in self.gateway.counters.items()})
        return out

    def prompt_ids(self, sample: Sample) -> list[int]:
        return self.renderer.prompt_ids(sample.messages)

    async def gateway_for(self, sampling: SamplingParams) -> Gateway:
        async with self._starting:
            if self.gateway is None:
                gw = Gateway(self.client, self.tokenizer, sampling=sampling,
                             max_total_tokens=self.cfg.max_total_tokens, max_turns=self.cfg.max_turns,
                             host=self.ext.host, port=self.ext.port,
                             image_refusal=self.image_refusal)  # fmt: skip
                await gw.start()
                self.gateway = gw
                log.info("agent gateway listening on %s", gw.url)
        return self.gateway

    async def aclose(self) -> None:
        if self.gateway is not None:
            await self.gateway.stop()
            self.gateway = None

    async def run(self, sample: Sample, sampling_params: SamplingParams, *, uid: str = "") -> AgentLoopOutput:
        gateway = await self.gateway_for(sampling_params)
        session = gateway.open_session(uid or os.urandom(6).hex())
        task = {
            "uid": session.uid,
            "messages": sample.messages,
            "data_source": sample.data_source,
            "ground_truth": sample.ground_truth,
            "extra_info": sample.extra_info,
        }
        reward: dict[str, Any] | None = None
        error = ""
        try:
            if self._slots is not None:
                async with self._slots:
                    reward = await self._episode(session, task)
            else:
                reward = await self._episode(session, task)
        except EpisodeFailed as err:
            error = str(err)
        except asyncio.CancelledError:
            await gateway.close_session(session)
            raise
        except Exception as err:  # noqa: BLE001 - a harness's own failure is one episode's, not the run's
            error = f"{type(err).__name__}: {err}"
        await gateway.close_session(session)
        return self._output(sample, session, reward, error)

    # ------------------------------------------------------------------ one harness run
    async def _episode(self, session: Session, task: dict[str, Any]) -> dict[str, Any] | None:
        if self._function is not None:
            value = await self._call(session, task)
            return (
                None if self.ext.reward == "function" else _reward_value(value, "the callable's return value")
            )
        return await self._command(session, task)

    async def _call(self, session: Session, task: dict[str, Any]) -> Any:
        fn = self._function
        try:
            if inspect.iscoroutinefunction(fn):
                coro = fn(task, session.base_url, session.api_key)
            else:  # a thread cannot be killed: on timeout the episode fails and the thread is left to end
                coro = asyncio.to_thread(fn, task, session.base_url, session.api_key)
            return await asyncio.wait_for(coro, self.ext.timeout_s)
        except TimeoutError as err:
            raise EpisodeFailed(f"the harness did not finish within {self.ext.timeout_s:g} s") from err
        except Exception as err:
            raise EpisodeFailed(f"the harness raised {type(err).__name__}: {err}") from err

    async def _command(self, session: Session, task: dict[str, Any]) -> dict[str, Any] | None:
        workdir = Path(tempfile.mkdtemp(prefix="slipstream-episode-"))
        try:
            task_file, reward_file = workdir / "task.json", workdir / "reward"
            task_file.write_text(json.dumps(task, default=str))
            code = await self._spawn(session, workdir, task_file, reward_file)
            return self._command_reward(code, reward_file, workdir / "stderr")
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

    async def _spawn(self, session: Session, workdir: Path, task_file: Path, reward_file: Path) -> int:
        env = {k: v for k, v in os.environ.items() if k not in PRIVATE_ENV}
        env.update(self.ext.env)
        env.update(OPENAI_BASE_URL=session.base_url, OPENAI_API_KEY=session.api_key,
                   SLIPSTREAM_TASK_FILE=str(task_file), SLIPSTREAM_REWARD_FILE=str(reward_file),
                   SLIPSTREAM_EPISODE=session.uid)  # fmt: skip
        argv = [sys.executable if a == "{python}" else a for a in self.ext.command]
        with open(task_file, "rb") as stdin, open(workdir / "stdout", "wb") as out, \
                open(workdir / "stderr", "wb") as err:  # fmt: skip
            try:
                proc = await asyncio.create_subprocess_exec(
                    *argv, stdin=stdin, stdout=out, stderr=err, env=env,
                    cwd=self.ext.cwd or None, start_new_session=True,
                )  # fmt: skip
            except OSError as e:
                raise EpisodeFailed(f"cannot start the harness {argv[0]!r}: {e}") from e
            try:
                return await asyncio.wait_for(proc.wait(), self.ext.timeout_s)
            except TimeoutError as e:
                raise EpisodeFailed(f"the harness did not finish within {self.ext.timeout_s:g} s") from e
            finally:
                if proc.returncode is None:  # timed out or cancelled: end the harness and its children
                    _kill_group(proc.pid)
                    await proc.wait()

    def _command_reward(self, code: int, reward_file: Path, stderr: Path) -> dict[str, Any] | None:
        if code < 0:
            raise EpisodeFailed(f"the harness was killed by {_signal_name(-code)}{_tail(stderr)}")
        if self.ext.reward == "exit_status":
            if code in (0, 1):
                return {"reward": 1.0 - code}
            raise EpisodeFailed(f"the harness exited with status {code}{_tail(stderr)}")
        if code != 0:
            raise EpisodeFailed(f"the harness exited with status {code}{_tail(stderr)}")
        if self.ext.reward == "function":
            return None
        if not reward_file.exists():
            raise EpisodeFailed("the harness wrote no reward to $SLIPSTREAM_REWARD_FILE")
        text = reward_file.read_text(errors="replace").strip()
        try:
            value = json.loads(text)
        except ValueError as err:
            raise EpisodeFailed(f"the reward file holds {text[:80]!r}, not a number or JSON") from err
        return _reward_value(value, "the reward file")

    # ------------------------------------------------------------------ the trajectory
    def _output(self, sample: Sample, session: Session, reward: dict | None, error: str) -> AgentLoopOutput:
        out = session.current
        if out is None:  # the harness made no request: the prompt alone, and a token for a non-empty response
            out = AgentLoopOutput(prompt_ids=self.prompt_ids(sample))
            end = self.renderer.end_of_turn_id
            out.response_ids, out.loss_mask, out.logprobs = [end if end is not None else 0], [0], [0.0]
            out.versions = [self.gateway.latest_version if self.gateway else 0]
        out.earlier_segments = [seg for seg in session.segments[:-1] if seg.response_ids]
        out.response_text = session.final_text
        out.num_resumes = session.resumes
        out.finish_reason = "length" if session.aborted else out.finish_reason
        metrics = session.metrics()
        metrics["episode_failed"] = float(bool(error))
        out.metrics = metrics
        if error:
            self.failed_episodes += 1
            log.warning("episode %s failed: %s", session.uid, error)
            for seg in (out, *out.earlier_segments):
                seg.loss_mask = [0] * len(seg.response_ids)
            out.reward, out.reward_error = self.ext.failure_reward, error
        elif reward is not None:
            out.reward = float(reward["reward"])
            out.reward_components = reward.get("components", {})
        return out


def _reward_value(value: Any, where: str) -> dict[str, Any]:
    """``{"reward": float, "components": {...}}`` from a number or a mapping; EpisodeFailed otherwise."""
    if isinstance(value, dict):
        components = value.get("components", {})
        value = value.get("reward")
        if not (
            isinstance(components, dict) and all(isinstance(v, int | float) for v in components.values())
        ):
            raise EpisodeFailed(f"{where}: components must map names to numbers")
    else:
        components = {}
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        raise EpisodeFailed(f'{where} is {value!r}, not a number (or {{"reward": number}})')
    return {"reward": float(value), "components": {k: float(v) for k, v in components.items()}}


def _load_callable(path: str):
    module, _, name = path.partition(":")
    if not module or not name:
        raise ValueError(f"agent.external.callable: expected `package.module:function`, got {path!r}")
    fn = getattr(importlib.import_module(module), name, None)
    if not callable(fn):
        raise ValueError(f"agent.external.callable: {path!r} is not a function")
    return fn


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)  # the harness was started in its own session: its group is its own
    except ProcessLookupError:
        pass


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _tail(stderr: Path) -> str:
    try:
        text = stderr.read_text(errors="replace").strip()
    except OSError:
        return ""
    return f": ...{text[-REASON_CHARS:]}" if len(text) > REASON_CHARS else (f": {text}" if text else "")
