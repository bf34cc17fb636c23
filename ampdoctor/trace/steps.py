"""The steps table as a DataFrame, read in time linear in its rows and in memory bounded by them: the numbers of a
chunk of rows go into numpy at once (no Python object kept per value), the learning-rate JSON is parsed once per
change (a schedule changes it every step: a fast path for the usual one-group list), and the observation reason, which
is "sentinel" on most steps, is read only where it is not. Every value read is checked as it is read (numbers, or the
writer's 'nan' / 'inf' texts; JSON lists of numbers; text reasons): a malformed row is a ``checks.Invalid``.
Offline side: no torch.
"""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

import numpy as np
import numpy.typing as npt

from . import blocks, checks, schema

CHUNK = 65536  # rows converted at a time: a few MB of Python objects whatever the length of the run
TEXT_FIELDS = ("lr", "reason")
NUMBER_FIELDS = schema.STEP_NUMBERS
FLOAT_FIELDS = (
    "time",
    "step_time",
    "data_time",
    "samples_per_s",
    "loss",
    "loss_scale",
    "loss_scale_next",
    "grad_norm",
    "grad_max",
    "observer_time",
)
INT_FIELDS = ("samples", "microbatches", "peak_mem", "level")  # integers, NaN where missing
FLAG_FIELDS = ("skipped", "nonfinite")  # booleans, missing = False
# Columns that hold one value on most steps: read where they differ from it (skips and non-finite steps are rare, a
# step observes its sites one time in ten, the batch size and micro-batches hardly change) instead of on every row.
SPARSE = {"skipped": 0, "nonfinite": 0, "level": -1, "samples": None, "microbatches": None, "peak_mem": None}
_JSON_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
# A chunk of learning-rate texts in the writer's usual form (one-group lists of plain numbers) is parsed at once, by
# Python's own (correctly rounded) float parsing; any other text sends its chunk through the JSON parser.
_NOT_PLAIN = re.compile(  # a character or a place a plain list does not have; one "[...]" a line
    r"[^0-9.eE+\-\[\]\n, ]|(?<![eE])\+|(?:^|\n)[^\[]|[^\]](?:\n|$)|\[ *,|, *\]|, *,"
)
_OTHER_GROUPS = re.compile(r" *,[^\n]*\]")  # ", x, y]" after a list's first number
if TYPE_CHECKING:  # (typing names past Python 3.9: for the type checker only)
    from typing import TypeAlias

    import pandas as pd  # (imported by ``read``: the arrays of ``columns`` need no pandas)

    # every group's learning rate of one step, as recorded (None: a JSON null)
    Groups: TypeAlias = list[float | None]


def read(conn: sqlite3.Connection, lr_groups: bool = True) -> pd.DataFrame:
    """One row per step, columns as schema.STEP_FIELDS (``lr``: the first group's learning rate) plus ``lr_groups``
    (every group's, as recorded) unless ``lr_groups`` is False. Run inside one read transaction (Trace.snapshot).
    Without ``lr_groups`` the steps the writer packed into blocks (trace.blocks) are read from there, the others
    from the rows."""
    import pandas as pd

    numbers, reasons, groups = columns(conn, lr_groups)
    n = len(numbers)
    cols: dict[str, object] = {"step": np.arange(n, dtype=np.int64)}
    for i, f in enumerate(NUMBER_FIELDS):
        col = numbers[:, i]
        if f in FLAG_FIELDS:
            cols[f] = np.where(np.isnan(col), 0.0, col).astype(bool)
        elif f in INT_FIELDS:
            whole = (
                not np.isnan(col).any() and bool((col == np.floor(col)).all()) and np.abs(col).max(initial=0) < 2**53
            )
            cols[f] = col.astype(np.int64) if whole else col
        else:
            cols[f] = col.copy()  # (its own array: the frame keeps none of ``numbers``)
    cols["lr"] = numbers[:, -1].copy()
    cols["reason"] = reasons
    del numbers
    # one frame made in the columns' order, of the arrays above as they are: a frame grown column by column, then
    # reordered, held the numbers three times over at its peak (~400 MB at 10^6 steps)
    df = pd.DataFrame({f: cols.pop(f) for f in schema.STEP_FIELDS}, copy=False)
    if groups is not None:
        df["lr_groups"] = groups
    return df


def columns(
    conn: sqlite3.Connection, lr_groups: bool = False, fields: Sequence[str] = NUMBER_FIELDS, n: int | None = None
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.object_], list[Groups | None] | None]:
    """The steps as arrays, checked (``read`` without the frame, for a reader of a few columns of a long run):
    [steps x fields + lr] in column order (``fields``: some of NUMBER_FIELDS; NaN where a row has no value), the
    reasons, and every group's learning rates when ``lr_groups`` (then read from the rows, not the blocks). ``n``:
    the steps recorded, counted in the caller's read transaction (None: counted here, ~0.03 s at 10^6 steps)."""
    have = {r[1] for r in conn.execute("PRAGMA table_info(steps)")}
    if n is None:
        n = conn.execute("SELECT count(*) FROM steps").fetchone()[0]
    # column after column; the last one: the learning rate
    numbers = np.empty((n, len(fields) + 1), order="F")
    reasons = np.empty(n, dtype=object)  # filled, not np.full: numpy fills objects so ~10x faster (0.08 s at 10^6)
    reasons.fill("sentinel" if "reason" in have else None)
    start = 0 if lr_groups else blocks.read(conn, numbers, reasons, (*fields, "lr"))  # the first step read from rows
    dense = [i for i, f in enumerate(fields) if f not in SPARSE or f not in have]
    sparse = [i for i in range(len(fields)) if i not in dense]
    numbers[start:, sparse] = _sparse(conn, [fields[i] for i in sparse], start, n)
    cols = [f if f in have else "NULL" for f in (fields[i] for i in dense)]  # (columns a trace may lack)
    groups: list[Groups | None] | None = [] if lr_groups else None
    parsed = _LrParser()
    lr_col = "lr" if "lr" in have else "NULL"
    cur = conn.execute(
        f"SELECT {''.join(c + ',' for c in cols)} {lr_col} FROM steps WHERE step >= ? ORDER BY step", (start,)
    )
    at = start
    while True:
        rows = cur.fetchmany(CHUNK)
        if not rows:
            break
        k = len(rows)
        if at + k > n:
            raise checks.Invalid("the steps table changed while it was read")
        numbers[at : at + k, dense] = np.array([r[:-1] for r in rows], dtype=np.float64)
        texts = [r[-1] for r in rows]
        plain = None if groups is not None else _plain_lrs(texts)
        numbers[at : at + k, -1] = plain if plain is not None else parsed.first(texts, groups)
        at += k
    if at != n:
        raise checks.Invalid("the steps table changed while it was read")
    for i, f in enumerate(fields):
        checks.check_range("steps", f, numbers[:, i])  # the ranges the whole-file checks hold a small file to
    _reasons(conn, start, n, reasons, "reason" in have)
    return numbers, reasons, groups


