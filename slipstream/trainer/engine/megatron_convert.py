"""Weight conversion between Hugging Face Llama/Qwen2 checkpoints and Megatron-core ``GPTModel`` shards.

Pure tensor code (no megatron import), so the name and shape maps are unit-tested on CPU. The Megatron
layout (megatron-core 0.16.1, ``GPTModel`` with the Transformer-Engine layer spec; the local spec differs
only in where the two layer norms live, see ``te``):

=====================================================  ============================================  =========
Megatron name (layer index local to the pipeline stage)  HF name                                        TP split
=====================================================  ============================================  =========
embedding.word_embeddings.weight                         model.embed_tokens.weight                      dim 0
decoder.layers.i.self_attention.linear_qkv.weight        q_proj, k_proj, v_proj interleaved per group    groups
decoder.layers.i.self_attention.linear_qkv.bias          q/k/v biases (Qwen2), same interleave           groups
decoder.layers.i.self_attention.linear_qkv.layer_norm_weight  input_layernorm.weight (te)               -
decoder.layers.i.input_layernorm.weight                  input_layernorm.weight (local spec)             -
decoder.layers.i.self_attention.linear_proj.weight       o_proj.weight                                   dim 1
decoder.layers.i.mlp.linear_fc1.weight                   gate_proj ; up_proj (each split, then joined)   gated
decoder.layers.i.mlp.linear_fc1.layer_norm_weight        post_attention_layernorm.weight (te)            -
decoder.layers.i.pre_mlp_layernorm.weight                post_attention_layernorm.weight (local spec)    -
decoder.layers.i.mlp.linear_fc2.weight                   down_proj.weight                                dim 1
decoder.final_layernorm.weight                           model.norm.weight (last stage)                  -
output_layer.weight                                      lm_head.weight (last stage, untied)             dim 0
output_layer.weight                                      model.embed_tokens.weight (tied, PP > 1: load)  dim 0
=====================================================  ============================================  =========

QKV interleave: for each of the ``num_kv_heads`` groups, Megatron stores that group's
``heads/kv_heads`` query heads, then its key head, then its value head (rows of ``head_dim`` each), so a
tensor-parallel rank owns whole groups.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

# HF model types whose checkpoints convert to Megatron-core's GPT layout (dense decoders).
MODEL_TYPES = ("llama", "qwen2", "mistral")


@dataclass(frozen=True)
class ArchSpec:
    """What the conversion needs to know about a Llama-family model."""

    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden: int
    vocab_size: int
    tied: bool
    qkv_bias: bool

    @classmethod
    def from_hf_config(cls, config: Any) -> ArchSpec:
        model_type = getattr(config, "model_type", "")
        if model_type not in MODEL_TYPES:
            raise ValueError(
                f"megatron conversion supports {'/'.join(MODEL_TYPES)}, got model_type={model_type!r}"
            )
        heads = config.num_attention_heads
        return cls(
            num_layers=config.num_hidden_layers,
            hidden=config.hidden_size,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            ffn_hidden=config.intermediate_size,
            vocab_size=config.vocab_size,
            tied=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or bool(getattr(config, "attention_bias", False)),
        )

    def layers_of_stage(self, pp_rank: int, pp_size: int) -> range:
        if self.num_layers % pp_size:
            raise ValueError(f"{self.num_layers} layers do not split evenly over {pp_size} pipeline stages")
        per = self.num_layers // pp_size
        return range(pp_rank * per, (pp_rank + 1) * per)


# ------------------------------------------------------------------------------------------ fused tensors
def qkv_to_mcore(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ArchSpec) -> torch.Tensor:
    """HF q/k/v (weights [out, hidden] or biases [out]) → Megatron's per-group interleaved linear_qkv."""
    g, d = spec.num_kv_heads, spec.head_dim
    per = spec.num_heads // g
    rest = q.shape[1:]
    q = q.reshape(g, per * d, *rest)
    k = k.reshape(g, d, *rest)
    v = v.reshape(g, d, *rest)
    return torch.cat([q, k, v], dim=1).reshape(g * (per + 2) * d, *rest)


def qkv_from_mcore(qkv: torch.Tensor, spec: ArchSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g, d = spec.num_kv_heads, spec.head_dim
    per = spec.num_heads // g
    rest = qkv.shape[1:]
    grouped = qkv.reshape(g, (per + 2) * d, *rest)
    q, k, v = grouped.split([per * d, d, d], dim=1)
    return q.reshape(g * per * d, *rest), k.reshape(g * d, *rest), v.reshape(g * d, *rest)


# ------------------------------------------------------------------------------------------ TP sharding
def shard(tensor: torch.Tensor, kind: str, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This TP rank's piece of a full Megatron tensor. kinds: none, row (dim 1), column/vocab/qkv (dim 0),
    gated (fc1: gate and up halves split separately, the rank's pieces joined)."""
    if kind == "none" or tp_size == 1:
        return tensor
    if kind == "row":
        return tensor.chunk(tp_size, dim=1)[tp_rank]
    if kind in ("column", "vocab", "qkv"):
        return tensor.chunk(tp_size, dim=0)[tp_rank]
    if kind == "gated":
        gate, up = tensor.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp_size, dim=0)[tp_rank], up.chunk(tp_size, dim=0)[tp_rank]])
    raise ValueError(f"unknown shard kind {kind!r}")


