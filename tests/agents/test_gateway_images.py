"""Image content parts the gateway refuses, over real HTTP on loopback: remote and other non-data URLs, broken
data URLs, images over the limits, too many images, placeholders that do not match the images, and any image
where the servers take none (the embedded server) or the model has no image pad. Each is a 400 naming the
message and part or the reason, reaches no server, and leaves other sessions served.

The inference server is scripted (agent_fakes.py): nothing here may reach it. Images through real vLLM are in
tests/vllm/test_vllm_gateway_images.py.
"""

from __future__ import annotations

import asyncio
import base64
import io
import os

import httpx
import pytest

from slipstream.agents.gateway import Gateway
from slipstream.agents.multimodal import ImageLimits, images_refused
from slipstream.agents.protocol import SamplingParams
from slipstream.utils.text_bounds import longest_token_chars
from tests.agents.agent_fakes import ScriptedClient


@pytest.fixture(scope="module")
def vlm_tok(tmp_path_factory):
    from transformers import AutoTokenizer

    from slipstream.utils.tiny_vlm import make_tiny_qwen2_vl

    return AutoTokenizer.from_pretrained(make_tiny_qwen2_vl(tmp_path_factory.mktemp("vlm") / "qwen2-vl"))


def run(main):
    return asyncio.run(asyncio.wait_for(main(), 120))  # a guard against a hang, not a timed assertion


def encoded(fmt: str = "PNG", size: tuple[int, int] = (56, 56)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, "red").save(buf, format=fmt)
    return buf.getvalue()