def _plain_lrs(texts: Sequence[object]) -> npt.NDArray[np.float64] | None:
    """The learning rates of a chunk of texts that are all one-number JSON lists (or NULL, or empty: NaN), parsed
    in one pass; None when one is not."""
    strs = cast("Sequence[str | None]", texts)  # (when all are: the condition below)
    big = (
        "\n".join("[]" if t is None else t for t in strs) if all(isinstance(t, str) or t is None for t in texts) else ""
    )
    if not big or big.count("[") != len(texts) or big.count("]") != len(texts) or _NOT_PLAIN.search(big):
        return None
    if "," in big:  # several groups: the first one's (the others are numbers too: the characters said so)
        big = _OTHER_GROUPS.sub("]", big)
    try:
        return np.array(big.replace("[]", "nan").replace("[", "").replace("]", "").split("\n"), dtype=np.float64)
    except ValueError:  # e.g. "[1e]": the JSON parser says what is wrong
        return None


def _sparse(conn: sqlite3.Connection, cols: list[str], start: int, n: int) -> npt.NDArray[np.float64]:
    """[n - start x cols] of columns that hold one value on most rows (SPARSE: that value, or when None the first
    row's), read in one scan where any of them holds another (numbers, or the writer's NaN texts, as the dense
    read), steps [start, n)."""
    if not cols:
        return np.zeros((n - start, 0))
    first = conn.execute(f"SELECT {', '.join(cols)} FROM steps WHERE step >= ? ORDER BY step LIMIT 1", (start,))
    row = first.fetchone()
    default = [SPARSE[c] if SPARSE[c] is not None else (row[i] if row else None) for i, c in enumerate(cols)]
    out = np.tile(np.array([default], dtype=np.float64), (n - start, 1))
    where = " OR ".join(f"{c} IS NOT ?" for c in cols)
    rows = conn.execute(
        f"SELECT step, {', '.join(cols)} FROM steps WHERE typeof(step) = 'integer' AND step >= ? AND step < ? "
        f"AND ({where})",
        (start, n, *default),
    ).fetchall()
    if rows:
        arr = np.array([r[1:] for r in rows], dtype=np.float64)
        out[np.array([r[0] for r in rows], dtype=np.int64) - start] = arr
    return out


class _LrParser:
    """Learning rates from the JSON lists the writer records, parsed once per distinct consecutive text."""

    def __init__(self) -> None:
        self.last_text: object = None
        self.last: tuple[float, Groups | None] = (np.nan, None)

    def parse(self, text: object) -> tuple[float, Groups | None]:
        if text is None or text == "":
            return np.nan, None
        if isinstance(text, str) and text[:1] == "[" and text[-1:] == "]" and _JSON_NUMBER.fullmatch(text[1:-1]):
            v = float(text[1:-1])
            return v, [v]
        parsed = checks.parse_json(text, "steps.lr") if isinstance(text, str) else text
        if not isinstance(parsed, list):
            raise checks.Invalid(f"table steps: column lr holds {text!r:.40}: not a JSON list of numbers")
        checks.check_value(parsed, [(checks.NUM, None)], "steps.lr")
        return (float(parsed[0]) if parsed and parsed[0] is not None else np.nan), parsed

    def first(self, texts: Sequence[object], groups: list[Groups | None] | None) -> npt.NDArray[np.float64]:
        out = np.empty(len(texts))
        for i, t in enumerate(texts):
            if t != self.last_text or type(t) is not type(self.last_text):
                self.last = self.parse(t)
                self.last_text = t
            out[i] = self.last[0]
            if groups is not None:
                groups.append(self.last[1])
        return out


def _reasons(conn: sqlite3.Connection, start: int, n: int, out: np.ndarray, have: bool) -> None:
    """Why each step from ``start`` observed what it did, into ``out`` (which holds "sentinel", the reason of most
    steps): only the other rows are read."""
    if not have:
        return
    rows = conn.execute(
        "SELECT step, reason FROM steps WHERE reason IS NOT 'sentinel' AND typeof(step) = 'integer' "
        "AND step >= ? AND step < ?",
        (start, n),
    ).fetchall()
    if rows:
        steps, why = zip(*rows)
        bad = [w for w in set(why) if w is not None and not isinstance(w, str)]
        if bad:
            raise checks.Invalid(f"table steps: column reason holds {bad[0]!r:.40}: not text")
        out[np.array(steps, dtype=np.int64)] = np.array(why, dtype=object)
