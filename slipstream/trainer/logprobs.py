"""Per-token log-probabilities and entropy of a causal LM without full-vocabulary logits for every token.

Why: the plain path projects every hidden state onto the whole vocabulary at once and upcasts it, so a
micro-batch of T tokens over a vocabulary of V costs T x V x 4 bytes per copy (32,768 tokens x 151,936 =
19.9 GB), and autograd keeps several such copies alive (the logits, their fp32 upcast, the softmax, the
entropy's product). :func:`token_logprobs` instead walks the tokens in chunks of ``chunk`` rows: each
chunk's logits are computed, reduced to the few per-token numbers the losses need (the sampled token's
log-probability, the log-partition, the entropy) and freed. Backward recomputes each chunk's logits from
the saved hidden states and weight and turns them straight into the gradients of the hidden states and of
the weight, so the largest transient is one chunk's [chunk, V] fp32 block (two while differentiating).

The values are the plain path's: logits ``h @ W^T`` in the compute dtype, upcast to fp32, divided by the
sampling temperature; ``logprob = z[target] - logsumexp(z)``; ``entropy = -sum p log p`` with ``p = softmax(z)`` (the plain path's
``logsumexp(z) - sum p z``, written so that no large terms cancel).
Gradients, with ``p = softmax(z)``::

    d logprob / dz = onehot(target) - p
    d entropy / dz = -p * (z - E_p[z]) = -p * (log p + entropy)       (entropy saved from forward)

and d z / d(h @ W^T) = 1 / temperature. ``tests/trainer/test_logprobs.py`` checks values and gradients
against the plain path to 1e-5 in fp32.

Fused kernels: liger-kernel's fused linear cross-entropy also never materialises the logits, but it returns
a loss, computes the gradients during the forward pass on the assumption that the loss is a (scaled) sum of
the per-token cross-entropies, and gives no entropy. RL losses are non-linear in the per-token logprobs
(clipped ratios, KL, entropy bonus), so their upstream gradient is only known in backward: that kernel does
not fit, and this module is written for the job instead.

:class:`LogprobHead` puts this computation inside the model's forward (see its docstring for why that
matters under FSDP2).

**Sampling masks.** A run that samples with top-k or top-p (``rollout.sampling.top_k`` > 0, ``top_p`` < 1)
draws each token from the tempered distribution renormalised over the tokens the filter keeps, and the
servers return that token's log-probability in it (vLLM with ``--logprobs-mode processed_logprobs``, the
embedded server). Given a :class:`Truncation`, both paths score the same distribution: per row the kept set is
rebuilt from the trainer's own tempered logits in the servers' order and arithmetic (vLLM's
``apply_top_k_top_p_pytorch``, transformers' continuous-batching warpers; :func:`_cut`):

1. ``z = logits / T`` (fp32);
2. top-k: keep ``z >= `` the k-th largest ``z`` (ties with it are kept);
3. top-p, on what top-k kept: sort ascending, ``cumsum(softmax)``, drop the prefix whose cumulative mass is
   ``<= 1 - top_p`` (``1 - top_p`` in fp32), always keep the largest;

and the dropped logits become ``-inf`` before the log-softmax (in the chunked path fp32's lowest number,
so that its hand-written ``p * log p`` terms stay 0 without special cases), so the logprob, the entropy and
their gradients are those of the renormalised distribution (a dropped token's gradient is 0). Two rules where the servers'
own set is not recoverable: (a) the kept set is a threshold set, ``z >= cut``, so an exact tie at the top-p
cut keeps every tied token, where vLLM keeps the ones its sort puts last; (b) the sampled token is always in
the set: it was sampled, so the server kept it, and a near-tie (the trainer's logits differ from the server's
by ~1e-6) that puts it just below the rebuilt cut must not make its logprob ``-inf``. A near-tie of another
token at the cut is not caught: the normaliser then differs by that token's probability. vLLM's Model Runner
V2 can return the kept set itself (``return_sampling_mask``; GPU builds only), which this rebuild stands in
for. ``min_p`` is not a ``rollout.sampling`` key, so no server applies it to training requests.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# What a dropped token's tempered logit becomes in the chunked path: finite, so that the 0 * log 0 terms of
# its entropy and entropy gradient are 0 rather than NaN (each is multiplied by p = 0 before anything else).
DROPPED = torch.finfo(torch.float32).min
# Rows sorted at a time for top-p: bounds the transient (values and int64 indices of [rows, V]).
_CUT_ROWS = 256


@dataclass(frozen=True)
class Truncation:
    """The servers' top-k / top-p filter, replayed on the trainer's logits (module docstring, "Sampling masks").

    ``top_k`` <= 0 and ``top_p`` == 1 are off; build one with :func:`sampling_truncation`, which returns None
    when neither filter is on, so the plain computation runs unchanged.
    """

    top_k: int = -1
    top_p: float = 1.0


def sampling_truncation(temperature: float, top_k: int, top_p: float) -> Truncation | None:
    """The filter training requests sampled through, or None. Greedy requests (temperature 0) take the argmax
    and no filter, and their logprobs are not sampling probabilities anyway."""
    if temperature <= 0 or (top_k <= 0 and top_p >= 1.0):
        return None
    return Truncation(top_k=top_k if top_k > 0 else -1, top_p=float(top_p))


def _cut(z: torch.Tensor, trunc: Truncation) -> torch.Tensor:
    """Per row of tempered fp32 logits ``z`` [n, V], the smallest logit the servers' filter keeps [n].

    The arithmetic is vLLM's (``apply_top_k_top_p_pytorch``) and transformers' (the continuous-batching top-k
    then top-p warpers), which agree: top-k keeps ``z >= `` the k-th largest; top-p sorts what is left
    ascending and drops the prefix whose cumulative probability is ``<= 1 - top_p``, keeping the largest.
    Where top-k is on, top-p sorts only what top-k kept (ties with the k-th included): the servers' full
    sort puts the dropped tokens first with probability exactly 0, so the cumulative sums are the same sums
    (up to the softmax's summation order), at a fraction of the cost.
    """
    v = z.shape[-1]
    k = min(trunc.top_k, v) if trunc.top_k > 0 else v
    if trunc.top_p >= 1.0:
        return z.topk(k, dim=-1).values[:, -1]
    out = torch.empty(z.shape[0], dtype=z.dtype, device=z.device)
    drop_mass = 1 - torch.tensor(trunc.top_p, dtype=torch.float32, device=z.device)  # as the servers round it
    for s in range(0, z.shape[0], _CUT_ROWS):
        zs = _ascending_kept_by_top_k(z[s : s + _CUT_ROWS], k)
        cum = zs.softmax(dim=-1).cumsum_(dim=-1)
        # cum only grows, so the dropped tokens are a prefix; the largest token is always kept
        first_kept = (cum <= drop_mass).sum(dim=-1).clamp_(max=zs.shape[-1] - 1)
        out[s : s + zs.shape[0]] = zs.gather(1, first_kept[:, None])[:, 0]
    return out


def _ascending_kept_by_top_k(rows: torch.Tensor, k: int) -> torch.Tensor:
    """The values of ``rows`` top-k keeps, sorted ascending, ``-inf`` first where a row keeps fewer than
    others (ties with the k-th make a row keep more than k); every value when ``k`` is the vocabulary."""
    v = rows.shape[-1]
    if k >= v:
        return rows.sort(dim=-1).values
    kth = rows.topk(k, dim=-1).values[:, -1:]
    widest = int((rows >= kth).sum(dim=-1).max())  # k, unless some row ties with its k-th
    zs = rows.topk(widest, dim=-1).values.flip(-1)
    return zs.masked_fill_(zs < kth, float("-inf"))


def _truncate_(z: torch.Tensor, targets: torch.Tensor, cut: torch.Tensor) -> torch.Tensor:
    """Set every logit below its row's cut to :data:`DROPPED`, in place, except the target's (always kept)."""
    keep = z.gather(1, targets[:, None])
    z.masked_fill_(z < cut[:, None], DROPPED)
    return z.scatter_(1, targets[:, None], keep)


def truncate_logits(z: torch.Tensor, targets: torch.Tensor, trunc: Truncation | None) -> torch.Tensor:
    """Tempered fp32 logits [n, V] with the tokens ``trunc`` drops set to ``-inf`` (out of place, so autograd
    sees a masked copy); ``z`` itself when ``trunc`` is None. The plain path's version of the replay; take
    the entropy of the result with :func:`plain_entropy`."""
    if trunc is None:
        return z
    with torch.no_grad():
        keep = z >= _cut(z.detach(), trunc)[:, None]
        keep.scatter_(1, targets.long()[:, None], True)
    return z.masked_fill(~keep, float("-inf"))


def plain_entropy(z: torch.Tensor, truncated: bool) -> torch.Tensor:
    """Entropy per row of logits from :func:`truncate_logits`: with ``truncated`` its ``-inf`` entries count
    0 log 0 = 0, with no NaN in value or gradient; without, ``entropy_from_logits`` as before."""
    from slipstream.trainer.algos.kl import entropy_from_logits

    if not truncated:
        return entropy_from_logits(z)
    logsm = torch.log_softmax(z.float(), dim=-1)
    return -(logsm.exp() * logsm.masked_fill(torch.isneginf(z), 0.0)).sum(dim=-1)


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    """fp32 tempered logits of one chunk, computed exactly as the plain path computes them."""
    z = F.linear(h, weight).float()  # a fresh buffer either way: dividing in place is safe
    return z.div_(temperature) if temperature != 1.0 else z


class _ChunkedTokenLogprobs(torch.autograd.Function):
    """(hidden [N, H], weight [V, H], targets [N]) -> (logprobs [N] fp32, entropy [N] fp32 or [0]).

    With a :class:`Truncation`, each row's cut is found in forward and saved ([N] floats), and backward drops
    the same tokens of the recomputed (bit-identical) logits.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk, with_entropy, trunc):  # noqa: ANN001, ANN205
        n = hidden.shape[0]
        f32 = dict(dtype=torch.float32, device=hidden.device)
        logp, shift = torch.empty(n, **f32), torch.empty(n, 2, **f32)
        ent = torch.empty(n if with_entropy else 0, **f32)
        cut = torch.empty(n if trunc is not None else 0, **f32)
        step = chunk if chunk > 0 else max(n, 1)
        for s in range(0, n, step):
            e = min(n, s + step)
            z = _chunk_logits(hidden[s:e], weight, temperature)
            if trunc is not None:
                cut[s:e] = _cut(z, trunc)
                _truncate_(z, targets[s:e], cut[s:e])
            p, shift[s:e] = _log_softmax_(z)
            logp[s:e] = z.gather(-1, targets[s:e, None])[:, 0]
            if with_entropy:
                # -sum p log p: no large terms cancel (logsumexp - E[z] would); the product reuses p's buffer
                ent[s:e] = -p.mul_(z).sum(dim=-1)
            del z, p
        ctx.save_for_backward(hidden, weight, targets, shift, ent, cut)
        ctx.temperature, ctx.step, ctx.trunc = temperature, step, trunc
        ctx.set_materialize_grads(False)
        if not with_entropy:
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_logp, g_ent):  # noqa: ANN001, ANN205
        hidden, weight, targets, shift, ent, cut = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if g_ent is not None and ent.numel() == 0:
            g_ent = None
        if (g_logp is None and g_ent is None) or not (need_h or need_w):
            return None, None, None, None, None, None, None
        gh = torch.empty_like(hidden) if need_h else None
        # fp32 accumulator across chunks: one rounding to the weight's dtype at the end, as one matmul has
        gw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        n, step = hidden.shape[0], ctx.step
        for s in range(0, n, step):
            e = min(n, s + step)
            z = _chunk_logits(hidden[s:e], weight, ctx.temperature)
            if ctx.trunc is not None:
                _truncate_(z, targets[s:e], cut[s:e])
            grad = _chunk_grad(
                z,
                shift[s:e],
                ent[s:e] if g_ent is not None else None,
                targets[s:e],
                g_logp[s:e] if g_logp is not None else None,
                g_ent[s:e] if g_ent is not None else None,
            )
            del z
            if ctx.temperature != 1.0:
                grad.div_(ctx.temperature)
            grad = grad.to(hidden.dtype)
            if need_h:
                gh[s:e] = grad @ weight
            if need_w:
                if weight.dtype == torch.float32:
                    gw.addmm_(grad.t(), hidden[s:e])
                else:
                    gw.add_(grad.t() @ hidden[s:e])
            del grad
        return gh, (gw.to(weight.dtype) if need_w else None), None, None, None, None, None


