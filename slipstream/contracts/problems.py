"""What the contract checker reports: one :class:`Problem` per thing we send that upstream lacks."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    """``where``: the endpoint (``vllm POST /pause``), launch command or Python API; ``field``: the
    request field, flag or argument; ``upstream``: the file of the pinned release it was checked against;
    ``origin``: which of our calls or files sent it."""

    where: str
    field: str
    message: str
    upstream: str = ""
    origin: str = ""

    def __str__(self) -> str:
        field = f" `{self.field}`" if self.field else ""
        up = f" [upstream: {self.upstream}]" if self.upstream else ""
        origin = f" (from {self.origin})" if self.origin else ""
        return f"{self.where}:{field} {self.message}{up}{origin}"


def dedupe(problems: list[Problem]) -> list[Problem]:
    """One problem per (where, field, message); the first origin is kept."""
    seen: dict[tuple[str, str, str], Problem] = {}
    for p in problems:
        seen.setdefault((p.where, p.field, p.message), p)
    return list(seen.values())
