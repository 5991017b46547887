"""The partial-rollout wrapper against a scripted client: resumes, budgets, versions, limits."""

from __future__ import annotations

import asyncio

from rollouter_fakes import ControlledClient, settle

from slipstream.agents.protocol import SamplingParams
from slipstream.rollouter.partial import PartialRolloutClient


def test_aborted_request_is_resumed_with_the_remaining_budget():
    async def main():
        inner = ControlledClient(tokens_per_request=3)
        client = PartialRolloutClient(inner, max_in_flight=4)
        task = asyncio.create_task(client.generate([1, 2, 3], SamplingParams(max_new_tokens=8), rid="g-0"))
        await settle()
        assert client.active == 1
        inner.abort_running()  # a weight push aborts it after one token of version 0
        inner.version = 1
        await settle()
        ((rid, input_ids, budget),) = inner.requests[1:]
        assert rid == "g-0.r1" and input_ids == [1, 2, 3, 65] and budget == 7
        inner.finish(rid)
        out = await asyncio.wait_for(task, 5)
        assert out.output_ids == [65, 65, 66, 256] and out.versions == [0, 1, 1, 1]
        assert len(out.logprobs) == 4 and out.finish_reason == "stop" and out.num_resumes == 1
        assert client.active == 0 and client.generated_tokens == 4

    asyncio.run(main())


def test_budget_spent_by_aborted_pieces_ends_with_length():
    async def main():
        inner = ControlledClient()
        client = PartialRolloutClient(inner, max_in_flight=1)
        task = asyncio.create_task(client.generate([1], SamplingParams(max_new_tokens=2), rid="r"))
        for _ in range(2):
            await settle()
            inner.abort_running()
        out = await asyncio.wait_for(task, 5)
        assert out.finish_reason == "length" and len(out.output_ids) == 2 and out.num_resumes == 1

    asyncio.run(main())


def test_stopping_and_explicit_aborts_are_not_resumed():
    async def main():
        inner = ControlledClient()
        client = PartialRolloutClient(inner, max_in_flight=2)
        a = asyncio.create_task(client.generate([1], SamplingParams(max_new_tokens=8), rid="a"))
        b = asyncio.create_task(client.generate([1], SamplingParams(max_new_tokens=8), rid="b"))
        c = asyncio.create_task(client.generate([1], SamplingParams(max_new_tokens=8), rid="c"))
        await settle()
        assert (client.active, client.queued) == (2, 1)  # max_in_flight holds the third
        await client.abort("a")
        out_a = await asyncio.wait_for(a, 5)
        assert out_a.finish_reason == "abort" and out_a.num_resumes == 0
        await settle()
        assert set(inner.pending) == {"b", "c"}
        await client.abort_all()
        outs = await asyncio.wait_for(asyncio.gather(b, c), 5)
        assert [o.finish_reason for o in outs] == ["abort", "abort"]
        assert len(inner.requests) == 3

    asyncio.run(main())


def test_routes_are_stitched_across_a_resume():
    """A resumed piece re-prefills prompt + partial output: the earlier segment keeps the routes its tokens
    were generated with, rows it never forwarded (-1) and every later row come from the resumed piece."""
    import numpy as np

    from slipstream.rollouter.partial import stitch_routes

    first = np.full((5, 2, 2), 1, dtype=np.int16)
    first[4] = -1  # the abort came before this row's forward
    resumed = np.full((8, 2, 2), 7, dtype=np.uint8)
    routes = stitch_routes(first, resumed)
    assert routes.dtype == np.uint8 and routes.shape == (8, 2, 2)
    assert (routes[:4] == 1).all() and (routes[4:] == 7).all()
    assert stitch_routes(None, resumed) is resumed and stitch_routes(first, None) is first
