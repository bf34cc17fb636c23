"""Read-only view of a trace file. Offline side: no torch import.

A trace may come from anyone, so it is checked when opened (files.py: a regular SQLite file, opened read-only;
checks.py: plain tables with their declared columns, value types, dense step and site ids, JSON well-formed and
shallow), every allocation is sized by rows that exist, and whatever else is wrong becomes a one-line TraceError.
"""

from __future__ import annotations

import contextlib
import copy
import os
import sqlite3

import numpy as np
import pandas as pd

from . import checks, files, schema
from .schema import HIST_HI, HIST_LO, TraceError


class Trace:
    """A trace opened read-only. Every query reads the file again, so a trace being written shows new steps."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self._snapshot_depth = 0
        files.check_file(self.path)
        try:
            self._conn, app_id, version = files.connect(self.path)
        except (sqlite3.DatabaseError, OSError) as exc:
            raise TraceError(f"{self.path}: corrupt or unreadable trace ({exc})") from None
        if app_id != schema.APPLICATION_ID:
            self._conn.close()
            raise TraceError(f"{self.path}: a SQLite database, but not an ampdoctor trace")
        if version > schema.VERSION:
            self._conn.close()
            raise TraceError(
                f"{self.path}: trace format {version} is newer than this ampdoctor reads "
                f"(up to {schema.VERSION}); upgrade ampdoctor"
            )
        try:
            with self.snapshot():  # one state of the file for all checks (a live trace grows)
                self._checked(checks.check_tables, self._conn)
                _ = self.meta  # parsed and type-checked; raises on a malformed entry
        except TraceError:
            self._conn.close()
            raise

    # -- plumbing ----------------------------------------------------------------------------------------------
    def _query(self, sql: str, args=()) -> list:
        try:
            return self._conn.execute(sql, args).fetchall()
        except sqlite3.DatabaseError as exc:
            raise TraceError(f"{self.path}: corrupt or unreadable trace ({exc})") from None

    def _checked(self, fn, *args):
        """``fn(*args)``, its complaints about the file (checks.Invalid, or a value numpy or pandas cannot take)
        turned into one TraceError line."""
        try:
            return fn(*args)
        except checks.Invalid as exc:
            raise TraceError(f"{self.path}: corrupt trace ({exc})") from None
        except sqlite3.DatabaseError as exc:
            raise TraceError(f"{self.path}: corrupt or unreadable trace ({exc})") from None
        except (ValueError, TypeError, OverflowError, RecursionError) as exc:
            raise TraceError(
                f"{self.path}: corrupt trace ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0][:80] if str(exc) else ''})"
            ) from None

    def close(self) -> None:
        self._conn.close()

    @property
    def connection(self) -> sqlite3.Connection:
        """The read-only SQLite connection, for callers that query the file themselves (the dashboard's range
        queries, and its time limit on each statement)."""
        return self._conn

    def reopen(self) -> Trace:
        """Another Trace of this file on a connection of its own (for another thread), without the checks again:
        they read every table and were done when this one was opened. The caller makes sure it is still the same
        file."""
        clone = copy.copy(self)
        try:
            clone._conn, _app_id, _version = files.connect(self.path)
        except (sqlite3.DatabaseError, OSError) as exc:
            raise TraceError(f"{self.path}: corrupt or unreadable trace ({exc})") from None
        clone._snapshot_depth = 0
        return clone

    @contextlib.contextmanager
    def snapshot(self):
        """Every read inside sees one state of the file (one SQLite read transaction): for analyses that combine
        several tables of a trace that is still being written. Re-entrant."""
        if self._snapshot_depth == 0:
            self._query("BEGIN")
            self._query("SELECT count(*) FROM sqlite_master")  # a deferred transaction starts at its first read
        self._snapshot_depth += 1
        try:
            yield self
        finally:
            self._snapshot_depth -= 1
            if self._snapshot_depth == 0:
                self._conn.rollback()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        return f"Trace({self.path!r}, steps={self.n_steps}, sites={len(self.sites())})"

    def _repr_html_(self) -> str:  # notebooks: the `ampdoctor info` summary (ampdoctor/notebook.py)
        from ..notebook import trace_html

        return trace_html(self)

    # -- run level ---------------------------------------------------------------------------------------------
    @property
    def meta(self) -> dict:
        """Run metadata: versions, device, precision configuration (see docs/trace-format.md)."""
        rows = self._query("SELECT key, value FROM meta")
        return self._checked(lambda: {k: checks.meta_value(k, v) for k, v in rows})

    @property
    def config(self) -> dict:
        """The observed precision configuration (autocast, dtypes, optimizer, scaler)."""
        return self.meta.get("config", {})

    @property
    def n_steps(self) -> int:
        return self._query("SELECT count(*) FROM steps")[0][0]

    # -- tables ------------------------------------------------------------------------------------------------
    def steps(self) -> pd.DataFrame:
        """One row per optimizer step (skipped steps included)."""
        have = {r[1] for r in self._query("PRAGMA table_info(steps)")}
        cols = [f if f in have else "NULL" for f in schema.STEP_FIELDS]  # a trace from before the later columns
        rows = self._query(f"SELECT {','.join(cols)} FROM steps ORDER BY step")
        return self._checked(_steps_frame, rows)

    def sites(self, kind: str | None = None) -> pd.DataFrame:
        """Observed sites: id, path, module, kind, module_type, dtype, shape, first_step."""
        sql = "SELECT id, path, module, kind, module_type, dtype, shape, first_step FROM sites"
        args: tuple = ()
        if kind is not None:
            _check_kind(kind)
            sql += " WHERE kind = ?"
            args = (kind,)
        rows = self._query(sql + " ORDER BY id", args)
        if any(not isinstance(r[0], int) or not isinstance(r[1], str) or not isinstance(r[2], str) for r in rows):
            raise TraceError(f"{self.path}: corrupt trace (a site without an integer id, a path or a module)")
        return pd.DataFrame(
            rows, columns=["id", "path", "module", "kind", "module_type", "dtype", "shape", "first_step"]
        )

    def metrics(self, name: str | None = None) -> pd.DataFrame:
        """Logged scalars (log_metric): step, name, value, time."""
        sql, args = "SELECT step, name, value, time FROM metrics", ()
        if name is not None:
            sql, args = sql + " WHERE name = ?", (name,)
        df = pd.DataFrame(self._query(sql + " ORDER BY step, rowid", args), columns=["step", "name", "value", "time"])
        self._checked(lambda: df.__setitem__("value", _numbers(df["value"]).astype(float)))
        return df

    def probes(self) -> pd.DataFrame:
        """Precision-loss probe results (``attach(probe_every=N)``): one row per probed step and module: step, site,
        path, module_type, calls, k (terms per output element), numel, dtype (of the half-precision output),
        rel_err (norm-wise relative error against the FP32 recomputation), max_err (max |error| / max |FP32 output|),
        ref_norm, ref_absmax. Empty for a run without probes (and for traces written before the table existed)."""
        cols = ["step", "site", "path", "module_type", "calls", "k", "numel", "dtype", *schema.PROBE_FIELDS]
        if not self._query("SELECT name FROM sqlite_master WHERE type = 'table' AND name = 'probes'"):
            return pd.DataFrame(columns=cols)
        rows = self._query(
            f"SELECT p.step, p.site, s.path, s.module_type, p.calls, p.k, p.numel, p.dtype, "
            f"{', '.join('p.' + f for f in schema.PROBE_FIELDS)} FROM probes p "
            f"LEFT JOIN sites s ON s.id = p.site ORDER BY p.step, p.site"
        )
        df = pd.DataFrame(rows, columns=cols)
        for f in schema.PROBE_FIELDS:
            df[f] = pd.to_numeric(df[f], errors="coerce").astype(float)
        return df

    def events(self, kind: str | None = None) -> pd.DataFrame:
        """Events (e.g. kind "nonfinite": where the first NaN/Inf of a step came from), with the site path."""
        sql = (
            "SELECT e.step, e.kind, e.site, s.path, s.kind, e.phase, e.message, e.data FROM events e "
            "LEFT JOIN sites s ON s.id = e.site"
        )
        args: tuple = ()
        if kind is not None:
            sql, args = sql + " WHERE e.kind = ?", (kind,)
        rows = self._query(sql + " ORDER BY e.id", args)
        df = pd.DataFrame(rows, columns=["step", "kind", "site", "path", "site_kind", "phase", "message", "data"])
        df["data"] = self._checked(lambda: [_event_data(d) for d in df["data"]])
        return df

    def full_steps(self) -> np.ndarray:
        """Steps that have full statistics."""
        rows = self._query("SELECT DISTINCT step FROM stats WHERE typeof(step) = 'integer' AND step >= 0 ORDER BY step")
        return np.array([r[0] for r in rows], dtype=np.int64)

    # -- per-site arrays ---------------------------------------------------------------------------------------
    def records(self, field: str, kind: str = "act", fill: float = np.nan) -> np.ndarray:
        """[steps x sites] array of one statistic; columns follow ``sites(kind)``, row i is step i.

        ``field`` is "peak" (max |x| every step; NaN/Inf when the tensor held one) or one of the full statistics
        (schema.STATS_FIELDS), present at full-statistics steps only. Steps or sites without a value get ``fill``.
        """
        _check_kind(kind)
        ids = self.sites(kind)["id"].to_numpy()
        n = self.n_steps
        out = np.full((n, len(ids)), fill, dtype=np.float64)
        if not len(ids) or not n:
            return out
        if field == "peak":
            rows = self._query("SELECT step, data FROM peaks WHERE step >= 0 AND step < ? ORDER BY step", (n,))
            self._checked(_fill_peaks, out, rows, ids, fill)
            return out
        if field not in schema.STATS_FIELDS and field not in ("scale", "calls"):
            raise ValueError(
                f"Argument field should be 'peak' or one of {', '.join(schema.STATS_FIELDS)}, but given {field!r}"
            )
        rows = self._query(
            f"SELECT step, site, {field} FROM stats WHERE site BETWEEN ? AND ? AND step >= 0 AND step < ?",
            (int(ids.min()), int(ids.max()), n),
        )
        if rows:
            self._checked(_fill_stats, out, rows, ids, fill)
        return out

    def hist(self, site: int | str, kind: str | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(steps, counts[len(steps) x 255]) exponent histogram of one site; column j is binade 2^(j-127).

        A value x is counted in binade e = floor(log2|x|); zeros, NaN and Inf are not in the histogram (see the
        ``zeros``, ``nan``, ``inf`` statistics); e = -127 holds every non-zero |x| < 2^-126 (FP32 subnormals).
        """
        sid = self.site_id(site, kind)
        rows = self._query("SELECT step, lo, counts FROM hists WHERE site = ? ORDER BY step", (sid,))
        return self._checked(_hist_rows, rows)

    def site_id(self, site: int | str, kind: str | None = None) -> int:
        """Site id from an id or a path (with kind when the path has several)."""
        if isinstance(site, (int, np.integer)):
            return int(site)
        sql, args = "SELECT id, kind FROM sites WHERE path = ?", (site,)
        rows = self._query(sql, args)
        if kind is not None:
            rows = [r for r in rows if r[1] == kind]
        if not rows:
            raise KeyError(f"no site {site!r}" + (f" of kind {kind!r}" if kind else "") + f" in {self.path}")
        if len(rows) > 1:
            raise KeyError(f"site {site!r} exists for kinds {sorted(r[1] for r in rows)}; pass kind=")
        return int(rows[0][0])


