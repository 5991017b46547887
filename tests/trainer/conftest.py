"""Trainer test helpers: trainer settings pointing at the tiny model, a publisher that records what a trainer
pushes, and a guard that tears down the 1-rank process group an in-process engine starts, so no state leaks
into other tests."""

from __future__ import annotations

import pytest
import torch


def trainer_settings(model_path, *overrides: str):
    """``TrainerSettings`` from a root config of the tiny model plus dotted root-key ``overrides``."""
    from slipstream import config

    return config.trainer_settings(trainer_config(model_path, *overrides))


def trainer_config(model_path, *overrides: str):
    from slipstream.config import load_config

    return load_config(
        None,
        [
            f"model.path={model_path}",
            "trainer.device=cpu",
            "trainer.lr=1e-3",
            "trainer.micro_batch_tokens=64",
            "trainer.checkpoint_every=0",
            *overrides,
        ],
    )


@pytest.fixture
def single_process_group():
    """Yields; afterwards destroys whatever default process group the test created."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


class RecordingPublisher:
    """Rank 0's publisher as ``Trainer.push`` calls it, recording each push: ``(version, what travelled,
    {name: shape})``. ``lora_push`` is the answer a real publisher reads from its servers."""

    def __init__(self, lora_push: str = "adapters") -> None:
        self.pushes: list[tuple[int, str, dict[str, tuple[int, ...]]]] = []
        self.servers: dict[str, object] = {}
        self._lora_push = lora_push

    def _record(self, version: int, sent: str, named):
        from slipstream.weightsync.publisher import PublishReport

        self.pushes.append((version, sent, {name: tuple(t.shape) for name, t in named}))
        return PublishReport(version=version, sent=sent)

    def publish(self, version, named_tensors):
        return self._record(version, "full", named_tensors)

    def lora_push(self) -> str:
        return self._lora_push

    def publish_lora(self, version, adapters, base, lora_scale):
        return self._record(version, "lora" if base is not None else "adapters", [*adapters, *(base or ())])

    def publish_merged(self, version, named_tensors):
        return self._record(version, "merged", named_tensors)
