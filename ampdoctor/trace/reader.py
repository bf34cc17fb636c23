"""Read-only view of a trace file. Offline side: no torch import.

A trace may come from anyone, so it is checked when opened (files.py: a regular SQLite file, opened read-only;
checks.py: plain tables with their declared columns, dense step and site ids; in a file up to FULL_CHECK_BYTES every
value's type and range, JSON well-formed and shallow), the values of a larger file are checked as they are read (a
whole-file check would cost more than any command: ~30 s for a 10^6-step run), every allocation is sized by rows that
exist, and whatever else is wrong becomes a one-line TraceError.
"""

from __future__ import annotations

import contextlib
import copy
import os
import sqlite3
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import numpy as np
import numpy.typing as npt

from . import bulk, checks, files, schema
from . import steps as steps_table
from .messages import SiteMsg
from .schema import TraceError

# Files up to this size (with their -wal) have every value checked when opened (~0.3 s at this size); larger ones
# have each value checked as a view reads it.
FULL_CHECK_BYTES = 8 << 20
# records() without steps= allocates [steps x sites]: refused beyond this many cells (read long runs by steps=).
DENSE_CELLS = 1 << 26

T = TypeVar("T")
if TYPE_CHECKING:  # (typing names past Python 3.9: for the type checker only)
    from typing import Self, TypeVarTuple, Unpack

    import pandas as pd  # (imported where a frame is made: `ampdoctor info` starts without pandas)

    Args = TypeVarTuple("Args")


# a row of the sites table (``Trace.site_rows``) holds what the writer's message carried when the site was first seen
SiteRow = SiteMsg


class EventRow(NamedTuple):
    """A row of the events table with its site's path and kind (``Trace.event_rows``); ``data`` parsed."""

    step: int
    kind: str
    site: int | None
    path: str | None
    site_kind: str | None
    phase: str | None
    message: str | None
    data: dict[str, Any]


class _Sites(NamedTuple):
    """The sites table as a Trace last read it: (count, largest id), the rows, the frames made of them by kind."""

    key: tuple[Any, ...]
    rows: tuple[SiteRow, ...]
    frames: dict[str | None, pd.DataFrame]


