"""LoRA versions to servers that cannot rebuild adapters (SGLang; vLLM's own ``nccl`` engine): the publisher
says so (``lora_push``), and the trainer pushes whole merged weights, ``W + (alpha/r) B A`` as
``merge_lora`` computes them, through the normal bucketed transport. Checked bit for bit against the fake
SGLang server of test_adapters.py, which keeps every tensor it receives."""

from __future__ import annotations

import logging

import httpx
import pytest
import torch
from test_adapters import fake_sglang, wait_up
from test_send_less import SCALE, adapters, merged
from wsync_helpers import digest, mixed_tensors, spawn

from slipstream.serverkinds import server_kind
from slipstream.utils.net import free_port
from slipstream.weightsync.config import WeightSyncConfig
from slipstream.weightsync.publisher import WeightPublisher, publish_lora


@pytest.fixture
def sglang_url():
    port = free_port()
    proc = spawn(fake_sglang, port)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_up(url)
        yield url
    finally:
        proc.kill()
        proc.join(timeout=10)


def received(url: str) -> dict:
    return httpx.get(f"{url}/received", timeout=10).json()


def config() -> WeightSyncConfig:
    return WeightSyncConfig(bucket_mb=1, timeout_s=10, device="cpu")


def test_lora_versions_to_sglang_go_as_merged_whole_weights_equal_to_merge_lora(sglang_url, caplog):
    base = mixed_tensors(1)
    pub = WeightPublisher(config(), [sglang_url], server_kind("sglang"))
    try:
        with caplog.at_level(logging.INFO, logger="slipstream.weightsync.publisher"):
            for v in (1, 2):
                want = merged(base, adapters(v))  # merge_lora of each adapted weight, the rest as it is
                report = publish_lora(
                    pub,
                    v,
                    lambda: pytest.fail("adapters gathered for a server that cannot take them"),
                    lambda: pytest.fail("base weights gathered for a server that cannot take them"),
                    SCALE,
                    merged=lambda want=want: iter(want.items()),
                )
                assert report is not None and report.ok == [sglang_url] and report.sent == "merged"
                assert received(sglang_url) == digest(want)
        notes = [r.getMessage() for r in caplog.records if "LoRA versions go as" in r.getMessage()]
        assert len(notes) == 1 and "merged whole weights" in notes[0] and "unpickles" in notes[0]
    finally:
        pub.close()


def test_a_merged_push_needs_the_merged_weights_on_every_rank(sglang_url):
    pub = WeightPublisher(config(), [sglang_url], server_kind("sglang"))
    try:
        assert pub.lora_push() == "merged"
        with pytest.raises(ValueError, match="cannot rebuild LoRA adapter versions, and no merged weights"):
            publish_lora(pub, 1, lambda: iter(adapters(1)), lambda: iter(mixed_tensors(1)), SCALE)
        # a rank other than 0 follows rank 0's answer (code 2: merged) and iterates the merged weights only
        seen = []
        out = publish_lora(
            None,
            1,
            lambda: pytest.fail("adapters gathered"),
            lambda: pytest.fail("base gathered"),
            SCALE,
            agree=lambda code: 2,
            merged=lambda: (seen.append(n) or (n, t) for n, t in mixed_tensors(1)),
        )
        assert out is None and len(seen) == len(mixed_tensors(1))
    finally:
        pub.close()


@pytest.fixture
def one_rank():
    import torch.distributed as dist

    torch.set_num_threads(1)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_a_lora_trainer_pushes_sglang_the_merged_model(sglang_url, tiny_model_path, one_rank, tmp_path):
    """The FSDP2 LoRA engine, after training steps, pushed by the pipeline's ``TrainerRank.publish``: the
    server receives every HF weight, the adapted ones equal to ``merge_lora`` of the base weight and the
    engine's adapters, and never an adapter tensor."""
    from transformers import AutoModelForCausalLM

    from slipstream.pipeline.actors import TrainerRank
    from slipstream.trainer.engine.fsdp import FSDPEngine
    from slipstream.trainer.synthetic import make_packed_batch
    from slipstream.trainer.trainer import Trainer
    from slipstream.utils.logging import get_logger
    from slipstream.weightsync.delta import lora_scale, merge_adapters
    from tests.trainer.conftest import trainer_settings
    from tests.trainer.fake_queue import FakeQueue

    settings = trainer_settings(
        tiny_model_path, "trainer.lora.rank=4", "trainer.lora.alpha=8", "rollout.backend=sglang"
    )
    engine = FSDPEngine(settings)
    engine.initialize()
    batch = make_packed_batch([3, 5, 2], [4, 1, 7], vocab_size=200, seed=0, group_size=3)
    for _ in range(2):  # B starts at zero: train so that the merged weights differ from the base
        nll = lambda out, mb: (-(out["logprobs"] * mb["loss_mask"].float()).sum() / 10.0, {})  # noqa: E731
        engine.forward_backward_batch(batch, nll)
        engine.optimizer_step()
    handlers = list(get_logger("slipstream").handlers)
    rank = TrainerRank(settings, 0, 1, str(tmp_path), threads=0)
    for handler in set(get_logger("slipstream").handlers) - set(handlers):  # its run-directory log
        get_logger("slipstream").removeHandler(handler)
    rank.engine, rank.trainer = engine, Trainer(settings, engine, FakeQueue(), rank=0, world_size=1)
    rank.publisher = WeightPublisher(config(), [sglang_url], server_kind(settings.server_kind))
    try:
        report = rank.publish(1).publish
    finally:
        rank.publisher.close()
    assert report is not None and report.ok == [sglang_url] and report.sent == "merged"
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    base = {n: p.detach().clone() for n, p in hf.named_parameters()}
    adapted = merge_adapters(base, dict(engine.get_adapter_params()), scale=lora_scale(8, 4))
    assert any(not torch.equal(adapted[n], base[n]) for n in adapted), "training moved no adapted weight"
    assert received(sglang_url) == digest({**base, **adapted})
