"""Chunked logprobs/entropy equal the full-vocabulary path in value and gradient (fp32, CPU), tied or not."""

from __future__ import annotations

import pytest
import torch

from slipstream.trainer.logprobs import LogprobHead, full_token_logprobs, install_logprob_head, token_logprobs

N, H, V = 37, 16, 301


def _inputs(seed=0, dtype=torch.float32, scale=0.4):
    g = torch.Generator().manual_seed(seed)
    # scale 0.4: logits of std ~1.6, max ~8. Much larger logits put the plain path's own fp32 rounding of the
    # entropy gradient (measured against fp64) above 1e-5: test_as_exact_as_the_full_path_on_sharp_logits
    hidden = torch.randn(N, H, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=g) * scale).to(dtype).requires_grad_()
    targets = torch.randint(0, V, (N,), generator=g)
    g_logp, g_ent = torch.randn(N, generator=g), torch.randn(N, generator=g)
    return hidden, weight, targets, g_logp, g_ent


def _grads(fn, hidden, weight, targets, g_logp, g_ent, entropy, temperature):
    hidden.grad = weight.grad = None
    logp, ent = fn(hidden, weight, targets, temperature=temperature, entropy=entropy is not None)
    loss = (logp * g_logp).sum()
    if entropy == "grad":
        loss = loss + (ent * g_ent).sum()
    loss.backward()
    return (
        logp.detach(),
        (ent.detach() if ent is not None else None),
        hidden.grad.clone(),
        weight.grad.clone(),
    )


@pytest.mark.parametrize("chunk", [0, 5, 16, 37, 4096])
@pytest.mark.parametrize("entropy", [None, "metric", "grad"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_equals_full_values_and_grads(chunk, entropy, temperature):
    args = _inputs()
    want = _grads(full_token_logprobs, *args, entropy, temperature)

    def chunked(*a, **kw):
        return token_logprobs(*a, chunk=chunk, **kw)

    got = _grads(chunked, *args, entropy, temperature)
    for w, g in zip(want, got, strict=True):
        if w is None:
            assert g is None
            continue
        assert (w - g).abs().max().item() <= 1e-5


def _fp64_truth(hidden, weight, targets, *, temperature, entropy):
    """The plain path in fp64 throughout (entropy_from_logits would upcast only to fp32)."""
    logsm = torch.log_softmax(hidden.double() @ weight.double().t() / temperature, dim=-1)
    ent = -(logsm.exp() * logsm).sum(-1) if entropy else None
    return logsm.gather(-1, targets[:, None])[:, 0], ent


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_as_exact_as_the_full_path_on_sharp_logits(temperature):
    """Logits up to ~45: both paths are compared with fp64; the chunked one is no further from it."""
    args = _inputs(scale=2.0)
    truth = _grads(_fp64_truth, *args, "grad", temperature)
    full = _grads(full_token_logprobs, *args, "grad", temperature)
    ours = _grads(lambda *a, **kw: token_logprobs(*a, chunk=8, **kw), *args, "grad", temperature)
    for t, f, o in zip(truth, full, ours, strict=True):
        full_err, our_err = (f.double() - t).abs().max().item(), (o.double() - t).abs().max().item()
        assert our_err <= full_err + 1e-6, (our_err, full_err)


def test_bf16_compute_matches_full_path_closely():
    args = _inputs(dtype=torch.bfloat16)
    want = _grads(full_token_logprobs, *args, "grad", 1.0)
    got = _grads(lambda *a, **kw: token_logprobs(*a, chunk=8, **kw), *args, "grad", 1.0)
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=0)  # same bf16 logits, fp32 reductions
    torch.testing.assert_close(got[1], want[1], atol=1e-4, rtol=0)
    torch.testing.assert_close(got[2].float(), want[2].float(), atol=0.05, rtol=0.02)
    torch.testing.assert_close(got[3].float(), want[3].float(), atol=0.05, rtol=0.02)


def test_head_in_a_tied_model_gives_the_embedding_its_gradient(tmp_path):
    """Tied embeddings: one parameter is both the input table and the output weight; its gradient must hold
    both contributions, exactly as with the plain output layer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ids = torch.randint(0, 97, (1, 12))
    g = torch.randn(11)

    logits = model(input_ids=ids).logits[0].float()
    want = (torch.log_softmax(logits[:-1], -1).gather(-1, ids[0, 1:, None])[:, 0] * g).sum()
    want.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    head = install_logprob_head(model, chunk_tokens=4, temperature=1.0)
    assert isinstance(head, LogprobHead) and model.lm_head is head
    assert head.weight is model.model.embed_tokens.weight
    assert [n for n, _ in model.named_parameters()] == list(ref)
    with head.request(targets=ids[0, 1:]):
        logp, ent = model(input_ids=ids).logits
    assert ent is None
    (logp * g).sum().backward()
    for name, p in model.named_parameters():
        assert (p.grad - ref[name]).abs().max().item() <= 1e-5, name
    # outside a request it is the plain output layer again
    torch.testing.assert_close(model(input_ids=ids).logits[0].float(), logits.detach())
