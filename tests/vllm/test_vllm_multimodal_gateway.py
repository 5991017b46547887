"""Image content parts through the gateway to real vLLM: a harness's chat with a data-URL image, driven by the
official ``openai`` client, reaches the tiny Qwen2-VL through the rollouter's client stack (partial-rollout
wrapper over ``VLLMClient`` on the native route). The gateway sends the compact prompt (one pad per image)
with the image, and records the prompt as the server expanded it: the record equals what vLLM answers for
the same ids and image asked directly, a continued turn keeps sending the compact prompt, and the external
loop's trajectory carries the images the group will hold.

The server is conftest.py's ``vlm``, shared with test_vllm_multimodal.py.
"""

from __future__ import annotations

import asyncio

import httpx
from openai import AsyncOpenAI

from slipstream.agents.config import AgentConfig, ExternalAgentConfig
from slipstream.agents.data import Sample
from slipstream.agents.gateway import Gateway
from slipstream.agents.multimodal import data_url, group_images
from slipstream.agents.protocol import SamplingParams
from slipstream.agents.registry import make_agent_loop
from slipstream.rollouter.partial import PartialRolloutClient
from slipstream.serverkinds.vllm import VLLMClient
from tests.vllm.conftest import run
from tests.vllm.test_vllm_multimodal import GENERATE, expanded, picture

GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
QUESTION = "How many shapes?"


def image_message(image, text: str = QUESTION) -> dict:
    url = data_url(image)
    return {
        "role": "user",
        "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}],
    }


def direct(url: str, ids: list[int], images) -> dict:
    """vLLM's own answer for ``ids`` and ``images`` (greedy, as the gateway's sampling)."""
    body = {
        "token_ids": ids,
        "content_parts": [{"type": "image_url", "url": data_url(im)} for im in images],
        "sampling_params": {"max_tokens": GREEDY.max_new_tokens, "temperature": 0, "ignore_eos": True},
        "return_token_ids": True,
    }
    reply = httpx.post(url + GENERATE, json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    return reply.json()


def compact(tok, messages: list[dict]) -> list[int]:
    """The template's ids with one pad per image (the tiny template renders `<image>` as an image part)."""
    plain = [{**m, "content": "<image>" + m["content"][1]["text"]} if isinstance(m["content"], list) else m
             for m in messages]  # fmt: skip
    ids = tok.apply_chat_template(plain, add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_an_image_chat_is_recorded_as_the_server_expanded_it(vlm):
    url, tok = vlm
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    red, blue = picture(112, 112, "red"), picture(56, 56, "blue")  # 16 and 4 image tokens

    async def go():
        raw = VLLMClient(url, api="generate", timeout_s=300)
        gw = Gateway(PartialRolloutClient(raw, max_in_flight=4), tok, sampling=GREEDY, max_total_tokens=2048)
        await gw.start()
        try:
            session = gw.open_session("img-0")
            harness = AsyncOpenAI(base_url=session.base_url, api_key=session.api_key)
            first = [image_message(red)]
            one = await harness.chat.completions.create(
                model="p", messages=first, extra_body={"return_token_ids": True}
            )
            seg = session.current
            turn1 = (list(seg.prompt_ids), list(seg.response_ids))
            second = [*first, one.choices[0].message.model_dump(exclude_none=True),
                      {"role": "user", "content": "Are you sure?"}]  # fmt: skip
            two = await harness.chat.completions.create(
                model="p", messages=second, extra_body={"return_token_ids": True}
            )
            continued = session.divergences == 0 and len(session.segments) == 1
            sent_second = session.context_ids()[: -len(two.choices[0].model_extra["token_ids"])]
            third = [
                *second,
                two.choices[0].message.model_dump(exclude_none=True),
                image_message(blue, "And?"),
            ]
            await harness.chat.completions.create(model="p", messages=third)
            await harness.close()
            return one, two, turn1, continued, sent_second, await gw.close_session(session)
        finally:
            await gw.stop()
            await raw.aclose()

    one, two, (prompt1, response1), continued, sent_second, session = run(go())
    ids = compact(tok, [image_message(red)])
    assert ids.count(pad) == 1
    # the record's prompt is the server's expansion of the compact prompt, and the reply is vLLM's own
    want = direct(url, ids, [red])
    assert prompt1 == want["prompt_token_ids"] == expanded(ids, pad, [16])
    assert response1 == want["choices"][0]["token_ids"] == one.choices[0].model_extra["token_ids"]
    assert one.choices[0].model_extra["prompt_token_ids"] == prompt1 and one.usage.prompt_tokens == len(
        prompt1
    )
    assert one.choices[0].message.content == tok.decode(response1, skip_special_tokens=True)
    # the next turn continues the segment: the compact prompt is sent again with the image, the record keeps
    # the expanded one, and the reply is what vLLM gives for exactly the ids sent
    assert continued
    assert sent_second[: len(ids)] == ids and sent_second.count(pad) == 1
    again = direct(url, sent_second, [red])
    assert two.choices[0].model_extra["token_ids"] == again["choices"][0]["token_ids"]
    assert two.choices[0].model_extra["prompt_token_ids"] == again["prompt_token_ids"]
    # a new message with an image starts a segment whose prompt holds both images
    first_seg, last = session.segments
    assert first_seg.prompt_ids == prompt1 and first_seg.images == [red]
    assert first_seg.response_ids[: len(response1)] == response1
    assert last.images == [red, blue] and last.prompt_ids.count(pad) == 16 + 4
    assert session.divergences == 1


def harness(task: dict, base_url: str, api_key: str) -> float:
    """An external harness that shows the model a picture of its own (the task is text)."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key=api_key)
    picture_ = picture(112, 112, "green")
    reply = client.chat.completions.create(
        model="p", messages=[image_message(picture_, task["messages"][0]["content"])]
    )
    return 1.0 if reply.choices[0].message.content is not None else 0.0


def test_the_external_loops_trajectory_carries_its_images(vlm):
    """An episode's trajectory holds the expanded pads in its prompt and its images, which the group carries
    once (the rollouter's ``group_images``), as a dataset's image rows are carried."""
    url, tok = vlm
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    sample = Sample(index=0, messages=[{"role": "user", "content": QUESTION}], data_source="shapes")
    external = ExternalAgentConfig(callable=f"{__name__}:harness")
    cfg = AgentConfig(name="external", max_total_tokens=2048, max_turns=2, external=external)

    async def go():
        raw = VLLMClient(url, api="generate", timeout_s=300)
        loop = make_agent_loop(cfg, PartialRolloutClient(raw, max_in_flight=4), tok)
        try:
            return await asyncio.gather(*(loop.run(sample, GREEDY, uid=f"g0-{i}") for i in range(2)))
        finally:
            await loop.aclose()
            await raw.aclose()

    outs = run(go())
    green = picture(112, 112, "green")
    for out in outs:
        out.validate()
        assert out.reward == 1.0 and not out.reward_error
        assert out.images == [green] and out.prompt_ids.count(pad) == 16
        assert sum(out.loss_mask) == GREEDY.max_new_tokens
    assert group_images([], outs) == [green.data]
