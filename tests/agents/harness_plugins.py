"""Agent harnesses (callables for the `external` loop) that misbehave on purpose, loaded as
`harness_plugins:<name>`."""

from __future__ import annotations

import httpx
from openai import OpenAI


def malformed_then_answers(task, base_url, api_key):
    """Sends a malformed request (gets a 400), then a good one; its episode is a normal one."""
    headers = {"Authorization": f"Bearer {api_key}"}
    bad = httpx.post(f"{base_url}/chat/completions", content=b'{"messages": 7}', headers=headers, timeout=60)
    assert bad.status_code == 400, bad.text
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    client.chat.completions.create(model="policy", messages=task["messages"], max_tokens=4)
    return {"reward": 0.5, "components": {"bad_requests": 1.0}}


def raises_on_bad_request(task, base_url, api_key):
    """Sends a message without a valid role (refused with a 400) and lets the client's error escape."""
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    client.chat.completions.create(model="policy", messages=[{"role": "narrator", "content": "x"}])
    return 1.0


def compacts_twice(task, base_url, api_key):
    """Two turns, then the history replaced by a summary of it (a compaction), twice: three segments of two
    turns each."""
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)

    def ask(messages):
        reply = client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
        return reply.choices[0].message.content or ""

    history = list(task["messages"])
    for round_ in range(3):
        history += [{"role": "assistant", "content": ask(history)}, {"role": "user", "content": "Go on."}]
        summary = ask(history)
        history = [{"role": "system", "content": f"Summary {round_} of the work so far: {summary}"},
                   {"role": "user", "content": "Continue from the summary."}]  # fmt: skip
    return 0.25


def returns_text(task, base_url, api_key):
    return "great"


def first_sample_wins(task, base_url, api_key):
    """Sample 0 of a group scores 0.75 after one request; every other sample crashes."""
    if not task["uid"].endswith("-0"):
        raise RuntimeError("harness bug")
    OpenAI(base_url=base_url, api_key=api_key, max_retries=0).completions.create(
        model="policy", prompt="Hi", max_tokens=3
    )
    return 0.75
