"""Reads of the large tables (stats, hists, peaks) sized by what the file holds, never by the steps x sites it
claims: the distinct steps of a table found by index seeks (not a scan of its rows), statistics of given steps for
every site of a kind in one query, the histograms of many sites and steps in one query kept as concatenated counts,
and the peaks rows streamed in chunks. Every value is checked as it is read (``checks.Invalid`` otherwise).
Offline side: numpy only.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from . import checks
from .schema import HIST_HI, HIST_LO

N_BINADES = HIST_HI - HIST_LO + 1
PEAK_CHUNK_VALUES = 1 << 20  # float32 peaks decoded at a time (4 MB), whatever the number of sites


def check_steps(conn: sqlite3.Connection, table: str, recorded: int | None = None) -> None:
    """Every row of ``table`` (keyed by step first) names a recorded step: its smallest and largest step, two index
    seeks, against the steps recorded as of the same read (a trace being written commits a step's rows with the step;
    a text or real step sorts apart from the integers: it shows there, or among the distinct steps). ``recorded``:
    the steps the caller counted in the read transaction this runs in (None: counted here, ~0.05 s at 10^6 steps)."""
    # one aggregate per query: SQLite answers a lone min() or max() from the index, both together by a scan
    lo = conn.execute(f"SELECT min(step) FROM {table}").fetchone()[0]
    hi = conn.execute(f"SELECT max(step) FROM {table}").fetchone()[0]
    # after: a step committed meanwhile only adds
    n = recorded if recorded is not None else conn.execute("SELECT count(*) FROM steps").fetchone()[0]
    for v in (lo, hi):
        if v is not None and not (isinstance(v, int) and 0 <= v < n):
            raise checks.Invalid(f"table {table}: column step holds {v!r:.20}: not a recorded step")


def distinct_steps(conn: sqlite3.Connection, table: str, n_steps: int) -> np.ndarray:
    """The steps that have rows in ``table`` (stats or hists: keyed by (step, site)), found by one index seek per
    distinct step: ~12,000 seeks for a 10^6-step run, not a scan of its 10^7 rows. ``n_steps``: the steps recorded,
    counted in the caller's read transaction."""
    check_steps(conn, table, n_steps)
    rows = conn.execute(
        f"WITH RECURSIVE d(s) AS (SELECT (SELECT min(step) FROM {table}) UNION ALL "
        f"SELECT (SELECT min(step) FROM {table} WHERE step > d.s) FROM d WHERE d.s IS NOT NULL) "
        "SELECT s FROM d WHERE s IS NOT NULL"
    ).fetchall()
    bad = [r[0] for r in rows if not isinstance(r[0], int)]
    if bad:
        raise checks.Invalid(f"table {table}: column step holds {bad[0]!r:.20}: not a recorded step")
    return np.array([r[0] for r in rows], dtype=np.int64)


def _in_list(steps: np.ndarray) -> str:
    return ",".join(str(int(s)) for s in steps)


def stats_at(
    conn: sqlite3.Connection,
    fields: tuple[str, ...],
    steps: np.ndarray,
    ids: np.ndarray,
    n_sites: int,
    fill: float = np.nan,
) -> dict[str, np.ndarray]:
    """field -> [len(steps) x len(ids)] statistics at these steps (sorted, distinct) of these sites (sorted ids);
    ``fill`` where a site has no row. Every row of those steps is read and its site checked (of ``n_sites``)."""
    out = {f: np.full((len(steps), len(ids)), fill) for f in fields}
    if not len(steps) or not len(ids):
        return out
    cur = conn.execute(f"SELECT step, site, {', '.join(fields)} FROM stats WHERE step IN ({_in_list(steps)})")
    while True:
        rows = cur.fetchmany(65536)
        if not rows:
            break
        arr = np.array(rows, dtype=np.float64)
        where = arr[:, :2]
        if not np.isfinite(where).all() or (where != np.floor(where)).any():
            raise checks.Invalid("a stats row without an integer step and site")
        if (where[:, 1] < 0).any() or (where[:, 1] >= n_sites).any():
            raise checks.Invalid("table stats: column site holds a value that is not a site id")
        i = np.searchsorted(steps, where[:, 0].astype(np.int64))
        j = np.searchsorted(ids, where[:, 1].astype(np.int64))
        i, j = np.minimum(i, len(steps) - 1), np.minimum(j, len(ids) - 1)
        keep = (steps[i] == where[:, 0]) & (ids[j] == where[:, 1])
        for k, f in enumerate(fields):
            vals = arr[keep, 2 + k]
            checks.check_range("stats", f, vals)
            vals[np.isnan(vals)] = fill
            out[f][i[keep], j[keep]] = vals
    return out


