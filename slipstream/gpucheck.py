"""`scripts/gpu_check.sh`: what only a GPU can prove, in one command, written to ``docs/gpu/results.json``.

Each check runs in a process of its own under a time limit (a hang or a crash fails that check, never
the rest), and the whole run fits in 25 minutes on one H100. Checks:

* ``env``: device, driver, and the versions of torch, transformers, nixl, megatron-core and Ray;
* ``gpu_tests``: every test marked ``gpu`` (``pytest -m gpu``): FSDP2 bf16 parity with transformers, the
  Megatron-core engine (local layer spec) against transformers, NIXL and CUDA IPC weight sync between two
  processes on the GPU with digests, and the rest; a test that needs two GPUs skips on one;
* ``train``: ``bench train --device cuda`` (tokens/s, MFU of packed batches);
* ``rollout``: ``bench rollout --device cuda --dtype bfloat16`` (the embedded engine against transformers
  ``generate`` on the same GPU, and its logprob error against a teacher-forced forward);
* ``weightsync``: ``bench weightsync --device cuda --backends ipc,nixl`` on the 1.17B bf16 set (2.35 GB):
  the CUDA IPC and NIXL engines between two processes, beside one device copy of the same bytes (the
  bound: a CUDA IPC copy between processes runs at the same speed);
* ``push_dtype``: bytes a parameter a bf16-served model pushes (2 expected);
* ``one_gpu_train``: ``slipstream train`` on this machine with a tiny random model, no Ray started by hand
  (skipped where Ray is not installed).

``figures`` gathers the numbers the GPU issues ask for (``one_gpu_train_steps``,
``weightsync_cuda_ipc_gbps``, ``weightsync_nixl_gpu_gbps``, ``weightsync_ipc_copy_gbps``,
``push_bytes_per_param``, ``embedded_vs_generate_*``, ``train_mfu``, ...). ``--device cpu`` runs the same
checks at toy sizes on a CPU, which is how the suite keeps this runner working.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

CHECKS: dict[str, Callable[[argparse.Namespace, Path], dict]] = {}
LIMITS_S: dict[str, int] = {}


def check(name: str, limit_s: int):
    def deco(fn):
        CHECKS[name], LIMITS_S[name] = fn, limit_s
        return fn

    return deco


def _cli(*args: str, timeout_s: int) -> dict:
    """Run ``slipstream ...`` and return the JSON object its last stdout line holds."""
    proc = subprocess.run(
        [sys.executable, "-m", "slipstream.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"slipstream {' '.join(args)} exited {proc.returncode}: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _version(module: str) -> str | None:
    from importlib import metadata

    for dist in (module, module.replace("_", "-"), f"{module}-cu13", f"{module}-cu12"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


@check("env", 60)
def env(args: argparse.Namespace, work: Path) -> dict:
    import torch

    figures: dict = {"torch": torch.__version__, "python": sys.version.split()[0]}
    for name in ("transformers", "nixl", "megatron-core", "ray"):
        figures[name] = _version(name)
    if args.device == "cuda":
        figures["device"] = torch.cuda.get_device_name()
        figures["gpus"] = torch.cuda.device_count()
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
        )
        figures["driver"] = smi.stdout.strip().splitlines()[0] if smi.returncode == 0 else None
    return {"ok": args.device != "cuda" or torch.cuda.is_available(), "figures": figures}


@check("gpu_tests", 600)
def gpu_tests(args: argparse.Namespace, work: Path) -> dict:
    """Every ``gpu`` test. A module that cannot be imported here (Ray not brought along) counts against
    the check only when it holds GPU tests."""
    report = work / "gpu_tests.xml"
    marker = "gpu" if args.device == "cuda" else "gpu and not gpu"  # on a CPU: collect only
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-m", marker, "-p", "no:cacheprovider",
         "--continue-on-collection-errors", f"--junitxml={report}", "tests"],
        capture_output=True, text=True, timeout=LIMITS_S["gpu_tests"] - 10,
    )  # fmt: skip
    outcomes, unimportable = _junit(report) if report.exists() else ({}, [])
    failed = sorted(name for name, outcome in outcomes.items() if outcome == "failed")
    failed += [m for m in unimportable if _holds_gpu_tests(m)]
    counts = {
        f"gpu_tests_{o}": sum(1 for v in outcomes.values() if v == o) for o in ("passed", "failed", "skipped")
    }
    return {
        "ok": report.exists() and not failed,
        "figures": counts,
        "tests": outcomes,
        "unimportable": unimportable,
        "detail": proc.stdout[-3000:] if failed or not report.exists() else "",
    }


def _junit(path: Path) -> tuple[dict[str, str], list[str]]:
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


def _holds_gpu_tests(module: str) -> bool:
    path = Path(module.replace(".", "/") + ".py")
    return path.exists() and "mark.gpu" in path.read_text()


def _model(work: Path, size: str) -> str:
    """A random-initialised Llama: ``tiny`` for CPU smoke runs, ``1b`` the 1.17B shape GPU figures use."""
    from slipstream.testing import make_tiny_model

    shapes = {
        "tiny": dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128),
        "1b": dict(
            hidden_size=2048,
            num_layers=16,
            num_heads=32,
            num_kv_heads=8,
            intermediate_size=8192,
            max_position_embeddings=16384,
            dtype="bfloat16",
        ),
    }
    return str(make_tiny_model(work / f"model-{size}", **shapes[size]))


def _size(args: argparse.Namespace) -> str:
    return "1b" if args.device == "cuda" else "tiny"


@check("train", 300)
def train(args: argparse.Namespace, work: Path) -> dict:
    gpu = args.device == "cuda"
    sizes = ["--samples", "128", "--median", "1024", "--max-len", "8192", "--micro-batch-tokens", "16384"]
    out = _cli(
        "bench", "train", "--device", args.device, "--model", _model(work, _size(args)), "--steps", "2",
        *(sizes if gpu else ["--samples", "8", "--median", "8", "--max-len", "32"]), "--json",
        timeout_s=LIMITS_S["train"] - 10,
    )  # fmt: skip
    figures = {"train_packed_tok_s": out["packed_tok_s"], "train_packed_vs_padded": out["speedup"]}
    if gpu:
        figures["train_mfu"] = out.get("mfu")
    return {"ok": True, "figures": figures, "raw": out}


@check("rollout", 420)
def rollout(args: argparse.Namespace, work: Path) -> dict:
    gpu = args.device == "cuda"
    out = _cli(
        "bench", "rollout", "--device", args.device, "--dtype", "bfloat16" if gpu else "float32",
        "--model", _model(work, _size(args)), "--max-new-tokens", "256" if gpu else "8",
        "--concurrency", *(["64", "256"] if gpu else ["2"]), "--json",
        timeout_s=LIMITS_S["rollout"] - 10,
    )  # fmt: skip
    figures = {
        f"embedded_vs_generate_{k.split('_')[-1]}": v for k, v in out.items() if k.startswith("speedup_")
    }
    figures["embedded_logprob_max_abs_err"] = out["logprob_max_abs_err"]
    bound = 0.1 if gpu else 1e-3  # bf16 on the GPU, fp32 on a CPU
    return {"ok": out["logprob_max_abs_err"] <= bound, "figures": figures, "raw": out}


@check("weightsync", 480)
def weightsync(args: argparse.Namespace, work: Path) -> dict:
    """The IPC and NIXL engines pushing the same bytes between two processes, beside one copy of them."""
    gpu = args.device == "cuda"
    backends = "ipc,nixl" if _version("nixl") else "ipc"
    out = _cli(
        "bench", "weightsync", "--device", args.device, "--backends", backends, "--receivers", "1",
        "--sets", "llama-1b-bf16" if gpu else "tiny-fp32", "--reps", "3", "--bucket-mb", "256" if gpu else "1",
        "--json", timeout_s=LIMITS_S["weightsync"] - 10,
    )  # fmt: skip
    row = out["rows"][0]
    figures = {
        "weightsync_cuda_ipc_gbps" if gpu else "weightsync_ipc_gbps": row["ipc_gbps"],
        "weightsync_ipc_copy_gbps": row["memcpy_gbps"],
        "weightsync_nixl_gpu_gbps" if gpu else "weightsync_nixl_gbps": row.get("nixl_gbps"),
    }
    return {"ok": True, "figures": figures, "raw": row}


@check("push_dtype", 120)
def push_dtype(args: argparse.Namespace, work: Path) -> dict:
    """Bytes a parameter the trainer pushes for a model served in bf16 (the FSDP2 engine, one rank)."""
    import torch
    import torch.distributed as dist

    from slipstream.config import load_config
    from slipstream.trainer.engine.fsdp import FSDPEngine
    from slipstream.trainer.settings import from_root
    from slipstream.trainer.trainer import push_dtype as resolve
    from slipstream.utils.net import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    cfg = load_config(None, [f"model.path={_model(work, 'tiny')}", f"trainer.device={args.device}",
                             "weightsync.push_dtype=bfloat16"])  # fmt: skip
    settings = from_root(cfg)
    engine = FSDPEngine(settings)
    engine.initialize()
    nbytes = numel = 0
    for _, tensor in engine.get_per_tensor_param(dtype=resolve(settings)):
        nbytes, numel = nbytes + tensor.numel() * tensor.element_size(), numel + tensor.numel()
    dist.destroy_process_group()
    per_param = nbytes / numel
    return {
        "ok": per_param == torch.finfo(torch.bfloat16).bits / 8,
        "figures": {"push_bytes_per_param": per_param},
    }


@check("one_gpu_train", 420)
def one_gpu_train(args: argparse.Namespace, work: Path) -> dict:
    if _version("ray") is None:
        return {
            "ok": None,
            "detail": "ray is not installed (it travels separately; see scripts/gpu_check.sh)",
        }
    run_dir = work / "one-gpu"
    steps = 4
    proc = subprocess.run(
        [sys.executable, "-m", "slipstream.cli", "train", "configs/quickstart.yaml",
         f"model.path={_model(work, 'tiny')}", f"trainer.device={args.device}", f"run.output_dir={work}",
         "run.name=one-gpu",
         f"run.total_steps={steps}", "cluster.ray_address=local"],
        capture_output=True, text=True, timeout=LIMITS_S["one_gpu_train"] - 10,
    )  # fmt: skip
    metrics = run_dir / "metrics.jsonl"
    done = sum(1 for line in metrics.read_text().splitlines() if line.strip()) if metrics.exists() else 0
    return {
        "ok": proc.returncode == 0 and done >= steps,
        "figures": {"one_gpu_train_steps": done},
        "detail": proc.stderr[-3000:] if proc.returncode else "",
    }


def run_one(name: str, args: argparse.Namespace, work: Path) -> dict:
    """One check in a child process under its time limit: a hang or a crash fails that check alone."""
    start = time.monotonic()
    cmd = [
        sys.executable,
        "-m",
        "slipstream.gpucheck",
        "--device",
        args.device,
        "--child",
        name,
        "--work",
        str(work),
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=LIMITS_S[name])
        lines = proc.stdout.strip().splitlines()
        result = json.loads(lines[-1]) if proc.returncode == 0 and lines else {
            "ok": False, "detail": f"exited {proc.returncode}: {proc.stderr[-3000:]}"}  # fmt: skip
    except subprocess.TimeoutExpired:
        result = {"ok": False, "detail": f"did not finish within {LIMITS_S[name]} s"}
    result["seconds"] = round(time.monotonic() - start, 1)
    return result


def _child(name: str, args: argparse.Namespace, work: Path) -> int:
    try:
        result = CHECKS[name](args, work)
    except Exception as err:  # the parent records it as this check's failure
        result = {"ok": False, "detail": f"{type(err).__name__}: {err}"[-3000:]}
    print(json.dumps(result, default=str))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m slipstream.gpucheck", description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument(
        "--only", default="", help=f"comma-separated checks (default all: {', '.join(CHECKS)})"
    )
    parser.add_argument("--out", default="docs/gpu/results.json")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return _child(args.child, args, Path(args.work))
    names = [n for n in args.only.split(",") if n] or list(CHECKS)
    unknown = sorted(set(names) - set(CHECKS))
    if unknown:
        parser.error(f"unknown checks {unknown}; known: {list(CHECKS)}")
    results, figures = {}, {}
    with tempfile.TemporaryDirectory(prefix="slipstream-gpucheck-") as tmp:
        for name in names:
            print(f"[gpu check] {name} ...", file=sys.stderr, flush=True)
            results[name] = run_one(name, args, Path(tmp))
            figures.update(results[name].get("figures") or {})
            print(f"[gpu check] {name}: {_verdict(results[name]['ok'])} ({results[name]['seconds']} s)",
                  file=sys.stderr, flush=True)  # fmt: skip
    report = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "device": figures.get("device", args.device),
        "passed": all(r["ok"] is not False for r in results.values()),
        "figures": figures,
        "checks": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(json.dumps({"passed": report["passed"], "figures": figures}))
    return 0 if report["passed"] else 1


def _verdict(ok: bool | None) -> str:
    return {True: "pass", False: "FAIL", None: "skipped"}[ok]


if __name__ == "__main__":
    sys.exit(main())