def _log_softmax_(z: torch.Tensor, shift: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Turn ``z`` into log-softmax in place; return (softmax, [rows, 2] shift = (row max, log-sum)).

    Subtracting the row max first and the (small) log-sum second, as ``torch.log_softmax`` does, keeps the
    likeliest tokens' log-probabilities exact to fp32: subtracting one rounded logsumexp (~ the logits' size)
    would cost the entropy gradient a digit. With ``shift`` given (backward), the forward's is reused.
    """
    if shift is None:
        m = z.amax(dim=-1)
        p = z.sub_(m[:, None]).exp()
        total = p.sum(dim=-1)
        z.sub_(total.log()[:, None])
        return p.div_(total[:, None]), torch.stack([m, total.log()], dim=-1)
    z.sub_(shift[:, 0:1]).sub_(shift[:, 1:2])
    return z.exp(), shift


def _chunk_grad(z, shift, ent, targets, g_logp, g_ent) -> torch.Tensor:  # noqa: ANN001
    """d(sum g_logp * logprob + g_ent * entropy) / dz for one chunk, reusing ``z``'s buffer."""
    p, _ = _log_softmax_(z, shift)
    logsm = z
    if g_ent is not None:
        # z - E_p[z] = log p + entropy: small numbers, no cancellation
        grad = logsm.add_(ent[:, None]).mul_(p).mul_(-g_ent[:, None])
        if g_logp is not None:
            grad.addcmul_(p, g_logp[:, None], value=-1.0)
        del p
    else:
        del logsm
        grad = p.mul_(-g_logp[:, None])
    if g_logp is not None:
        grad.scatter_add_(1, targets[:, None], g_logp[:, None].to(grad.dtype))
    return grad