@dataclass
class Hists:
    """Exponent histograms of many (step, site) rows, stored as read: row r counts ``counts[offsets[r]:offsets[r+1]]``
    for binades ``lo[r]``, ``lo[r] + 1``, ... (none of its 255 columns is stored where it is empty)."""

    step: np.ndarray
    site: np.ndarray
    lo: np.ndarray
    offsets: np.ndarray
    counts: np.ndarray  # int64

    def __len__(self) -> int:
        return len(self.step)

    def take(self, rows: np.ndarray) -> Hists:
        """The given rows (indices), in that order."""
        rows = np.asarray(rows, dtype=np.int64)
        n = self.offsets[rows + 1] - self.offsets[rows]
        starts = np.repeat(self.offsets[rows] - np.concatenate(([0], np.cumsum(n)[:-1])), n)
        idx = starts + np.arange(int(n.sum()))
        return Hists(
            self.step[rows], self.site[rows], self.lo[rows], np.concatenate(([0], np.cumsum(n))), self.counts[idx]
        )

    @property
    def cumulative(self) -> np.ndarray:
        """Running sum of the counts with a 0 in front (int64: exact)."""
        c: npt.NDArray[np.int64] | None = self.__dict__.get("_cum")
        if c is None:
            c = self.__dict__["_cum"] = np.concatenate(([0], np.cumsum(self.counts, dtype=np.int64)))
        return c

    def between(self, first: npt.ArrayLike, stop: npt.ArrayLike) -> npt.NDArray[np.float64]:
        """Per row, the values in binades first .. stop - 1 (binade numbers; broadcast per row)."""
        n = self.offsets[1:] - self.offsets[:-1]
        a = np.clip(np.asarray(first) - self.lo, 0, n)
        b = np.clip(np.asarray(stop) - self.lo, 0, n)
        b = np.maximum(a, b)
        cum = self.cumulative
        out: npt.NDArray[np.float64] = (cum[self.offsets[:-1] + b] - cum[self.offsets[:-1] + a]).astype(np.float64)
        return out

    @property
    def totals(self) -> npt.NDArray[np.float64]:
        return self.between(HIST_LO, HIST_HI + 1)

    def dense(self) -> np.ndarray:
        """[rows x 255] counts (column j: binade j - 127); for a few rows at a time."""
        out = np.zeros((len(self), N_BINADES), dtype=np.int64)
        n = self.offsets[1:] - self.offsets[:-1]
        r = np.repeat(np.arange(len(self)), n)
        col = np.arange(len(self.counts)) - np.repeat(self.offsets[:-1], n) + np.repeat(self.lo - HIST_LO, n)
        out[r, col] = self.counts
        return out


def hists_at(conn: sqlite3.Connection, steps: np.ndarray, n_sites: int, ids: np.ndarray | None = None) -> Hists:
    """The histograms at these steps (sorted) of these sites (sorted ids; None: all), in (step, site) order. Every
    row of those steps is read and its site checked (of ``n_sites``)."""
    if not len(steps) or (ids is not None and not len(ids)):
        return _hists([])
    rows = conn.execute(
        f"SELECT step, site, lo, counts FROM hists WHERE step IN ({_in_list(steps)}) ORDER BY step, site"
    ).fetchall()
    h = _hists(rows)
    if len(h) and ((h.site < 0).any() or (h.site >= n_sites).any()):
        raise checks.Invalid("table hists: column site holds a value that is not a site id")
    if ids is not None and len(h):
        j = np.minimum(np.searchsorted(ids, h.site), len(ids) - 1)
        keep = ids[j] == h.site
        if not keep.all():
            h = h.take(np.flatnonzero(keep))
    return h


