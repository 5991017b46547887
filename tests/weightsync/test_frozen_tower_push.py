"""A trainer with trainer.freeze_vision_tower pushes whole versions: the FSDP engine on the tiny random Qwen2-VL,
its tower frozen, pushes each step through the WeightPublisher to a serving process whose receiver requires
every weight it serves (as the embedded server's and vLLM's do), and the server takes each version: it then
serves exactly what the trainer holds, the language model moved and the tower still the checkpoint's."""

from __future__ import annotations

import functools

import pytest
import torch
from tensordict import TensorDict
from wsync_helpers import TargetServers, digest, served, status
from wsync_target_server import serve_checkpoint

from slipstream.serverkinds import server_kind
from slipstream.weightsync.config import WeightSyncConfig
from slipstream.weightsync.publisher import WeightPublisher


@pytest.fixture
def vlm(tmp_path):
    from slipstream.utils.tiny_vlm import make_tiny_qwen2_vl

    return make_tiny_qwen2_vl(tmp_path / "qwen2-vl")


@pytest.fixture
def frozen_engine(vlm):
    """The FSDP engine (one CPU rank) on ``vlm`` with its vision tower frozen; the process group is torn down
    afterwards."""
    import torch.distributed as dist

    from slipstream.trainer.engine.fsdp import FSDPEngine
    from tests.trainer.conftest import trainer_settings

    torch.set_num_threads(1)
    engine = FSDPEngine(
        trainer_settings(vlm, "trainer.micro_batch_tokens=4096", "trainer.freeze_vision_tower=true")
    )
    engine.initialize()
    yield engine
    if dist.is_initialized():
        dist.destroy_process_group()


def text_batch() -> TensorDict:
    """Two packed text samples (a prompt of 3 tokens, a response of 4 and 2); enough for a step of the
    language model (the frozen tower takes no part either way)."""
    ids = [11, 12, 13, 40, 41, 42, 43, 21, 22, 23, 50, 51]
    return TensorDict(
        {
            "input_ids": torch.tensor(ids),
            "position_ids": torch.tensor(list(range(7)) + list(range(5))),
            "loss_mask": torch.tensor([0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 1, 1]),
            "cu_seqlens": torch.tensor([0, 7, 12], dtype=torch.int32),
            "prompt_lens": torch.tensor([3, 3]),
        },
        batch_size=[],
    )


def likelihood_loss(outputs, mb):
    return -(outputs["logprobs"] * mb["loss_mask"].float()).sum() / 6.0, {}


def test_a_frozen_tower_trainer_pushes_whole_versions_a_strict_receiver_applies(vlm, frozen_engine):
    from safetensors.torch import load_file

    stored = load_file(str(vlm / "model.safetensors"))
    tower = {n: t for n, t in stored.items() if n.startswith("visual.")}
    servers = TargetServers(functools.partial(serve_checkpoint, str(vlm)))
    try:
        url = servers.start()
        cfg = WeightSyncConfig(backend="torch_dist", bucket_mb=1, timeout_s=30, device="cpu", keep_last=False)
        pub = WeightPublisher(cfg, [url], server_kind("embedded"))
        try:
            for version in (1, 2):
                frozen_engine.forward_backward_batch(text_batch(), likelihood_loss)
                frozen_engine.optimizer_step()
                pushed = list(frozen_engine.get_per_tensor_param())
                report = pub.publish(version, iter(pushed))
                assert report.ok == [url], report.failed
                assert served(url) == {"version": version, "digest": digest(pushed)}
            now = dict(pushed)
            assert digest({n: now[n] for n in tower}) == digest(tower)
            assert not torch.equal(now["lm_head.weight"], stored["lm_head.weight"])
            assert status(url)["failed_versions"] == 0
        finally:
            pub.close()
    finally:
        servers.stop()
