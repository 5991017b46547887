"""Stage-1 checks that start an embedded server on the GPU: generation speed and fidelity, and one push.

``rollout``: the embedded server against transformers ``generate`` on the same GPU and prompts, eager at 64
and 256 concurrent requests and with a static cache (compiled decode step) at 64, with a KV cache that holds
the whole workload (so no eviction is measured), and its logprobs against a teacher-forced forward of the same
weights (and the same forward read one token off, which a working bound must reject).

``push``: one weight version from an FSDP2 engine (fp32 master weights as DTensors: ``full_tensor`` then the
cast) through :class:`WeightPublisher` with the config's own resolution of ``weightsync.push_dtype`` (left at
``auto``) over the ipc engine into an embedded server on the same GPU serving bf16; the server starts from
other weights, so its logprobs afterwards tell whether every byte landed.
"""

from __future__ import annotations

import asyncio
import os
import random
import time

from slipstream.serverkinds import server_kind
from slipstream.system.gpucheck.models import SHAPES, model_dir
from slipstream.system.gpucheck.runner import Context, check, partial

# Largest |logprob error| of a bf16 server against a bf16 teacher-forced forward (different kernels, peaked
# distributions). What tells a working server from a broken one is the second condition of each check: the same
# comparison against wrong weights, or read one token off, must be at least 5x larger.
BF16_BOUND = 0.5


def _prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(24, 40))] for _ in range(n)]


