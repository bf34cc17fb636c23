"""A trace's steps read as it grows, and the health figures exported for each. Offline side: no torch import.

``StepRows`` keeps one read-only connection (the trace's own, ``trace.files.connect``: WAL lets it read while the
writer writes) and each ``read()`` asks only for the rows after the last one it returned, a page at a time, so a
live exporter costs a small query per poll and ``ampdoctor export`` of 10^6 steps holds one page in memory.
"""

from __future__ import annotations

import math
import sqlite3
from dataclasses import dataclass
from typing import NamedTuple

from ..trace import load
from ..trace.files import connect
from ..trace.schema import TraceError

PAGE = 10_000  # rows per query: bounded memory whatever the trace's length

# the steps columns read (a trace from before the later columns gives NULL for them)
COLUMNS = (
    "step",
    "time",
    "loss",
    "loss_scale",
    "skipped",
    "nonfinite",
    "grad_norm",
    "grad_max",
    "step_time",
    "data_time",
    "observer_time",
)
_NAN_TEXT = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}  # how the writer stores a NaN (REAL NaN is NULL)


class Figure(NamedTuple):
    """One exported scalar: its name under the prefix, and what it is (the docs' table)."""

    name: str
    about: str


FIGURES = (
    Figure("loss", "the training loss of the step (summed over its micro-batches); NaN/Inf exported as they are"),
    Figure("loss_scale", "the GradScaler's scale in force at the step"),
    Figure("skipped", "1 when the scaler skipped the optimizer step (inf/NaN gradients), else 0"),
    Figure("skipped_total", "skipped steps so far, every step counted whatever the cadence"),
    Figure("nonfinite_total", "steps with a NaN/Inf (loss, gradients or an observed tensor) so far"),
    Figure("grad_norm", "global norm of the unscaled gradients the optimizer received"),
    Figure("grad_peak", "largest |unscaled gradient| element"),
    Figure("step_time", "seconds of the step, ampdoctor's share included"),
    Figure("data_wait", "seconds the step waited for its first batch (the input pipeline)"),
    Figure("observer_time", "seconds ampdoctor spent on the training thread in the step"),
    Figure("cost", "ampdoctor's share of the run's time so far (observer_time / step_time, summed)"),
)
NAMES = tuple(f.name for f in FIGURES)


class Point(NamedTuple):
    """The figures of one step; a figure the step did not record is absent (never written as 0 or NaN)."""

    step: int
    values: dict
    anomalous: bool  # skipped or non-finite: exported whatever the cadence
    time: float | None = None  # when the step ended (seconds since the epoch), as the trace recorded it


@dataclass
class _Totals:
    skipped: int = 0
    nonfinite: int = 0
    observer: float = 0.0
    time: float = 0.0


def _number(v, path: str, column: str):
    """A stored value as a float (None when NULL); anything else is a corrupt trace."""
    if v is None:
        return None
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str) and v in _NAN_TEXT:
        return _NAN_TEXT[v]
    raise TraceError(f"{path}: corrupt trace (steps.{column} holds {v!r:.40}, not a number)")


class StepRows:
    """The rows of a trace's steps table after the last read, as Points. ``read()`` never returns a step twice."""

    def __init__(self, path: str, page: int = PAGE):
        self.path = path
        load(path).close()  # every check the reader runs on a file from anyone, once
        try:
            self._conn = connect(path)[0]
            have = {r[1] for r in self._conn.execute("PRAGMA table_info(steps)")}
        except sqlite3.DatabaseError as exc:
            raise TraceError(f"{path}: corrupt or unreadable trace ({exc})") from None
        cols = ", ".join(c if c in have else "NULL" for c in COLUMNS)
        self._sql = f"SELECT {cols} FROM steps WHERE step > ? ORDER BY step LIMIT {int(page)}"
        self.last = -1  # the last step returned
        self._totals = _Totals()

    def read(self) -> list[Point]:
        """The next page of rows after the last read ([] when there is none yet)."""
        try:
            rows = self._conn.execute(self._sql, (self.last,)).fetchall()
        except sqlite3.DatabaseError as exc:
            raise TraceError(f"{self.path}: corrupt or unreadable trace ({exc})") from None
        out = []
        for row in rows:
            raw = dict(zip(COLUMNS, row))
            step = raw.pop("step")
            if not isinstance(step, int) or step != self.last + 1:
                raise TraceError(f"{self.path}: corrupt trace (step {step!r} follows step {self.last})")
            out.append(self._point(step, {k: _number(v, self.path, k) for k, v in raw.items()}))
            self.last = step
        return out

    def read_all(self):
        """Every row not read yet, page by page (a generator: one page in memory at a time)."""
        while True:
            page = self.read()
            if not page:
                return
            yield page

    def _point(self, step: int, r: dict) -> Point:
        t = self._totals
        skipped = bool(r["skipped"])
        nonfinite = bool(r["nonfinite"])
        t.skipped += skipped
        t.nonfinite += nonfinite
        obs, st = r["observer_time"], r["step_time"]
        if obs is not None and st is not None and math.isfinite(obs) and math.isfinite(st):
            t.observer += obs
            t.time += st
        values = {
            "loss": r["loss"],
            "loss_scale": r["loss_scale"],
            "skipped": int(skipped),
            "skipped_total": t.skipped,
            "nonfinite_total": t.nonfinite,
            "grad_norm": r["grad_norm"],
            "grad_peak": r["grad_max"],
            "step_time": st,
            "data_wait": r["data_time"],
            "observer_time": obs,
            "cost": t.observer / t.time if obs is not None and t.time > 0 else None,
        }
        when = r["time"] if r["time"] is not None and math.isfinite(r["time"]) else None
        return Point(step, {k: v for k, v in values.items() if v is not None}, skipped or nonfinite, when)

    def close(self) -> None:
        self._conn.close()