def _steps_frame(rows: list) -> pd.DataFrame:
    """The steps table as a DataFrame: numbers as floats (the writer's 'nan' text is NaN), lr from its JSON list."""
    df = pd.DataFrame(rows, columns=list(schema.STEP_FIELDS))
    lrs = [checks.parse_json(v, "steps.lr") if v else None for v in df["lr"]]
    for v in lrs:
        if v is not None:
            checks.check_value(v, [(checks.NUM, None)], "steps.lr")
    df["lr_groups"] = lrs
    df["lr"] = [float(v[0]) if v and v[0] is not None else np.nan for v in lrs]
    for col in ("skipped", "nonfinite"):
        df[col] = _numbers(df[col]).fillna(0).astype(bool)
    for col in (
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
    ):
        df[col] = _numbers(df[col]).astype(float)
    for col in ("samples", "microbatches", "peak_mem", "level"):
        df[col] = _numbers(df[col])
    return df


_NAN_TEXT = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf}  # how the writer stores a NaN loss (REAL NaN is NULL)


def _numbers(col: pd.Series) -> pd.Series:
    """A column of numbers (NULL: NaN, the writer's 'nan' text: NaN); anything else is a malformed trace."""
    if not pd.api.types.is_numeric_dtype(col):  # object, or pandas' string dtype when all are text
        col = col.astype(object).map(lambda v: _NAN_TEXT.get(v, v) if isinstance(v, str) else v)
    return pd.to_numeric(col, errors="raise")


