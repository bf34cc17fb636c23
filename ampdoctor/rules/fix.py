"""A finding's fix as data: text and code parts, in order. Each code part runs as printed (the tests execute
them); the CLI, the dashboard, the report and the live log render these parts, never a guess over prose."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

KINDS = ("text", "code")


@dataclass(frozen=True)
class Part:
    """One paragraph of prose (``text``) or one block of Python (``code``)."""

    kind: str
    text: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Argument kind should be one of {', '.join(KINDS)}, but given {self.kind!r}")


def text(*lines: str) -> Part:
    """Prose, one line per argument."""
    return Part("text", "\n".join(lines))


def code(*lines: str) -> Part:
    """Python that runs as printed, one line per argument."""
    return Part("code", "\n".join(lines))


def plain(parts: Iterable[Part]) -> str:
    """The parts as one plain text, one part after the other (``Diagnosis.recommendation``)."""
    return "\n".join(p.text for p in parts)


def of(value: str | Iterable[Part | Mapping[str, str]] | None) -> list[Part]:
    """Parts from what a rule or a JSON file gives: Parts, {"kind", "text"} dicts, or a plain string (one text)."""
    if isinstance(value, str):
        return [text(value)] if value else []
    return [p if isinstance(p, Part) else Part(p["kind"], p["text"]) for p in value or ()]
