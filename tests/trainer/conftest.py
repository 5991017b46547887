"""Trainer test helpers: trainer settings pointing at the tiny model, and a guard that tears down the 1-rank
process group an in-process engine starts, so no state leaks into other tests."""

from __future__ import annotations

import pytest
import torch


def trainer_settings(model_path, *overrides: str):
    """``TrainerSettings`` from a root config of the tiny model plus dotted root-key ``overrides``."""
    from slipstream.trainer.settings import from_root

    return from_root(trainer_config(model_path, *overrides))


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
