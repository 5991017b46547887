"""rollouter/vllm_vision.py: with it installed, a Qwen2-VL processor loads and expands images where
torchvision is missing, as vLLM's processes need; without it, the load fails (what the module is for)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from slipstream.utils.tiny_vlm import make_tiny_qwen2_vl

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torchvision") is not None,
    reason="torchvision is installed: nothing to stand in for",
)

SCRIPT = """
import io, json, sys
from PIL import Image
if sys.argv[2] == "install":
    from slipstream.rollouter.vllm_vision import install
    assert install()
from transformers import AutoProcessor
try:
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize  # vLLM's import
    processor = AutoProcessor.from_pretrained(sys.argv[1])
except Exception as err:
    print(json.dumps({"error": f"{type(err).__name__}: {err}"}))
    sys.exit(0)
text = processor.tokenizer.apply_chat_template(
    [{"role": "user", "content": "<image>How many?"}], add_generation_prompt=True, tokenize=False)
out = processor(text=[text], images=[Image.new("RGB", (100, 80), "red")])
try:
    processor(text=["<|vision_start|><|video_pad|><|vision_end|>"], videos=[[Image.new("RGB", (28, 28))] * 2])
    video = "accepted"
except Exception as err:
    video = str(err)
import numpy as np
print(json.dumps({"ids": np.asarray(out["input_ids"][0]).tolist(), "grid": np.asarray(out["image_grid_thw"][0]).tolist(),
                  "resize": smart_resize(80, 100, 28, 56 * 56, 224 * 224), "video": video}))
"""


def run(model, mode: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(model), mode],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_qwen2_vl_processor_loads_and_expands_images_once_installed(tmp_path):
    model = make_tiny_qwen2_vl(tmp_path / "vlm")
    assert run(model, "plain")["error"] == "ModuleNotFoundError: No module named 'torchvision'"
    got = run(model, "install")
    # 100 x 80 resizes to 112 x 84 (multiples of 28): a 6 x 8 patch grid, 12 tokens after the 2 x 2 merge.
    assert got["resize"] == [84, 112] and got["grid"] == [1, 6, 8]
    pad = json.loads((model / "tokenizer.json").read_text())
    pad_id = next(t["id"] for t in pad["added_tokens"] if t["content"] == "<|image_pad|>")
    assert got["ids"].count(pad_id) == 12
    assert "videos need torchvision" in got["video"]
