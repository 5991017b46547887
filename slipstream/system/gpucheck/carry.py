"""What the GPU machine has, and exactly what travels to it as wheels (``scripts/gpu_wheels.sh``).

The machine (``/work/.library/device/KINDS.md``) runs Python 3.12 with torch 2.11.0+cu130, transformers
5.17.0, huggingface-hub 1.33.0, tokenizers 0.23.2, safetensors 0.8.0 and a long list of common packages, and
has no package registry. Everything else Slipstream imports travels as wheels, pinned here, installed with
``pip install --no-deps --no-index`` into one folder: nothing may be missing and nothing may be carried that
the image already has in a version that works (huggingface-hub, tokenizers and safetensors above all: a newer
hub imports ``httpx2``, which the image lacks).

Stage 1 (no Ray, no NIXL) must fit one call: its wheels are ``STAGE1`` (<= ``CARRY_LIMIT_MIB``). Stage 2
adds Ray with the jsonschema family it imports at start-up, and NIXL; those travel in calls of their own.

This module imports nothing outside the standard library, so ``python3 slipstream/system/gpucheck/carry.py`` works
in any interpreter (``gpu_wheels.sh`` reads the lists that way).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

# The image's own versions (KINDS.md: "pip list, as a session saw it"; the rest of its package list has
# no versions and is installed unpinned by the rehearsal). torch stays the CPU build in the rehearsal.
IMAGE_PYTHON = "3.12"
IMAGE_TORCH = "2.11.0+cu130"
IMAGE: dict[str, str | None] = {
    "accelerate": "1.15.0",
    "huggingface-hub": "1.33.0",
    "numpy": "2.5.2",
    "safetensors": "0.8.0",
    "tokenizers": "0.23.2",
    "transformers": "5.17.0",
    "aiohttp": None,
    "httpx": None,
    "pyyaml": None,
    "pytest": None,
    "pytest-timeout": None,
    "hypothesis": None,
    "pyarrow": None,
    "rich": None,
    "psutil": None,
    "requests": None,
    "click": None,
    "h11": None,
    "anyio": None,
    "annotated-doc": None,
    "cloudpickle": None,
    "regex": None,
    "typer": None,
    "tqdm": None,
    "packaging": None,
    "sympy": None,
    "attrs": None,
    "msgpack": None,
    "protobuf": None,
    "filelock": None,
    "matplotlib": None,
    "jinja2": None,
    "pandas": None,
}
# Pins that have no build for the rehearsal's Python (3.11 here; the image runs 3.12): the newest there.
REHEARSAL_SUBSTITUTES = {"numpy": "2.4.6"}

# What the image lacks, pinned. transformers travels because Slipstream needs a newer one than 5.17.0 (the
# test suite runs 5.19.0); the image's hub, tokenizers and safetensors satisfy it.
STAGE1: dict[str, str] = {
    "transformers": "5.19.0",
    "msgspec": "0.22.0",
    "pyzmq": "27.3.0",
    "tensordict": "0.15.3",
    "pyvers": "0.2.3",
    "fastapi": "0.136.3",
    "starlette": "1.10.0",
    "pydantic": "2.14.4",
    "pydantic-core": "2.50.5",
    "annotated-types": "0.8.0",
    "typing-inspection": "0.4.5",
    "typing-extensions": "4.16.0",  # pydantic 2.14 needs >= 4.16; the image's is older or unknown
    "uvicorn": "0.54.0",
    "megatron-core": "0.16.1",
    "math-verify": "0.9.0",
    "latex2sympy2-extended": "1.11.0",
    "antlr4-python3-runtime": "4.13.2",
}
# Ray imports jsonschema (and its family) at start-up; without them `import ray` fails.
STAGE2_RAY: dict[str, str] = {
    "ray": "2.60.0",
    "jsonschema": "4.26.0",
    "jsonschema-specifications": "2025.9.1",
    "referencing": "0.37.0",
    "rpds-py": "2026.9.1",
}
STAGE2_NIXL: dict[str, str] = {"nixl": "1.5.1", "nixl-cu13": "1.5.1"}
NEVER_CARRY = ("huggingface-hub", "tokenizers", "safetensors", "torch", "numpy")
CARRY_LIMIT_MIB = 60.0
FOLDERS = {"stage1": ".whl", "ray": ".whl_ray", "nixl": ".whl_nixl"}  # ray: split into .whl_ray_1, _2
SETS = {"stage1": STAGE1, "ray": STAGE2_RAY, "nixl": STAGE2_NIXL}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_name_version(filename: str) -> tuple[str, str]:
    """``pydantic_core-2.50.5-cp312-...whl`` -> ("pydantic-core", "2.50.5")."""
    parts = Path(filename).name.split("-")
    return norm(parts[0]), parts[1]


def check_folder(folder: str | Path, wanted: dict[str, str]) -> list[str]:
    """Problems with a folder of wheels against its pinned set: missing, extra, wrong version, forbidden."""
    folder = Path(folder)
    found: dict[str, str] = {}
    problems = []
    for wheel in sorted(folder.glob("*.whl")):
        name, version = wheel_name_version(wheel.name)
        if name in found:
            problems.append(f"two wheels of {name} in {folder}")
        found[name] = version
        if "cp312" not in wheel.name and "py3-none" not in wheel.name and "abi3" not in wheel.name:
            problems.append(f"{wheel.name}: not a wheel for the image's Python {IMAGE_PYTHON}")
    want = {norm(k): v for k, v in wanted.items()}
    for name, version in want.items():
        if name not in found:
            problems.append(f"{folder}: {name}=={version} missing")
        elif found[name] != version:
            problems.append(f"{folder}: {name} is {found[name]}, pinned {version}")
    for name in sorted(set(found) - set(want)):
        problems.append(f"{folder}: {name} is carried but not pinned")
    for name in NEVER_CARRY:
        if name in found:
            problems.append(f"{folder}: {name} must not travel (the image's works)")
    return problems


def check_manifest() -> list[str]:
    """Static rules of the pins themselves (no files needed)."""
    problems = []
    carried = {norm(k) for s in SETS.values() for k in s}
    for name in NEVER_CARRY:
        if name in carried:
            problems.append(f"{name} is pinned to travel; the image's own must be used")
    if "ray" in STAGE2_RAY and not {"jsonschema", "referencing", "rpds-py"} <= set(STAGE2_RAY):
        problems.append("ray travels without jsonschema/referencing/rpds-py: `import ray` fails")
    overlap = carried & {norm(k) for k, v in IMAGE.items() if v is None}
    problems += [f"{name} travels though the image has it" for name in sorted(overlap)]
    return problems


def mib(folder: str | Path) -> float:
    return sum(p.stat().st_size for p in Path(folder).glob("*.whl")) / 2**20


def specs(which: str) -> list[str]:
    return [f"{name}=={version}" for name, version in SETS[which].items()]


def image_specs(rehearsal: bool = True) -> list[str]:
    """The image's packages as pip requirements (pinned where the version is known)."""
    out = []
    for name, version in IMAGE.items():
        if rehearsal and name in REHEARSAL_SUBSTITUTES and sys.version_info[:2] != (3, 12):
            version = REHEARSAL_SUBSTITUTES[name]
        out.append(f"{name}=={version}" if version else name)
    return out


if __name__ == "__main__":  # gpu_wheels.sh: `python3 carry.py specs stage1` | `folder stage1` | `check`
    verb, *rest = sys.argv[1:] or ["check"]
    if verb == "specs":
        print("\n".join(specs(rest[0])))
    elif verb == "folder":
        print(FOLDERS[rest[0]])
    elif verb == "image":
        print("\n".join(image_specs()))
    else:
        found = check_manifest()
        for which, folder in FOLDERS.items():
            if Path(folder).is_dir():
                found += check_folder(folder, SETS[which])
        print("\n".join(found) or "ok")
        sys.exit(1 if found else 0)
