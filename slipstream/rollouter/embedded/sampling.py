"""Per-request sampling for the embedded engine, on top of transformers' continuous-batching warpers.

transformers applies per-request temperature, top-k and top-p through its ``ContinuousBatching*LogitsWarper``
classes, but only (a) when the generation config named a non-default value at start-up and (b) always over
the whole batch: top-k and top-p each sort the full ``[batch, vocab]`` score matrix at every step, even when
no request in the batch asked for them, which on CPU costs as much as the model's forward pass for a
135M model with a 49k vocabulary. RL sampling almost always runs with both filters off.

So the engine starts the manager with placeholder values (which makes transformers build the three
warpers) and :func:`install_fast_warpers` swaps them for the subclasses below. They keep transformers'
arithmetic and tensor layout and add two things:

* a fast path that returns the scores untouched when no row of the batch needs the filter (skipped while
  a CUDA graph is being captured, where a data-dependent branch is not allowed);
* greedy decoding for ``temperature < GREEDY_BELOW`` (1e-4; 0 is the usual way to ask): every token but the
  arg-max gets ``-inf``, so the sampler picks the arg-max and the returned log-probability is 0. Dividing by
  a temperature that small would overflow to ``inf`` and turn the sampling distribution into NaNs, which
  stops transformers' generation loop for every request, so such values never reach the division.

What the returned log-probabilities mean (the trainer must compute the same thing): transformers computes
them from the *processed* scores, after the warpers, so a token's logprob is ``log_softmax(logits / T)``
renormalised over the tokens that survive top-k and top-p. With both filters off (``top_k=-1``,
``top_p=1``) that is exactly ``log_softmax(logits / T)[token]``; for greedy requests it is 0.
"""

from __future__ import annotations

import torch
from transformers.generation.continuous_batching.cb_logits_processors import (
    ContinuousBatchingTemperatureLogitsWarper,
    ContinuousBatchingTopKLogitsWarper,
    ContinuousBatchingTopPLogitsWarper,
)

# Placeholder values handed to GenerationConfig so transformers creates each warper; every request then
# sends its own values, so these never take effect.
PLACEHOLDER_TEMPERATURE = 0.5
PLACEHOLDER_TOP_K = 50
PLACEHOLDER_TOP_P = 0.5
# Temperatures below this decode greedily.
GREEDY_BELOW = 1e-4


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class FastTemperatureWarper(ContinuousBatchingTemperatureLogitsWarper):
    """Divides by each row's temperature; a temperature below ``GREEDY_BELOW`` means greedy."""

    def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
        temperatures = tensor_arg[: scores.size(0)].view(dtype=torch.float32).unsqueeze(-1)
        greedy = temperatures < GREEDY_BELOW
        scaled = scores / torch.where(greedy, torch.ones_like(temperatures), temperatures)
        not_argmax = scores < scores.amax(dim=-1, keepdim=True)
        return scaled.masked_fill(greedy & not_argmax, float("-inf"))


class FastTopKWarper(ContinuousBatchingTopKLogitsWarper):
    """transformers' per-row top-k, skipped when every row keeps the whole vocabulary."""

    def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
        if not _capturing() and bool((tensor_arg[: scores.size(0)] >= scores.size(-1)).all()):
            return scores
        return super().__call__(scores, tensor_arg)


class FastTopPWarper(ContinuousBatchingTopPLogitsWarper):
    """transformers' per-row top-p, skipped when every row has ``top_p >= 1``."""

    def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
        top_p = tensor_arg[: scores.size(0)].view(dtype=torch.float32)
        if not _capturing() and bool((top_p >= 1.0).all()):
            return scores
        return super().__call__(scores, tensor_arg)


_FAST = {
    ContinuousBatchingTemperatureLogitsWarper: FastTemperatureWarper,
    ContinuousBatchingTopKLogitsWarper: FastTopKWarper,
    ContinuousBatchingTopPLogitsWarper: FastTopPWarper,
}


def install_fast_warpers(manager) -> None:
    """Swap the manager's three per-request warpers for the fast subclasses (before ``manager.start()``).

    Raises when one of them is missing: the engine relies on all three to honour per-request values.
    """
    processors = manager.logit_processor.logits_processor
    found = set()
    for i, proc in enumerate(processors):
        fast_cls = _FAST.get(type(proc))
        if fast_cls is None:
            continue
        fast = fast_cls.__new__(fast_cls)
        fast.__dict__.update(proc.__dict__)
        processors[i] = fast
        found.add(type(proc))
    missing = [cls.__name__ for cls in _FAST if cls not in found]
    if missing:
        raise RuntimeError(f"continuous batching did not create the per-request warpers {missing}")


def request_sampling_kwargs(temperature: float, top_k: int, top_p: float, vocab_size: int) -> dict:
    """The per-request keyword arguments ``ContinuousBatchingManager.add_request`` expects.

    ``top_k == -1`` (SGLang's "off") becomes the vocabulary size, which the fast path recognises; the types
    are exactly the ones transformers checks (a Python int temperature would be rejected).
    """
    return {
        "temperature": float(temperature),
        "top_k": int(vocab_size if top_k < 0 or top_k >= vocab_size else top_k),
        "top_p": float(top_p),
    }
