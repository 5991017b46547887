"""What the sampling-mask tests against real servers share: a checkpoint whose next-token distributions are
peaked enough for top-k 20 and top-p 0.8 to cut (the tiny random model's are nearly flat), and the trainer's
logprobs of a server's tokens computed with ``trainer/logprobs.py`` on that checkpoint.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from slipstream.trainer.logprobs import full_token_logprobs, sampling_truncation, token_logprobs

# (temperature, top_k, top_p): each filter alone, both, and both under a temperature below 1.
SETTINGS = [(1.0, 20, 1.0), (1.0, -1, 0.8), (1.0, 20, 0.8), (0.7, 20, 0.8)]
# lm_head scale: logits of std ~3, so a handful of tokens carry most of the mass and top-p 0.8 binds.
SHARPEN = 20.0


def sharpened(src: Path, dst: Path, scale: float = SHARPEN) -> Path:
    """``src`` with its output layer scaled by ``scale``, saved as a checkpoint directory at ``dst``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(scale)
    model.save_pretrained(dst)
    for f in Path(src).iterdir():  # the tokenizer's files
        if f.is_file() and not (dst / f.name).exists():
            shutil.copy(f, dst / f.name)
    return dst


class TrainerView:
    """The trainer's logprobs of a server's tokens: the checkpoint's final hidden states through
    :func:`token_logprobs` (the chunked head) or :func:`full_token_logprobs` (the plain path)."""

    def __init__(self, path: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def logprobs(
        self,
        prompt: list[int],
        output: list[int],
        temperature: float,
        top_k: int,
        top_p: float,
        *,
        replay=True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(chunked, plain) fp32 logprobs of ``output`` after ``prompt``; ``replay=False``: unfiltered."""
        trunc = sampling_truncation(temperature, top_k, top_p) if replay else None
        ids = torch.tensor([prompt + output])
        with torch.no_grad():
            hidden = self.model.model(input_ids=ids).last_hidden_state[0, len(prompt) - 1 : -1]
            weight, targets = self.model.get_output_embeddings().weight, torch.tensor(output)
            chunked, _ = token_logprobs(
                hidden, weight, targets, temperature=temperature, chunk=16, truncation=trunc
            )
            plain, _ = full_token_logprobs(hidden, weight, targets, temperature=temperature, truncation=trunc)
        return chunked, plain

    def tensors(self):
        return ((n, p.detach().clone()) for n, p in self.model.named_parameters())


def compare(
    view: TrainerView, prompt, output, server_logprobs, temperature, top_k, top_p
) -> dict[str, float]:
    """Max |trainer - server| with the replay (chunked and plain path) and without it."""
    server = torch.tensor(server_logprobs, dtype=torch.float32)
    chunked, plain = view.logprobs(prompt, output, temperature, top_k, top_p)
    unfiltered, _ = view.logprobs(prompt, output, temperature, top_k, top_p, replay=False)
    return {
        "chunked": (chunked - server).abs().max().item(),
        "plain": (plain - server).abs().max().item(),
        "no_replay": (unfiltered - server).abs().max().item(),
    }
