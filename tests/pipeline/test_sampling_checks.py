"""Top-k / top-p runs are checked before launch: the servers must return logprobs of the renormalised
distribution they sample from, and the trainer engine must rebuild it (``trainer/logprobs.py``)."""

from __future__ import annotations

import pytest

from slipstream.config import ConfigError, load_config, trainer_settings
from slipstream.pipeline.modes import check_config, prepare_config
from slipstream.trainer.logprobs import Truncation, sampling_truncation


def checked(*overrides: str) -> None:
    cfg, _ = prepare_config(load_config(None, list(overrides)))
    check_config(cfg, environment=False)


@pytest.mark.parametrize("backend", ["embedded", "vllm"])
def test_servers_that_return_processed_logprobs_take_the_filters(backend):
    checked(f"rollout.backend={backend}", "rollout.sampling.top_p=0.8", "rollout.sampling.top_k=20")


SGLANG = ("rollout.backend=sglang", "cluster.gpus_per_server=1")


def test_sglang_is_refused_with_the_reason():
    with pytest.raises(ConfigError, match=r"rollout.sampling: top_k 20, top_p 0.8 .* SGLang returns the log"):
        checked(*SGLANG, "rollout.sampling.top_p=0.8", "rollout.sampling.top_k=20")
    checked(*SGLANG)  # filters off: nothing to replay
    checked(*SGLANG, "rollout.sampling.top_k=20", "rollout.sampling.temperature=0")  # greedy


def test_vllm_with_raw_logprobs_is_refused():
    with pytest.raises(ConfigError, match=r"--logprobs-mode to raw_logprobs"):
        checked(
            "rollout.backend=vllm",
            "rollout.sampling.top_k=20",
            "rollout.server_args=[--logprobs-mode=raw_logprobs]",
        )
    checked("rollout.backend=vllm", "rollout.server_args=[--logprobs-mode, raw_logprobs]")  # filters off


def test_megatron_is_refused():
    with pytest.raises(ConfigError, match=r"trainer.engine: .* megatron"):
        checked(
            "trainer.engine=megatron", "trainer.device=cuda", "cluster.gpus_per_trainer_rank=1",
            "rollout.sampling.top_p=0.9",
        )  # fmt: skip


def test_the_trainer_follows_rollout_sampling():
    s = trainer_settings(load_config(None, ["rollout.sampling.top_p=0.8", "rollout.sampling.top_k=20"]))
    assert sampling_truncation(s.sampling_temperature, s.sampling_top_k, s.sampling_top_p) == Truncation(
        20, 0.8
    )
    s = trainer_settings(load_config(None, []))
    assert sampling_truncation(s.sampling_temperature, s.sampling_top_k, s.sampling_top_p) is None
