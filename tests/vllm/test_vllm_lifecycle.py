"""Launching vLLM: the command a config gives, a server that never gets healthy, a server killed mid-run."""

from __future__ import annotations

import json
import os
import signal

import pytest

from slipstream.agents.protocol import SamplingParams
from slipstream.rollouter.launch import ServerLaunchError, launch_server
from slipstream.serverkinds import server_kind
from slipstream.serverkinds.vllm import VLLMClient
from tests.vllm.conftest import run, vllm_config


def test_command_runs_the_module_in_dev_mode_with_our_engine(vllm_server):
    cmd = vllm_server.process.command
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]  # the CPU build has no `vllm` script
    assert json.loads(cmd[cmd.index("--weight-transfer-config") + 1]) == {"backend": "slipstream"}
    assert "--enable-scale-out" in cmd and "--enforce-eager" in cmd
    assert cmd[cmd.index("--logprobs-mode") + 1] == "processed_logprobs"


def test_user_flags_win_over_ours(tmp_path):
    cfg = vllm_config(server_args=["--weight-transfer-config", '{"backend": "nccl"}'])
    cmd = server_kind("vllm").argv(str(tmp_path), "127.0.0.1", 8000, cfg)
    assert "--weight-transfer-config" not in cmd  # launch_server appends the user's


def test_a_server_that_cannot_start_fails_naming_its_log(tmp_path):
    (tmp_path / "config.json").write_text("{}")  # not a model vLLM can load
    log = tmp_path / "bad-vllm.log"
    server = launch_server(server_kind("vllm"), tmp_path, cfg=vllm_config(), log_path=log)
    with pytest.raises(ServerLaunchError, match="exited with code") as err:
        server.wait_healthy(timeout_s=600)
    assert str(log) in str(err.value)
    assert not server.is_alive()


def test_a_server_killed_mid_push_fails_that_version_and_takes_the_next_after_restart(
    vllm_server, vllm_model
):
    """A crash (the API server and its engine at once) while a version is on the wire: the push reports that
    server failed, in bounded time, instead of hanging; the dead server is seen dead; restarted, it serves
    and the next version reaches it."""
    import torch
    from transformers import AutoModelForCausalLM

    from slipstream.weightsync.config import WeightSyncConfig
    from slipstream.weightsync.publisher import WeightPublisher

    model = AutoModelForCausalLM.from_pretrained(vllm_model, dtype=torch.float32)
    weights = [(n, p.detach().clone()) for n, p in model.named_parameters()]
    cfg = WeightSyncConfig(backend="torch_dist", bucket_mb=1, timeout_s=60, device="cpu", keep_last=False)

    async def go(url):
        c = VLLMClient(url, api="generate", timeout_s=120)
        try:
            healthy = await c.health()
            out = (
                await c.generate([1, 2, 3], SamplingParams(max_new_tokens=4, ignore_eos=True))
                if healthy
                else None
            )
            return healthy, out
        finally:
            await c.aclose()

    def killed_part_way():
        for i, item in enumerate(weights):
            if i == len(weights) // 2:  # the first buckets are on the server: crash it
                os.killpg(vllm_server.process.pid, signal.SIGKILL)
                vllm_server.process.popen.wait(timeout=60)
            yield item

    old_url = vllm_server.url
    pub = WeightPublisher(cfg, [old_url], server_kind("vllm"))
    try:
        report = pub.publish(1, killed_part_way())
    finally:
        pub.close()
    assert report.ok == [] and old_url in report.failed
    assert run(go(old_url))[0] is False
    vllm_server.restart()
    healthy, out = run(go(vllm_server.url))
    assert healthy and len(out.output_ids) == 4
    pub = WeightPublisher(cfg, [vllm_server.url], server_kind("vllm"))
    try:
        assert pub.publish(2, iter(weights)).ok == [vllm_server.url]
    finally:
        pub.close()
    assert run(go(vllm_server.url))[1].versions == [2] * 4