def noise(width: int, height: int) -> bytes:
    """A PNG of random pixels (it does not compress: about 3 bytes a pixel)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.frombytes("RGB", (width, height), os.urandom(width * height * 3)).save(buf, format="PNG")
    return buf.getvalue()


def url_of(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def image_chat(*urls: str, text: str = "What is it?") -> dict:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return {"model": "p", "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]}


async def refusals(tok, bodies: list[dict], **gateway) -> tuple[list[httpx.Response], httpx.Response, list]:
    """Each body's response in a session of its own, then a text chat in a fresh session, and the requests
    that reached the server."""
    client = ScriptedClient(tok, ["fine"])
    gw = Gateway(client, tok, sampling=SamplingParams(max_new_tokens=8), max_total_tokens=512, **gateway)
    await gw.start()
    try:
        out = []
        for i, body in enumerate(bodies):
            session = gw.open_session(f"ep-{i}")
            headers = {"Authorization": f"Bearer {session.api_key}"}
            async with httpx.AsyncClient(base_url=session.base_url, headers=headers, timeout=60) as http:
                out.append(await http.post("/chat/completions", json=body))
        after = gw.open_session("ep-after")
        headers = {"Authorization": f"Bearer {after.api_key}"}
        async with httpx.AsyncClient(base_url=after.base_url, headers=headers, timeout=60) as http:
            text = {"model": "p", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
            fine = await http.post("/chat/completions", json=text)
        return out, fine, client.requests
    finally:
        await gw.stop()


def messages_of(responses: list[httpx.Response]) -> list[str]:
    assert [r.status_code for r in responses] == [400] * len(responses), [r.text for r in responses]
    return [r.json()["error"]["message"] for r in responses]


def test_urls_other_than_data_urls_are_refused_naming_the_part(vlm_tok):
    png = url_of(encoded())
    bodies = [
        image_chat(png, "https://example.com/cat.png"),
        image_chat("http://127.0.0.1:1/x.png"),
        image_chat("file:///etc/passwd"),
        image_chat("cat.png"),
    ]
    responses, fine, requests = run(lambda: refusals(vlm_tok, bodies))
    got = messages_of(responses)
    assert got[0].startswith(
        "messages[0].content[1]: only data: URLs are accepted (the gateway fetches nothing"
    )
    assert "got a https URL" in got[0]
    assert "got a http URL" in got[1] and "got a file URL" in got[2] and "got a relative URL" in got[3]
    assert fine.status_code == 200 and fine.json()["choices"][0]["message"]["content"] == "fine"
    assert len(requests) == 1  # the text chat's only


def test_broken_data_urls_are_refused_naming_the_part(vlm_tok):
    png = encoded()
    bodies = [
        image_chat("data:image/png;base64,iVBORw0K!!!not-base64"),
        image_chat(url_of(b"these bytes are no picture")),
        image_chat(url_of(png[: len(png) // 2])),
        image_chat(url_of(encoded("GIF"), "image/png")),
        image_chat(url_of(png, "image/gif")),
        image_chat("data:image/png," + "%89PNG"),
        {"model": "p", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        {
            "model": "p",
            "messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}],
        },
    ]
    responses, fine, requests = run(lambda: refusals(vlm_tok, bodies))
    got = messages_of(responses)
    assert got[0].startswith("messages[0].content[0]: the data URL's base64 is malformed")
    assert got[1].startswith("messages[0].content[0]: image bytes cannot be decoded")
    assert got[2].startswith("messages[0].content[0]: image bytes cannot be decoded")
    assert got[3] == "messages[0].content[0]: image format GIF is not one of PNG, JPEG, WEBP"
    assert (
        got[4]
        == "messages[0].content[0]: media type 'image/gif' is not one of image/png, image/jpeg, image/webp"
    )
    assert got[5] == "messages[0].content[0]: the data URL must be base64 (data:image/png;base64,...)"
    assert got[6].startswith("messages[0].content[0] is an image part without")
    assert got[7] == "messages[0].content[0] must be a part of type text or image_url, got 'input_audio'"
    assert fine.status_code == 200 and len(requests) == 1


def test_images_over_the_limits_are_refused(vlm_tok):
    limits = ImageLimits(max_images=2, max_pixels=100 * 100, max_bytes=20_000)
    small = url_of(encoded())
    bodies = [
        image_chat(small, small, small),
        image_chat(url_of(encoded(size=(120, 100)))),
        image_chat(url_of(noise(100, 100))),  # 30 kB that do not compress
    ]
    responses, fine, requests = run(lambda: refusals(vlm_tok, bodies, image_limits=limits))
    got = messages_of(responses)
    assert got[0] == "messages[0].content[2]: a request may carry at most 2 images"
    assert got[1] == "messages[0].content[0]: image is 120x100 = 12000 pixels, more than the 10000 allowed"
    assert got[2] == "messages[0].content[0]: the image is over the 20000 bytes allowed"
    assert fine.status_code == 200 and len(requests) == 1


def test_placeholders_that_do_not_match_the_images_are_refused(vlm_tok):
    """The tiny model's template renders a `<image>` in string content as an image slot (verl's placeholder),
    and the tokenizer reads a typed `<|image_pad|>` as the pad: a prompt with more pads than images would
    reach vLLM as a 500, or have an image read into a pad the harness typed."""
    typed = {"model": "p", "messages": [{"role": "user", "content": "<image> what is this?"}]}
    bodies = [typed, image_chat(url_of(encoded()), text="and <|image_pad|>")]
    responses, fine, requests = run(lambda: refusals(vlm_tok, bodies))
    got = messages_of(responses)
    assert got[0].startswith("the prompt renders 1 image placeholders (<|image_pad|>) for 0 images")
    assert got[1].startswith("the prompt renders 2 image placeholders (<|image_pad|>) for 1 images")
    assert fine.status_code == 200 and len(requests) == 1


def test_servers_without_images_refuse_them_with_the_reason(vlm_tok, tiny_model_path):
    """The embedded server (and SGLang, and vLLM's /v1/completions) take no images: the rollouter gives the
    gateway the reason, and an image part is a 400 with it. A text model has no image pad: the same."""
    from transformers import AutoTokenizer

    body = image_chat(url_of(encoded()))
    refusal = images_refused("embedded", "generate")
    responses, fine, requests = run(lambda: refusals(vlm_tok, [body], image_refusal=refusal))
    (got,) = messages_of(responses)
    assert got == f"this gateway takes no image parts: {refusal}"
    assert "rollout.backend `embedded` takes no images" in got
    assert fine.status_code == 200 and len(requests) == 1

    text_tok = AutoTokenizer.from_pretrained(tiny_model_path)
    responses, fine, requests = run(lambda: refusals(text_tok, [body]))
    (got,) = messages_of(responses)
    assert got.startswith(
        "this gateway takes no image parts: the model's tokenizer has no <|image_pad|> token"
    )
    assert fine.status_code == 200 and len(requests) == 1


def test_image_urls_do_not_count_as_text(vlm_tok):
    """The text bound (characters per token times the episode's tokens) leaves image URLs out: a picture
    larger than an episode's text would otherwise be refused as `context_length_exceeded`."""
    big = url_of(noise(300, 300))
    assert len(big) > 512 * longest_token_chars(vlm_tok)
    # refused for what it is (too many pixels here), not for its length
    limits = ImageLimits(max_pixels=50 * 50)
    responses, _, _ = run(lambda: refusals(vlm_tok, [image_chat(big)], image_limits=limits))
    (got,) = messages_of(responses)
    assert "more than the 2500 allowed" in got


def test_the_budget_counts_the_expanded_image_tokens(vlm_tok):
    """A 112 x 112 image is 16 tokens once the server expands its pad: a prompt that fits the episode's
    tokens only compact gets an empty reply (finish_reason length) and reaches no server, and the segment,
    never expanded, is not kept (its pads would not match its images in the trainer)."""
    from slipstream.agents.gateway.images import IMAGE_PAD

    body = image_chat(url_of(encoded(size=(112, 112))))
    pad = vlm_tok.convert_tokens_to_ids(IMAGE_PAD)
    rendered = vlm_tok.apply_chat_template(
        [{"role": "user", "content": "<image>What is it?"}], add_generation_prompt=True
    )
    compact = list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
    assert compact.count(pad) == 1

    async def main():
        client = ScriptedClient(vlm_tok, [])
        sampling = SamplingParams(max_new_tokens=8)
        gw = Gateway(client, vlm_tok, sampling=sampling, max_total_tokens=len(compact) + 15)
        await gw.start()
        try:
            session = gw.open_session("ep-budget")
            headers = {"Authorization": f"Bearer {session.api_key}"}
            async with httpx.AsyncClient(base_url=session.base_url, headers=headers, timeout=60) as http:
                response = await http.post("/chat/completions", json=body)
            return response, client.requests, await gw.close_session(session)
        finally:
            await gw.stop()

    response, requests, session = run(main)
    assert response.status_code == 200 and response.json()["choices"][0]["finish_reason"] == "length"
    assert requests == [] and session.segments == []


def test_a_group_carries_the_images_its_episodes_sent_once():
    """The rollouter's group images: a sample's own, else those every trajectory of the group sent (the
    queue carries one list a group); episodes that sent different images are refused naming one."""
    from slipstream.agents.base import AgentLoopOutput
    from slipstream.agents.multimodal import decode_image, group_images

    red = decode_image(encoded(), limits=ImageLimits())
    blue = decode_image(encoded("JPEG"), limits=ImageLimits())
    same = [AgentLoopOutput(prompt_ids=[1], images=[red]) for _ in range(3)]
    assert group_images([], same) == [red.data]
    assert group_images([blue], same) == [blue.data]  # a dataset row's images are the group's
    assert group_images([], [AgentLoopOutput(prompt_ids=[1])]) == []
    with pytest.raises(ValueError, match=r"trajectory 2 sent other images than trajectory 0 \(1 against 1\)"):
        group_images([], [*same[:2], AgentLoopOutput(prompt_ids=[1], images=[blue])])
