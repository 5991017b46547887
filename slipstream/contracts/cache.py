"""The local copy of the pinned upstream sources: fetched once with ``pip download --no-deps``, unpacked.

Layout: ``<cache>/<dist>-<version>/`` holds the ``.py`` files of the pin's top-level packages (nothing
is installed or imported), plus ``.complete`` written last, so a half-finished fetch is never taken
for a warm cache. The wheel itself is deleted after unpacking: vLLM's is over 300 MB, its Python
sources about 50 MB. ``<cache>`` is ``.cache/contracts`` under the repository (git-ignored) unless
``SLIPSTREAM_CONTRACTS_CACHE`` names another directory.

Example::

    root = ensure(PINS["vllm"])          # fetches on first use, then returns at once
    (root / "vllm/entrypoints/rl/online/api_router.py").read_text()
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from slipstream.contracts.pins import PINS, WHEEL_TARGET, Pin

CACHE_ENV = "SLIPSTREAM_CONTRACTS_CACHE"
_MARKER = ".complete"


class FetchError(RuntimeError):
    """A pinned release could not be downloaded or unpacked (no network, unknown version, ...)."""


def cache_dir() -> Path:
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    return Path(__file__).resolve().parents[2] / ".cache" / "contracts"


def pin_dir(pin: Pin, root: Path | None = None) -> Path:
    return (root or cache_dir()) / pin.key


def is_warm(pins: list[Pin] | None = None, root: Path | None = None) -> bool:
    """True when every pin (default: all of :data:`PINS`) is unpacked in the cache."""
    return all((pin_dir(p, root) / _MARKER).exists() for p in (pins or list(PINS.values())))


def missing(root: Path | None = None) -> list[Pin]:
    return [p for p in PINS.values() if not (pin_dir(p, root) / _MARKER).exists()]


def ensure(pin: Pin, root: Path | None = None) -> Path:
    """The unpacked sources of ``pin``, fetching them first if the cache lacks them."""
    dest = pin_dir(pin, root)
    if (dest / _MARKER).exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=dest.parent) as tmp:
        wheel = _download(pin, Path(tmp))
        staging = Path(tmp) / "unpacked"
        _unpack(wheel, pin, staging)
        (staging / _MARKER).write_text(wheel.name + "\n")
        if dest.exists():  # a cold leftover of an interrupted fetch
            shutil.rmtree(dest)
        staging.rename(dest)
    return dest


def ensure_all(root: Path | None = None) -> dict[str, Path]:
    return {name: ensure(pin, root) for name, pin in PINS.items()}


def _download(pin: Pin, into: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", *WHEEL_TARGET]
    cmd += ["--disable-pip-version-check", "-q", "-d", str(into), pin.requirement]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise FetchError(f"pip download {pin.requirement}: {err}") from err
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise FetchError(f"pip download {pin.requirement} failed: {' | '.join(tail)}")
    wheels = sorted(into.glob("*.whl"))
    if not wheels:
        raise FetchError(f"pip download {pin.requirement} produced no wheel in {into}")
    return wheels[0]


def _unpack(wheel: Path, pin: Pin, dest: Path) -> None:
    """Extract only the Python sources of the pin's packages (no shared libraries, no data)."""
    prefixes = tuple(f"{p}/" for p in pin.packages)
    try:
        with zipfile.ZipFile(wheel) as zf:
            names = [n for n in zf.namelist() if n.startswith(prefixes) and n.endswith((".py", ".pyi"))]
            if not names:
                raise FetchError(f"{wheel.name} has no Python sources under {', '.join(prefixes)}")
            for name in names:
                zf.extract(name, dest)
    except zipfile.BadZipFile as err:
        raise FetchError(f"{wheel.name}: {err}") from err
    finally:
        wheel.unlink(missing_ok=True)
