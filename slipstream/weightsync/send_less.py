"""Send less: delta and LoRA adapter-only versions on the wire, and their exact rebuild on the receiving side.

``delta.py`` holds the pure tensor functions (encode and apply a delta, merge an adapter); this module puts
them on the weight transport: what a sender yields to ``Transport.send_weights`` (entries of the kinds in
``types.py``, with a :class:`~slipstream.weightsync.types.VersionInfo` stamped on every bucket), and
:class:`Rebuilder`, which the generic receiver (``WeightReceiver`` in ``http_receiver.py``, which the vLLM
plug-in wraps too) runs *before* ``WeightTarget.apply_weights``. A target therefore only ever sees full,
HF-named tensors, whatever travelled: the embedded server and vLLM (which fuses q/k/v and so cannot hand
its current tensors back) get delta and LoRA versions without a line of their own.

**Delta versions** (``weightsync.delta``). Every version the publisher sends is stamped ``keep``: the
receiver keeps a copy of what it applied, in the serving dtype (memory: one more copy of the model in the
serving dtype, on the receiver's staging device, and only when the sender asks for it). When every server
of a push holds the previous version, the publisher sends, per tensor, the smallest of
``delta_index``+``delta_values`` (sparse), ``delta_mask``+``delta_values`` (bitmap) or ``dense``
(:func:`delta_entries`), stamped ``base`` = the previous version; otherwise the whole version dense. The
receiver refuses a delta whose base it does not hold (it restarted, or applied another version since),
naming both versions, and the publisher's retry sends it the whole version from its kept copy. Rebuilding
copies bits (``delta.apply_delta``), so a delta version serves exactly what a full push of it would.

**LoRA versions** (``trainer.lora``). A *full* LoRA version carries every base weight: ``lora_base`` for
the modules that have an adapter (the receiver keeps them: memory, the adapted base weights in the push
dtype), ``dense`` for the others, plus the adapters (``lora_A``/``lora_B``) and ``lora_scale``. An
*adapter-only* version carries the adapters alone. Either way the receiver serves ``W + scale B A``
(``delta.merge_lora``, the function the trainer's merged push uses), so an adapter-only version serves
exactly what a full LoRA version with the same adapters would. An adapter-only version to a receiver
without the base weights, or an adapter whose shapes do not fit its base, is refused by name.

Example (what the receiver does with one staged version)::

    rebuilder = Rebuilder()
    version_tensors = rebuilder.rebuild(staging.staged, staging.parts, staging.info, version)
    target.apply_weights(version_tensors.tensors, version)
    rebuilder.applied(version_tensors, version)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import torch

from slipstream.weightsync.delta import (
    AdapterShapeError,
    Delta,
    DeltaError,
    adapter_target,
    apply_delta,
    changed_mask,
    check_adapter_shapes,
    compute_delta,
    merge_lora,
)
from slipstream.weightsync.types import (
    DELTA_INDEX,
    DELTA_KINDS,
    DELTA_MASK,
    DELTA_VALUES,
    DENSE,
    LORA_A,
    LORA_B,
    LORA_BASE,
    LORA_KINDS,
    VersionInfo,
)


class SendLessError(ValueError):
    """A delta or LoRA version this receiver cannot rebuild exactly (it is refused; the old one serves)."""


# -------------------------------------------------------------------------------------------- sender side


def delta_entries(
    name: str, tensor: torch.Tensor, prev: torch.Tensor | None, stats: DeltaStats
) -> list[tuple[str, torch.Tensor, str]]:
    """The entries of one tensor in a delta version: against ``prev`` (what every receiver holds under this
    name), in its smallest encoding; dense when there is no ``prev`` of the same shape and dtype. The
    entries do not alias ``prev`` (the caller may overwrite it next). ``stats`` counts what went by."""
    if prev is None or prev.shape != tensor.shape or prev.dtype != tensor.dtype:
        stats.add(tensor.numel(), tensor.numel(), tensor.numel() * tensor.element_size(), tensor)
        return [(name, tensor, DENSE)]
    new = tensor.detach().to(prev.device)
    d = compute_delta(prev, new)
    changed = d.changed if d.encoding != "dense" else int(changed_mask(prev, new).sum())
    stats.add(d.numel, changed, d.nbytes, tensor)
    if d.encoding == "dense":
        return [(name, tensor, DENSE)]
    if d.encoding == "sparse":
        assert d.indices is not None
        return [(name, d.indices, DELTA_INDEX), (name, d.values, DELTA_VALUES)]
    assert d.mask is not None
    return [(name, d.mask, DELTA_MASK), (name, d.values, DELTA_VALUES)]


@dataclass
class DeltaStats:
    """What one delta version carried: elements, changed elements, wire bytes and dense bytes."""

    numel: int = 0
    changed: int = 0
    bytes: int = 0
    dense_bytes: int = 0

    def add(self, numel: int, changed: int, nbytes: int, tensor: torch.Tensor) -> None:
        self.numel += numel
        self.changed += changed
        self.bytes += nbytes
        self.dense_bytes += numel * tensor.element_size()

    @property
    def changed_fraction(self) -> float:
        return self.changed / self.numel if self.numel else 0.0


def lora_items(
    adapters: Iterable[tuple[str, torch.Tensor]], base: Iterable[tuple[str, torch.Tensor]] | None
) -> Iterator[tuple[str, torch.Tensor, str]]:
    """Entries of a LoRA version: the adapters (``lora_A``/``lora_B``), then, for a full version, every base
    weight (``lora_base`` when an adapter targets it, ``dense`` otherwise). Adapters come first so the
    adapted modules are known before the base goes by; ``base`` is None for an adapter-only version."""
    adapted: set[str] = set()
    for name, tensor in adapters:
        module_weight, which = adapter_target(name)
        adapted.add(module_weight)
        yield name, tensor, LORA_A if which == "A" else LORA_B
    if base is None:
        return
    for name, tensor in base:
        yield name, tensor, LORA_BASE if name in adapted else DENSE


# ------------------------------------------------------------------------------------------ receiver side


@dataclass
class Rebuilt:
    """A version ready for ``apply_weights``: full HF-named tensors, and what to keep once it applied."""

    tensors: list[tuple[str, torch.Tensor]]
    # every tensor the target must hold after this version (a partial LoRA version lists fewer)
    complete: bool = True
    keep: bool = False
    lora_base: dict[str, torch.Tensor] | None = None
    lora_scale: float = 0.0
    stats: dict[str, float] = field(default_factory=dict)


class Rebuilder:
    """What a receiver keeps to rebuild delta and LoRA versions, and the rebuild itself (module docstring).

    ``base``/``base_version``: the last applied version's tensors, kept only for a version stamped ``keep``.
    ``lora_base``: the base weights of the adapted modules from the last full LoRA version. Nothing kept
    changes until :meth:`applied` is called, so a version the target refuses leaves both as they were.
    """

    def __init__(self) -> None:
        self.base: dict[str, torch.Tensor] = {}
        self.base_version: int | None = None
        self.lora_base: dict[str, torch.Tensor] = {}
        self.lora_scale = 0.0

    @property
    def kept_bytes(self) -> int:
        """Receiver memory this holds (the delta base and the LoRA base weights)."""
        tensors = list(self.base.values()) + list(self.lora_base.values())
        return sum(t.numel() * t.element_size() for t in tensors)

    def check_base(self, info: VersionInfo, version: int) -> None:
        """Refuse a delta version whose base this receiver does not hold (before a byte of it is staged)."""
        if info.base < 0:
            return
        if self.base_version != info.base:
            held = (
                "holds no base (it restarted, or no full version reached it with weightsync.delta on)"
                if self.base_version is None
                else f"holds version {self.base_version}"
            )
            raise SendLessError(
                f"version {version} is a delta against version {info.base}, but this receiver {held}: "
                "it needs a full push"
            )

    def rebuild(
        self,
        staged: Mapping[str, torch.Tensor],
        parts: Mapping[tuple[str, str], torch.Tensor],
        info: VersionInfo | None,
        version: int,
    ) -> Rebuilt:
        """The full tensors version ``version`` serves, from its dense entries and its parts."""
        info = info or VersionInfo()
        kinds = {kind for kind, _ in parts}
        if kinds & set(LORA_KINDS):
            if kinds & set(DELTA_KINDS) or info.base >= 0:
                raise SendLessError(f"version {version} mixes delta and LoRA entries")
            return self._rebuild_lora(staged, parts, info, version)
        self.check_base(info, version)
        tensors: dict[str, torch.Tensor] = dict(staged)
        changed = 0
        if info.base >= 0:
            deltas = _deltas(parts, self.base, version)
            for name, prev in self.base.items():
                if name in tensors:
                    continue
                d = deltas.pop(name, None)
                if d is None:
                    raise SendLessError(f"delta version {version} says nothing of `{name}`")
                changed += d.changed
                try:
                    tensors[name] = apply_delta(prev, d) if d.changed else prev
                except DeltaError as err:
                    raise SendLessError(f"delta version {version}: `{name}`: {err}") from err
            if deltas:
                raise SendLessError(
                    f"delta version {version}: deltas of unknown tensors {sorted(deltas)[:5]}"
                )
        elif parts:
            raise SendLessError(f"version {version}: delta entries without a base version")
        stats = {"delta_changed": float(changed)}
        return Rebuilt(list(tensors.items()), keep=info.keep, stats=stats)

    def _rebuild_lora(
        self,
        staged: Mapping[str, torch.Tensor],
        parts: Mapping[tuple[str, str], torch.Tensor],
        info: VersionInfo,
        version: int,
    ) -> Rebuilt:
        if info.lora_scale <= 0:
            raise SendLessError(f"LoRA version {version} carries no lora_scale")
        new_base = {name: t for (kind, name), t in parts.items() if kind == LORA_BASE}
        full = bool(new_base)
        base = new_base if full else self.lora_base
        if not base:
            raise SendLessError(
                f"version {version} carries LoRA adapters only, but this receiver holds no LoRA base weights "
                "(it restarted, or no full LoRA version reached it): it needs a full push"
            )
        halves: dict[str, dict[str, torch.Tensor]] = {}
        for (kind, name), tensor in parts.items():
            if kind in (LORA_A, LORA_B):
                module_weight, which = adapter_target(name)
                halves.setdefault(module_weight, {})[which] = tensor
        missing = sorted(set(base) - set(halves))
        if missing:
            raise SendLessError(
                f"LoRA version {version}: no adapter for {len(missing)} adapted weights, e.g. {missing[:3]}"
            )
        merged: list[tuple[str, torch.Tensor]] = []
        try:
            for module_weight, h in halves.items():
                if set(h) != {"A", "B"}:
                    raise AdapterShapeError(
                        f"{module_weight}: LoRA {'B' if 'A' in h else 'A'} tensor missing"
                    )
                w = base.get(module_weight)
                if w is None:
                    raise AdapterShapeError(
                        f"LoRA adapter for {module_weight}, which has no base weight here"
                    )
                check_adapter_shapes(tuple(w.shape), tuple(h["A"].shape), tuple(h["B"].shape), module_weight)
            for module_weight, h in halves.items():
                merged.append(
                    (module_weight, merge_lora(base[module_weight], h["A"], h["B"], info.lora_scale))
                )
        except AdapterShapeError as err:
            raise SendLessError(f"LoRA version {version}: {err}") from err
        tensors = [*staged.items(), *merged]
        return Rebuilt(
            tensors,
            complete=full,
            lora_base=new_base if full else None,
            lora_scale=info.lora_scale,
        )

    def applied(self, rebuilt: Rebuilt, version: int) -> None:
        """``rebuilt`` is serving now: keep what later versions are rebuilt from (copies: staged tensors are
        views of receive memory the next version reuses)."""
        if rebuilt.lora_base is not None:
            self.lora_base = {name: t.clone() for name, t in rebuilt.lora_base.items()}
        if rebuilt.lora_scale:
            self.lora_scale = rebuilt.lora_scale
        if not rebuilt.keep:
            self.base, self.base_version = {}, None  # what serves now is not what a delta would apply to
            return
        kept: dict[str, torch.Tensor] = {}
        for name, tensor in rebuilt.tensors:
            old = self.base.get(name)
            kept[name] = tensor if tensor is old else tensor.detach().clone()
        self.base, self.base_version = kept, version

    def forget(self) -> None:
        """Drop everything kept (the next delta or adapter-only version is refused until a full one)."""
        self.base, self.base_version, self.lora_base = {}, None, {}


def _deltas(
    parts: Mapping[tuple[str, str], torch.Tensor], base: Mapping[str, torch.Tensor], version: int
) -> dict[str, Delta]:
    """{name: Delta} from a version's delta entries, checked against the kept base tensors."""
    by_name: dict[str, dict[str, torch.Tensor]] = {}
    for (kind, name), tensor in parts.items():
        if kind not in DELTA_KINDS:
            raise SendLessError(f"version {version}: a `{kind}` entry in a delta version")
        by_name.setdefault(name, {})[kind] = tensor
    out: dict[str, Delta] = {}
    for name, p in by_name.items():
        prev = base.get(name)
        if prev is None:
            raise SendLessError(f"delta version {version}: `{name}` is not in the base this receiver holds")
        values = p.get(DELTA_VALUES)
        where = DELTA_INDEX if DELTA_INDEX in p else DELTA_MASK if DELTA_MASK in p else None
        if values is None or where is None or (DELTA_INDEX in p and DELTA_MASK in p):
            raise SendLessError(f"delta version {version}: `{name}` needs values and one of indices or mask")
        if values.dtype != prev.dtype:
            raise SendLessError(
                f"delta version {version}: `{name}` values are {values.dtype}, base {prev.dtype}"
            )
        encoding = "sparse" if where == DELTA_INDEX else "mask"
        d = Delta(
            encoding,
            tuple(prev.shape),
            prev.dtype,
            values,
            indices=p[where] if encoding == "sparse" else None,
            mask=p[where] if encoding == "mask" else None,
        )
        _check_delta(d, prev, name, version)
        out[name] = d
    return out


def _check_delta(d: Delta, prev: torch.Tensor, name: str, version: int) -> None:
    try:
        if d.encoding == "mask" and d.mask is not None and d.mask.numel() != (prev.numel() + 7) // 8:
            raise DeltaError(f"bit mask of {d.mask.numel()} bytes for {prev.numel()} elements")
        if d.encoding == "sparse" and d.indices is not None and d.indices.numel() != d.values.numel():
            raise DeltaError(f"{d.indices.numel()} indices for {d.values.numel()} values")
    except DeltaError as err:
        raise SendLessError(f"delta version {version}: `{name}`: {err}") from err
