"""The performance profile's data: the structs the simulator reads and the YAML file they load from and
save to (the fields and their units: ``sim/profile.py``'s docstring). Its own module so that the simulator
(``simulate.py``) and the profile fitting (``profile.py``, which runs the simulator) both import it and not
each other.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import msgspec
import yaml

Pos = Annotated[float, msgspec.Meta(gt=0)]
NonNeg = Annotated[float, msgspec.Meta(ge=0)]


class ProfileError(ValueError):
    """A profile that cannot be used; the message names the field."""


class _Struct(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


class DecodeCurve(_Struct):
    concurrency: list[Pos]
    tokens_per_s: list[Pos]

    def rate(self, k: int) -> float:
        """Total decode tokens/s of one server with ``k`` requests decoding (linear between points)."""
        if k <= 0:
            return 0.0
        xs, ys = self.concurrency, self.tokens_per_s
        if k <= xs[0]:
            return ys[0] * k / xs[0]
        for (x0, y0), (x1, y1) in zip(
            zip(xs, ys, strict=False), zip(xs[1:], ys[1:], strict=False), strict=False
        ):
            if k <= x1:
                return y0 + (y1 - y0) * (k - x0) / (x1 - x0)
        return ys[-1]


class Lengths(_Struct):
    mean: Pos
    sigma: NonNeg = 1.0
    samples: list[Pos] = []
    drift_per_step: float = 0.0


class TrainerRates(_Struct):
    tokens_per_s_per_rank: Pos
    fixed_s: NonNeg = 0.0


class PushCost(_Struct):
    fixed_s: NonNeg = 0.0
    s_per_byte: NonNeg = 0.0
    model_bytes: NonNeg = 0.0

    @property
    def seconds(self) -> float:
        return self.fixed_s + self.s_per_byte * self.model_bytes


class ModelSize(_Struct):
    """The model a profile's rates were measured on. A mixture-of-experts model computes each token through
    its ``active_params`` (the experts it is routed to, not all of them) but holds and pushes all its
    ``params``; 0 (a dense model) means all of them."""

    params: Pos
    active_params: NonNeg = 0.0

    @property
    def per_token(self) -> float:
        return self.active_params or self.params


class Profile(_Struct):
    decode: DecodeCurve
    prefill_tokens_per_s: Pos
    prompt_tokens: NonNeg
    lengths: Lengths
    trainer: TrainerRates
    push: PushCost = msgspec.field(default_factory=PushCost)
    step_overhead_s: NonNeg = 0.0
    # Share of finished groups whose samples all score the same (all solved or all failed): dynamic
    # sampling (rollout.dynamic_sampling) drops them after generating them. Used only when the config turns
    # the filter on; a profile made from a run takes its rollouter/filter_ratio.
    filtered_fraction: Annotated[float, msgspec.Meta(ge=0, lt=1)] = 0.0
    source: str = ""
    # The model the rates are of (optional): what scale_to_model scales from.
    model: ModelSize | None = None


def check_profile(prof: Profile) -> Profile:
    """Checks msgspec cannot express (decode points paired and increasing, drift above -1); returns ``prof``."""
    d = prof.decode
    if not d.concurrency or len(d.concurrency) != len(d.tokens_per_s):
        raise ProfileError(
            "profile field decode.tokens_per_s: needs one value per decode.concurrency point "
            f"({len(d.concurrency)} points, {len(d.tokens_per_s)} values)"
        )
    if any(b <= a for a, b in zip(d.concurrency, d.concurrency[1:], strict=False)):
        raise ProfileError(f"profile field decode.concurrency: must increase, got {d.concurrency}")
    if prof.lengths.drift_per_step <= -1:
        raise ProfileError("profile field lengths.drift_per_step: must be above -1")
    if prof.model is not None and prof.model.active_params > prof.model.params:
        raise ProfileError(
            f"profile field model.active_params: {prof.model.active_params:g} is more than model.params "
            f"({prof.model.params:g})"
        )
    return prof


def scale_to_model(prof: Profile, params: float, active_params: float = 0.0) -> Profile:
    """``prof``, measured on ``prof.model``, carried over to a model of ``params`` parameters of which a
    token runs through ``active_params`` (0: all; a mixture-of-experts model's is its routed share).

    Per-token work scales with the active parameters: decode and prefill tokens/s and the trainer's tokens/s
    per rank divide by their ratio; a push moves every parameter, so its bytes scale with the total. A first
    estimate on the same hardware and parallel layout: MoE kernels reach a lower share of the GPU's peak than
    dense ones (expert weights read per token batch, all-to-all), so the rates it gives are an upper bound.

    Worked example: the verl Qwen2.5-Math-7B profile carried to Qwen3-30B-A3B (30.5B, 3.35B active) trains
    and decodes 2.3x the tokens per second and pushes 4x the bytes."""
    if prof.model is None:
        raise ProfileError(
            "profile field model: the profile does not say which model its rates were measured on "
            "(model: {params: ..., active_params: ...}), so it cannot be scaled to another"
        )
    target = ModelSize(params=params, active_params=active_params)
    speed = prof.model.per_token / target.per_token
    decode = DecodeCurve(prof.decode.concurrency, [v * speed for v in prof.decode.tokens_per_s])
    return msgspec.structs.replace(
        prof,
        decode=decode,
        prefill_tokens_per_s=prof.prefill_tokens_per_s * speed,
        trainer=msgspec.structs.replace(
            prof.trainer, tokens_per_s_per_rank=prof.trainer.tokens_per_s_per_rank * speed
        ),
        push=msgspec.structs.replace(
            prof.push, model_bytes=prof.push.model_bytes * params / prof.model.params
        ),
        model=target,
        source=f"{prof.source} (scaled to {params / 1e9:.2f}B parameters, {target.per_token / 1e9:.2f}B per token)",
    )


def parse_profile(data: Any) -> Profile:
    """A :class:`Profile` from plain data (a YAML mapping), validated."""
    if not isinstance(data, dict):
        raise ProfileError(f"a profile is a mapping of fields, got {type(data).__name__}")
    try:
        prof = msgspec.convert(data, Profile)
    except msgspec.ValidationError as err:
        text = str(err)
        where = text.rpartition(" - at `$")[2].rstrip("`") if " - at `$" in text else ""
        what = text.partition(" - at ")[0]
        field = where.lstrip(".") or "(top level)"
        if what.startswith("Object contains unknown field"):
            field = f"{where.lstrip('.') + '.' if where else ''}{what.split('`')[1]}"
        raise ProfileError(f"profile field {field}: {what}") from None
    return check_profile(prof)


def load_profile(path: str | Path) -> Profile:
    p = Path(path)
    if not p.is_file():
        raise ProfileError(f"profile {p}: no such file")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as err:
        raise ProfileError(f"profile {p}: not YAML: {err}") from None
    return parse_profile(data)


def save_profile(prof: Profile, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(msgspec.to_builtins(prof), sort_keys=False))


__all__ = [
    "DecodeCurve",
    "Lengths",
    "ModelSize",
    "Profile",
    "ProfileError",
    "PushCost",
    "TrainerRates",
    "check_profile",
    "load_profile",
    "parse_profile",
    "save_profile",
    "scale_to_model",
]
