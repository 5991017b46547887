"""The embedded engine serves the tiny MoE families: the logprobs of the tokens it generates, many requests
batched together (so one MoE layer routes several requests' tokens at once), equal a plain HF forward of the
same checkpoint within 1e-4 in fp32, and a weight update of the experts and routers (the fused HF names the
FSDP trainer pushes) lands whole: later tokens carry the new version and the new weights' logprobs."""

from __future__ import annotations

import pytest
import torch

from slipstream.agents.protocol import SamplingParams
from slipstream.utils.tiny_models import MOE_FAMILIES
from tests.rollouter.test_engine_weights import LiveServer


@pytest.fixture(scope="module", params=MOE_FAMILIES)
def moe_live(request, tiny_moe_models):
    server = LiveServer(tiny_moe_models[request.param])
    server.path = tiny_moe_models[request.param]
    yield server
    server.close()


def _hf_logprobs(model, prompt, output, temperature) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()[len(prompt) - 1 : -1]
    return torch.log_softmax(logits / temperature, -1).gather(1, torch.tensor(output)[:, None])[:, 0]


def _generate(live, prompts, temperature=1.0, max_new_tokens=16):
    engine = live.engine

    async def main():
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature)
        states = [
            await engine.submit(p, params, rid=f"moe-{id(p)}-{i}", ignore_eos=True)
            for i, p in enumerate(prompts)
        ]
        return [await engine.wait(s) for s in states]

    return live.call(main())


def _max_err(model, states, temperature) -> float:
    err = 0.0
    for state in states:
        want = _hf_logprobs(model, state.input_ids, state.output_ids, temperature)
        err = max(err, float((torch.tensor(state.logprobs) - want).abs().max()))
    return err


def test_moe_logprobs_of_batched_requests_equal_a_plain_hf_forward(moe_live):
    from transformers import AutoModelForCausalLM

    prompts = [[11, 12, 13 + i] * (1 + i) for i in range(6)]
    states = _generate(moe_live, prompts, temperature=0.8)
    assert all(len(s.output_ids) == 16 and set(s.versions) == {0} for s in states)
    hf = AutoModelForCausalLM.from_pretrained(moe_live.path)
    assert _max_err(hf, states, 0.8) < 1e-4


def test_expert_and_router_updates_land_whole(moe_live):
    from transformers import AutoModelForCausalLM

    engine = moe_live.engine
    specs = engine.weight_specs()
    moe = [n for n in specs if ".mlp.experts." in n or n.endswith(".mlp.gate.weight")]
    assert {n.rsplit(".", 1)[-1] for n in moe} >= {"gate_up_proj", "down_proj", "weight"}
    hf = AutoModelForCausalLM.from_pretrained(moe_live.path)
    gen = torch.Generator().manual_seed(1)
    params = dict(hf.named_parameters())
    new = {}
    for name in moe:
        new[name] = params[name].detach() + 0.5 * torch.randn(params[name].shape, generator=gen)
        params[name].data.copy_(new[name])
    engine.apply_weights(list(new.items()), version=3)
    states = _generate(moe_live, [[21, 22, 23], [5, 6, 7, 8, 9]])
    assert all(set(s.versions) == {3} for s in states)
    assert _max_err(hf, states, 1.0) < 1e-4
    assert _max_err(AutoModelForCausalLM.from_pretrained(moe_live.path), states, 1.0) > 1e-2


def test_each_request_gets_the_experts_its_tokens_were_routed_to(moe_live):
    """Routing replay's source: every request, batched with others, comes back with the experts each layer
    picked for its prompt and generated tokens but the last, as a plain forward of those tokens through the
    served weights (the engine's model: an earlier test of this module pushed new ones) picks them."""
    from slipstream.trainer.engine.moe import record_routes

    prompts = [[31, 32, 33 + i] * (2 + i) for i in range(4)]
    prompts.append([(7 * i) % 250 + 1 for i in range(700)])  # prefilled in chunks (max_batch_tokens 512)
    states = _generate(moe_live, prompts, temperature=1.0, max_new_tokens=12)
    hf = moe_live.engine.model
    for state in states:
        tokens = state.input_ids + state.output_ids[:-1]
        got = state.routed_experts
        assert got is not None and got.dtype == torch.uint8
        assert got.shape == (len(tokens), hf.config.num_hidden_layers, hf.config.num_experts_per_tok)
        want = record_routes(hf, input_ids=torch.tensor([tokens]))
        assert torch.equal(got.long(), want), (got.long() != want).nonzero()[:5]


def test_generate_returns_routes_in_vllms_encoding_only_when_asked(moe_live):
    """``return_routed_experts`` over HTTP: the client decodes ``meta_info.routed_experts`` (base64 .npy, the
    parser vLLM's replies go through too) into the engine's own uint8 routes; without the flag none come."""
    from slipstream.serverapi import EMBEDDED
    from slipstream.serverkinds.sglang import SGLangClient

    prompt = [11, 12, 13, 14]

    async def main():
        client = SGLangClient(moe_live.url, server_api=EMBEDDED)
        try:
            asked = SamplingParams(max_new_tokens=6, ignore_eos=True, return_routed_experts=True)
            with_routes = await client.generate(prompt, asked, rid="routes-1")
            plain = await client.generate(prompt, SamplingParams(max_new_tokens=6, ignore_eos=True))
            return with_routes, plain
        finally:
            await client.aclose()

    out, plain = moe_live.call(main())
    routes = out.routed_experts
    cfg = moe_live.engine.model.config
    assert routes.dtype.name == "uint8"
    assert routes.shape == (len(prompt) + 6 - 1, cfg.num_hidden_layers, cfg.num_experts_per_tok)
    assert plain.routed_experts is None
    hf_routes = _hf_routes(moe_live.engine.model, prompt + out.output_ids[:-1])
    assert (torch.from_numpy(routes).long().sort(-1).values == hf_routes.sort(-1).values).all()


def _hf_routes(model, ids) -> torch.Tensor:
    """[tokens, layers, k] top-k expert ids a plain forward picks (router logits from HF's own output)."""
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_router_logits=True)
    k = model.config.num_experts_per_tok
    return torch.stack([logits.topk(k, -1).indices for logits in out.router_logits], 1)


def test_routes_asked_of_a_dense_model_are_refused():
    from slipstream.rollouter.embedded.app import check_generate_options
    from slipstream.rollouter.embedded.engine import RequestError
    from slipstream.rollouter.embedded.schemas import GenerateReqInput

    class Dense:
        records_routes = False

    with pytest.raises(RequestError, match="return_routed_experts: the served model is not a mixture"):
        check_generate_options(GenerateReqInput(input_ids=[1], return_routed_experts=True), Dense())
