"""`slipstream bench rollout [--json]`: embedded server tokens/s against transformers `generate`, and fidelity.

What runs, all in one invocation on the same machine and the same prompts:

1. the embedded server (`slipstream serve`, a separate process, driven over HTTP by :class:`SGLangClient`)
   answers N concurrent requests, for N = 32 and N = 64; tokens/s = generated tokens / wall time;
2. right after each of those, transformers ``generate`` (in this process, idle server beside it) on the
   same N prompts as one left-padded batch with the same sampling (do_sample, temperature,
   max_new_tokens); only tokens up to and including each sequence's EOS count;
3. the log-probabilities the server returned at N = 32 are compared with a teacher-forced forward pass of
   the same weights on the same tokens (``log_softmax(logits / T)``); the largest absolute difference is
   reported.

The last line printed is the JSON summary; ``--json`` prints nothing else on stdout. Prompts are the
quickstart's arithmetic questions in the model's chat template.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import time

import torch

from slipstream.agents.protocol import SamplingParams
from slipstream.cli_args import (
    JSON_ONLY,
    add_device_flag,
    add_json_flag,
    add_key_option,
    command_parser,
    doc_paragraph,
)
from slipstream.rollouter.config import EmbeddedServerConfig, RolloutConfig, SamplingConfig
from slipstream.serverkinds import server_kind

QUESTION = "What is {a} + {b}? Reply with only the number."


def make_prompts(tokenizer, n: int) -> list[list[int]]:
    prompts = []
    for i in range(n):
        a, b = 1 + (7 * i) % 20, 1 + (11 * i + 3) % 20
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": QUESTION.format(a=a, b=b)}],
            add_generation_prompt=True,
            tokenize=False,
        )
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
    return prompts


async def embedded_wave(url: str, prompts: list[list[int]], sampling: SamplingParams):
    """N concurrent requests to the embedded server at ``url`` (after one warm-up); (outputs, seconds)."""
    from slipstream.serverkinds.sglang import SGLangClient

    return await _wave(SGLangClient(url), prompts, sampling)


async def _vllm_wave(url: str, prompts: list[list[int]], sampling: SamplingParams):
    from slipstream.serverkinds.vllm import VLLMClient

    return await _wave(VLLMClient(url, api="generate"), prompts, sampling)


async def _wave(client, prompts: list[list[int]], sampling: SamplingParams):
    """N concurrent requests through ``client`` (after one warm-up request); (outputs, seconds)."""
    try:
        await client.generate(prompts[0], SamplingParams(max_new_tokens=4))  # warm-up
        start = time.perf_counter()
        outs = await asyncio.gather(
            *(client.generate(p, sampling, rid=f"bench-{i}") for i, p in enumerate(prompts))
        )
        return outs, time.perf_counter() - start
    finally:
        await client.aclose()


def hf_generate_wave(
    model, tokenizer, prompts: list[list[int]], sampling: SamplingParams
) -> tuple[int, float]:
    """One left-padded ``generate`` batch; returns (real generated tokens, seconds)."""
    configured = model.generation_config.eos_token_id
    eos = set(configured if isinstance(configured, list) else [] if configured is None else [configured])
    eos |= {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(eos))
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    kwargs = dict(do_sample=True, temperature=sampling.temperature, top_k=0, top_p=1.0, pad_token_id=pad)
    with torch.no_grad():
        model.generate(ids[:1, :], attention_mask=mask[:1, :], max_new_tokens=4, **kwargs)  # warm-up
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=sampling.max_new_tokens, **kwargs)
        if out.is_cuda:
            torch.cuda.synchronize(out.device)
        seconds = time.perf_counter() - start
    tokens = 0
    for row in out[:, width:].tolist():
        ends = [i for i, t in enumerate(row) if t in eos]
        tokens += ends[0] + 1 if ends else len(row)
    return tokens, seconds


def logprob_max_abs_err(model, prompts, outs, temperature: float) -> float:
    worst = 0.0
    with torch.no_grad():
        for prompt, out in zip(prompts, outs, strict=True):
            if not out.output_ids:
                continue
            ids = torch.tensor([prompt + out.output_ids], device=model.device)
            logits = model(ids).logits[0].float().cpu()[len(prompt) - 1 : -1]
            ref = torch.log_softmax(logits / temperature, -1).gather(
                1, torch.tensor(out.output_ids)[:, None]
            )[:, 0]
            worst = max(worst, (ref - torch.tensor(out.logprobs)).abs().max().item())
    return worst


def run_bench(
    model_name: str,
    max_new_tokens: int,
    concurrencies: list[int],
    threads: int,
    log,
    repeats: int = 1,
    device: str = "cpu",
    dtype: str = "float32",
    backend: str = "embedded",
) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from slipstream.rollouter.launch import launch_server
    from slipstream.rollouter.models import resolve_model_path

    torch.set_num_threads(threads)
    path = resolve_model_path(model_name)
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = make_prompts(tokenizer, max(concurrencies))
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0)
    engine_cfg = EmbeddedServerConfig(
        num_threads=threads, max_model_len=1024, kv_cache_tokens=65536, seed=0, device=device, dtype=dtype
    )
    results: dict = {
        "model": model_name,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "dtype": dtype,
        "max_new_tokens": max_new_tokens,
        "threads": threads,
        "repeats": repeats,
    }
    results["load_avg_1m_start"] = round(os.getloadavg()[0], 2)
    fidelity_outs = vllm_outs = None
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device).eval()
    log(f"starting the embedded server ({path})")
    with (
        launch_server(server_kind("embedded"), path, cfg=RolloutConfig(embedded=engine_cfg)) as server,
        _vllm_server(backend, path, threads, dtype, max(concurrencies), log) as vllm,
    ):
        server.wait_healthy(600)
        # Each pair runs back to back, so a change in machine load affects both sides alike; with repeats,
        # each side keeps its best run (the one least disturbed by other work on the machine).
        for n in concurrencies:
            best_embedded = best_generate = best_vllm = 0.0
            for r in range(repeats):
                outs, seconds = asyncio.run(embedded_wave(server.url, prompts[:n], sampling))
                tokens = sum(len(o.output_ids) for o in outs)
                best_embedded = max(best_embedded, tokens / seconds)
                log(
                    f"embedded  n={n} #{r}: {tokens} tokens in {seconds:.1f} s = {tokens / seconds:.1f} tok/s"
                )
                fidelity_outs = fidelity_outs or (prompts[:n], outs)
                if vllm is not None:
                    outs, seconds = asyncio.run(_vllm_wave(vllm.url, prompts[:n], sampling))
                    tokens = sum(len(o.output_ids) for o in outs)
                    best_vllm = max(best_vllm, tokens / seconds)
                    log(
                        f"vllm      n={n} #{r}: {tokens} tokens in {seconds:.1f} s = {tokens / seconds:.1f} tok/s"
                    )
                    vllm_outs = vllm_outs or (prompts[:n], outs)
                tokens, seconds = hf_generate_wave(model, tokenizer, prompts[:n], sampling)
                best_generate = max(best_generate, tokens / seconds)
                log(
                    f"generate  n={n} #{r}: {tokens} tokens in {seconds:.1f} s = {tokens / seconds:.1f} tok/s"
                )
            results[f"embedded_tok_s_{n}"] = round(best_embedded, 2)
            results[f"hf_generate_tok_s_{n}"] = round(best_generate, 2)
            if vllm is not None:
                results[f"vllm_tok_s_{n}"] = round(best_vllm, 2)
    err = logprob_max_abs_err(model, *fidelity_outs, temperature=sampling.temperature)
    results["load_avg_1m_end"] = round(os.getloadavg()[0], 2)
    first = concurrencies[0]
    summary = {
        "embedded_tok_s": results[f"embedded_tok_s_{first}"],
        "hf_generate_tok_s": results[f"hf_generate_tok_s_{first}"],
        "logprob_max_abs_err": err,
        "concurrency": first,
        **results,
    }
    for n in concurrencies:
        summary[f"speedup_{n}"] = round(results[f"embedded_tok_s_{n}"] / results[f"hf_generate_tok_s_{n}"], 3)
    if vllm_outs is not None:
        summary["vllm_tok_s"] = results[f"vllm_tok_s_{first}"]
        summary["vllm_logprob_max_abs_err"] = logprob_max_abs_err(
            model, *vllm_outs, temperature=sampling.temperature
        )
        for n in concurrencies:
            summary[f"vllm_vs_embedded_{n}"] = round(
                results[f"vllm_tok_s_{n}"] / results[f"embedded_tok_s_{n}"], 3
            )
    return summary


@contextlib.contextmanager
def _vllm_server(backend: str, path, threads: int, dtype: str, max_seqs: int, log):
    """A vLLM server beside the embedded one (``--backend vllm``), idle while the others are timed."""
    if backend != "vllm":
        yield None
        return
    from slipstream.rollouter.config import VLLMServerConfig
    from slipstream.rollouter.launch import launch_server

    v = VLLMServerConfig(dtype=dtype, max_model_len=1024, max_num_seqs=max_seqs, cpu_threads=threads)
    log(f"starting vLLM ({path})")
    with launch_server(server_kind("vllm"), path, cfg=RolloutConfig(backend="vllm", vllm=v)) as server:
        server.wait_healthy(900)
        yield server


def build_parser() -> argparse.ArgumentParser:
    """The bench's parser: ``--max-new-tokens``, ``--dtype`` and ``--backend`` are the run config's
    ``rollout.*`` keys, generated from them; the rest are the bench's own sizes."""
    parser = command_parser("slipstream bench rollout", doc_paragraph(__doc__))
    parser.add_argument("--model", default="smollm2-135m-instruct", help="known model name or HF directory")
    add_key_option(parser, SamplingConfig, "max_new_tokens", section="rollout.sampling", default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[32, 64])
    parser.add_argument(
        "--threads", type=int, default=os.cpu_count() or 1, help="torch threads for both sides"
    )
    parser.add_argument(
        "--repeats", type=int, default=1, help="runs per side and concurrency; the best counts"
    )
    add_device_flag(parser, "where both sides run")
    add_key_option(parser, EmbeddedServerConfig, "dtype", section="rollout.embedded")
    add_key_option(
        parser,
        RolloutConfig,
        "backend",
        section="rollout",
        choices=["embedded", "vllm"],
        note="Here vllm also runs a vLLM server on the same prompts, between the other two (vllm_tok_s, "
        "vllm_logprob_max_abs_err, vllm_vs_embedded_N).",
    )
    add_json_flag(parser, JSON_ONLY)
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    # A plain SIGTERM would skip the `with` blocks and leave the server process running.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    def log(msg: str) -> None:
        print(f"[bench rollout] {msg}", file=sys.stderr if ns.json else sys.stdout, flush=True)

    summary = run_bench(
        ns.model,
        ns.max_new_tokens,
        ns.concurrency,
        ns.threads,
        log,
        ns.repeats,
        ns.device,
        ns.dtype,
        ns.backend,
    )
    print(json.dumps(summary))
    return 0
