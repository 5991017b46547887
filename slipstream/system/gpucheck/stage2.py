"""Stage 2: what needs Ray or NIXL, carried in calls of their own (run only when device time is left).

``one_gpu_train`` runs ``slipstream train`` on this machine as a user would on one GPU: Ray started by the
run itself (``cluster.ray_address`` left null, so both pools are declared with one unit per GPU), trainer
rank and embedded server sharing the GPU (``cluster.colocate=true``, one GPU each in the config), weights
pushed over the ipc engine (NCCL cannot join two processes on one GPU), and no wandb (not in the image).
"""

from __future__ import annotations

import subprocess
import sys
import time
from importlib.util import find_spec
from pathlib import Path

from slipstream.system.gpucheck.models import model_dir
from slipstream.system.gpucheck.runner import Context, check

ONE_GPU_STEPS = 4


def one_gpu_train_overrides(model_path: str | Path, out: str | Path, device: str, steps: int = ONE_GPU_STEPS,
                            data: str | Path | None = None) -> list[str]:  # fmt: skip
    """The key=value overrides of configs/quickstart.yaml for a run on one GPU (or, ``device=cpu``, the same
    layout on a CPU: no GPUs reserved, no colocation)."""
    gpu = device == "cuda"
    overrides = [
        f"model.path={model_path}", "model.dtype=float32", f"trainer.device={device}",
        f"run.output_dir={out}", "run.name=one-gpu", f"run.total_steps={steps}", "eval.every=0",
        "rollout.backend=embedded",
        f"rollout.embedded.device={device}", f"rollout.embedded.dtype={'bfloat16' if gpu else 'float32'}",
        "weightsync.backend=ipc", f"weightsync.device={device}", "wandb.mode=disabled",
    ]  # fmt: skip
    if gpu:
        overrides += ["cluster.colocate=true", "cluster.gpus_per_trainer_rank=1", "cluster.gpus_per_server=1"]
    if data:
        overrides += [f"data.train_files=[{data}]", "data.val_files=[]"]
    return overrides


@check("one_gpu_train", 300, stage=2)
def one_gpu_train(ctx: Context) -> dict:
    if find_spec("ray") is None:
        return {
            "ok": None,
            "detail": "ray is not installed (stage 2 carries it: scripts/gpu_check.sh --stage2)",
        }
    path = model_dir(ctx.work, "small" if ctx.small else "135m", dtype="float32", device=ctx.device)
    run_dir = ctx.work / "one-gpu"
    data = ctx.work / "arithmetic_train.parquet"  # made by the run itself (the config's datagen section)
    cmd = [sys.executable, "-m", "slipstream.cli", "train", "configs/quickstart.yaml",
           *one_gpu_train_overrides(path, ctx.work, ctx.device, data=data)]  # fmt: skip
    start = time.monotonic()
    with open(ctx.work / "one_gpu_train.log", "wb") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=max(10, ctx.limit_s - 10))
    metrics = run_dir / "metrics.jsonl"
    done = sum(1 for line in metrics.read_text().splitlines() if line.strip()) if metrics.exists() else 0
    tail = (ctx.work / "one_gpu_train.log").read_text(errors="replace")[-3000:]
    return {"ok": proc.returncode == 0 and done >= ONE_GPU_STEPS,
            "figures": {"one_gpu_train_steps": done, "one_gpu_train_s": round(time.monotonic() - start, 1)},
            "detail": tail if proc.returncode else ""}  # fmt: skip


@check("nixl_weightsync", 120, stage=2)
def nixl_weightsync(ctx: Context) -> dict:
    """The NIXL engine on GPU memory between two processes (``bench weightsync --backends nixl``)."""
    if find_spec("nixl") is None and find_spec("nixl_cu13") is None:
        return {"ok": None, "detail": "nixl is not installed (stage 2 carries it)"}
    import json

    proc = subprocess.run(
        [sys.executable, "-m", "slipstream.cli", "bench", "weightsync", "--device", ctx.device, "--backends",
         "nixl", "--receivers", "1", "--sets", "tiny-fp32" if ctx.small else "llama-1b-bf16", "--reps", "3",
         "--bucket-mb", "1" if ctx.small else "256", "--json"],
        capture_output=True, text=True, timeout=max(10, ctx.limit_s - 10),
    )  # fmt: skip
    if proc.returncode:
        return {"ok": False, "detail": proc.stderr[-3000:]}
    row = json.loads(proc.stdout.strip().splitlines()[-1])["rows"][0]
    key = "weightsync_nixl_gpu_gbps" if ctx.device == "cuda" else "weightsync_nixl_gbps"
    return {"ok": True, "figures": {key: row.get("nixl_gbps")}, "raw": row}
