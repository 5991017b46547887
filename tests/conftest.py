"""Shared fixtures: a tiny random model (built once per session) and the `gpu` marker's skip rule."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except Exception:
        has_gpu = False
    if has_gpu:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory):
    """A 2-layer random Llama with the byte-level test tokenizer, as an HF checkpoint directory."""
    from slipstream.utils.tiny_models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-model"))


class _TinyMoEModels(dict):
    """family -> path of a tiny random MoE checkpoint, written on first use (utils/tiny_models.py)."""

    def __init__(self, root):
        super().__init__()
        self.root = root

    def __missing__(self, family):
        from slipstream.utils.tiny_models import make_tiny_moe_model

        self[family] = make_tiny_moe_model(self.root / family, family)
        return self[family]


@pytest.fixture(scope="session")
def tiny_moe_models(tmp_path_factory):
    """``tiny_moe_models["qwen3_moe"]``: a 2-layer, 4-expert, top-2 random MoE per family in MOE_FAMILIES."""
    return _TinyMoEModels(tmp_path_factory.mktemp("tiny-moe"))