def hists_of(conn: sqlite3.Connection, site: int, n_sites: int, n_steps: int) -> Hists:
    """Every histogram of one site: one index seek per histogram step (the table is keyed by step, then site), and
    two more for the smallest and largest site of that step (a row of no site: the file is corrupt). ``n_steps``:
    the steps recorded, counted in the caller's read transaction."""
    check_steps(conn, "hists", n_steps)
    rows = conn.execute(
        "WITH RECURSIVE d(s) AS (SELECT (SELECT min(step) FROM hists) UNION ALL "
        "SELECT (SELECT min(step) FROM hists WHERE step > d.s) FROM d WHERE d.s IS NOT NULL) "
        "SELECT d.s, (SELECT min(site) FROM hists WHERE step = d.s), (SELECT max(site) FROM hists WHERE step = d.s), "
        "h.site, h.lo, h.counts FROM d LEFT JOIN hists h ON h.step = d.s AND h.site = ? WHERE d.s IS NOT NULL "
        "ORDER BY d.s",
        (int(site),),
    ).fetchall()
    for _, lo, hi, *_ in rows:
        for v in (lo, hi):
            if not (isinstance(v, int) and 0 <= v < n_sites):
                raise checks.Invalid(f"table hists: column site holds {v!r:.20}: not a site id")
    return _hists([(r[0], r[3], r[4], r[5]) for r in rows if r[3] is not None])


def _hists(rows: list[tuple[Any, ...]]) -> Hists:
    if not rows:
        z = np.zeros(0, dtype=np.int64)
        return Hists(z, z, z, np.zeros(1, dtype=np.int64), z)
    steps, sites, lo, blobs = zip(*rows)
    # the integers' types checked by numpy's reading of them (a tuple of Python ints, and only that, reads as int64;
    # a real, a text or an integer past 64 bits does not), the BLOBs' by their lengths
    ints = [np.array(v) for v in (steps, sites, lo)]
    sizes = [len(b) if isinstance(b, bytes) else -1 for b in blobs]
    if any(a.dtype != np.int64 for a in ints) or min(sizes) < 0:
        raise checks.Invalid("a histogram row without an integer step, site and binade and int64 counts")
    n = np.array(sizes, dtype=np.int64)
    if (n % 8).any() or (n == 0).any():
        raise checks.Invalid("a histogram row without int64 counts")
    n //= 8
    step_a, site_a, lo_a = ints
    # read-only, and no copy where int64 is little-endian (every platform numpy ships for): nothing writes into it
    counts = np.frombuffer(b"".join(blobs), dtype="<i8").astype(np.int64, copy=False)
    if (lo_a < HIST_LO).any() or (lo_a + n - 1 > HIST_HI).any() or (counts < 0).any():
        raise checks.Invalid(f"a histogram spans binades outside {HIST_LO}..{HIST_HI} or holds negative counts")
    return Hists(step_a, site_a, lo_a, np.concatenate(([0], np.cumsum(n))), counts)


def peak_chunks(
    conn: sqlite3.Connection, n_steps: int, width: int, recorded: int | None = None
) -> Iterator[tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]]]:
    """The peaks rows of steps 0 .. n_steps - 1 in step order, as (steps, float32 [k x width]) chunks (-1: a site not
    observed, or beyond the row's sites); ``recorded`` as for check_steps."""
    check_steps(conn, "peaks", recorded)
    cur = conn.execute("SELECT step, data FROM peaks WHERE step >= 0 AND step < ? ORDER BY step", (n_steps,))
    per = max(16, PEAK_CHUNK_VALUES // max(width, 1))
    while True:
        rows = cur.fetchmany(per)
        if not rows:
            return
        steps, blobs = zip(*rows)
        if not all(isinstance(s, int) for s in steps) or not all(isinstance(b, bytes) for b in blobs):
            bad = next(s for s, b in rows if not isinstance(s, int) or not isinstance(b, bytes))
            raise checks.Invalid(f"peaks of step {bad!r:.20} are not float32 values")
        sizes = {len(b) for b in blobs}
        if any(size % 4 for size in sizes):
            raise checks.Invalid("peaks that are not float32 values")
        if sizes == {4 * width}:  # every row holds every site: one buffer
            out = np.frombuffer(b"".join(blobs), dtype="<f4").reshape(len(rows), width).copy()
        else:
            out = np.full((len(rows), width), -1.0, dtype=np.float32)
            for i, blob in enumerate(blobs):
                arr = np.frombuffer(blob, dtype="<f4", count=min(len(blob) // 4, width))
                out[i, : len(arr)] = arr
        yield np.array(steps, dtype=np.int64), out
