"""`scripts/gpu_check.sh --rehearse DIR`: the GPU run's stage 1, on a CPU, in the GPU machine's environment.

1. The carried set is checked against its pins (carry.py): every wheel of ``.whl`` present, none extra, none
   the image already has, built for the image's Python, and ``carry_mib`` <= 60 (a call carries 64 MiB with
   the working tree). Missing wheels are fetched with ``scripts/gpu_wheels.sh`` first.
2. A venv (``DIR/venv``) gets the image's packages at the image's versions (carry.IMAGE; torch stays the CPU
   build torch==2.13.0, and a pin with no build for this Python is replaced by the newest that has one,
   recorded in ``substitutes``), then exactly the carried wheels with ``--no-deps``, as the GPU machine gets
   them (a wheel built for Python 3.12 is installed as the same version built for this Python).
3. Stage 1 runs in that venv with the repository on ``PYTHONPATH`` (as on the GPU machine), ``--small``, its
   limits stretched by ``--limit-scale`` for a slow CPU; ``DIR/results.json`` gets every check and
   ``carry_mib``; it passes when every check passed and the carried set is right.

``--reuse-venv`` skips step 2 and runs the checks with this interpreter (the suite's reduced form, where
building a venv would take minutes); the carried set and version list are then only checked statically.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from slipstream.system.gpucheck import carry

REPO = Path(__file__).resolve().parents[3]
CPU_TORCH = "torch==2.13.0"


def _pip(python: Path, *args: str, log) -> None:
    cmd = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *args]
    print("+", " ".join(cmd), file=log, flush=True)
    subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT, timeout=1800)


def build_venv(venv: Path, log) -> dict:
    """The image's versions plus the carried wheels; returns what was substituted for this Python."""
    if not (venv / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    _pip(python, CPU_TORCH, log=log)
    _pip(python, *carry.image_specs(rehearsal=True), log=log)
    wheels = sorted((REPO / carry.FOLDERS["stage1"]).glob("*.whl"))
    here = f"cp{sys.version_info.major}{sys.version_info.minor}"
    portable = [str(w) for w in wheels if "-py3-none-any" in w.name]
    native = [f"{n}=={v}" for n, v in (carry.wheel_name_version(w.name) for w in wheels
              if "-py3-none-any" not in w.name)]  # fmt: skip
    _pip(python, "--no-deps", "--upgrade", *portable, log=log)
    if native:  # the same versions, built for this interpreter
        _pip(python, "--no-deps", "--upgrade", "--only-binary=:all:", *native, log=log)
    subs = {k: v for k, v in carry.REHEARSAL_SUBSTITUTES.items() if sys.version_info[:2] != (3, 12)}
    return {"python": sys.version.split()[0], "image_python": carry.IMAGE_PYTHON, "native_as": here,
            "substitutes": subs, "torch": CPU_TORCH}  # fmt: skip


def static_checks() -> tuple[list[str], float]:
    folder = REPO / carry.FOLDERS["stage1"]
    problems = carry.check_manifest()
    if not list(folder.glob("*.whl")):
        problems.append(f"{folder} holds no wheels: run scripts/gpu_wheels.sh")
        return problems, 0.0
    problems += carry.check_folder(folder, carry.STAGE1)
    size = carry.mib(folder)
    if size > carry.CARRY_LIMIT_MIB:
        problems.append(f"the carried wheels are {size:.1f} MiB, over {carry.CARRY_LIMIT_MIB} MiB")
    from slipstream.system.gpucheck.runner import CHECKS, STAGE_BUDGET_S, stage_checks

    total = sum(CHECKS[n].limit_s for n in stage_checks(1))
    if total > STAGE_BUDGET_S[1]:
        problems.append(f"stage 1 limits add up to {total} s, over its budget of {STAGE_BUDGET_S[1]} s")
    return problems, round(size, 2)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/gpu_check.sh --rehearse", description=__doc__.split("\n")[0])
    # Hand-written: where the rehearsal builds and what it runs, no config key.
    p.add_argument("--dir", required=True)
    p.add_argument("--reuse-venv", action="store_true", help="run with this interpreter (no venv built)")
    p.add_argument("--only", default="", help="comma-separated stage-1 checks (default: all)")
    p.add_argument("--limit-scale", type=float, default=float(os.environ.get("SLIPSTREAM_REHEARSE_SCALE", 6)))
    args = p.parse_args(argv)
    out = Path(args.dir).absolute()
    out.mkdir(parents=True, exist_ok=True)
    folder = REPO / carry.FOLDERS["stage1"]
    if not list(folder.glob("*.whl")) and not args.reuse_venv:
        subprocess.run(["bash", str(REPO / "scripts" / "gpu_wheels.sh")], cwd=REPO, timeout=900)
    problems, size = static_checks()
    start = time.monotonic()
    env_info: dict = {"reused": sys.executable} if args.reuse_venv else {}
    python = Path(sys.executable)
    if not args.reuse_venv and not problems:
        with open(out / "venv.log", "w") as log:
            try:
                env_info = build_venv(out / "venv", log)
                python = out / "venv" / "bin" / "python"
            except subprocess.CalledProcessError as err:
                problems.append(f"building the venv failed ({err}); see {out / 'venv.log'}")
    env_info["build_s"] = round(time.monotonic() - start, 1)
    (out / "results.json").unlink(missing_ok=True)
    rc = None
    if not problems:
        env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "disabled"}  # fmt: skip
        env.pop("OUT", None)
        cmd = [str(python), "-m", "slipstream.system.gpucheck", "--device", "cpu", "--small", "--stage", "1",
               "--out", str(out), "--work", str(out / "work"), "--limit-scale", str(args.limit_scale)]  # fmt: skip
        if args.only:
            cmd += ["--only", args.only]
        rc = subprocess.run(cmd, cwd=REPO, env=env).returncode
    report = json.loads((out / "results.json").read_text()) if (out / "results.json").exists() else {}
    checks = report.get("checks", {})
    report.update(carry_mib=size, carry_limit_mib=carry.CARRY_LIMIT_MIB, carried=carry.specs("stage1"),
                  rehearsal=env_info, problems=problems,
                  passed=not problems and rc == 0 and bool(checks) and all(c.get("ok") for c in checks.values()))  # fmt: skip
    (out / "results.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    verdict = {n: c.get("ok") for n, c in checks.items()}
    print(
        json.dumps({"passed": report["passed"], "carry_mib": size, "checks": verdict, "problems": problems})
    )
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
