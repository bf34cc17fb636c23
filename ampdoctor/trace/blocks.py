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

import numpy as np
import numpy.typing as npt

from . import checks, schema

SIZE = 4096  # steps per block: ~600 KB of values; the rows after the last whole block are at most SIZE - 1
# the columns a block holds, in its BLOB's order: the numeric step columns, the first group's learning rate, and the
# reason as an index into the block's list of reasons
FIELDS = schema.STEP_NUMBERS + ("lr",)
REASON = "reason"
WRITTEN = ",".join(FIELDS + (REASON,))
INSERT = "INSERT INTO step_blocks (first, n, fields, data, reasons) VALUES (?, ?, ?, ?, ?)"

Row = tuple[int, int, str, bytes, str]


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
        self.filled = 0  # its steps so far
        # the block's columns, allocated once (nothing grows per step): FIELDS, then the reason's index in names
        self.data = np.empty((len(FIELDS) + 1, self.size), dtype="<f8")
        self.names: dict[str | None, int] = {}

    def add(self, step: int, values: Sequence[float], reason: str | None) -> Row | None:
        """One step's FIELDS values; the block's row when this step completes it. A step that does not follow the
        last one (the writer numbers them 0, 1, ...: not expected) starts the blocks over after it."""
        if step != self.first + self.filled:
            self._start(step + 1)
            return None
        self.data[:-1, self.filled] = values
        self.data[-1, self.filled] = self.names.setdefault(reason, len(self.names))
        self.filled += 1
        return self._full() if self.filled == self.size else None

    def _start(self, first: int) -> None:
        self.first, self.filled, self.names = first, 0, {}

    def _full(self) -> Row:
        row = (self.first, self.size, WRITTEN, self.data.tobytes(), json.dumps(list(self.names)))
        self._start(self.first + self.size)
        return row

    def add_many(self, first: int, values: npt.NDArray[np.float64], reasons: Sequence[str | None]) -> list[Row]:
        """Consecutive steps from ``first`` ([steps x FIELDS]: a batch of the writer's, a generated run's chunk): the
        rows of the blocks they complete. The same as ``add`` step by step, a block's share of the steps at a time
        (no Python per step: the writer runs it on every step, sharing the GIL with training)."""
        rows: list[Row] = []
        at, n = 0, len(values)
        if n and first != self.first + self.filled:  # (as add(): a step that does not follow starts over after it)
            self._start(first + 1)
            at = 1
        while at < n:
            k = min(n - at, self.size - self.filled)
            seg = reasons[at : at + k]
            names = self.names
            for reason in dict.fromkeys(seg):  # (each new reason in order of first appearance, as add() numbers them)
                names.setdefault(reason, len(names))
            self.data[:-1, self.filled : self.filled + k] = values[at : at + k].T
            self.data[-1, self.filled : self.filled + k] = list(map(names.__getitem__, seg))
            self.filled += k
            at += k
            if self.filled == self.size:
                rows.append(self._full())
        return rows


def read(
    conn: sqlite3.Connection,
    out: npt.NDArray[np.float64],
    reasons: npt.NDArray[np.object_],
    fields: Sequence[str] = FIELDS,
) -> int:
    """Fill ``out`` ([steps x fields], some of FIELDS; best in column order) and ``reasons`` (one per step) from the
    blocks that continue each other from step 0, as far as ``out`` reaches (the rows the steps table holds); how many
    steps they gave (0: a trace without blocks). Inside the caller's read transaction."""
    if not conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'step_blocks'").fetchone():
        return 0
    wanted = [FIELDS.index(f) for f in fields]
    at = 0
    for first, n, written, data, names in conn.execute(
        "SELECT first, n, fields, data, reasons FROM step_blocks ORDER BY first"
    ):
        if first != at or not isinstance(n, int) or n <= 0 or at + n > len(out):
            break
        cols = _columns(written)
        if cols is None or not isinstance(data, bytes) or len(data) != 8 * n * len(written.split(",")):
            break
        block = np.frombuffer(data, dtype="<f8").reshape(-1, n)
        for j, i in enumerate(wanted):  # only the columns asked for: a reader of a few copies a few
            out[at : at + n, j] = block[cols[i]]
        reasons[at : at + n] = _reasons(names, block[cols[-1]])
        at += n
    return at


def _columns(fields: object) -> list[int] | None:
    """Where each of FIELDS, then the reason, sits in a block written with ``fields`` (a later version may add
    columns); None when a block lacks one of them."""
    if fields == WRITTEN:
        return list(range(len(FIELDS) + 1))
    if not isinstance(fields, str):
        return None
    have = {f: i for i, f in enumerate(fields.split(","))}
    return [have[f] for f in FIELDS + (REASON,)] if all(f in have for f in FIELDS + (REASON,)) else None


def _reasons(text: object, codes: npt.NDArray[np.float64]) -> npt.NDArray[np.object_]:
    """A block's reasons: its list of reason texts (JSON, null allowed) taken at each step's index."""
    names = checks.parse_json(text, "step_blocks.reasons") if isinstance(text, str) else None
    if not isinstance(names, list) or not all(v is None or isinstance(v, str) for v in names):
        raise checks.Invalid(f"table step_blocks: column reasons holds {text!r:.40}: not a JSON list of texts")
    at = codes.astype(np.int64)
    if (at != codes).any() or (at < 0).any() or (at >= len(names)).any():
        raise checks.Invalid("table step_blocks: a reason index out of the block's list")
    return np.array(names + [None], dtype=object)[:-1][at]
