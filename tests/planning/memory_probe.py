"""Run in a fresh process: one training step of a small model on CPU, its peak RSS above the state before it,
beside the plan's items that a step allocates and frees (everything but the sharded parameters, the AdamW
moments and the GPU reserve) for the same config. Prints one JSON line with the items."""

from __future__ import annotations

import json
import os
import sys
import threading

import psutil
import torch

from slipstream.config import load_config, trainer_settings
from slipstream.planning.memory import GIB, plan
from slipstream.trainer.engine.fsdp import FSDPEngine
from slipstream.trainer.synthetic import make_packed_batch
from slipstream.utils.net import free_port
from slipstream.utils.tiny_models import make_tiny_model


def nll(out, mb):
    mask = mb["loss_mask"].float()
    return -(out["logprobs"] * mask).sum() / mask.sum(), {}


def wide_vocab_model(path: str, vocab: int) -> str:
    """A 2-layer Llama with a large vocabulary: the root module and the logprob head dominate its step."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def main(workdir: str, checkpointing: str, vocab: int = 0) -> None:
    torch.set_num_threads(1)
    if vocab:
        path, tokens, extra = (
            wide_vocab_model(f"{workdir}/model", vocab),
            2048,
            ["trainer.logits_chunk_tokens=512"],
        )
    else:
        path = make_tiny_model(f"{workdir}/model", hidden_size=384, num_layers=4, num_heads=6, num_kv_heads=2,
                               intermediate_size=1024)  # fmt: skip
        tokens, extra = 4096, []
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    cfg = load_config(None, [f"model.path={path}", "trainer.device=cpu", f"trainer.micro_batch_tokens={tokens}",
                             f"trainer.activation_checkpointing={checkpointing}", *extra])  # fmt: skip
    engine = FSDPEngine(trainer_settings(cfg))
    engine.initialize()
    batch = make_packed_batch([16] * 16, [tokens // 16 - 16] * 16, vocab_size=200, seed=0, group_size=16)
    engine.forward_backward_batch(batch, nll)
    engine.optimizer_step()  # the optimizer's state exists before the measured step
    proc, done = psutil.Process(), threading.Event()
    base = proc.memory_info().rss
    peak = [base]

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    engine.forward_backward_batch(batch, nll)
    done.set()
    watcher.join()
    part = plan(cfg).trainer
    kept = part.items["sharded parameters, AdamW moments"] + part.items["reserve"]
    print(json.dumps({"measured_gib": (peak[0] - base) / GIB, "estimated_gib": (part.total - kept) / GIB,
                      "items_gib": {k: v / GIB for k, v in part.items.items()}}))  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 0)
