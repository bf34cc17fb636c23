"""Read-only view of a trace file. Offline side: no torch import."""
from __future__ import annotations

import contextlib
import json
import os
import sqlite3

import numpy as np
import pandas as pd

from . import schema
from .schema import TraceError

_SQLITE_MAGIC = b"SQLite format 3\x00"
HIST_LO, HIST_HI = -127, 127        # binades a histogram row can hold; column j of hist() is binade HIST_LO + j


def _check_file(path: str) -> None:
    if not os.path.exists(path):
        raise TraceError(f"{path}: no such file")
    if os.path.isdir(path):
        raise TraceError(f"{path}: is a directory, not a trace file")
    size = os.path.getsize(path)
    if size == 0:
        raise TraceError(f"{path}: empty file (0 bytes), not an ampdoctor trace")
    with open(path, "rb") as f:
        head = f.read(100)
    if not head.startswith(_SQLITE_MAGIC):
        raise TraceError(f"{path}: not an ampdoctor trace (not a SQLite database)")
    if len(head) < 100:
        raise TraceError(f"{path}: truncated trace ({size} bytes, shorter than a SQLite header)")
    page_size = int.from_bytes(head[16:18], "big")
    page_size = 65536 if page_size == 1 else page_size
    if page_size and size % page_size:
        raise TraceError(f"{path}: truncated or corrupt trace ({size} bytes is not a whole number of "
                         f"{page_size}-byte pages)")


def _connect(path: str):
    """Read-only connection. A WAL reader needs the -shm file; where it cannot create one (a read-only directory)
    and no writer is active, the file is opened as immutable, which needs nothing next to it."""
    uri = "file:" + os.path.abspath(path).replace("?", "%3f").replace("#", "%23")
    try:
        conn = sqlite3.connect(f"{uri}?mode=ro", uri=True, check_same_thread=False)
        ids = conn.execute("PRAGMA application_id").fetchone()[0], conn.execute("PRAGMA user_version").fetchone()[0]
    except sqlite3.OperationalError:
        if os.path.exists(path + "-wal") or os.access(os.path.dirname(os.path.abspath(path)), os.W_OK):
            raise
        conn = sqlite3.connect(f"{uri}?immutable=1", uri=True, check_same_thread=False)
        ids = conn.execute("PRAGMA application_id").fetchone()[0], conn.execute("PRAGMA user_version").fetchone()[0]
    return conn, ids[0], ids[1]


