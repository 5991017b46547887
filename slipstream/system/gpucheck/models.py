"""Random-initialised models of the shapes the GPU figures are measured on, built once per run, and digests.

``1b`` is the 1.17B shape of the earlier H100 figures (hidden 2048, 16 layers, 32 heads, 8 KV heads,
intermediate 8192) with SmolLM2's 49,152-token vocabulary; ``135m`` is SmolLM2-135M's shape; ``small`` the
rehearsal's stand-in for both on a CPU. Each comes with a word-level tokenizer covering its whole
vocabulary, so any sampled id decodes. The output layer is scaled up (``head_scale``) so the next-token
distributions are peaked, as a trained model's are: a logprob error bound then tells right weights from
wrong ones (on a near-uniform random model every logprob is about -log V and any bound passes). The EOS row
of the output layer is zero, so generation never stops early and every side makes the same tokens.
"""

from __future__ import annotations

import fcntl
import json
from pathlib import Path

SHAPES = {
    "1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=8192, vocab_size=49152),
    "135m": dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                 intermediate_size=1536, vocab_size=49152),
    "small": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, vocab_size=512),
}  # fmt: skip
HEAD_SCALE = 4.0


def make_tokenizer(path: Path, vocab_size: int):
    """A word-level tokenizer with ids 0..vocab_size-1 (``<unk>``, ``<pad>``, ``<eos>``, then ``w3``...)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<pad>": 1, "<eos>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>"
    )
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tok.save_pretrained(path)
    return tok


def model_dir(work: Path, shape: str, *, seed: int = 0, dtype: str = "bfloat16", max_positions: int = 4096,
              device: str = "cpu") -> Path:  # fmt: skip
    """The checkpoint directory of ``shape`` (built on first use, under a lock: checks share it)."""
    path = work / f"model-{shape}-s{seed}-{dtype}-p{max_positions}"
    with open(work / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (path / "config.json").exists():
            _build(path, shape, seed, dtype, max_positions, device)
    return path


def _build(path: Path, shape: str, seed: int, dtype: str, max_positions: int, device: str) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    make_tokenizer(path, SHAPES[shape]["vocab_size"])
    config = LlamaConfig(
        **SHAPES[shape], max_position_embeddings=max_positions, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=2, pad_token_id=1, torch_dtype=dtype,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        if device != "cpu":
            torch.cuda.manual_seed(seed)
        model = LlamaForCausalLM(config).to(getattr(torch, dtype))
        with torch.no_grad():
            model.lm_head.weight.mul_(HEAD_SCALE)
            model.lm_head.weight[config.eos_token_id].zero_()  # never sampled: every run makes all its tokens
    model.save_pretrained(path)
    (path / "gpucheck.json").write_text(json.dumps({"shape": shape, "seed": seed, "head_scale": HEAD_SCALE}))
    del model


def num_params(shape: str) -> int:
    s = SHAPES[shape]
    h, layers, inter, vocab = (
        s["hidden_size"],
        s["num_hidden_layers"],
        s["intermediate_size"],
        s["vocab_size"],
    )
    kv = h // s["num_attention_heads"] * s["num_key_value_heads"]
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * inter + 2 * h
    return layers * per_layer + 2 * vocab * h + h


def digest(tensors) -> str:
    """A digest of the bytes of named tensors (any device), computed where they live, in 32M-element pieces:
    sum over elements of (bits as integers) * (1 + position mod 251), per tensor, then hashed together."""
    import hashlib

    import torch

    h = hashlib.sha256()
    for name, t in sorted(tensors, key=lambda kv: kv[0]):
        flat = t.detach().contiguous().view(-1)
        ints = flat.view(
            {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
        )
        total = 0
        step = 1 << 25
        for s in range(0, ints.numel(), step):
            piece = ints[s : s + step].to(torch.int64)
            weights = torch.arange(s, s + piece.numel(), device=piece.device) % 251 + 1
            total += int((piece * weights).sum())
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}:{total};".encode())
    return h.hexdigest()[:16]
