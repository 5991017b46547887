"""Ray's subreaper setting makes the driver and every worker ignore SIGCHLD; the pipeline's processes take
the default back, so a failed child's exit code is seen (a server that dies reports its own code)."""

from __future__ import annotations

import subprocess
import sys

from slipstream.pipeline.actors import wait_for_own_children

FAIL = [sys.executable, "-c", "raise SystemExit(3)"]


def test_a_childs_exit_code_survives_ray_in_the_driver_and_in_an_actor(ray_pools):
    import ray

    class _Parent:  # defined here so Ray ships it by value (workers cannot import the tests)
        def __init__(self) -> None:
            wait_for_own_children()

        def child_code(self) -> int:
            return subprocess.run(FAIL).returncode

    assert subprocess.run(FAIL).returncode == 3
    parent = ray.remote(_Parent).options(num_cpus=0).remote()
    try:
        assert ray.get(parent.child_code.remote(), timeout=120) == 3
    finally:
        ray.kill(parent)