def _columns_of(ids: np.ndarray, sites: np.ndarray) -> np.ndarray:
    """Column of each site id in ``ids`` (sorted), -1 where it is not one of them; no table sized by id values."""
    pos = np.minimum(np.searchsorted(ids, sites), len(ids) - 1)
    return np.where(ids[pos] == sites, pos, -1)


def _fill_peaks(out: np.ndarray, rows: list, ids: np.ndarray, fill: float) -> None:
    for step, blob in rows:
        if not isinstance(blob, bytes) or len(blob) % 4:
            raise checks.Invalid(f"peaks of step {step} are not float32 values")
        arr = np.frombuffer(blob, dtype="<f4")
        take = ids < len(arr)
        vals = arr[ids[take]].astype(np.float64)
        vals[vals < 0] = fill
        out[step, np.flatnonzero(take)] = vals


def _fill_stats(out: np.ndarray, rows: list, ids: np.ndarray, fill: float) -> None:
    arr = np.array(rows, dtype=np.float64)
    where = arr[:, :2]
    if not np.isfinite(where).all() or (where != np.floor(where)).any():
        raise checks.Invalid("a stats row without an integer step and site")
    j = _columns_of(ids, where[:, 1].astype(np.int64))
    keep = j >= 0
    vals = arr[keep, 2]
    vals[np.isnan(vals)] = fill
    out[where[keep, 0].astype(np.int64), j[keep]] = vals


