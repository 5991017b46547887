"""Multi-modal datasets: verl's `images` column read in its three layouts, bad images refused naming the
row, images kept encoded in the Sample, and the offline `shapes` task with its held-out split and reward."""

from __future__ import annotations

import io
import json
import random

import msgspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image as PILImage

from slipstream.agents.data import DatasetError, Sample, load_samples
from slipstream.agents.datagen import main as datagen_main
from slipstream.agents.datagen import make_rows, write_rows
from slipstream.agents.multimodal import Image, ImageLimits
from slipstream.agents.rewards import resolve
from slipstream.agents.shapes import render
from slipstream.config import ConfigError, load_config
from slipstream.pipeline.modes import check_data


def png(width: int = 8, height: int = 6, colour: str = "red", fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    PILImage.new("RGB", (width, height), colour).save(buf, format=fmt)
    return buf.getvalue()


def noise(width: int, height: int) -> bytes:
    """A PNG of random pixels: it does not compress, so its size in bytes is about 3 per pixel."""
    buf = io.BytesIO()
    PILImage.frombytes("RGB", (width, height), random.Random(0).randbytes(width * height * 3)).save(
        buf, "PNG"
    )
    return buf.getvalue()


def row(images, content: str = "<image>How many shapes?") -> dict:
    return {
        "prompt": [{"role": "user", "content": content}],
        "images": images,
        "data_source": "shapes",
        "reward_model": {"style": "rule", "ground_truth": "1"},
        "extra_info": {"index": 0},
    }


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_reads_bytes_hf_dicts_and_relative_paths(tmp_path):
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "a.jpg").write_bytes(png(10, 4, fmt="JPEG"))
    data = png(8, 6)
    rows = [
        row([{"bytes": data, "path": None}]),
        row(
            [{"bytes": None, "path": "img/a.jpg"}, {"bytes": data, "path": "ignored.png"}],
            "<image><image>Same?",
        ),
    ]
    samples = load_samples([write_parquet(tmp_path / "mm.parquet", rows)])
    assert samples[0].images == [Image(data=data, format="PNG", width=8, height=6)]
    assert [(i.format, i.width, i.height) for i in samples[1].images] == [("JPEG", 10, 4), ("PNG", 8, 6)]
    assert samples[1].images[0].data == (tmp_path / "img" / "a.jpg").read_bytes()  # kept as stored
    # Plain bytes per item and string paths (a column of lists of binary / of strings).
    plain = load_samples([write_parquet(tmp_path / "plain.parquet", [row([data])])])
    assert plain[0].images[0].data == data
    jsonl = tmp_path / "paths.jsonl"
    jsonl.write_text(json.dumps(row(["img/a.jpg"])) + "\n")
    assert load_samples([jsonl])[0].images[0].format == "JPEG"


def test_text_rows_are_unchanged(tmp_path):
    text = make_rows("arithmetic", 3, seed=0)
    samples = load_samples([write_parquet(tmp_path / "t.parquet", text)])
    assert all(s.images == [] for s in samples)
    # A text file never had an images column: a literal "<image>" in its prompt is text, not a placeholder.
    literal = {**text[0], "prompt": [{"role": "user", "content": "What does <image> mean in HTML?"}]}
    assert load_samples([write_parquet(tmp_path / "l.parquet", [literal])])[0].images == []


def _bmp() -> bytes:
    return png(fmt="BMP")


@pytest.mark.parametrize(
    "images, content, limits, message",
    [
        ([{"bytes": None, "path": "missing.png"}], "<image>", None, "missing.png does not exist"),
        ([b"not an image at all"], "<image>", None, "cannot be decoded"),
        ([png()[:40]], "<image>", None, "cannot be decoded"),  # truncated: verify() finds it
        ([_bmp()], "<image>", None, "format BMP is not one of PNG, JPEG, WEBP"),
        ([png(40, 30)], "<image>", ImageLimits(max_pixels=1000), "40x30 = 1200 pixels, more than the 1000"),
        ([noise(40, 30)], "<image>", ImageLimits(max_bytes=1000), "bytes, more than the 1000 allowed"),
        ([png(), png(), png()], "<image>" * 3, ImageLimits(max_images=2), "3 images, more than the 2"),
        ([png(), png()], "<image>Which?", None, "1 `<image>` placeholders but the row has 2 images"),
        (None, "<image>Which?", None, "1 `<image>` placeholders but the row has 0 images"),
        ([{"bytes": None, "path": None}], "<image>", None, "has neither `bytes` nor `path`"),
    ],
)
def test_bad_image_is_one_error_naming_the_row(tmp_path, images, content, limits, message):
    rows = [row([png()]), row([png()]), row(images, content)]
    path = tmp_path / "bad.parquet"
    if any(isinstance(i, dict) for i in images or []):
        rows = [row([{"bytes": png(), "path": None}])] * 2 + [row(images, content)]
    write_parquet(path, rows)
    with pytest.raises(DatasetError) as err:
        load_samples([path], image_limits=limits)
    assert f"{path}: row 2: " in str(err.value) and message in str(err.value), str(err.value)


def test_data_check_reports_the_bad_row(tmp_path):
    path = write_parquet(tmp_path / "bad.parquet", [row([png()]), row([b"junk"])])
    cfg = load_config(overrides=[f"data.train_files=[{path}]", "trainer.batch_groups=1"])
    with pytest.raises(ConfigError, match=r"data.train_files: .*bad.parquet: row 1: field `images\[0\]`"):
        check_data(cfg)


