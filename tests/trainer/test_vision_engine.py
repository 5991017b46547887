"""The FSDP engine on image prompts (tiny random Qwen2-VL): packed micro-batches of image and text samples give
the per-sample HF forward's logprobs, images follow their samples into micro-batches, and
trainer.freeze_vision_tower keeps the tower out of the optimizer and at the checkpoint's weights while the
pushes still carry it (every version whole)."""

from __future__ import annotations

import io

import pytest
import torch
from tensordict import TensorDict

from slipstream.trainer.batching import select_samples
from slipstream.trainer.engine.vision import ImageProcessor


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory):
    from slipstream.utils.tiny_vlm import make_tiny_qwen2_vl

    return make_tiny_qwen2_vl(tmp_path_factory.mktemp("vlm") / "qwen2-vl")


def png(width: int, height: int, colour: str) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(buf, format="PNG")
    return buf.getvalue()


def image_batch(path, samples: list[tuple[str, list[bytes], list[int]]]) -> TensorDict:
    """A packed batch of (prompt text with ``<image>``s, its images, response ids), pads expanded."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    processor = ImageProcessor(str(path))
    images = processor([imgs for _, imgs, _ in samples])
    per_image = iter(processor.tokens_per_image(images["image_grid_thw"]))
    ids, pos, mask, cu, prompt_lens = [], [], [], [0], []
    for text, _, response in samples:
        chat = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        chat = list(chat["input_ids"] if hasattr(chat, "keys") else chat)
        prompt = [t for c in chat for t in ([pad] * next(per_image) if c == pad else [c])]
        ids += prompt + response
        pos += list(range(len(prompt) + len(response)))
        mask += [0] * len(prompt) + [1] * len(response)
        cu.append(len(ids))
        prompt_lens.append(len(prompt))
    return TensorDict(
        {
            "input_ids": torch.tensor(ids),
            "position_ids": torch.tensor(pos),
            "loss_mask": torch.tensor(mask),
            "cu_seqlens": torch.tensor(cu, dtype=torch.int32),
            "prompt_lens": torch.tensor(prompt_lens),
            **images,
        },
        batch_size=[],
    )


SAMPLES = [
    ("<image>How many shapes?", [png(112, 112, "red")], [40, 41, 42, 43]),
    ("plain text, no picture", [], [50, 51, 52]),
    ("<image> and <image>: which is blue?", [png(100, 80, "blue"), png(56, 84, "green")], [60, 61]),
]


def hf_logprobs(path, batch: TensorDict) -> torch.Tensor:
    """Each sample alone through the HF model (plain sdpa, its own positions), logprobs aligned to tokens."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    pad = model.config.image_token_id
    out = []
    for i in range(batch["cu_seqlens"].numel() - 1):
        one = select_samples(batch, [i])
        ids = one["input_ids"][None]
        kw = {}
        if int(one["image_counts"].sum()):
            kw = {
                "pixel_values": one["pixel_values"],
                "image_grid_thw": one["image_grid_thw"].long(),
                "mm_token_type_ids": (ids == pad).int(),
            }
        with torch.no_grad():
            logp = model(input_ids=ids, **kw).logits[0].float().log_softmax(-1)
        out += [logp.new_zeros(1), logp[:-1].gather(-1, ids[0, 1:, None])[:, 0]]
    return torch.cat(out)


def test_images_follow_their_samples_into_micro_batches(tiny_vlm):
    batch = image_batch(tiny_vlm, SAMPLES)
    assert batch["image_counts"].tolist() == [1, 0, 2]
    last = select_samples(batch, [2])
    assert last["image_grid_thw"].tolist() == batch["image_grid_thw"][1:].tolist()
    assert torch.equal(last["pixel_values"], batch["pixel_values"][16 * 4 :])
    text = select_samples(batch, [1])
    assert text["pixel_values"].shape[0] == 0 and text["image_counts"].tolist() == [0]


