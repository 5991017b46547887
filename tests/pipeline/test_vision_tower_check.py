"""trainer.freeze_vision_tower in a run: refused for a vision-language model with the reason (the servers apply
whole versions only), ignored for a text model."""

from __future__ import annotations

import pytest

from slipstream.config import ConfigError, load_config
from slipstream.pipeline.modes import _check_vision_tower


def test_a_frozen_tower_is_refused_for_a_vision_model_only(tmp_path, tiny_model_path):
    from slipstream.utils.tiny_vlm import make_tiny_qwen2_vl

    vlm = make_tiny_qwen2_vl(tmp_path / "vlm")
    with pytest.raises(ConfigError, match="trainer.freeze_vision_tower: a frozen tower is left out"):
        _check_vision_tower(load_config(overrides=[f"model.path={vlm}", "trainer.freeze_vision_tower=true"]))
    _check_vision_tower(load_config(overrides=[f"model.path={vlm}"]))
    _check_vision_tower(
        load_config(overrides=[f"model.path={tiny_model_path}", "trainer.freeze_vision_tower=true"])
    )