def test_old_sample_records_decode_without_images():
    """A Sample encoded before the `images` field existed decodes, with no images; a new one round-trips."""

    class OldSample(msgspec.Struct, kw_only=True, omit_defaults=True):
        index: int
        messages: list[dict]
        data_source: str
        ground_truth: object = None
        extra_info: dict = {}

    old = OldSample(index=3, messages=[{"role": "user", "content": "hi"}], data_source="arithmetic")
    for enc, dec in (
        (msgspec.msgpack.encode, msgspec.msgpack.decode),
        (msgspec.json.encode, msgspec.json.decode),
    ):
        assert dec(enc(old), type=Sample) == Sample(index=3, messages=old.messages, data_source="arithmetic")
    new = Sample(
        index=1,
        messages=[],
        data_source="shapes",
        images=[Image(data=png(), format="PNG", width=8, height=6)],
    )
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(new), type=Sample) == new
    # A text sample encodes exactly as before: the empty default is omitted.
    assert msgspec.msgpack.encode(Sample(index=3, messages=old.messages, data_source="arithmetic")) == (
        msgspec.msgpack.encode(old)
    )


def test_shapes_task_is_deterministic_verifiable_and_loads(tmp_path):
    a, b = make_rows("shapes", 20, seed=7), make_rows("shapes", 20, seed=7)
    assert a == b and make_rows("shapes", 20, seed=8) != a
    for r in a:
        shapes = r["extra_info"]["problem"]
        assert r["images"][0]["bytes"] == render(shapes)
        question = r["prompt"][0]["content"]
        kind = next((k for k in ("circles", "squares", "triangles") if k in question), None)
        expected = len(shapes) if kind is None else sum(s["kind"] + "s" == kind for s in shapes)
        assert r["reward_model"]["ground_truth"] == str(expected)
    out = tmp_path / "shapes.parquet"
    assert datagen_main(["shapes", "--n", "12", "--out", str(out), "--seed", "3"]) == 0
    samples = load_samples([out])
    assert len(samples) == 12 and all(len(s.images) == 1 and s.images[0].format == "PNG" for s in samples)
    assert (samples[0].images[0].width, samples[0].images[0].height) == (112, 112)
    reward = resolve(samples[0].data_source)
    truth = samples[0].ground_truth
    assert reward(f"I count {truth}", truth, {}) == 1.0 and reward(f"{int(truth) + 1}", truth, {}) == 0.0


def test_shapes_heldout_split_is_disjoint_by_picture(tmp_path):
    train = make_rows("shapes", 200, seed=0, split="train")
    heldout = make_rows("shapes", 20, seed=1, split="heldout")
    key = lambda r: json.dumps(r["extra_info"]["problem"], sort_keys=True)  # noqa: E731
    assert not {key(r) for r in train} & {key(r) for r in heldout}
    assert len({key(r) for r in heldout}) == 20


def test_shapes_refuse_jsonl(tmp_path):
    with pytest.raises(ValueError, match="need a .parquet file"):
        write_rows(make_rows("shapes", 1), tmp_path / "s.jsonl")


def test_data_url_carries_the_stored_bytes():
    import base64

    from slipstream.agents.multimodal import data_url, decode_image

    data = png()
    url = data_url(decode_image(data, limits=ImageLimits()))
    head, body = url.split(",", 1)
    assert head == "data:image/png;base64" and base64.b64decode(body) == data


def test_image_data_runs_on_vllms_native_route_only(tmp_path):
    """Images reach vLLM's native route with the single_turn loop; any other server, route or loop would
    generate image prompts as text, and the data check refuses it naming the key to change."""
    out = tmp_path / "shapes.parquet"
    write_rows(make_rows("shapes", 4, seed=0), out)
    base = [f"data.train_files=[{out}]", "trainer.batch_groups=1"]
    refused = {
        "rollout.backend=embedded": "rollout.backend `embedded` takes no images",
        "rollout.backend=sglang": "rollout.backend `sglang` takes no images",
        "rollout.vllm.route=completions": "vLLM's /v1/completions takes no images",
        "agent.name=tool": "agent loop `tool` sends no images",
    }
    for override, reason in refused.items():
        vllm = [] if "backend" in override else ["rollout.backend=vllm", "rollout.vllm.route=generate"]
        cfg = load_config(overrides=[*base, *vllm, override])
        with pytest.raises(ConfigError, match=rf"data.train_files: 4 of 4 prompts have images .*{reason}"):
            check_data(cfg)
    check_data(load_config(overrides=[*base, "rollout.backend=vllm", "rollout.vllm.route=generate"]))


def test_image_tokens_are_counted_as_the_processor_expands_them(tmp_path):
    """The rollouter's prompt-length check counts each image's tokens before any request: the numbers the HF
    processor (and vLLM, tests/vllm/test_vllm_multimodal.py) expand a pad to, within the model's resize bounds."""
    import io

    from PIL import Image as PILImage

    from slipstream.agents.multimodal import ImageTokens, decode_image
    from slipstream.utils.tiny_vlm import make_tiny_qwen2_vl

    tokens = ImageTokens.from_model(make_tiny_qwen2_vl(tmp_path / "vlm"))
    assert tokens == ImageTokens(min_pixels=56 * 56, max_pixels=224 * 224)
    assert ImageTokens.from_model(tmp_path) is None

    def sized(width: int, height: int) -> int:
        buf = io.BytesIO()
        PILImage.new("RGB", (width, height), "red").save(buf, format="PNG")
        return tokens.count(decode_image(buf.getvalue(), limits=ImageLimits()))

    # 112 x 112: 4 x 4 merged patches; 100 x 80 resizes to 112 x 84; tiny ones grow to 56 x 56, big ones
    # shrink to max_pixels (224 x 224: 8 x 8)
    assert [sized(112, 112), sized(100, 80), sized(20, 20), sized(448, 448)] == [16, 12, 4, 64]
