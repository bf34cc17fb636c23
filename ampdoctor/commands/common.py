"""What the commands share: usage errors and exit codes, control characters kept off the terminal, and the
number formats of every table a command prints (one place each, so two commands never print a value two ways)."""

from __future__ import annotations

import json
import math
import re
from typing import Any, TextIO

EXIT_OK, EXIT_FINDINGS, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """Bad arguments: printed as one line, exit 2."""


# C0 and C1 controls but tab and newline, DEL, and the bidirectional overrides that reorder what a line shows
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """``text`` with control characters written as escapes (``\\x1b``): names in a trace are user data, and an
    ESC sequence printed raw drives the terminal (clears it, sets its title)."""
    return _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


class Printable:
    """A command's standard output, written through printable()."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        return self._stream.write(printable(text))

    def __getattr__(self, name: str) -> Any:  # everything else as the stream has it (flush, encoding, ...)
        return getattr(self._stream, name)


def _missing(v: object) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def fmt(v: object, width: int = 10) -> str:
    """A table cell: 3 significant digits, scientific outside [1e-3, 1e5), '-' for a missing value."""
    if _missing(v):
        return "-".rjust(width)
    if isinstance(v, float):
        if v == 0:
            return "0".rjust(width)
        if math.isinf(v):
            return ("inf" if v > 0 else "-inf").rjust(width)
        return (f"{v:.3g}" if 1e-3 <= abs(v) < 1e5 else f"{v:.2e}").rjust(width)
    return str(v).rjust(width)


def approx(v: float | None, unit: str = "") -> str:
    """A value to 3 significant digits with its unit; '-' when missing or not finite."""
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return f"{v:.3g}{unit}"


def exact(v: float | None) -> str:
    """A loss scale (or any setting) written so it pastes back exactly: integers whole, the rest to 6 digits."""
    if v is None or _missing(v):
        return "-"
    return str(int(v)) if float(v).is_integer() and abs(v) < 1e16 else f"{v:.6g}"


def pct(v: float | None) -> str:
    """A share (0..1) as a percentage with 2 decimals."""
    return "-" if v is None or _missing(v) else f"{100.0 * v:.2f}%"


def share(count: float | None, numel: float | None) -> str:
    """``count`` of ``numel`` elements as a percentage; '-' when either is unknown."""
    if count is None or numel is None or numel == 0 or (isinstance(count, float) and math.isnan(count)):
        return "-"
    return f"{100.0 * count / numel:.2f}%"


def evidence(v: object) -> str:
    """An evidence value on one line: floats to 4 digits, anything else as JSON cut at 80 characters."""
    if isinstance(v, float):
        return f"{v:.4g}"
    s = json.dumps(v)
    return s if len(s) <= 80 else s[:77] + "..."


def ranges(steps: list[int]) -> str:
    """Step numbers as runs (``0-9, 12, 15-17``), the first 12 runs."""
    out: list[str] = []
    start: int | None = None
    prev = 0  # (read only once start is set)
    for s in steps:
        if start is None:
            start = prev = s
        elif s == prev + 1:
            prev = s
        else:
            out.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = prev = s
    if start is not None:
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
    return ", ".join(out[:12]) + (" ..." if len(out) > 12 else "")