@pytest.mark.parametrize(
    "overrides",
    [(), ("trainer.logits_chunk_tokens=0",), ("trainer.micro_batch_tokens=40",)],
    ids=["chunked-head", "full-logits", "one-sample-micro-batches"],
)
def test_packed_image_prompts_give_the_per_sample_logprobs(tiny_vlm, single_process_group, overrides):
    from slipstream.trainer.engine.fsdp import FSDPEngine
    from tests.trainer.conftest import trainer_settings

    batch = image_batch(tiny_vlm, SAMPLES)
    want = hf_logprobs(tiny_vlm, batch)
    engine = FSDPEngine(trainer_settings(tiny_vlm, "trainer.micro_batch_tokens=4096", *overrides))
    engine.initialize()
    got = engine.forward_backward_batch(batch, None, forward_only=True).tokens["logprobs"]
    scored = batch["loss_mask"].bool()
    torch.testing.assert_close(got[scored], want[scored], atol=1e-5, rtol=0)


def checkpoint_tensors(path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under its own names (the names the servers load and pushes carry)."""
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


@pytest.mark.parametrize("freeze", [False, True], ids=["tower-trains", "tower-frozen"])
def test_a_frozen_tower_stays_at_the_checkpoint_and_every_push_carries_it(
    tiny_vlm, single_process_group, freeze
):
    """Frozen: the optimizer holds no tower parameter, two steps move the language model and leave the tower
    at the checkpoint's bits, and each push still carries the tower (a whole version, which the servers'
    receivers require). Trained: the tower moves and is pushed as it now is."""
    from slipstream.trainer.engine.fsdp import FSDPEngine
    from tests.trainer.conftest import trainer_settings

    engine = FSDPEngine(
        trainer_settings(tiny_vlm, "trainer.micro_batch_tokens=4096", f"trainer.freeze_vision_tower={freeze}")
    )
    engine.initialize()
    batch = image_batch(tiny_vlm, SAMPLES)
    params = dict(engine.model.named_parameters())
    tower = [n for n in params if n.startswith("model.visual.")]
    in_optimizer = {id(p) for group in engine.optimizer.param_groups for p in group["params"]}
    assert tower and {id(params[n]) for n in tower}.isdisjoint(in_optimizer) == freeze
    assert id(params["lm_head.weight"]) in in_optimizer

    def loss(outputs, mb):
        return -(outputs["logprobs"] * mb["loss_mask"].float()).sum() / 9.0, {}

    stored = checkpoint_tensors(tiny_vlm)
    for _ in range(2):
        engine.forward_backward_batch(batch, loss)
        if freeze:
            assert all(params[n].grad is None for n in tower)
        engine.optimizer_step()
    pushed = dict(engine.get_per_tensor_param())
    assert set(pushed) == set(stored)
    moved = {n for n, t in pushed.items() if not torch.equal(t, stored[n])}
    tower_names = {n for n in stored if n.startswith("visual.")}
    assert moved - tower_names, "the language model did not train"
    if freeze:
        assert not moved & tower_names
    else:
        assert "visual.patch_embed.proj.weight" in moved


def test_a_generated_image_pad_is_refused_naming_the_sample(tiny_vlm, single_process_group):
    from transformers import AutoConfig

    from slipstream.trainer.engine.fsdp import FSDPEngine
    from tests.trainer.conftest import trainer_settings

    pad_id = AutoConfig.from_pretrained(tiny_vlm).image_token_id
    batch = image_batch(tiny_vlm, [SAMPLES[0], ("<image>x", [png(56, 56, "red")], [7, pad_id, 8])])
    engine = FSDPEngine(trainer_settings(tiny_vlm, "trainer.micro_batch_tokens=4096"))
    engine.initialize()
    with pytest.raises(ValueError, match="sample 1 of the micro-batch has an image pad"):
        engine.forward_backward_batch(batch, None, forward_only=True)