def token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk: int = 4096,
    entropy: bool = False,
    truncation: Truncation | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probability of ``targets`` under ``softmax(hidden @ weight^T / temperature)``, and its entropy.

    hidden: [N, H] (compute dtype), weight: [V, H], targets: [N] token ids. Returns fp32 ``logprobs`` [N]
    and ``entropy`` [N] (None unless asked), both differentiable in ``hidden`` and ``weight``. ``chunk``
    rows are projected at a time; 0 projects all N at once (still without autograd's extra copies). With a
    ``truncation`` both are of the distribution renormalised over the tokens the sampler's top-k / top-p
    keeps (module docstring, "Sampling masks").

    Example::

        logp, ent = token_logprobs(h[:-1], lm_head.weight, ids[1:], temperature=0.7, entropy=True)
        logp, _ = token_logprobs(h[:-1], lm_head.weight, ids[1:], truncation=Truncation(top_k=20, top_p=0.8))
    """
    logp, ent = _ChunkedTokenLogprobs.apply(
        hidden, weight, targets.long(), float(temperature), int(chunk), bool(entropy), truncation
    )
    return logp, (ent if entropy else None)


def full_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    entropy: bool = False,
    truncation: Truncation | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The plain path, full [N, V] fp32 logits at once: the reference :func:`token_logprobs` must equal."""
    logits = truncate_logits(F.linear(hidden, weight).float() / temperature, targets, truncation)
    logp = torch.log_softmax(logits, dim=-1).gather(-1, targets.long()[:, None])[:, 0]
    return logp, (plain_entropy(logits, truncation is not None) if entropy else None)


@dataclass
class _Request:
    src: torch.Tensor | None  # rows of the flattened hidden states to score (None: the first len(targets))
    targets: torch.Tensor
    entropy: str | None  # None, "metric" (no gradient) or "grad"


class LogprobHead(torch.nn.Module):
    """Drop-in for a causal LM's bias-free ``lm_head`` that returns per-token logprobs instead of logits.

    Why a module in place of the output layer, rather than a function the engine calls on the model's
    hidden states: under FSDP2 the output weight (and, when tied, the embedding it shares) belongs to the
    root module's parameter group and is a sharded DTensor outside the root's forward. Computing inside the
    root's forward means FSDP's own hooks all-gather the weight before this runs, hand this module the plain
    unsharded tensor, and (through the pre-backward hook FSDP registers on the forward's outputs) gather it
    again before :func:`token_logprobs`'s backward recomputes the logits; the weight gradient returned there
    lands on the unsharded parameter and FSDP reduce-scatters it like any other. No FSDP internals are
    touched, and the parameter keeps its object identity and name (``lm_head.weight``, or the embedding's
    when tied), so checkpoints, weight sync and the optimizer see the same parameters as before.

    Lifecycle: the engine swaps it in before sharding (:func:`install_logprob_head`), then per micro-batch::

        with head.request(targets=ids[1:], entropy="metric"):
            logp, ent = model(input_ids=ids[None], position_ids=pos[None]).logits

    Inside a request, row j of the output is the log-probability of ``targets[j]`` given the hidden state
    of row ``src[j]`` of the flattened [batch * seq, H] hidden states (``src`` None: row j). Outside one it
    behaves as the linear layer it replaced (plain logits, e.g. for generation).
    """

    def __init__(
        self,
        weight: torch.nn.Parameter,
        chunk_tokens: int,
        temperature: float,
        truncation: Truncation | None = None,
    ) -> None:
        super().__init__()
        self.weight = weight
        self.chunk_tokens = chunk_tokens
        self.temperature = temperature
        self.truncation = truncation
        self._request: _Request | None = None

    @contextlib.contextmanager
    def request(
        self, targets: torch.Tensor, src: torch.Tensor | None = None, entropy: str | None = None
    ) -> Iterator[None]:
        self._request = _Request(src, targets, entropy)
        try:
            yield
        finally:
            self._request = None

    def forward(self, hidden: torch.Tensor):  # noqa: ANN201
        req = self._request
        if req is None:
            return F.linear(hidden, self.weight)
        flat = hidden.reshape(-1, hidden.shape[-1])
        flat = flat[: req.targets.numel()] if req.src is None else flat.index_select(0, req.src)
        logp, ent = token_logprobs(
            flat,
            self.weight,
            req.targets,
            temperature=self.temperature,
            chunk=self.chunk_tokens,
            entropy=req.entropy is not None,
            truncation=self.truncation,
        )
        if ent is not None and req.entropy != "grad":
            ent = ent.detach()
        return logp, ent


def install_logprob_head(
    model: torch.nn.Module, chunk_tokens: int, temperature: float, truncation: Truncation | None = None
) -> LogprobHead | None:
    """Replace ``model``'s output layer with a :class:`LogprobHead` sharing its weight; None if unsupported.

    Supported: a bias-free ``nn.Linear`` output layer whose logits the model's forward returns unchanged
    (Llama, Qwen2/3, Mistral and most decoder-only families). Models that scale or soft-cap logits after
    the output layer keep the plain path.
    """
    config = getattr(model, "config", None)
    scaled = getattr(config, "logit_scale", None) not in (None, 1.0)
    if scaled or getattr(config, "final_logit_softcapping", None):
        return None
    get = getattr(model, "get_output_embeddings", None)
    out = get() if get is not None else None
    if type(out) is not torch.nn.Linear or out.bias is not None:
        return None
    head = LogprobHead(out.weight, chunk_tokens, temperature, truncation)
    model.set_output_embeddings(head)
    return head
