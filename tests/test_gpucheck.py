"""The GPU check, on a CPU: what travels, how checks run and die, the one-GPU configs, and a reduced rehearsal.

The full rehearsal (`scripts/gpu_check.sh --rehearse DIR`) builds a venv with the GPU image's versions and
takes minutes; here it runs reduced: this venv, a few stage-1 checks at small shapes, the carried set and the
version list checked statically.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from slipstream.config import ConfigError, load_config
from slipstream.system.gpucheck import carry, runner
from slipstream.system.gpucheck.runner import CHECKS, STAGE_BUDGET_S, stage_checks

REPO = Path(__file__).resolve().parents[1]
ISSUE_FIGURES = {"weightsync_cuda_ipc_gbps", "weightsync_ipc_copy_gbps", "push_bytes_per_param",
                 "embedded_vs_generate_256", "embedded_vs_generate_64", "embedded_logprob_err_bf16",
                 "trainer_mfu_1b", "long_32k_peak_gb", "one_gpu_train_steps"}  # fmt: skip


# ------------------------------------------------------------------------------------------ what travels
def test_the_carried_set_never_holds_what_the_image_has_and_ray_brings_jsonschema():
    assert carry.check_manifest() == []
    for name in ("huggingface-hub", "tokenizers", "safetensors", "torch"):
        assert name not in carry.STAGE1 and name not in carry.STAGE2_RAY
    assert {"jsonschema", "referencing", "rpds-py", "jsonschema-specifications"} <= set(carry.STAGE2_RAY)
    assert "ray" not in carry.STAGE1 and "nixl" not in carry.STAGE1  # stage 1 needs neither


def test_gpu_wheels_takes_its_lists_from_the_pins():
    script = (REPO / "scripts" / "gpu_wheels.sh").read_text()
    assert 'CARRY="$PY slipstream/system/gpucheck/carry.py"' in script and '$CARRY specs "$which"' in script


def _wheels() -> Path:
    folder = REPO / carry.FOLDERS["stage1"]
    if not list(folder.glob("*.whl")):
        proc = subprocess.run(["bash", "scripts/gpu_wheels.sh"], cwd=REPO, capture_output=True, text=True,
                              timeout=600)  # fmt: skip
        if proc.returncode or not list(folder.glob("*.whl")):
            pytest.skip(f"no package registry to fetch the carried wheels from: {proc.stderr[-300:]}")
    return folder


def test_the_carried_wheels_are_exactly_the_pins_and_fit_a_call():
    folder = _wheels()
    assert carry.check_folder(folder, carry.STAGE1) == []
    assert carry.mib(folder) <= carry.CARRY_LIMIT_MIB


def _ray_wheels(tmp: Path) -> list[Path]:
    """Stage 2's Ray wheels (Ray put back together from its parts), where gpu_wheels.sh fetched them."""
    first, second = REPO / ".whl_ray_1", REPO / ".whl_ray_2"
    if not (first / "PARTS").exists():
        return []
    parts = (first / "PARTS").read_text().split()
    found = [d / p for p in parts for d in (first, second) if (d / p).exists()]
    if len(found) != len(parts):
        return []
    ray = tmp / parts[0].rsplit(".part.", 1)[0]
    ray.write_bytes(b"".join(p.read_bytes() for p in found))
    return [ray, *first.glob("*.whl")]


def test_every_carried_wheel_finds_what_it_requires_on_the_gpu_machine(tmp_path):
    """Each stage-1 wheel's requirements (for Python 3.12 on Linux) are carried or in the image, and the
    versions the image pins satisfy them (a hub that imports httpx2, or Ray without jsonschema, fails here)."""
    from packaging.requirements import Requirement

    env = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
           "platform_system": "Linux", "implementation_name": "cpython", "platform_machine": "x86_64",
           "os_name": "posix", "platform_python_implementation": "CPython", "extra": ""}  # fmt: skip
    present = {carry.norm(k): v for k, v in carry.IMAGE.items()}
    for pins in (carry.STAGE1, carry.STAGE2_RAY):
        present.update({carry.norm(k): v for k, v in pins.items()})
    present.update(torch="2.11.0", cffi=None)  # torch: the image's; cffi only for PyPy's pyzmq
    problems = []
    for wheel in [*_wheels().glob("*.whl"), *_ray_wheels(tmp_path)]:
        with zipfile.ZipFile(wheel) as z:
            meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            lines = z.read(meta).decode().splitlines()
        for line in lines:
            if not line.startswith("Requires-Dist:"):
                continue
            req = Requirement(line.split(":", 1)[1].strip())
            if req.marker is not None and not req.marker.evaluate(env):
                continue
            name = carry.norm(req.name)
            if name not in present:
                problems.append(f"{wheel.name}: needs {req}, neither carried nor in the image")
            elif present[name] and not req.specifier.contains(present[name], prereleases=True):
                problems.append(f"{wheel.name}: needs {req}, the GPU machine has {present[name]}")
    assert problems == []