def _hist_rows(rows: list) -> tuple[np.ndarray, np.ndarray]:
    steps = np.array([r[0] for r in rows], dtype=np.int64)
    counts = np.zeros((len(rows), HIST_HI - HIST_LO + 1), dtype=np.int64)
    for i, (_, lo, blob) in enumerate(rows):
        if not isinstance(lo, int) or not isinstance(blob, bytes) or len(blob) % 8:
            raise checks.Invalid("a histogram row without an integer binade and int64 counts")
        c = np.frombuffer(blob, dtype="<i8")
        if lo < HIST_LO or lo + len(c) - 1 > HIST_HI or (c < 0).any():
            raise checks.Invalid(f"a histogram spans binades {lo}..{lo + len(c) - 1}, outside {HIST_LO}..{HIST_HI}")
        counts[i, lo - HIST_LO : lo - HIST_LO + len(c)] = c
    return steps, counts


def _event_data(text) -> dict:
    d = checks.parse_json(text, "events.data") if text else {}
    checks.check_value(d, checks.EVENT_DATA, "events.data")
    return d


def _check_kind(kind: str) -> None:
    if kind not in schema.KINDS:
        raise ValueError(f"Argument kind should be one of {', '.join(schema.KINDS)}, but given {kind!r}")


def is_trace(path: str | os.PathLike) -> bool:
    """Cheap test for directory scans: a SQLite header carrying the trace's application id. A trace still being
    written in WAL mode may carry the id only in its -wal file until the first checkpoint; then it is opened."""
    path = os.fspath(path)
    try:
        head = files.read_head(path, 72)  # never blocks on a FIFO
    except (OSError, TraceError):
        return False
    if not head.startswith(files.SQLITE_MAGIC):
        return False
    app_id = int.from_bytes(head[68:72], "big")
    if app_id == schema.APPLICATION_ID:
        return True
    if app_id != 0 or not os.path.exists(path + "-wal"):
        return False
    try:
        load(path).close()
    except TraceError:
        return False
    return True


def load(path: str | os.PathLike) -> Trace:
    """Open a trace read-only; raises TraceError with one line on a missing, empty, corrupt or foreign file."""
    return Trace(path)
