"""vLLM's shared-memory readers spin as ``SLIPSTREAM_VLLM_SPIN_S`` says: the patched default reaches every
reader built after the plug-in ran, and an unset variable (the launcher's default) leaves vLLM's own."""

from __future__ import annotations

import pytest

from slipstream.rollouter.config import RolloutConfig
from slipstream.rollouter.vllm_idle import SPIN_ENV, apply_spin_setting

shm_broadcast = pytest.importorskip("vllm.distributed.device_communicators.shm_broadcast")


def reader(tmp_path, name: str):
    import zmq

    condition = shm_broadcast.SpinCondition(
        is_reader=True, context=zmq.Context.instance(), notify_address=f"ipc://{tmp_path}/{name}"
    )
    condition.local_notify_socket.close(linger=0)
    return condition


def test_the_launcher_leaves_vllms_own_spin():
    """Opt-in only: without spinning, a missed wake-up stalls a paused vLLM for 5 s (vllm_idle.py)."""
    from slipstream.serverkinds import vllm as vllm_kind

    assert SPIN_ENV not in vllm_kind.vllm_env(RolloutConfig(backend="vllm"))


def test_readers_spin_as_the_variable_says(monkeypatch, tmp_path):
    condition = shm_broadcast.SpinCondition
    monkeypatch.setattr(condition, "__init__", condition.__init__)  # all three restored after the test
    monkeypatch.setattr(condition, "_slipstream_spin_s", None, raising=False)
    monkeypatch.setattr(condition, "_slipstream_original_init", condition.__init__, raising=False)
    monkeypatch.delenv(SPIN_ENV, raising=False)
    apply_spin_setting()
    assert reader(tmp_path, "a").busy_loop_s == 1  # vLLM's own: a second of busy-waiting
    monkeypatch.setenv(SPIN_ENV, "0")
    apply_spin_setting()
    apply_spin_setting()  # twice (vLLM may load plug-ins twice in a process): still one wrapper
    assert reader(tmp_path, "b").busy_loop_s == 0.0
