"""`slipstream simulate`: a run in virtual time (``sim/simulate.py``), or with ``--autotune-eval`` the
autotune controller against every static setting (``sim/autotune_eval.py``). Its own module because the
evaluation runs the simulator: neither imports the other's command."""

from __future__ import annotations

from slipstream.sim import autotune_eval, simulate


def main(argv: list[str]) -> int:
    if "--autotune-eval" in argv:
        return autotune_eval.main(argv)
    return simulate.main(argv)
