"""``slipstream bench multimodal``'s byte count: a group of n samples of one image prompt carries its image
once (ratio 1/n of per-sample copies), and far fewer bytes than the image's pixel values."""

from __future__ import annotations

from slipstream.agents.datagen import make_rows
from slipstream.system.bench_multimodal import image_bytes
from slipstream.utils.tiny_vlm import make_tiny_qwen2_vl


def test_a_group_carries_its_image_once(tmp_path):
    model = make_tiny_qwen2_vl(tmp_path / "vlm")
    row = make_rows("shapes", 1, seed=0)[0]
    got = image_bytes(model, row, n=8)
    png = len(row["images"][0]["bytes"])
    assert got["image_bytes_per_group"] == png
    assert got["image_bytes_per_sample_naive"] == 8 * png
    assert got["image_ratio"] <= 1 / 8
    assert got["pixel_bytes_per_image"] == 64 * 1176 * 4 > 100 * png
