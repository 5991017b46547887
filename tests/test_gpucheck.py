"""The GPU check runner, on a CPU: each check in its own process, results and figures in one JSON file."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from slipstream import gpucheck


def test_the_cpu_run_of_the_checks_writes_results_and_figures(tmp_path):
    out = tmp_path / "results.json"
    proc = subprocess.run(
        [sys.executable, "-m", "slipstream.gpucheck", "--device", "cpu", "--only", "env,push_dtype",
         "--out", str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["passed"] and set(report["checks"]) == {"env", "push_dtype"}
    assert all(check["ok"] and check["seconds"] >= 0 for check in report["checks"].values())
    figures = report["figures"]
    assert figures["torch"]
    assert figures["push_bytes_per_param"] == 2.0  # a bf16-served model pushes two bytes a parameter
    assert json.loads(proc.stdout.strip().splitlines()[-1])["figures"] == figures


def test_a_failing_check_fails_alone_and_names_its_error(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    result = gpucheck.run_one("weightsync", _args(device="cuda-less"), work)
    assert result["ok"] is False and "invalid choice" in result["detail"]


def test_unknown_checks_are_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        gpucheck.main(["--device", "cpu", "--only", "env,warp_drive"])
    assert "warp_drive" in capsys.readouterr().err


def _args(**kw):
    import argparse

    return argparse.Namespace(**kw)
