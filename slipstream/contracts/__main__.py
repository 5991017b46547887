"""``python -m slipstream.contracts [fetch|check]``: fetch the pinned releases, then check against them.

``fetch`` only fills the cache (exit 1 if it cannot); ``check`` (the default) fetches what is missing,
runs every check and prints the report (exit 1 on any problem).
"""

from __future__ import annotations

import sys

from slipstream.contracts import cache


def main(argv: list[str]) -> int:
    cmd = argv[0] if argv else "check"
    if cmd not in ("fetch", "check"):
        print(__doc__, file=sys.stderr)
        return 2
    try:
        for name, path in cache.ensure_all().items():
            print(f"{name}: {path}")
    except cache.FetchError as err:
        print(f"cannot fetch the pinned releases: {err}", file=sys.stderr)
        return 1
    if cmd == "fetch":
        return 0
    from slipstream.contracts.check import run
    from slipstream.utils.logging import get_logger

    get_logger("slipstream").setLevel(
        "ERROR"
    )  # the recorder drives real code; its progress logs are noise here
    report = run()
    print(report.summary())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