def unshard(pieces: list[torch.Tensor], kind: str) -> torch.Tensor:
    """Inverse of :func:`shard` given every TP rank's piece in rank order."""
    if kind == "none" or len(pieces) == 1:
        return pieces[0]
    if kind == "row":
        return torch.cat(pieces, dim=1)
    if kind in ("column", "vocab", "qkv"):
        return torch.cat(pieces, dim=0)
    if kind == "gated":
        halves = [p.chunk(2, dim=0) for p in pieces]
        return torch.cat([torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])])
    raise ValueError(f"unknown shard kind {kind!r}")


# ------------------------------------------------------------------------------------------ name maps
@dataclass(frozen=True)
class Rule:
    """One Megatron parameter: its HF sources, how to fuse/split them, and its TP split kind."""

    mcore: str
    hf: tuple[str, ...]
    kind: str
    fuse: Callable[..., torch.Tensor] | None = None  # HF tensors -> full Megatron tensor
    split: Callable[[torch.Tensor], tuple[torch.Tensor, ...]] | None = None  # full Megatron -> HF tensors


def layer_rules(spec: ArchSpec, global_layer: int, local_layer: int, *, te: bool = True) -> list[Rule]:
    h, m = f"model.layers.{global_layer}.", f"decoder.layers.{local_layer}."
    attn = h + "self_attn."
    qkv = (attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight")
    fuse_qkv = lambda q, k, v: qkv_to_mcore(q, k, v, spec)  # noqa: E731
    split_qkv = lambda t: qkv_from_mcore(t, spec)  # noqa: E731
    rules = [
        Rule(m + "self_attention.linear_qkv.weight", qkv, "qkv", fuse_qkv, split_qkv),
        Rule(m + "self_attention.linear_proj.weight", (attn + "o_proj.weight",), "row"),
        Rule(
            m + "mlp.linear_fc1.weight",
            (h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"),
            "gated",
            lambda gate, up: torch.cat([gate, up]),
            lambda t: tuple(t.chunk(2, dim=0)),
        ),
        Rule(m + "mlp.linear_fc2.weight", (h + "mlp.down_proj.weight",), "row"),
    ]
    if spec.qkv_bias:
        bias = (attn + "q_proj.bias", attn + "k_proj.bias", attn + "v_proj.bias")
        rules.append(Rule(m + "self_attention.linear_qkv.bias", bias, "qkv", fuse_qkv, split_qkv))
    ln1 = m + ("self_attention.linear_qkv.layer_norm_weight" if te else "input_layernorm.weight")
    ln2 = m + ("mlp.linear_fc1.layer_norm_weight" if te else "pre_mlp_layernorm.weight")
    rules.append(Rule(ln1, (h + "input_layernorm.weight",), "none"))
    rules.append(Rule(ln2, (h + "post_attention_layernorm.weight",), "none"))
    return rules


def stage_rules(spec: ArchSpec, pp_rank: int, pp_size: int, *, te: bool = True) -> list[Rule]:
    """Every parameter a pipeline stage holds, in a fixed order."""
    rules: list[Rule] = []
    if pp_rank == 0:
        rules.append(Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab"))
    for local, layer in enumerate(spec.layers_of_stage(pp_rank, pp_size)):
        rules += layer_rules(spec, layer, local, te=te)
    if pp_rank == pp_size - 1:
        rules.append(Rule("decoder.final_layernorm.weight", ("model.norm.weight",), "none"))
        if not spec.tied:
            rules.append(Rule("output_layer.weight", ("lm_head.weight",), "vocab"))
    return rules


def hf_to_mcore(
    hf: dict[str, torch.Tensor],
    spec: ArchSpec,
    *,
    tp_rank: int,
    tp_size: int,
    pp_rank: int,
    pp_size: int,
    te: bool,
) -> dict[str, torch.Tensor]:
    """The Megatron state dict of one (TP, PP) rank from a full HF state dict."""
    out = {}
    for rule in stage_rules(spec, pp_rank, pp_size, te=te):
        missing = [n for n in rule.hf if n not in hf]
        if missing:
            raise KeyError(f"HF checkpoint lacks {missing} (needed for {rule.mcore})")
        sources = [hf[n] for n in rule.hf]
        full = rule.fuse(*sources) if rule.fuse else sources[0]
        out[rule.mcore] = shard(full, rule.kind, tp_rank, tp_size).contiguous()
    if spec.tied and pp_size > 1 and pp_rank == pp_size - 1:
        # Megatron keeps its own copy of a tied embedding on the last stage for the output layer (kept equal
        # to the first stage's by the embedding-group grad all-reduce); it is loaded, never exported.
        embed = hf["model.embed_tokens.weight"]
        out["output_layer.weight"] = shard(embed, "vocab", tp_rank, tp_size).contiguous()
    return out


def mcore_to_hf(rule: Rule, full: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """HF (name, tensor) pairs of one full (TP-gathered) Megatron tensor."""
    parts = rule.split(full) if rule.split else (full,)
    return list(zip(rule.hf, parts, strict=True))
