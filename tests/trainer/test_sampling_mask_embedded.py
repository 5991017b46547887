"""The embedded server samples through transformers' top-k / top-p warpers and returns logprobs of the
renormalised distribution; the trainer's replay of the filter (``trainer/logprobs.py``) gives the same numbers
from its own forward pass, and without the replay it does not."""

from __future__ import annotations

import asyncio

import pytest

from slipstream.agents.protocol import SamplingParams
from slipstream.rollouter.embedded.engine import EmbeddedEngine
from tests.rollouter.conftest import TEST_ENGINE, run
from tests.trainer.sampling_mask_helpers import SETTINGS, TrainerView, compare, sharpened

PROMPTS = [[11, 12, 13], [40, 41, 42, 43, 44], [7]]


@pytest.fixture(scope="module")
def sharp_model(tiny_model_path, tmp_path_factory):
    return sharpened(tiny_model_path, tmp_path_factory.mktemp("sharp-model"))


def _generate(model_path, temperature, top_k, top_p):
    async def main():
        engine = EmbeddedEngine(model_path, TEST_ENGINE)
        await engine.start()
        try:
            params = SamplingParams(max_new_tokens=48, temperature=temperature, top_k=top_k, top_p=top_p)
            states = [
                await engine.submit(p, params, rid=f"mask-{i}", ignore_eos=True)
                for i, p in enumerate(PROMPTS)
            ]
            return await asyncio.gather(*(engine.wait(s) for s in states))
        finally:
            engine.stop()

    return run(main(), timeout_s=300)


@pytest.mark.parametrize("temperature,top_k,top_p", SETTINGS)
def test_trainer_logprobs_equal_the_embedded_servers(sharp_model, temperature, top_k, top_p):
    view = TrainerView(sharp_model)
    errors = []
    for state in _generate(sharp_model, temperature, top_k, top_p):
        errors.append(
            compare(view, state.input_ids, state.output_ids, state.logprobs, temperature, top_k, top_p)
        )
    worst = {k: max(e[k] for e in errors) for k in errors[0]}
    print(f"embedded T={temperature} top_k={top_k} top_p={top_p}: {worst}")
    assert worst["chunked"] <= 1e-4 and worst["plain"] <= 1e-4, worst
    assert worst["no_replay"] > 0.1, worst