def generate_wave(model, prompts, max_new_tokens: int, *, static: bool = False, pad: int = 1):
    """One left-padded ``generate`` batch (sampling at T=1); returns (generated tokens, seconds). With
    ``static`` the cache is transformers' static one, whose decode step it compiles on a GPU: the first call
    (compilation) is not timed."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = (torch.arange(width, device=model.device)[None, :] >= torch.tensor(
        [width - len(p) for p in prompts], device=model.device)[:, None]).long()  # fmt: skip
    kwargs = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=pad,
                  max_new_tokens=max_new_tokens, eos_token_id=None)  # fmt: skip
    if static:
        kwargs["cache_implementation"] = "static"
    with torch.no_grad():
        warm = (ids, mask) if static else (ids[:1], mask[:1])  # static: the same shapes, or it recompiles
        model.generate(
            warm[0], attention_mask=warm[1], **{**kwargs, "max_new_tokens": max_new_tokens if static else 4}
        )
        if model.device.type == "cuda":
            torch.cuda.synchronize(model.device)
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, **kwargs)
        if out.is_cuda:
            torch.cuda.synchronize(out.device)
        seconds = time.perf_counter() - start
    return int(out[:, width:].numel()), seconds


def logprob_errors(model, prompts, outs) -> tuple[float, float, float]:
    """Largest |server logprob - teacher-forced logprob| over the tokens, the same against the forward read
    one position off (what a broken server could return), and the spread (std) of the reference values."""
    import torch

    worst = off = 0.0
    refs = []
    with torch.no_grad():
        for prompt, out in zip(prompts, outs, strict=True):
            if len(out.output_ids) < 2:
                continue
            ids = torch.tensor([prompt + out.output_ids], device=model.device)
            logits = model(ids).logits[0].float()[len(prompt) - 1 : -1]
            logp = torch.log_softmax(logits, -1)
            targets = torch.tensor(out.output_ids, device=model.device)
            ref = logp.gather(1, targets[:, None])[:, 0].cpu()
            shifted = logp[1:].gather(1, targets[:-1, None])[:, 0].cpu()
            got = torch.tensor(out.logprobs)
            worst = max(worst, (ref - got).abs().max().item())
            off = max(off, (shifted - got[:-1]).abs().max().item())
            refs.append(ref)
    spread = torch.cat(refs).std().item() if refs else 0.0
    return worst, off, spread


@check("rollout", 160)
def rollout(ctx: Context) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from slipstream.agents.protocol import SamplingParams
    from slipstream.rollouter.config import EmbeddedServerConfig, RolloutConfig
    from slipstream.rollouter.launch import launch_server
    from slipstream.system.bench_rollout import embedded_wave

    gpu = not ctx.small
    shape = "1b" if gpu else "small"
    dtype = "bfloat16" if ctx.device == "cuda" else "float32"
    path = model_dir(ctx.work, shape, dtype=dtype, max_positions=32768 if gpu else 4096, device=ctx.device)
    counts, new = ([64, 256], 256) if gpu else ([2, 4], 8)
    prompts = _prompts(max(counts), SHAPES[shape]["vocab_size"])
    page = 64
    longest = max(len(p) for p in prompts) + new
    kv_tokens = max(counts) * (-(-longest // page) * page) + 2 * page * max(counts)  # the whole workload
    ecfg = EmbeddedServerConfig(device=ctx.device, dtype=dtype, kv_cache_tokens=kv_tokens, kv_page_size=page,
                                max_running_requests=max(counts), max_model_len=-(-longest // page) * page + page,
                                seed=0, num_threads=0 if gpu else 1)  # fmt: skip
    sampling = SamplingParams(max_new_tokens=new, temperature=1.0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(ctx.device).eval()
    figures: dict = {"rollout_kv_cache_tokens": kv_tokens, "rollout_workload_tokens": max(counts) * longest}
    key = "embedded_logprob_err_bf16" if dtype == "bfloat16" else "embedded_logprob_err_fp32"
    with launch_server(server_kind("embedded"), path, cfg=RolloutConfig(embedded=ecfg)) as server:
        server.wait_healthy(max(30.0, ctx.limit_s - 20))
        for n in counts:
            outs, seconds = asyncio.run(embedded_wave(server.url, prompts[:n], sampling))
            tokens = sum(len(o.output_ids) for o in outs)
            figures[f"embedded_tok_s_{n}"] = round(tokens / seconds, 1)
            if key not in figures:  # fidelity first: a check cut short at its limit still reports it
                err, off, spread = logprob_errors(model, prompts[: min(n, 8)], outs[:8])
                figures.update({key: float(f"{err:.4g}"), "embedded_logprob_err_one_off": round(off, 3),
                                "embedded_logprob_ref_std": round(spread, 3)})  # fmt: skip
            partial(ctx, "rollout", figures)
            tokens, seconds = generate_wave(model, prompts[:n], new)
            figures[f"generate_eager_tok_s_{n}"] = round(tokens / seconds, 1)
            figures[f"embedded_vs_generate_{n}"] = round(
                figures[f"embedded_tok_s_{n}"] / figures[f"generate_eager_tok_s_{n}"], 3)  # fmt: skip
            partial(ctx, "rollout", figures)
    err, off = figures[key], figures["embedded_logprob_err_one_off"]
    n = counts[0]
    try:  # last: its compilation is the longest, and a baseline that cannot compile fails no check of ours
        tokens, seconds = generate_wave(model, prompts[:n], new, static=True)
        figures[f"generate_static_tok_s_{n}"] = round(tokens / seconds, 1)
        figures[f"embedded_vs_generate_static_{n}"] = round(
            figures[f"embedded_tok_s_{n}"] * seconds / tokens, 3
        )
    except Exception as err:
        figures["generate_static_error"] = f"{type(err).__name__}: {err}"[:500]
    bound = BF16_BOUND if dtype == "bfloat16" else 1e-3
    ok = err <= bound and off >= 5 * max(err, 1e-6)
    return {"ok": ok, "figures": figures, "logprob_bound": bound,
            "detail": "" if ok else f"logprob error {err:.4g} (bound {bound}); one token off: {off:.4g}"}  # fmt: skip


# ------------------------------------------------------------------------------------------ push
@check("push", 40)
def push(ctx: Context) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from slipstream.agents.protocol import SamplingParams
    from slipstream.config import load_config, trainer_settings
    from slipstream.pipeline.modes import prepare_config
    from slipstream.rollouter.launch import launch_server
    from slipstream.system.bench_rollout import embedded_wave
    from slipstream.trainer.engine.fsdp import FSDPEngine
    from slipstream.trainer.trainer import push_dtype
    from slipstream.utils.net import free_port
    from slipstream.weightsync.publisher import WeightPublisher

    shape = "small" if ctx.small else "135m"
    new_weights = model_dir(ctx.work, shape, seed=0, dtype="float32", device=ctx.device)
    old_weights = model_dir(ctx.work, shape, seed=1, dtype="float32", device=ctx.device)
    cfg = load_config(
        None,
        [
            f"model.path={new_weights}",
            f"trainer.device={ctx.device}",
            "rollout.backend=embedded",
            f"rollout.embedded.device={ctx.device}",
            "rollout.embedded.dtype=bfloat16",
            "rollout.embedded.kv_cache_tokens=4096",
            "rollout.embedded.max_model_len=512",
            "rollout.embedded.kv_page_size=64",
            "rollout.embedded.seed=0",
            f"rollout.embedded.num_threads={1 if ctx.small else 0}",
            "weightsync.backend=ipc",
            f"weightsync.device={ctx.device}",
            f"weightsync.bucket_mb={1 if ctx.small else 256}",
        ],
    )  # fmt: skip  (weightsync.push_dtype stays `auto`: the run's own resolution is what is checked)
    cfg, _ = prepare_config(cfg)
    settings = trainer_settings(cfg)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    figures: dict = {"push_dtype_resolved": cfg.weightsync.push_dtype}
    seen = {"bytes": 0, "numel": 0, "dtensors": 0, "dtypes": set()}

    def counted(named):
        for name, tensor in named:
            seen["bytes"] += tensor.numel() * tensor.element_size()
            seen["numel"] += tensor.numel()
            seen["dtypes"].add(str(tensor.dtype))
            yield name, tensor

    with launch_server(server_kind("embedded"), old_weights, cfg=cfg.rollout) as server:
        engine = FSDPEngine(settings)
        engine.initialize()
        seen["dtensors"] = sum(hasattr(p, "full_tensor") for p in engine.model.parameters())
        server.wait_healthy(max(30.0, ctx.limit_s - 15))
        publisher = WeightPublisher(settings.weightsync, [server.url], server_kind("embedded"))
        try:
            t0 = time.perf_counter()
            report = publisher.publish(1, counted(engine.get_per_tensor_param(push_dtype(settings))))
            seconds = time.perf_counter() - t0
        finally:
            publisher.close()
        figures.update(push_bytes_per_param=seen["bytes"] / max(seen["numel"], 1), push_bytes=seen["bytes"],
                       push_publisher_gbps=round(seen["bytes"] / seconds / 1e9, 3),
                       push_dtensor_params=seen["dtensors"])  # fmt: skip
        partial(ctx, "push", figures)
        prompts = _prompts(4, SHAPES[shape]["vocab_size"], seed=3)
        outs, _ = asyncio.run(
            embedded_wave(server.url, prompts, SamplingParams(max_new_tokens=16, temperature=1.0))
        )
        served_version = asyncio.run(_version(server.url))
    errs = {}
    for label, path in (("new", new_weights), ("old", old_weights)):
        ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(ctx.device).eval()
        errs[label] = logprob_errors(ref, prompts, outs)[0]
        del ref
    figures.update(push_logprob_err_new=round(errs["new"], 4), push_logprob_err_old=round(errs["old"], 3))
    ok = (report.ok == [server.url] and served_version == 1 and figures["push_bytes_per_param"] == 2.0
          and seen["dtensors"] > 0 and errs["new"] <= BF16_BOUND and errs["old"] >= 5 * max(errs["new"], 1e-6))  # fmt: skip
    return {"ok": ok, "figures": figures, "report": {"ok": report.ok, "failed": report.failed},
            "served_version": served_version, "dtypes_pushed": sorted(seen["dtypes"])}  # fmt: skip


async def _version(url: str) -> int:
    from slipstream.serverkinds.sglang import SGLangClient

    client = SGLangClient(url)
    try:
        return await client.weight_version()
    finally:
        await client.aclose()