class Trace:
    """A trace opened read-only. Every query reads the file again, so a trace being written shows new steps."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self._snapshot_depth = 0
        _check_file(self.path)
        try:
            self._conn, app_id, version = _connect(self.path)
        except sqlite3.DatabaseError as exc:
            raise TraceError(f"{self.path}: corrupt or unreadable trace ({exc})") from None
        if app_id != schema.APPLICATION_ID:
            self._conn.close()
            raise TraceError(f"{self.path}: a SQLite database, but not an ampdoctor trace")
        if version > schema.VERSION:
            self._conn.close()
            raise TraceError(f"{self.path}: trace format {version} is newer than this ampdoctor reads "
                             f"(up to {schema.VERSION}); upgrade ampdoctor")
        self._query("SELECT count(*) FROM steps")     # touches the schema: a damaged file fails here

    # -- plumbing ----------------------------------------------------------------------------------------------
    def _query(self, sql: str, args=()) -> list:
        try:
            return self._conn.execute(sql, args).fetchall()
        except sqlite3.DatabaseError as exc:
            raise TraceError(f"{self.path}: corrupt or unreadable trace ({exc})") from None

    def close(self) -> None:
        self._conn.close()

    @contextlib.contextmanager
    def snapshot(self):
        """Every read inside sees one state of the file (one SQLite read transaction): for analyses that combine
        several tables of a trace that is still being written. Re-entrant."""
        if self._snapshot_depth == 0:
            self._query("BEGIN")
            self._query("SELECT count(*) FROM steps")     # a deferred transaction starts at its first read
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

    # -- run level ---------------------------------------------------------------------------------------------
    @property
    def meta(self) -> dict:
        """Run metadata: versions, device, precision configuration (see docs/trace-format.md)."""
        return {k: json.loads(v) for k, v in self._query("SELECT key, value FROM meta")}

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
        cols = [f if f in have else "NULL" for f in schema.STEP_FIELDS]    # a trace from before the later columns
        rows = self._query(f"SELECT {','.join(cols)} FROM steps ORDER BY step")
        df = pd.DataFrame(rows, columns=list(schema.STEP_FIELDS))
        lrs = [json.loads(v) if v else None for v in df["lr"]]
        df["lr_groups"] = lrs
        df["lr"] = [v[0] if v else np.nan for v in lrs]
        df["skipped"] = df["skipped"].fillna(0).astype(bool)
        df["nonfinite"] = df["nonfinite"].fillna(0).astype(bool)
        for col in ("time", "step_time", "data_time", "samples_per_s", "loss", "loss_scale", "loss_scale_next",
                    "grad_norm", "grad_max", "observer_time"):
            df[col] = pd.to_numeric(df[col], errors="coerce").astype(float)
        return df

    def sites(self, kind: str | None = None) -> pd.DataFrame:
        """Observed sites: id, path, module, kind, module_type, dtype, shape, first_step."""
        sql = "SELECT id, path, module, kind, module_type, dtype, shape, first_step FROM sites"
        args: tuple = ()
        if kind is not None:
            _check_kind(kind)
            sql += " WHERE kind = ?"
            args = (kind,)
        rows = self._query(sql + " ORDER BY id", args)
        return pd.DataFrame(rows, columns=["id", "path", "module", "kind", "module_type", "dtype", "shape",
                                           "first_step"])

    def metrics(self, name: str | None = None) -> pd.DataFrame:
        """Logged scalars (log_metric): step, name, value, time."""
        sql, args = "SELECT step, name, value, time FROM metrics", ()
        if name is not None:
            sql, args = sql + " WHERE name = ?", (name,)
        return pd.DataFrame(self._query(sql + " ORDER BY step, rowid", args),
                            columns=["step", "name", "value", "time"])

    def events(self, kind: str | None = None) -> pd.DataFrame:
        """Events (e.g. kind "nonfinite": where the first NaN/Inf of a step came from), with the site path."""
        sql = ("SELECT e.step, e.kind, e.site, s.path, s.kind, e.phase, e.message, e.data FROM events e "
               "LEFT JOIN sites s ON s.id = e.site")
        args: tuple = ()
        if kind is not None:
            sql, args = sql + " WHERE e.kind = ?", (kind,)
        rows = self._query(sql + " ORDER BY e.id", args)
        df = pd.DataFrame(rows, columns=["step", "kind", "site", "path", "site_kind", "phase", "message", "data"])
        df["data"] = [json.loads(d) if d else {} for d in df["data"]]
        return df

    def full_steps(self) -> np.ndarray:
        """Steps that have full statistics."""
        return np.array([r[0] for r in self._query("SELECT DISTINCT step FROM stats ORDER BY step")], dtype=int)

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
        col = {int(s): j for j, s in enumerate(ids)}
        if field == "peak":
            rows = self._query("SELECT step, data FROM peaks WHERE step < ? ORDER BY step", (n,))
            for step, blob in rows:
                arr = np.frombuffer(blob, dtype="<f4")
                take = ids[ids < len(arr)]
                vals = arr[take].astype(np.float64)
                vals[vals < 0] = fill
                out[step, [col[int(s)] for s in take]] = vals
            return out
        if field not in schema.STATS_FIELDS and field not in ("scale", "calls"):
            raise ValueError(f"Argument field should be 'peak' or one of {', '.join(schema.STATS_FIELDS)}, "
                             f"but given {field!r}")
        lo, hi = int(ids.min()), int(ids.max())
        rows = self._query(f"SELECT step, site, {field} FROM stats WHERE site BETWEEN ? AND ? AND step < ?",
                           (lo, hi, n))
        if rows:
            arr = np.array(rows, dtype=np.float64)
            lookup = np.full(hi - lo + 1, -1, dtype=np.int64)
            lookup[ids - lo] = np.arange(len(ids))
            j = lookup[arr[:, 1].astype(np.int64) - lo]
            keep = j >= 0
            vals = arr[keep, 2]
            vals[np.isnan(vals)] = fill
            out[arr[keep, 0].astype(np.int64), j[keep]] = vals
        return out

    def hist(self, site: int | str, kind: str | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(steps, counts[len(steps) x 255]) exponent histogram of one site; column j is binade 2^(j-127).

        A value x is counted in binade e = floor(log2|x|); zeros, NaN and Inf are not in the histogram (see the
        ``zeros``, ``nan``, ``inf`` statistics); e = -127 holds every non-zero |x| < 2^-126 (FP32 subnormals).
        """
        sid = self.site_id(site, kind)
        rows = self._query("SELECT step, lo, counts FROM hists WHERE site = ? ORDER BY step", (sid,))
        steps = np.array([r[0] for r in rows], dtype=int)
        counts = np.zeros((len(rows), HIST_HI - HIST_LO + 1), dtype=np.int64)
        for i, (_, lo, blob) in enumerate(rows):
            c = np.frombuffer(blob, dtype="<i8")
            counts[i, lo - HIST_LO: lo - HIST_LO + len(c)] = c
        return steps, counts

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


def _check_kind(kind: str) -> None:
    if kind not in schema.KINDS:
        raise ValueError(f"Argument kind should be one of {', '.join(schema.KINDS)}, but given {kind!r}")


def is_trace(path: str | os.PathLike) -> bool:
    """Cheap test for directory scans: a SQLite header carrying the trace's application id. A trace still being
    written in WAL mode may carry the id only in its -wal file until the first checkpoint; then it is opened."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            head = f.read(72)
    except OSError:
        return False
    if not head.startswith(_SQLITE_MAGIC):
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