class Trace:
    """A trace opened read-only. Every query reads the file again, so a trace being written shows new steps."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = os.fspath(path)
        self._snapshot_depth = 0
        self._counted: int | None = None  # the steps recorded, as of the snapshot in progress
        self._sites: _Sites | None = None  # the sites table as last read
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
        size = sum(os.path.getsize(self.path + x) for x in ("", "-wal") if os.path.isfile(self.path + x))
        self._full_check = size <= FULL_CHECK_BYTES
        self._checked_rows: dict[
            str, int
        ] = {}  # small tables of a large file: rowid up to which their values are checked
        try:
            with self.snapshot():  # one state of the file for all checks (a live trace grows)
                self.checked(checks.check_tables, self._conn, self._full_check)
                _ = self.meta  # parsed and type-checked; raises on a malformed entry
        except TraceError:
            self._conn.close()
            raise

    # -- plumbing ----------------------------------------------------------------------------------------------
    def query(self, sql: str, args: Sequence[object] = ()) -> list[Any]:
        try:
            return self._conn.execute(sql, args).fetchall()
        except sqlite3.DatabaseError as exc:
            raise TraceError(f"{self.path}: corrupt or unreadable trace ({exc})") from None

    def checked(self, fn: Callable[[Unpack[Args]], T], *args: Unpack[Args]) -> T:
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

    def _check_table(self, table: str) -> None:
        """The values of a small table (events, metrics, probes) of a large file, checked before it is read: the rows
        added since the last check (probes, a table without rowids: all of them when their number changed)."""
        if self._full_check or not self._has(table):
            return
        rowid = table != "probes"
        top = self.query(f"SELECT max(rowid) FROM {table}" if rowid else f"SELECT count(*) FROM {table}")[0][0]
        if top is None or top == self._checked_rows.get(table):
            return
        n_sites = self.query("SELECT count(*) FROM sites")[0][0]
        after = {table: self._checked_rows[table]} if rowid and table in self._checked_rows else None
        self.checked(checks.check_values, self._conn, (table,), n_sites, self.n_steps, after)
        self._checked_rows[table] = top

    def _has(self, table: str) -> bool:
        return bool(self.query("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (table,)))

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
        clone._snapshot_depth, clone._counted, clone._sites = 0, None, None
        return clone

    @contextlib.contextmanager
    def snapshot(self) -> Iterator[Self]:
        """Every read inside sees one state of the file (one SQLite read transaction): for analyses that combine
        several tables of a trace that is still being written. Re-entrant."""
        if self._snapshot_depth == 0:
            self.query("BEGIN")
            self.query("SELECT count(*) FROM sqlite_master")  # a deferred transaction starts at its first read
            self._counted = None
        self._snapshot_depth += 1
        try:
            yield self
        finally:
            self._snapshot_depth -= 1
            if self._snapshot_depth == 0:
                self._counted = None
                self._conn.rollback()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Trace({self.path!r}, steps={self.n_steps}, sites={self.n_sites})"

    def _repr_html_(self) -> str:  # notebooks: the `ampdoctor info` summary (ampdoctor/notebook.py)
        from ..notebook import trace_html

        return trace_html(self)

    # -- run level ---------------------------------------------------------------------------------------------
    @property
    def meta(self) -> dict[str, Any]:
        """Run metadata: versions, device, precision configuration (see docs/trace-format.md)."""
        rows = self.query("SELECT key, value FROM meta")
        return self.checked(lambda: {k: checks.meta_value(k, v) for k, v in rows})

    @property
    def config(self) -> dict[str, Any]:
        """The observed precision configuration (autocast, dtypes, optimizer, scaler)."""
        config: dict[str, Any] = self.meta.get("config", {})
        return config

    @property
    def n_steps(self) -> int:
        """The steps recorded (counted once per snapshot: a count walks the whole table, ~0.05 s at 10^6 steps)."""
        if self._counted is not None:
            return self._counted
        n: int = self.query("SELECT count(*) FROM steps")[0][0]
        if self._snapshot_depth:
            self._counted = n
        return n

    def _recorded(self) -> int | None:
        """The steps recorded as of the read transaction in progress (Trace.snapshot); None outside one."""
        return self.n_steps if self._snapshot_depth else None

    # -- tables ------------------------------------------------------------------------------------------------
    def steps(self, lr_groups: bool = True) -> pd.DataFrame:
        """One row per optimizer step (skipped steps included): schema.STEP_FIELDS, ``lr`` the first parameter group's
        learning rate, and unless ``lr_groups`` is False, ``lr_groups`` every group's."""
        with self.snapshot():
            return self.checked(steps_table.read, self._conn, lr_groups)

    def step_columns(self, fields: Sequence[str] = steps_table.NUMBER_FIELDS) -> dict[str, np.ndarray]:
        """The steps as arrays, not a frame (a few columns of a long run read at less cost): "step", the number
        columns ``fields`` (default: all of schema.STEP_NUMBERS) as float64 (NaN where a step has none), "lr" (the
        first group's) and "reason"."""
        with self.snapshot():
            numbers, reasons, _ = self.checked(steps_table.columns, self._conn, False, fields, self.n_steps)
        out = {"step": np.arange(len(numbers), dtype=np.int64), "reason": reasons}
        out.update({f: numbers[:, i] for i, f in enumerate((*fields, "lr"))})
        return out

    def sites(self, kind: str | None = None) -> pd.DataFrame:
        """Observed sites: id, path, module, kind, module_type, dtype, shape, first_step. The caller's own frame: a
        copy of the one made once per kind while the table stays as it is."""
        import pandas as pd

        frames = self._site_table().frames
        if kind not in frames:
            df = pd.DataFrame(self.site_rows(kind), columns=list(SiteRow._fields))
            df["id"] = df["id"].astype(np.int64)  # (an empty table's columns would be objects)
            frames[kind] = df
        return frames[kind].copy()

    def site_rows(self, kind: str | None = None) -> list[SiteRow]:
        """The sites as rows (``sites`` without the frame: what ``info`` reads, without importing pandas)."""
        rows = self._site_table().rows
        if kind is None:
            return list(rows)
        _check_kind(kind)
        return [r for r in rows if r.kind == kind]

    def _site_table(self) -> _Sites:
        """The sites table, read and checked once while it stays as it is: a view reads it a dozen times (5 x 10^3
        modules: ~0.1 s a read). Sites are only ever added, so its row count and largest id tell when it grew."""
        key = tuple(self.query("SELECT count(*), max(id) FROM sites")[0])
        if self._sites is None or self._sites.key != key:
            sql = "SELECT id, path, module, kind, module_type, dtype, shape, first_step FROM sites ORDER BY id"
            rows = self.query(sql)
            if any(not isinstance(r[0], int) or not isinstance(r[1], str) or not isinstance(r[2], str) for r in rows):
                raise TraceError(f"{self.path}: corrupt trace (a site without an integer id, a path or a module)")
            self._sites = _Sites(key, tuple(SiteRow(*r) for r in rows), {})
        return self._sites

    def metrics(self, name: str | None = None) -> pd.DataFrame:
        """Logged scalars (log_metric): step, name, value, time."""
        import pandas as pd

        self._check_table("metrics")
        sql = "SELECT step, name, value, time FROM metrics"
        args: tuple[str, ...] = ()
        if name is not None:
            sql, args = sql + " WHERE name = ?", (name,)
        df = pd.DataFrame(self.query(sql + " ORDER BY step, rowid", args), columns=["step", "name", "value", "time"])
        self.checked(lambda: df.__setitem__("value", _numbers(df["value"]).astype(float)))
        return df

    def probes(self) -> pd.DataFrame:
        """Precision-loss probe results (``attach(probe_every=N)``): one row per probed step and module: step, site,
        path, module_type, calls, k (terms per output element), numel, dtype (of the half-precision output),
        rel_err (norm-wise relative error against the FP32 recomputation), max_err (max |error| / max |FP32 output|),
        ref_norm, ref_absmax. Empty for a run without probes (and for traces written before the table existed)."""
        import pandas as pd

        cols = ["step", "site", "path", "module_type", "calls", "k", "numel", "dtype", *schema.PROBE_FIELDS]
        if not self._has("probes"):
            return pd.DataFrame(columns=cols)
        self._check_table("probes")
        rows = self.query(
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
        import pandas as pd

        rows = self._event_query(kind)
        df = pd.DataFrame(rows, columns=list(EventRow._fields))
        df["data"] = self.checked(lambda: [_event_data(d) for d in df["data"]])
        return df

    def event_rows(self, kind: str | None = None) -> list[EventRow]:
        """The events as rows (``events`` without the frame: what ``info`` reads, without importing pandas)."""
        rows = self._event_query(kind)
        return self.checked(
            lambda: [
                EventRow(step, kind, site, path, site_kind, phase, message, _event_data(data))
                for step, kind, site, path, site_kind, phase, message, data in rows
            ]
        )

    def _event_query(self, kind: str | None) -> list[tuple[Any, ...]]:
        self._check_table("events")
        sql = (
            "SELECT e.step, e.kind, e.site, s.path, s.kind, e.phase, e.message, e.data FROM events e "
            "LEFT JOIN sites s ON s.id = e.site"
        )
        args: tuple[str, ...] = ()
        if kind is not None:
            sql, args = sql + " WHERE e.kind = ?", (kind,)
        return self.query(sql + " ORDER BY e.id", args)

    def full_steps(self) -> np.ndarray:
        """Steps that have full statistics."""
        with self.snapshot():
            return self.checked(bulk.distinct_steps, self._conn, "stats", self.n_steps)

    def hist_steps(self) -> np.ndarray:
        """Steps that have histograms."""
        with self.snapshot():
            return self.checked(bulk.distinct_steps, self._conn, "hists", self.n_steps)

    @property
    def n_sites(self) -> int:
        n: int = self.query("SELECT count(*) FROM sites")[0][0]
        return n

    # -- per-site arrays ---------------------------------------------------------------------------------------
    def records(
        self, field: str, kind: str = "act", fill: float = np.nan, steps: npt.ArrayLike | None = None
    ) -> npt.NDArray[np.float64]:
        """[steps x sites] array of one statistic; columns follow ``sites(kind)``, row i is step i, or with ``steps``
        (an array of steps) row i is step ``steps[i]``: a long run is read by the steps a question needs.

        ``field`` is "peak" (max |x| every step; NaN/Inf when the tensor held one) or one of the full statistics
        (schema.STATS_FIELDS), present at full-statistics steps only. Steps or sites without a value get ``fill``.
        """
        _check_kind(kind)
        if field != "peak" and field not in schema.STATS_FIELDS and field not in ("scale", "calls"):
            raise ValueError(
                f"Argument field should be 'peak' or one of {', '.join(schema.STATS_FIELDS)}, but given {field!r}"
            )
        ids = self.sites(kind)["id"].to_numpy()
        n = self.n_steps
        want = np.arange(n) if steps is None else np.asarray(steps, dtype=np.int64)
        if steps is None and n * len(ids) > DENSE_CELLS:
            raise TraceError(
                f"{self.path}: {n} steps x {len(ids)} {kind} sites is too large to read at once; read it by steps"
            )
        out = np.full((len(want), len(ids)), fill, dtype=np.float64)
        if not len(ids) or not len(want):
            return out
        uniq, inverse = np.unique(want, return_inverse=True)
        uniq_ok = uniq[(uniq >= 0) & (uniq < n)]
        if field == "peak":
            width = int(ids.max()) + 1
            got = np.full((len(uniq_ok), len(ids)), fill)
            with self.snapshot():
                self.checked(bulk.check_steps, self._conn, "peaks", self._recorded())
                rows = self.query(
                    f"SELECT step, data FROM peaks WHERE step IN ({','.join(map(str, uniq_ok.tolist()))})"
                    if steps is not None
                    else "SELECT step, data FROM peaks WHERE step >= 0 AND step < ? ORDER BY step",
                    () if steps is not None else (n,),
                )
            self.checked(_fill_peaks, got, rows, ids, fill, uniq_ok, width)
        else:
            with self.snapshot():
                got = self.checked(bulk.stats_at, self._conn, (field,), uniq_ok, ids, self.n_sites, fill)[field]
        full = np.full((len(uniq), len(ids)), fill)
        full[np.searchsorted(uniq, uniq_ok)] = got
        out[:] = full[inverse]
        return out

    def stats_at(self, fields: Sequence[str], kind: str | None, steps: npt.ArrayLike) -> dict[str, np.ndarray]:
        """field -> [len(steps) x sites of ``kind`` (None: every site)] full statistics at these (sorted, distinct)
        steps, NaN where none: several statistics of a bounded set of steps in one query."""
        if kind is not None:
            _check_kind(kind)
        bad = [f for f in fields if f not in schema.STATS_FIELDS and f not in ("scale", "calls")]
        if bad:
            raise ValueError(f"Argument fields should be from {', '.join(schema.STATS_FIELDS)}, but given {bad[0]!r}")
        ids = self.sites(kind)["id"].to_numpy()
        with self.snapshot():
            return self.checked(
                bulk.stats_at, self._conn, tuple(fields), np.asarray(steps, dtype=np.int64), ids, self.n_sites
            )

    def hists_at(self, steps: npt.ArrayLike, sites: npt.ArrayLike | None = None) -> bulk.Hists:
        """The histograms at these (sorted) steps of these sites (sorted ids; None: every site), read in one query and
        kept as recorded (bulk.Hists): a bounded set of steps of many sites."""
        ids = None if sites is None else np.asarray(sites, dtype=np.int64)
        with self.snapshot():
            return self.checked(bulk.hists_at, self._conn, np.asarray(steps, dtype=np.int64), self.n_sites, ids)

    def peak_chunks(
        self, n_steps: int | None = None
    ) -> Iterator[tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]]]:
        """The peaks rows in step order as (steps, float32 [k x sites]) chunks of a few MB (-1: not observed)."""
        n = self.n_steps if n_steps is None else n_steps
        width = self.n_sites
        chunks = bulk.peak_chunks(self._conn, n, width, self._recorded())  # (at the first chunk: a generator)
        while (item := self.checked(next, chunks, None)) is not None:
            yield item

    def hist(self, site: int | str, kind: str | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(steps, counts[len(steps) x 255]) exponent histogram of one site; column j is binade 2^(j-127).

        A value x is counted in binade e = floor(log2|x|); zeros, NaN and Inf are not in the histogram (see the
        ``zeros``, ``nan``, ``inf`` statistics); e = -127 holds every non-zero |x| < 2^-126 (FP32 subnormals).
        """
        sid = self.site_id(site, kind)
        with self.snapshot():
            h = self.checked(bulk.hists_of, self._conn, sid, self.n_sites, self.n_steps)
        return h.step, h.dense()

    def site_id(self, site: int | str, kind: str | None = None) -> int:
        """Site id from an id or a path (with kind when the path has several)."""
        if isinstance(site, (int, np.integer)):
            return int(site)
        sql, args = "SELECT id, kind FROM sites WHERE path = ?", (site,)
        rows = self.query(sql, args)
        if kind is not None:
            rows = [r for r in rows if r[1] == kind]
        if not rows:
            raise KeyError(f"no site {site!r}" + (f" of kind {kind!r}" if kind else "") + f" in {self.path}")
        if len(rows) > 1:
            raise KeyError(f"site {site!r} exists for kinds {sorted(r[1] for r in rows)}; pass kind=")
        return int(rows[0][0])


_NAN_TEXT = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf}  # how the writer stores a NaN loss (REAL NaN is NULL)


def _numbers(col: pd.Series) -> pd.Series:
    """A column of numbers (NULL: NaN, the writer's 'nan' text: NaN); anything else is a malformed trace."""
    import pandas as pd

    if not pd.api.types.is_numeric_dtype(col):  # object, or pandas' string dtype when all are text
        col = col.astype(object).map(lambda v: _NAN_TEXT.get(v, v) if isinstance(v, str) else v)
    return pd.to_numeric(col, errors="raise")


def _fill_peaks(
    out: np.ndarray, rows: list[tuple[Any, ...]], ids: np.ndarray, fill: float, steps: np.ndarray, width: int
) -> None:
    """Rows of ``out`` (one per step of ``steps``) from peaks rows; negative stored values are ``fill``."""
    for step, blob in rows:
        if not isinstance(blob, bytes) or len(blob) % 4:
            raise checks.Invalid(f"peaks of step {step} are not float32 values")
        if not isinstance(step, int):
            raise checks.Invalid(f"a peaks row of step {step!r:.20}")
        i = np.searchsorted(steps, step)
        if i >= len(steps) or steps[i] != step:
            continue
        arr = np.frombuffer(blob, dtype="<f4", count=min(len(blob) // 4, width))
        take = ids < len(arr)
        vals = arr[ids[take]].astype(np.float64)
        vals[vals < 0] = fill
        out[i, np.flatnonzero(take)] = vals


def _event_data(text: object) -> dict[str, Any]:
    d: dict[str, Any] = checks.parse_json(text, "events.data") if text else {}
    checks.check_value(d, checks.EVENT_DATA, "events.data")
    return d


def _check_kind(kind: str) -> None:
    if kind not in schema.KINDS:
        raise ValueError(f"Argument kind should be one of {', '.join(schema.KINDS)}, but given {kind!r}")


def is_trace(path: str | os.PathLike[str]) -> bool:
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


def load(path: str | os.PathLike[str]) -> Trace:
    """Open a trace read-only; raises TraceError with one line on a missing, empty, corrupt or foreign file."""
    return Trace(path)