# ------------------------------------------------------------------------------------------ the runner
def test_stage_one_fits_one_call_and_names_the_issue_figures():
    names = stage_checks(1)
    assert names[0] == "preflight"
    assert sum(CHECKS[n].limit_s for n in names) <= STAGE_BUDGET_S[1] <= 400
    assert not {"one_gpu_train", "nixl_weightsync"} & set(names)
    source = "".join(
        (REPO / "slipstream" / "system" / "gpucheck" / f).read_text()
        for f in ("checks.py", "rollout.py", "stage2.py")
    )
    source += "".join(f'"embedded_vs_generate_{n}"' for n in (64, 256) if "[64, 256]" in source)
    assert [f for f in sorted(ISSUE_FIGURES) if f'"{f}"' not in source] == []


_TREE = """
import os, subprocess, sys, time
# a child in a session of its own (as a server is launched), which the check's group kill cannot reach
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
open(sys.argv[1], "w").write("started")
time.sleep(600)
"""


def test_a_check_past_its_limit_is_killed_with_everything_it_started(tmp_path):
    started = tmp_path / "started"
    tag = "test-" + os.urandom(4).hex()
    proc = subprocess.Popen([sys.executable, "-c", _TREE, str(started)], start_new_session=True,
                            env={**os.environ, runner.TAG_ENV: tag})  # fmt: skip
    try:
        while not started.exists():  # polls for a state, yielding the core
            assert proc.poll() is None
            time.sleep(0.05)
        assert len(runner.tagged_pids(tag)) == 2
        assert runner.kill_tagged(tag, proc.pid) == 1  # the grandchild; the leader is no stray
        proc.wait(timeout=60)
        assert proc.returncode == -signal.SIGKILL
        while runner.tagged_pids(tag):  # the grandchild dies asynchronously after SIGKILL
            time.sleep(0.05)
    finally:
        runner.kill_tagged(tag)


_HANGING_CHECK = """
import subprocess, sys, time
from slipstream.system.gpucheck.runner import check, partial

@check("hangs_with_a_server", 20)
def hangs(ctx):
    # a server-like child in a session of its own, then a hang: the runner must take both down
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    partial(ctx, "hangs_with_a_server", {"measured_before_the_hang": 1.5})
    time.sleep(600)
"""


def test_a_check_that_runs_out_of_time_is_killed_with_its_servers_and_recorded_at_once(tmp_path, monkeypatch):
    (tmp_path / "hanging_check.py").write_text(_HANGING_CHECK)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{REPO}")
    monkeypatch.setenv(runner.PLUGINS_ENV, "hanging_check")
    runner.load_checks()
    out, work = tmp_path / "out", tmp_path / "work"
    out.mkdir()
    work.mkdir()
    ctx = runner.Context("cpu", True, work, out, 0)
    try:
        report = runner.run(["hangs_with_a_server"], ctx, budget_s=60, report={})
    finally:
        CHECKS.pop("hangs_with_a_server", None)
    on_disk = json.loads((out / "results.json").read_text())
    result = on_disk["checks"]["hangs_with_a_server"]
    assert result["ok"] is False and "did not finish within 20 s" in result["detail"]
    assert result["killed_after"] == 1  # the server in its own session, which the group kill misses
    assert on_disk["figures"] == {"measured_before_the_hang": 1.5}  # what it measured before the limit
    assert on_disk == json.loads(json.dumps(report, default=str))


