"""Results the views keep on disk between visits (a run's diagnosis, its step summary, the loss-scale replay's
evidence), keyed by what the trace holds: a trace that grows, or another file at the same path, gets a new key and
the old result is not used.

Written only under the user's cache directory (``$AMPDOCTOR_CACHE_DIR``, else ``$XDG_CACHE_HOME/ampdoctor``, else
``~/.cache/ampdoctor``), never next to a trace: a trace's directory may be read-only or shared, and nothing here may
touch a trace file. Files are written whole and renamed into place; a cache that cannot be written is skipped.
JSON and numpy arrays only (no pickle: a cache file is not code).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import zipfile
from typing import IO, TYPE_CHECKING, Any, Callable

import numpy as np
import numpy.typing as npt

from ampdoctor import __version__

from .series import BUCKET, StepSummary, n_steps, sql

if TYPE_CHECKING:
    from ampdoctor.lossscale import Evidence
    from ampdoctor.trace import Trace

FORMAT = 2  # bump when what is cached changes shape (2: the diagnosis carries the formats table)


def cache_dir() -> str | None:
    """The directory results go to (created, private to the user), or None when it cannot be written."""
    base = os.environ.get("AMPDOCTOR_CACHE_DIR")
    if not base:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        base = os.path.join(xdg, "ampdoctor")
    path = os.path.join(base, f"views-{FORMAT}")
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except OSError:
        return None
    return path if os.access(path, os.W_OK | os.X_OK) else None


def identity(tr: Trace) -> str:
    """Which run a file holds: its real path and the run's recorded start (another run written to the same path
    later is another identity)."""
    run = tr.meta.get("run", {}) or {}
    raw = json.dumps([os.path.realpath(tr.path), run.get("started"), run.get("pid"), run.get("host")], default=str)
    return hashlib.sha256(raw.encode()).hexdigest()[:24]


def fingerprint(tr: Trace) -> list[Any]:
    """What the trace holds now, cheaply: the last row or key of every table (primary-key look-ups, no scans).
    Any new step, statistic, event, metric or probe changes it."""
    out: list[Any] = []
    for table, key in (
        ("steps", "step"),
        ("stats", "step"),
        ("peaks", "step"),
        ("hists", "step"),
        ("events", "id"),
        ("metrics", "rowid"),
        ("sites", "id"),
        ("probes", "step"),
    ):
        try:
            out.append(sql(tr, f"SELECT max({key}) FROM {table}")[0][0])
        except Exception:  # a table that an older trace lacks
            out.append(None)
    last = out[0]
    out.append(sql(tr, "SELECT * FROM steps WHERE step = ?", (last,)) if last is not None else None)
    out.append("closed" in tr.meta)
    return out


def key(what: str, *traces: Any, extra: Any = None) -> str:
    """The cache key of ``what`` computed from ``traces`` (their identity and content) by this ampdoctor."""
    parts = [what, __version__, FORMAT, extra]
    for tr in traces:
        parts.append(None if tr is None else [identity(tr), fingerprint(tr)])
    return what + "-" + hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:32]


def _path(name: str, ext: str) -> str | None:
    d = cache_dir()
    return None if d is None else os.path.join(d, f"{name}.{ext}")


def _write(path: str, write: Callable[[IO[bytes]], object]) -> bool:
    """Write through a temporary file in the same directory, then rename: a reader never sees half a file."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
        return True
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        return False


def load_json(name: str) -> Any:
    path = _path(name, "json")
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def save_json(name: str, value: Any) -> bool:
    path = _path(name, "json")
    if path is None:
        return False
    data = json.dumps(value, allow_nan=True).encode()
    return _write(path, lambda f: f.write(data))


def load_arrays(name: str) -> dict[str, npt.NDArray[Any]] | None:
    path = _path(name, "npz")
    if path is None or not os.path.exists(path):
        return None
    try:
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except (OSError, ValueError, KeyError, zipfile.BadZipFile):  # (a file cut short: as if none were kept)
        return None


def save_arrays(name: str, arrays: dict[str, npt.NDArray[Any]]) -> bool:
    path = _path(name, "npz")
    # numpy's stub types savez's **kwds as its own keyword flags (allow_pickle: bool), not as arrays
    return path is not None and _write(path, lambda f: np.savez(f, **arrays))  # type: ignore[arg-type]


def prefix_files(prefix: str, ext: str) -> list[str]:
    """Names (without extension) of the cached files whose name starts with ``prefix``."""
    d = cache_dir()
    if d is None:
        return []
    try:
        return [f[: -len(ext) - 1] for f in os.listdir(d) if f.startswith(prefix) and f.endswith("." + ext)]
    except OSError:
        return []


def remove(name: str, ext: str) -> None:
    path = _path(name, ext)
    if path is not None:
        with contextlib.suppress(OSError):
            os.unlink(path)


# -- the loss-scale replay's evidence (lossscale.gather's: what every scaler setting is replayed over) ---------------
def evidence_name(tr: Trace) -> str:
    """The cache name of a trace's evidence as it holds now (read inside the snapshot the evidence is read in: the
    name and the content then agree); the diagnosis process and the server name it alike."""
    return key("evidence", tr)


def save_evidence(name: str, ev: Evidence) -> bool:
    return save_arrays(name, ev.to_arrays())


def load_evidence(name: str) -> Evidence | None:
    """The evidence kept under ``name``, or None (none kept, or unreadable)."""
    from ampdoctor.lossscale import Evidence

    arrays = load_arrays(name)
    if arrays is None:
        return None
    try:
        return Evidence.from_arrays(arrays)
    except (KeyError, ValueError, IndexError, TypeError):
        return None


# -- a run's step summary (series.StepSummary: every step, in buckets), built by the server or the diagnosis ---------
def summary_name(tr: Trace) -> str:
    """The prefix of a run's step summaries on disk (the steps they cover follow it)."""
    return f"steps-{identity(tr)}-"


def load_summary(tr: Trace) -> StepSummary | None:
    """The longest summary of this run kept on disk that is still a prefix of the trace."""
    prefix = summary_name(tr)
    best = None
    for name in prefix_files(prefix, "npz"):
        try:
            done = int(name[len(prefix) :])
        except ValueError:
            continue
        if done <= n_steps(tr) and (best is None or done > best):
            best = done
    if best is None:
        return None
    arrays = load_arrays(prefix + str(best))
    return StepSummary.from_arrays(arrays, tr) if arrays else None


def save_summary(tr: Trace, sm: StepSummary) -> bool:
    """Keep ``sm`` (of ``tr``), in place of the run's shorter ones; whether it was written."""
    prefix = summary_name(tr)
    done = sm.n_buckets * BUCKET
    if not save_arrays(prefix + str(done), sm.to_arrays()):
        return False
    for name in prefix_files(prefix, "npz"):
        if name != prefix + str(done):
            remove(name, "npz")
    return True
