"""The numbers of the steps table again, by blocks of consecutive steps: one row of ``step_blocks`` holds SIZE steps'
values of every numeric step column as one little-endian float64 BLOB (column after column). A reader takes a block
into numpy at once instead of one Python object per value (~0.35 us each through sqlite3: ~7 s for the 2 x 10^7
values of a 10^6-step run; the blocks read in ~0.2 s).

The steps table stays the record (its rows are what every other query reads); the blocks repeat what the writer
inserted there, written when a block's last step is. The steps after the last whole block are read from the rows.
A trace without the table (written before it existed), or a block that does not continue the one before it, is read
from the rows from there on. Offline and training side (the writer packs them); no torch.
"""

from __future__ import annotations

import json
import math
import sqlite3
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from . import checks, schema

SIZE = 4096  # steps per block: ~600 KB of values; the rows after the last whole block are at most SIZE - 1
# the columns a block holds, in its BLOB's order: the numeric step columns, then the first group's learning rate
FIELDS = schema.STEP_NUMBERS + ("lr",)
FIELDS_TEXT = ",".join(FIELDS)
INSERT = "INSERT INTO step_blocks (first, n, fields, data, reasons) VALUES (?, ?, ?, ?, ?)"
DEFAULT_REASON = "sentinel"  # a step observed by the sentinel only: most steps; a block lists the others

Row = tuple[int, int, str, bytes, str | None]


def number(v: object) -> float:
    """A step value as the reader gives it: a number, NaN where there is none (None)."""
    return math.nan if v is None else float(v)  # type: ignore[arg-type]  # (the writer's values: numbers or None)


def first_lr(text: str | None) -> float:
    """The first parameter group's learning rate of the writer's JSON list, as the steps reader parses it."""
    if not text:
        return math.nan
    groups = json.loads(text)
    return float(groups[0]) if groups and groups[0] is not None else math.nan


class Packer:
    """Step values as the writer inserts them, packed into a ``step_blocks`` row every SIZE consecutive steps."""

    def __init__(self, size: int | None = None) -> None:
        self.size = size or SIZE
        self.first = 0  # the step the block being filled starts at
        self.values: list[Sequence[float]] = []  # one tuple of FIELDS per step
        self.reasons: dict[str, str | None] = {}  # offset in the block -> reason, where not DEFAULT_REASON

    def add(self, step: int, values: Sequence[float], reason: str | None) -> Row | None:
        """One step's FIELDS values; the block's row when this step completes it. A step that does not follow the
        last one (the writer numbers them 0, 1, ...: not expected) starts the blocks over after it."""
        if step != self.first + len(self.values):
            self.first, self.values, self.reasons = step + 1, [], {}
            return None
        if reason != DEFAULT_REASON:
            self.reasons[str(len(self.values))] = reason
        self.values.append(values)
        return self._full() if len(self.values) == self.size else None

    def _full(self) -> Row:
        data = np.asarray(self.values, dtype="<f8").T.tobytes()  # column after column
        row = (self.first, self.size, FIELDS_TEXT, data, json.dumps(self.reasons) if self.reasons else None)
        self.first, self.values, self.reasons = self.first + self.size, [], {}
        return row

    def add_many(self, first: int, values: npt.NDArray[np.float64], reasons: Sequence[str | None]) -> list[Row]:
        """Consecutive steps from ``first`` ([steps x FIELDS]: a generated run's, chunk by chunk): the rows of the
        blocks they complete; whole blocks are taken as they are."""
        out, i = [], 0
        while i < len(values):
            if not self.values and first + i == self.first and len(values) - i >= self.size:
                self.values = list(values[i : i + self.size])
                why = reasons[i : i + self.size]
                self.reasons = {str(k): r for k, r in enumerate(why) if r != DEFAULT_REASON}
                out.append(self._full())
                i += self.size
            else:
                row = self.add(first + i, values[i], reasons[i])
                out.extend([row] if row is not None else [])
                i += 1
        return out


class Blocks(NamedTuple):
    """The steps [0, n) read from blocks: values [n x FIELDS] and the reason of each step."""

    n: int
    values: npt.NDArray[np.float64]
    reasons: npt.NDArray[np.object_]


def read(conn: sqlite3.Connection, n_steps: int) -> Blocks:
    """The blocks that continue each other from step 0, up to ``n_steps`` (the rows the steps table holds): a trace
    without blocks gives n = 0. Inside the caller's read transaction."""
    empty = Blocks(0, np.empty((0, len(FIELDS))), np.empty(0, dtype=object))
    if not conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'step_blocks'").fetchone():
        return empty
    rows = conn.execute("SELECT first, n, fields, data, reasons FROM step_blocks ORDER BY first").fetchall()
    parts: list[npt.NDArray[np.float64]] = []
    reasons: dict[int, str | None] = {}
    at = 0
    for first, n, fields, data, why in rows:
        if first != at or not isinstance(n, int) or n <= 0 or at + n > n_steps:
            break
        cols = _columns(fields)
        if cols is None or not isinstance(data, bytes) or len(data) != 8 * n * len(fields.split(",")):
            break
        parts.append(np.frombuffer(data, dtype="<f8").reshape(-1, n)[cols].T)
        reasons.update(_reasons(why, first, n))
        at += n
    if not parts:
        return empty
    why_all = np.full(at, DEFAULT_REASON, dtype=object)
    for step, reason in reasons.items():
        why_all[step] = reason
    return Blocks(at, np.concatenate(parts), why_all)


def _columns(fields: object) -> list[int] | None:
    """Where each of FIELDS sits in a block written with ``fields`` (a later version may add columns); None when a
    block lacks one of them."""
    if fields == FIELDS_TEXT:
        return list(range(len(FIELDS)))
    if not isinstance(fields, str):
        return None
    have = {f: i for i, f in enumerate(fields.split(","))}
    return [have[f] for f in FIELDS] if all(f in have for f in FIELDS) else None


def _reasons(text: object, first: int, n: int) -> dict[int, str | None]:
    """A block's reasons other than the default: {offset: text or null} as JSON, offsets within the block."""
    if text is None:
        return {}
    value = checks.parse_json(text, "step_blocks.reasons") if isinstance(text, str) else None
    if not isinstance(value, dict):
        raise checks.Invalid(f"table step_blocks: column reasons holds {text!r:.40}: not a JSON object")
    out: dict[int, str | None] = {}
    for k, v in value.items():
        if not (k.isdigit() and int(k) < n) or not (v is None or isinstance(v, str)):
            raise checks.Invalid(f"table step_blocks: column reasons holds {k!r}: {v!r:.40}: not an offset and a text")
        out[first + int(k)] = v
    return out