# ------------------------------------------------------------------------------------------ configs
def test_the_one_gpu_run_declares_both_pools_colocates_and_pushes_over_ipc(tiny_model_path, tmp_path):
    from slipstream.pipeline.modes import check_config, prepare_config
    from slipstream.pipeline.placement import Node, fit, local_resources, plan
    from slipstream.system.gpucheck.stage2 import one_gpu_train_overrides

    overrides = one_gpu_train_overrides(tiny_model_path, tmp_path, "cuda", data=tmp_path / "d.parquet")
    cfg, _ = prepare_config(load_config(str(REPO / "configs" / "quickstart.yaml"), overrides))
    check_config(cfg, environment=False)
    assert (
        cfg.cluster.ray_address is None
    )  # a local start declares the pools (an address of `local` does not)
    assert cfg.cluster.colocate and cfg.weightsync.backend == "ipc" and cfg.wandb.mode == "disabled"
    node = Node("n1", "127.0.0.1", {"CPU": 16.0, "GPU": 1.0, **local_resources(cfg, 1)})
    groups, _ = plan(cfg)
    assert all(n == "n1" for placed in fit(groups, [node]).values() for n in placed)


def test_colocate_refuses_a_transport_that_cannot_share_one_gpu():
    base = ["cluster.colocate=true", "cluster.gpus_per_server=1", "cluster.gpus_per_trainer_rank=1",
            "trainer.device=cuda"]  # fmt: skip
    from slipstream.pipeline.placement import check_layout

    with pytest.raises(ConfigError, match="weightsync.backend: `torch_dist` cannot push.*ipc"):
        check_layout(load_config(None, [*base, "weightsync.device=cuda"]))
    for ok in ("weightsync.backend=ipc", "weightsync.backend=auto", "weightsync.device=cpu"):
        check_layout(load_config(None, [*base, ok]))
    for kind in ("vllm", "sglang"):
        with pytest.raises(
            ConfigError, match=f"cluster.colocate: `{kind}` servers have no weight transport.*Missing"
        ):
            check_layout(load_config(None, [*base, f"rollout.backend={kind}", "weightsync.device=cuda"]))


# ------------------------------------------------------------------------------------------ skips
_FAKE_ONE_GPU = """
import torch
torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 1
"""


def test_on_one_gpu_the_two_gpu_and_live_server_cases_skip(tmp_path):
    (tmp_path / "fake_one_gpu.py").write_text(_FAKE_ONE_GPU)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("SLIPSTREAM_TEST_MODEL", None)
    report = tmp_path / "junit.xml"
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "fake_one_gpu", "-p", "no:cacheprovider", "-m", "gpu",
         "-k", "torch_dist or live_server", f"--junitxml={report}", "tests/weightsync/test_gpu.py"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    from slipstream.system.gpucheck.checks import junit

    outcomes, unimportable = junit(report)
    assert not unimportable and len(outcomes) == 3
    assert set(outcomes.values()) == {"skipped"}, outcomes


# ------------------------------------------------------------------------------------------ rehearsal
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_reduced_rehearsal_runs_stage_one_plumbing_and_checks_the_carried_set(tmp_path):
    _wheels()
    proc = subprocess.run(
        [sys.executable, "-m", "slipstream.system.gpucheck.rehearse", "--dir", str(tmp_path), "--reuse-venv",
         "--only", "weightsync_ipc,train_32k", "--limit-scale", "20"],
        cwd=REPO, capture_output=True, text=True, timeout=580,
    )  # fmt: skip
    report = json.loads((tmp_path / "results.json").read_text())
    assert report["problems"] == [] and report["carry_mib"] <= 60
    checks = report["checks"]
    assert set(checks) == {"weightsync_ipc", "train_32k"}
    assert all(c["ok"] for c in checks.values()), {
        n: c.get("detail") or c.get("tail") for n, c in checks.items()
    }
    figures = report["figures"]
    assert figures["weightsync_shm_ipc_gbps"] > 0 and figures["train_32k_logit_chunks_per_step"] >= 2
    assert report["passed"] and proc.returncode == 0
