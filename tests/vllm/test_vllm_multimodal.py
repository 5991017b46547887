"""Images through real vLLM's native route: a tiny random Qwen2-VL, served by the CPU build without
torchvision (rollouter/vllm_vision.py), takes a prompt's images as data URLs in ``content_parts`` and
expands each ``<|image_pad|>`` of the token ids to one pad per merged 28 x 28 patch, as the HF processor
does; the images reach the vision tower (a different picture, different logprobs).

The server (a vision model) is conftest.py's ``vlm``, started once for this module and
test_vllm_multimodal_gateway.py; about a minute on 2 cores.
"""

from __future__ import annotations

import contextlib

import httpx

from slipstream.agents.datagen import make_rows
from slipstream.agents.multimodal import Image, ImageLimits, data_url, decode_image

GENERATE = "/inference/v1/generate"


def picture(width: int, height: int, colour: str) -> Image:
    import io

    from PIL import Image as PILImage

    buf = io.BytesIO()
    PILImage.new("RGB", (width, height), colour).save(buf, format="PNG")
    return decode_image(buf.getvalue(), limits=ImageLimits())


def prompt_ids(tok, text: str) -> list[int]:
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def generate(url: str, ids: list[int], images: list[Image], **sampling) -> dict:
    body = {
        "token_ids": ids,
        "content_parts": [{"type": "image_url", "url": data_url(im)} for im in images],
        "sampling_params": {"max_tokens": 4, "temperature": 0, "logprobs": 0, **sampling},
        "return_token_ids": True,
    }
    reply = httpx.post(url + GENERATE, json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    return reply.json()


def expanded(ids: list[int], pad: int, lengths: list[int]) -> list[int]:
    """``ids`` with its n-th image pad repeated ``lengths[n]`` times."""
    out, n = [], 0
    for t in ids:
        if t == pad:
            out += [pad] * lengths[n]
            n += 1
        else:
            out.append(t)
    return out


def test_server_expands_each_image_pad_per_merged_patch(vlm):
    url, tok = vlm
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    # A `shapes` row as `slipstream data make` writes it: 112 x 112 is 4 x 4 merged patches, 16 tokens.
    row = make_rows("shapes", 1, seed=0)[0]
    shapes = decode_image(row["images"][0]["bytes"], limits=ImageLimits())
    ids = prompt_ids(tok, row["prompt"][0]["content"])
    assert ids.count(pad) == 1
    out = generate(url, ids, [shapes])
    assert out["prompt_token_ids"] == expanded(ids, pad, [16])
    assert out["mm_placeholders"] == {"image": [{"offset": ids.index(pad), "length": 16}]}
    assert len(out["choices"][0]["token_ids"]) == 4
    # Two images in order: 100 x 80 resizes to 112 x 84 (3 x 4 merged patches, 12 tokens), then 16.
    ids2 = prompt_ids(tok, "<image> and <image>: which has more?")
    out2 = generate(url, ids2, [picture(100, 80, "red"), shapes])
    assert out2["prompt_token_ids"] == expanded(ids2, pad, [12, 16])
    first = ids2.index(pad)
    assert [p["length"] for p in out2["mm_placeholders"]["image"]] == [12, 16]
    assert out2["mm_placeholders"]["image"][0]["offset"] == first


def test_the_picture_reaches_the_model(vlm):
    url, tok = vlm
    ids = prompt_ids(tok, "<image>What colour?")
    red = generate(url, ids, [picture(56, 56, "red")])["choices"][0]
    again = generate(url, ids, [picture(56, 56, "red")])["choices"][0]
    blue = generate(url, ids, [picture(56, 56, "blue")])["choices"][0]
    assert red["token_ids"] == again["token_ids"] and red["logprobs"] == again["logprobs"]
    assert red["logprobs"] != blue["logprobs"]


def test_images_without_their_pads_fail_that_request_only(vlm):
    """vLLM answers more images than pads with a 500 naming the image (not a 400), so the placeholder count is
    checked before a request is made (agents/multimodal.py, at load); the server serves on."""
    url, tok = vlm
    ids = prompt_ids(tok, "<image>Which?")
    body = {
        "token_ids": ids,
        "content_parts": [{"type": "image_url", "url": data_url(picture(56, 56, "red"))}] * 2,
        "sampling_params": {"max_tokens": 2, "temperature": 0},
    }
    reply = httpx.post(url + GENERATE, json=body, timeout=300)
    assert reply.status_code == 500
    assert "Failed to apply prompt replacement for mm_items['image'][1]" in reply.text
    assert generate(url, ids, [picture(56, 56, "red")])["mm_placeholders"]["image"][0]["length"] == 4


def test_trainer_logprobs_of_image_prompts_equal_vllms(vlm):
    """vLLM samples at temperature 1 on image prompts; the FSDP engine, given vLLM's expanded prompt ids, the
    same encoded images through the model's own image processor and the sampled tokens, scores each sampled
    token as vLLM did (fp32 on both sides): the vision tower, the multi-modal positions and packing agree."""
    from slipstream.system.bench_multimodal import packed_replies
    from slipstream.trainer.engine.fsdp import FSDPEngine
    from tests.trainer.conftest import trainer_settings

    url, tok = vlm
    path = tok.name_or_path
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    shapes = decode_image(make_rows("shapes", 1, seed=1)[0]["images"][0]["bytes"], limits=ImageLimits())
    prompts = [
        ("<image>How many shapes?", [shapes]),
        ("<image> then <image>: which is red?", [picture(100, 80, "red"), picture(56, 84, "blue")]),
        ("no picture at all", []),
    ]
    replies = []
    for i, (text, imgs) in enumerate(prompts):
        out = generate(url, prompt_ids(tok, text), imgs, max_tokens=8, temperature=1.0, seed=7 + i)
        assert pad not in out["choices"][0]["token_ids"]  # a generated pad is not scored (engine/vision.py)
        replies.append((out, imgs))
    batch, served = packed_replies(replies, path)
    import torch.distributed as dist

    engine = FSDPEngine(trainer_settings(path, "trainer.micro_batch_tokens=4096"))
    try:
        engine.initialize()
        got = engine.forward_backward_batch(batch, None, forward_only=True).tokens["logprobs"]
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    scored = batch["loss_mask"].bool()
    err = (got[scored] - served[scored]).abs().max().item()
    assert err <= 1e-4, err


def test_the_rollout_sends_images_and_a_resumed_request_keeps_them(vlm):
    """The rollouter's client stack (partial-rollout wrapper over VLLMClient on the native route) sends a
    prompt's images with its one pad per image and returns the prompt as the server expanded it; a request
    aborted mid-way is re-submitted with its images (prompt + partial output, the pads expanded again), and
    its greedy tokens are those of the uninterrupted request."""

    from slipstream.agents.protocol import SamplingParams
    from slipstream.rollouter.partial import PartialRolloutClient
    from slipstream.serverkinds.vllm import VLLMClient
    from tests.vllm.conftest import generated, run, start_long, until, wait_for_tokens

    url, tok = vlm
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    ids = prompt_ids(tok, "<image> then <image>: which is red?")
    images = [picture(100, 80, "red"), picture(56, 56, "blue")]
    greedy = SamplingParams(max_new_tokens=4000, temperature=0.0, ignore_eos=True)

    async def go():
        c = VLLMClient(url, api="generate", timeout_s=300)
        partial = PartialRolloutClient(c, max_in_flight=4)
        try:
            task = await start_long(url, lambda: partial.generate(ids, greedy, rid="img", images=images))
            # the server ends the piece; the wrapper resumes it. Aborted again until it is: the server's tokens
            # that start_long saw may be another request's, with this one's images still being processed.
            for _ in range(120):
                await c.abort("img")
                with contextlib.suppress(TimeoutError):
                    await until(lambda: partial.resumes >= 1, timeout_s=1.0)
                    break
            await until(lambda: partial.resumes >= 1, timeout_s=1.0)
            await wait_for_tokens(url, generated(url) + 8)
            await partial.abort("img")
            resumed = await task
            n = len(resumed.output_ids)
            plain = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
            whole = await partial.generate(ids, plain, rid="img-whole", images=images)
            return resumed, whole
        finally:
            await c.aclose()

    resumed, whole = run(go())
    assert resumed.num_resumes >= 1
    assert resumed.prompt_ids == whole.prompt_ids == expanded(ids, pad, [12, 4])
    assert resumed.output_ids == whole.output_ids
