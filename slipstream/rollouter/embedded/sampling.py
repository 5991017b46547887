"""Per-request sampling for the embedded engine, on top of transformers' continuous-batching warpers.

transformers applies per-request temperature, top-k and top-p through its ``ContinuousBatching*LogitsWarper``
classes, but only (a) when the generation config named a non-default value at start-up and (b) always over
the whole batch: top-k and top-p each sort the full ``[batch, vocab]`` score matrix at every step, even when
no request in the batch asked for them, which on CPU costs as much as the model's forward pass for a
135M model with a 49k vocabulary. RL sampling almost always runs with both filters off.

So the engine starts the manager with placeholder values (which makes transformers build the three
warpers) and :func:`install_fast_warpers` swaps them for the subclasses below. They keep transformers'
arithmetic and tensor layout and add two things:

* a fast path that returns the scores untouched when no request in flight needs the filter (skipped while
  a CUDA graph is being captured, so that the graph holds the filter). Whether one does is counted on the
  host (:class:`FilterUse`, kept by the engine as requests start and end), not read from the batch's
  tensors: reading them would make every step wait for the device twice;
* greedy decoding for ``temperature < GREEDY_BELOW`` (1e-4; 0 is the usual way to ask): every token but the
  arg-max gets ``-inf``, so the sampler picks the arg-max and the returned log-probability is 0. Dividing by
  a temperature that small would overflow to ``inf`` and turn the sampling distribution into NaNs, which
  stops transformers' generation loop for every request, so such values never reach the division.

What the returned log-probabilities mean (the trainer must compute the same thing): transformers computes
them from the *processed* scores, after the warpers, so a token's logprob is ``log_softmax(logits / T)``
renormalised over the tokens that survive top-k and top-p. With both filters off (``top_k=-1``,
``top_p=1``) that is exactly ``log_softmax(logits / T)[token]``; for greedy requests it is 0. The warpers'
arithmetic is vLLM's: top-k keeps every score ``>=`` the k-th largest (ties included), then top-p sorts the
scores ascending and drops the prefix whose cumulative softmax is ``<= 1 - top_p`` (the largest is always
kept). The trainer rebuilds that same set from its own logits (``trainer/logprobs.py``, "Sampling masks";
``tests/trainer/test_sampling_mask_embedded.py`` holds the two within 1e-4).
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


class FilterUse:
    """How many requests in flight ask for top-k and for top-p; the warpers skip a filter nobody uses.

    The engine counts a request in (:meth:`acquire`) before handing it to the generation loop and out
    (:meth:`release`) when it ends, both on its event loop; the generation thread only reads the counts
    (an int read is atomic). A request counted out while still in a batch is one that was aborted, whose
    tokens are dropped, so skipping its filter for that last step changes nothing anyone reads.
    """

    def __init__(self) -> None:
        self.top_k = 0
        self.top_p = 0

    def acquire(self, top_k: bool, top_p: bool) -> tuple[bool, bool]:
        self.top_k += top_k
        self.top_p += top_p
        return top_k, top_p

    def release(self, used: tuple[bool, bool]) -> None:
        self.top_k -= used[0]
        self.top_p -= used[1]


class FastTemperatureWarper(ContinuousBatchingTemperatureLogitsWarper):
    """Divides by each row's temperature; a temperature below ``GREEDY_BELOW`` means greedy."""

    def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
        temperatures = tensor_arg[: scores.size(0)].view(dtype=torch.float32).unsqueeze(-1)
        greedy = temperatures < GREEDY_BELOW
        scaled = scores / torch.where(greedy, torch.ones_like(temperatures), temperatures)
        not_argmax = scores < scores.amax(dim=-1, keepdim=True)
        return scaled.masked_fill(greedy & not_argmax, float("-inf"))


class FastTopKWarper(ContinuousBatchingTopKLogitsWarper):
    """transformers' per-row top-k, skipped when no request in flight asked for one (``use.top_k == 0``)."""

    use: FilterUse

    def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
        if self.use.top_k == 0 and not _capturing():
            return scores
        return super().__call__(scores, tensor_arg)


class FastTopPWarper(ContinuousBatchingTopPLogitsWarper):
    """transformers' per-row top-p, skipped when no request in flight asked for one (``use.top_p == 0``)."""

    use: FilterUse

    def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
        if self.use.top_p == 0 and not _capturing():
            return scores
        return super().__call__(scores, tensor_arg)


_FAST = {
    ContinuousBatchingTemperatureLogitsWarper: FastTemperatureWarper,
    ContinuousBatchingTopKLogitsWarper: FastTopKWarper,
    ContinuousBatchingTopPLogitsWarper: FastTopPWarper,
}


def install_fast_warpers(manager, use: FilterUse) -> None:
    """Swap the manager's three per-request warpers for the fast subclasses (before ``manager.start()``).

    ``use`` is the engine's count of requests asking for top-k / top-p, which the fast paths read.
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
        fast.use = use
        processors[i] = fast
        found.add(type(proc))
    missing = [cls.__name__ for cls in _FAST if cls not in found]
    if missing:
        raise RuntimeError(f"continuous batching did not create the per-request warpers {missing}")


def filters_used(kwargs: dict, vocab_size: int) -> tuple[bool, bool]:
    """Whether request kwargs from :func:`request_sampling_kwargs` ask for (top-k, top-p) filtering."""
    return kwargs["top_k"] < vocab_size, kwargs["top_p"] < 1.0


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
