"""Background writer: the training thread only enqueues; this thread turns raw step packets into rows.

All number crunching that need not happen on the training thread (merging calls, deriving counts from the
histograms, locating the first non-finite value) happens here, in numpy. This thread shares the GIL with training
(whose every torch op gives it up and takes it back): a batch of steps becomes rows a column at a time, with no
Python per step, and goes into SQLite in a few many-row INSERTs, not one statement (and one GIL hand-over) per row.
"""

from __future__ import annotations

import json
import logging
import math
import sqlite3
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from itertools import chain
from operator import attrgetter, itemgetter, ne
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import numpy.typing as npt

from .. import formats
from . import blocks, newfile, schema, vectors
from .messages import Close, EventKind, EventMsg, MetaMsg, MetricMsg, ProbeMsg, SiteMsg, StepBatch, StepPacket, Sync
from .vectors import Entry, FullPlan, Layout, Phase, tensor_peaks

if TYPE_CHECKING:  # (typing names past Python 3.9: for the type checker only)
    from typing import TypeAlias

    # what the training side puts on the queue (messages.py), and what the writer thread stores one by one
    Message: TypeAlias = SiteMsg | MetaMsg | MetricMsg | ProbeMsg | EventMsg
    Item: TypeAlias = Message | StepPacket | StepBatch | Sync | Close

log = logging.getLogger("ampdoctor")

COMMIT_EVERY_S = 0.5  # the trace promises a commit at least once a second; half that leaves slack
WAKE_S = 0.2  # the writer drains its queue this often: no thread switch per training step
QUEUE_MAX = 256  # packets; a writer this far behind slows training down instead of eating memory
# items queued at which the training thread wakes the writer early: a loop of ~1 ms steps fills QUEUE_MAX within one
# WAKE_S, and would then wait on the writer (measured on a 0.5 ms/step model: 8 us a step, asleep)
WAKE_AT = 64
# steps reduced together at most: their stacked values stay within this many bytes (the CPU's cache: a debug step of
# 50 full vectors holds 200 kB, and 64 of them stacked at once ran ~2x slower than 5 at a time)
RUN_BYTES = 1 << 20
LAYOUTS_KEPT = 8
# How long the writer waits for another process's lock on the trace (a reader's checkpoint, a copy tool, sqlite3
# at a shell) before it gives up: meanwhile training goes on until QUEUE_MAX steps wait, then waits with it.
BUSY_TIMEOUT_MS = 120_000
# Rows per INSERT statement: a batch of steps goes in a few statements of many rows each (executemany runs one
# statement per row, and each releases and takes back the GIL, which training's thread is then handed in between:
# two thread switches per row). 32 rows of the steps table bind 608 values, under SQLite's oldest limit of 999.
ROWS_PER_INSERT = 32

# The steps table's columns in the order the writer binds them: the packet's figures, the row's numbers (as the
# training thread filled them), the one derived column, then the texts.
_PACKET_COLUMNS = ("step", "loss", "loss_scale", "loss_scale_next", "skipped", "grad_norm", "nonfinite")
_packet_figures = attrgetter("step", "loss", "scale", "scale_next", "skipped", "grad_norm", "nonfinite")
_ROW_NUMBERS = tuple(f for f in schema.STEP_NUMBERS if f not in _PACKET_COLUMNS and f != "samples_per_s")
_NUMBERS = _PACKET_COLUMNS + _ROW_NUMBERS + ("samples_per_s",)  # every numeric column, the step's number first
_COLUMNS = _NUMBERS + ("lr", "reason")
assert sorted(_COLUMNS) == sorted(schema.STEP_FIELDS)
_row_numbers, _row_texts = itemgetter(*_ROW_NUMBERS), itemgetter("lr", "reason")
_AT = {f: i for i, f in enumerate(_COLUMNS)}
_BLOCK_NUMBERS = [_AT[f] for f in schema.STEP_NUMBERS]  # blocks.FIELDS but the learning rate, in _NUMBERS
_row_of, _entries_of = attrgetter("row"), attrgetter("entries")
_NULL = np.array(None, dtype=object)
_STATS_COLUMNS = ("step", "site", "scale", "calls", *schema.STATS_FIELDS)


def _sql(v: object) -> object:
    """SQLite stores a NaN REAL as NULL ("no value"); a NaN loss is data, so it is stored as the text 'nan'."""
    return "nan" if isinstance(v, float) and math.isnan(v) else v


def _event_json(data: object) -> str:
    """Event data as strict JSON: a NaN/Inf number becomes the text 'nan', 'inf' or '-inf' (JSON has no such
    numbers; Python would write NaN/Infinity, which SQLite's json functions, and the reader's checks, reject)."""

    def plain(v: object) -> object:
        if isinstance(v, float) and not math.isfinite(v):
            return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        return v

    return json.dumps(plain(data), allow_nan=False)


def _finite(p: float) -> bool:
    return not (math.isnan(p) or math.isinf(p))


_INSERTS: dict[tuple[str, int], str] = {}


def _insert(conn: sqlite3.Connection, table: str, columns: tuple[str, ...], flat: list[Any]) -> None:
    """Rows into ``table``: ``flat`` holds their values one row after the other (``columns`` per row),
    ROWS_PER_INSERT rows to a statement."""
    width = len(columns)
    n, at = len(flat) // width, 0
    while at < n:
        k = min(ROWS_PER_INSERT, 1 << ((n - at).bit_length() - 1))  # 32, 16, ... rows: a few statements, each kept
        sql = _INSERTS.get((table, k))
        if sql is None:
            row = "(" + ",".join("?" * width) + ")"
            sql = _INSERTS[table, k] = f"INSERT INTO {table} ({','.join(columns)}) VALUES {','.join([row] * k)}"
        conn.execute(sql, flat[at * width : (at + k) * width])
        at += k


def _rows(rows: Iterable[tuple[Any, ...]]) -> list[Any]:
    """Rows' values one row after the other, as _insert takes them."""
    return list(chain.from_iterable(rows))


class Writer(threading.Thread):
    def __init__(self, path: str, *, free_name: bool = False):
        """``path``: the trace to create; FileExistsError when it exists, unless ``free_name``: then the first
        free name of ``free_names(path)`` is taken (``self.path`` says which)."""
        super().__init__(name="ampdoctor-writer", daemon=True)
        self._items: deque[Item] = deque()
        self._wake = threading.Event()
        self.error: BaseException | None = None
        self.n_sites = 0
        self.log_every: int | None = None
        self._site_names: dict[int, tuple[str, str]] = {}
        self._layouts: dict[
            int, tuple[list[Entry], dict[str, int], Layout]
        ] = {}  # id(entries) -> (entries, bases, Layout), the entries kept alive
        self._lr_json: tuple[object, str | None, float] = (None, None, math.nan)  # the last lr, its JSON, its first
        self._blocks = blocks.Packer()
        self._skipped_total = 0
        self.dropped = 0  # messages SQLite could not store (see _write_item)
        self._handlers: dict[type[Message], Callable[[sqlite3.Connection, Any], None]] = {
            SiteMsg: self._write_site,
            MetaMsg: self._write_meta,
            MetricMsg: self._write_metric,
            ProbeMsg: self._write_probe,
            EventMsg: self._write_event,
        }
        self.path = newfile.claim(path, free_name)
        self._conn: sqlite3.Connection | None = newfile.open_new(self.path)

    # -- training-thread side ----------------------------------------------------------------------------------
    def put(self, item: SiteMsg | MetaMsg | MetricMsg | EventMsg | ProbeMsg | StepPacket | StepBatch) -> None:
        """Enqueue (a deque append: no lock; a wake-up only when WAKE_AT items wait). Waits only while the writer is
        QUEUE_MAX items behind, and drops items once the writer has failed (the Doctor then stops collecting)."""
        items = self._items
        if self.error is not None:
            return
        items.append(item)
        n = len(items)
        if n == WAKE_AT:  # behind (a fast loop): drain now instead of at the next wake-up
            self._wake.set()
        elif n > QUEUE_MAX and self.is_alive():
            self._wake.set()
            deadline = time.monotonic() + 30
            while len(items) > QUEUE_MAX and self.is_alive() and time.monotonic() < deadline:
                time.sleep(0.002)

    def sync(self, timeout: float = 30.0) -> bool:
        """Wait until everything enqueued so far is written and committed; False on timeout or a failed writer."""
        if not self.is_alive():
            return False
        done = threading.Event()
        self._items.append(Sync(done))
        self._wake.set()
        while not done.wait(0.05):
            timeout -= 0.05
            if timeout <= 0 or not self.is_alive():
                return False
        return self.error is None

    def close(self, timeout: float = 30.0) -> None:
        if self.is_alive():
            self._items.append(Close())
            self._wake.set()
            self.join(timeout)
        elif self._conn is not None and not self._started.is_set():  # type: ignore[attr-defined]  # Thread's own flag
            self._conn.close()
            self._conn = None

    # -- writer thread -------------------------------------------------------------------------------------------
    def run(self) -> None:
        conn = cast(sqlite3.Connection, self._conn)  # (open until run() ends)
        items = self._items
        last_commit = -math.inf  # the first drain commits at once: a new trace is readable soon
        dirty = closing = False
        try:
            conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
            conn.execute("BEGIN")
            while not closing:
                self._wake.wait(WAKE_S)
                self._wake.clear()
                synced: list[threading.Event] = []
                steps: list[StepPacket] = []
                while items:
                    item = items.popleft()
                    if type(item) is StepPacket:  # gathered, written together (in order with the rest)
                        steps.append(item)
                        continue
                    if type(item) is StepBatch:
                        steps.extend(item.packets)
                        continue
                    if steps:
                        self._write_steps(conn, steps)
                        steps, dirty = [], True
                    if type(item) is Close:
                        closing = True
                        break
                    if type(item) is Sync:
                        synced.append(item.done)
                        continue
                    self._write_item(conn, item)  # type: ignore[arg-type]  # (a Message: the type() tests above)
                    dirty = True
                if steps:
                    self._write_steps(conn, steps)
                    dirty = True
                if dirty and (closing or synced or time.monotonic() - last_commit >= COMMIT_EVERY_S):
                    conn.execute("COMMIT")
                    conn.execute("BEGIN")
                    last_commit = time.monotonic()
                    dirty = False
                for done in synced:
                    done.set()
            conn.execute("COMMIT")
        except BaseException as exc:  # a full disk, a removed directory: report, never raise into training
            self.error = exc
            items.clear()
            try:
                conn.execute("ROLLBACK")
            except sqlite3.Error:
                pass
        finally:
            try:
                conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            except sqlite3.Error:
                pass
            conn.close()
            self._conn = None

    def _write_item(self, conn: sqlite3.Connection, item: Message) -> None:
        """One message other than a step. A value SQLite cannot store (an integer past 64 bits, text that is not
        valid UTF-8) drops that message with one log line, never the writer: the file, not the item, is what a
        failure of the disk or the database looks like."""
        try:
            self._handlers[type(item)](conn, item)
        except (sqlite3.InterfaceError, sqlite3.IntegrityError, OverflowError, UnicodeError, ValueError) as exc:
            self.dropped += 1
            if self.dropped == 1:
                log.warning("ampdoctor: a %s the trace cannot store was dropped (%s)", type(item).__name__, exc)

    def _write_site(self, conn: sqlite3.Connection, m: SiteMsg) -> None:
        conn.execute(
            "INSERT INTO sites (id, path, module, kind, module_type, dtype, shape, first_step) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            tuple(m),
        )
        self.n_sites = max(self.n_sites, m.id + 1)
        self._site_names[m.id] = (m.path, m.kind)

    def _write_meta(self, conn: sqlite3.Connection, m: MetaMsg) -> None:
        conn.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (m.key, json.dumps(m.value)))

    def _write_metric(self, conn: sqlite3.Connection, m: MetricMsg) -> None:
        conn.execute("INSERT INTO metrics (step, name, value, time) VALUES (?, ?, ?, ?)", tuple(m))

    def _write_probe(self, conn: sqlite3.Connection, m: ProbeMsg) -> None:
        """A probed step: per-module errors against FP32, and what was skipped."""
        conn.executemany(
            f"INSERT OR REPLACE INTO probes VALUES ({','.join('?' * (6 + len(schema.PROBE_FIELDS)))})",
            [tuple(_sql(v) if isinstance(v, float) else v for v in r) for r in m.rows],
        )
        message = f"{len(m.rows)} module(s) compared with FP32, {len(m.info.get('skipped', {}))} skipped"
        self._write_event(conn, EventMsg(m.step, EventKind.PROBE, None, "fwd", message, m.info))

    def _write_event(self, conn: sqlite3.Connection, m: EventMsg) -> None:
        data = _event_json(m.data) if m.data is not None else None
        conn.execute(
            "INSERT INTO events (step, kind, site, phase, message, data) VALUES (?, ?, ?, ?, ?, ?)",
            (m.step, EventKind(m.kind).value, m.site, Phase(m.phase).value if m.phase else None, m.message, data),
        )

    def _layout(self, p: StepPacket) -> Layout:
        """The Layout of a step's entries, kept for the few layouts a run alternates between (sentinel, peaks and
        full steps): building one costs ~60 us."""
        cached = self._layouts.get(id(p.entries))
        if cached is not None and cached[0] is p.entries and cached[1] == p.bases:
            return cached[2]
        layout = Layout(p.entries, p.bases)
        if len(self._layouts) >= LAYOUTS_KEPT:
            del self._layouts[next(iter(self._layouts))]  # the oldest
        self._layouts[id(p.entries)] = (p.entries, dict(p.bases), layout)
        return layout

    def _write_steps(self, conn: sqlite3.Connection, packets: list[StepPacket]) -> None:
        """Write consecutive step packets: their rows (and step blocks) as one batch, with no Python per step (the
        writer shares the GIL with the training thread, whose every torch op waits for it), and the sites of the
        steps that observed some (runs of steps with one layout reduced together: one numpy pass and a few INSERTs
        per run). NaN/Inf are data here, not errors (and -W error must not stop the writer)."""
        with np.errstate(all="ignore"):
            cells, numbers = self._step_cells(packets)
            observed = np.flatnonzero(
                (numbers[:, _AT["level"]] != schema.LEVEL_SENTINEL)  # (a step without a level: written as observed)
                | (numbers[:, _AT["nonfinite"]] != 0)
                | np.fromiter(map(bool, map(_entries_of, packets)), dtype=bool, count=len(packets))
            )
            health = self._write_observed(conn, [packets[i] for i in observed.tolist()])
            _insert(conn, "steps", _COLUMNS, cells.ravel().tolist())
            self._pack(conn, packets, numbers, cells[:, _AT["reason"]].tolist())
            self._log_health(packets, numbers, health)

    def _step_cells(self, packets: list[StepPacket]) -> tuple[npt.NDArray[np.object_], npt.NDArray[np.float64]]:
        """The steps' rows as SQLite takes them ([steps x _COLUMNS] Python values: NULL for None, the text 'nan'
        for a NaN, booleans as 0/1, the learning rates as JSON) and their numbers ([steps x _NUMBERS]: NaN for
        None), gathered a column at a time."""
        n = len(packets)
        rows = list(map(_row_of, packets))
        try:
            numbers, texts = list(map(_row_numbers, rows)), list(map(_row_texts, rows))
        except KeyError:  # a row some tool made without every field: a missing one is None, as in a row without it
            numbers = [tuple(map(r.get, _ROW_NUMBERS)) for r in rows]
            texts = [(r.get("lr"), r.get("reason")) for r in rows]
        cells = np.empty((n, len(_COLUMNS)), dtype=object)
        k = len(_PACKET_COLUMNS)
        cells[:, :k] = list(map(_packet_figures, packets))
        cells[:, k : k + len(_ROW_NUMBERS)] = numbers
        lrs, reasons = zip(*texts)
        cells[:, _AT["reason"]] = reasons
        cells[:, _AT["lr"]], first_lr = self._lr_texts(list(lrs))
        spd = _AT["samples_per_s"]
        given = cells[:, :spd] != None  # noqa: E711 (elementwise: the cells that hold a value)
        values = np.empty((n, len(_NUMBERS) + 1))  # _NUMBERS, then the first group's learning rate
        values[:, :spd] = cells[:, :spd].astype(np.float64)  # (None: NaN; True/False: 1/0)
        values[:, -1] = first_lr
        samples, step_time = values[:, _AT["samples"]], values[:, _AT["step_time"]]
        rate = given[:, _AT["samples"]] & (samples != 0) & given[:, _AT["step_time"]] & (step_time != 0)
        values[:, spd] = np.where(rate, samples / step_time, np.nan)  # (samples / step_time if both, as Python does)
        cells[:, spd] = np.where(rate, values[:, spd], _NULL)
        for f in ("skipped", "nonfinite"):  # (stored as integers whatever truth value the packet held)
            cells[:, _AT[f]] = values[:, _AT[f]].astype(np.int64).tolist()
        given = np.concatenate([given, rate[:, None]], axis=1)
        nan = np.isnan(values[:, : spd + 1]) & given  # a NaN given, not a missing value: SQLite would store NULL
        if nan.any():
            cells[:, : spd + 1][nan] = "nan"
        return cells, values

    def _lr_texts(self, lrs: list[Any]) -> tuple[npt.NDArray[np.object_], npt.NDArray[np.float64]]:
        """The learning rates as JSON, and the first group's, per step: encoded again only where they change (most
        steps repeat the last ones)."""
        last, text, first = self._lr_json
        changed = np.flatnonzero(list(map(ne, lrs, [last, *lrs[:-1]])))
        texts, firsts = [text], [first]
        for i in changed.tolist():
            lr = lrs[i]
            texts.append(None if lr is None else json.dumps(lr))
            firsts.append(blocks.first_lr(texts[-1]))
        which = np.zeros(len(lrs), dtype=np.intp)
        which[changed] = np.arange(1, len(changed) + 1)
        which = np.maximum.accumulate(which)
        self._lr_json = (lrs[-1], texts[-1], firsts[-1])
        return np.array(texts, dtype=object)[which], np.array(firsts, dtype=np.float64)[which]

    def _pack(
        self, conn: sqlite3.Connection, packets: list[StepPacket], numbers: np.ndarray, reasons: list[str | None]
    ) -> None:
        """The steps' numbers into the step blocks (blocks.Packer), a block's share at a time."""
        steps = numbers[:, 0]
        values = np.concatenate([numbers[:, _BLOCK_NUMBERS], numbers[:, -1:]], axis=1)  # blocks.FIELDS
        if len(steps) > 1 and not (np.diff(steps) == 1).all():  # (not expected: the packer starts over at a gap)
            rows = [r for p, v, why in zip(packets, values, reasons) if (r := self._blocks.add(p.step, v, why))]
        else:
            rows = self._blocks.add_many(packets[0].step, values, reasons)
        if rows:
            conn.executemany(blocks.INSERT, rows)

    def _write_observed(self, conn: sqlite3.Connection, packets: list[StepPacket]) -> dict[int, tuple[Any, Any]]:
        """The sites of the steps that observed some, and where a non-finite value came from: runs of packets with
        one layout reduced together. What the health line needs of each (its sites and their peaks), by step."""
        health: dict[int, tuple[Any, Any]] = {}
        i = 0
        while i < len(packets):
            layout = self._layout(packets[i])
            j, end = i + 1, i + max(1, RUN_BYTES // (8 * len(packets[i].values) or 1))
            while (
                j < min(len(packets), end)
                and packets[j].entries is packets[i].entries
                and packets[j].bases == packets[i].bases
                and len(packets[j].values) == len(packets[i].values)
            ):
                j += 1
            self._write_run(conn, packets[i:j], layout, health)
            i = j
        return health

    def _write_run(
        self, conn: sqlite3.Connection, run: list[StepPacket], layout: Layout, health: dict[int, tuple[Any, Any]]
    ) -> None:
        values = np.stack([p.values for p in run])
        peaks = layout.peaks(values)

        # 1. per-site peak (worst over calls and tensors)
        uniq, site_peak = layout.sites, layout.site_peaks(peaks)
        n = max(self.n_sites, int(uniq[-1]) + 1 if len(uniq) else 0)
        blobs = np.full((len(run), n), -1.0, dtype="<f4")
        blobs[:, uniq] = site_peak
        level = schema.LEVEL_SENTINEL
        observed = [(p.step, blobs[k].tobytes()) for k, p in enumerate(run) if p.row.get("level") != level]
        _insert(conn, "peaks", ("step", "data"), _rows(observed))  # none for a sentinel-only step

        # 2. full statistics, where every call of a site had them
        if layout.full_plan is not None:
            self._write_full(conn, run, values, layout.full_plan)

        # 3. where a non-finite value came from (the training thread decided whether there was one)
        for k, p in enumerate(run):
            if p.nonfinite and p.row.get("level") == schema.LEVEL_SENTINEL:
                self._unknown_origin(conn, p)
            elif p.nonfinite:
                self._locate(conn, p, values[k], peaks[k], layout.owner)
            if self.log_every:
                health[p.step] = (uniq, site_peak[k])

    def _log_health(self, packets: list[StepPacket], numbers: np.ndarray, health: dict[int, tuple[Any, Any]]) -> None:
        """The health line of every log_every-th step; the count of skipped steps kept."""
        skipped = numbers[:, _AT["skipped"]]
        if self.log_every:
            steps = numbers[:, 0].astype(np.int64)
            so_far = self._skipped_total + np.cumsum(skipped).astype(np.int64)
            nothing = (np.zeros(0, dtype=np.int64), np.zeros(0))
            for i in np.flatnonzero((steps + 1) % self.log_every == 0).tolist():
                p = packets[i]
                log.info(self._health(p, int(so_far[i]), *health.get(p.step, nothing)))
        self._skipped_total += int(skipped.sum())

    def _health(self, p: StepPacket, skipped: int, sites: np.ndarray, peaks: np.ndarray) -> str:
        """One line: loss, loss scale, skipped steps so far, the layer closest to the FP16 max (or non-finite)."""
        parts = [f"ampdoctor: step {p.step}"]
        if p.loss is not None:
            parts.append(f"loss {p.loss:.4g}")
        if p.scale is not None:
            parts.append(f"loss scale {p.scale:g}")
        parts.append(f"skipped {skipped} so far")
        worst, worst_room = None, math.inf
        for s, pk in zip(sites.tolist(), peaks.tolist()):
            name = self._site_names.get(s)
            if name is None or name[1] not in ("act", "grad_out"):
                continue
            room = -math.inf if not _finite(pk) else (math.log2(formats.FP16.max / pk) if pk > 0 else math.inf)
            if room < worst_room:
                worst, worst_room = name, room
        if worst is not None:
            headroom = "non-finite" if worst_room == -math.inf else f"{worst_room:.1f} binades below 65504"
            parts.append(f"worst FP16 headroom {worst[0]} ({worst[1]}): {headroom}")
        return " | ".join(parts)

    def _write_full(self, conn: sqlite3.Connection, run: list[StepPacket], values: np.ndarray, plan: FullPlan) -> None:
        """One stats row (and a histogram when due) per site with full statistics, derived for every site of every
        step of the run at once (one numpy pass and one executemany per table, whatever the number of steps)."""
        n_sites, n_tensors = len(plan.sites), len(plan.offs)
        if not n_sites:
            return
        k = len(run)
        at = (plan.offs[:, None] + np.arange(vectors.FULL_LEN)).reshape(-1)
        mat = values.take(at, axis=1).reshape(k * n_tensors, vectors.FULL_LEN)  # (take: contiguous, no second copy)
        starts = (np.arange(k)[:, None] * n_tensors + plan.starts[None, :]).reshape(-1)
        st, bins = vectors.derive_many(vectors.merge_rows(mat, starts), np.tile(plan.numel, k))
        scale = np.repeat([p.scale if p.scale is not None else 1.0 for p in run], n_sites)
        cols = [st[f].tolist() for f in schema.STATS_FIELDS]
        for i, f in enumerate(schema.STATS_FIELDS):
            if f.startswith("bf16"):  # NaN: a count the histogram cannot resolve, stored as NULL ("unknown")
                cols[i] = [None if v != v else v for v in cols[i]]
        steps = np.repeat([p.step for p in run], n_sites).tolist()
        sites = np.tile(plan.sites, k).tolist()
        scales = np.where(np.tile(plan.bwd, k), scale, 1.0).tolist()
        _insert(conn, "stats", _STATS_COLUMNS, _rows(zip(steps, sites, scales, plan.calls * k, *cols)))
        due = np.repeat([p.store_hist for p in run], n_sites)
        if not due.any():
            return
        rows = np.flatnonzero(due)
        occupied = bins[rows] > 0
        any_: npt.NDArray[np.bool_] = occupied.any(axis=1)  # type: ignore[assignment]  # (by axis: an array)
        lo = occupied.argmax(axis=1)
        hi = bins.shape[1] - 1 - occupied[:, ::-1].argmax(axis=1)
        counts = bins[rows].astype("<i8")
        _insert(
            conn,
            "hists",
            ("step", "site", "lo", "counts"),
            _rows(
                (steps[r], sites[r], int(lo[i]) + schema.HIST_LO, counts[i, lo[i] : hi[i] + 1].tobytes())
                for i, r in enumerate(rows.tolist())
                if any_[i]
            ),
        )

    def _unknown_origin(self, conn: sqlite3.Connection, p: StepPacket) -> None:
        """A NaN/Inf on a step that observed no site: its tensors are gone, so where it came from is not guessed.
        The flight recorder observes the next steps in full; a fault that recurs is located there."""
        what = "loss" if p.loss is not None and not _finite(p.loss) else "gradients"
        message = f"non-finite {what} on a step observed by the sentinel only: origin unknown"
        data = {"loss": p.loss, "grad_norm": p.grad_norm, "grad_max": p.row.get("grad_max")}
        self._write_event(conn, EventMsg(p.step, EventKind.NONFINITE_UNKNOWN, None, None, message, data))

    def _locate(
        self, conn: sqlite3.Connection, p: StepPacket, values: np.ndarray, peaks: np.ndarray, owner: np.ndarray
    ) -> None:
        """Event naming where the first non-finite value of this step came from.

        Forward: the first module (in completion order) whose output is non-finite while all of its inputs were
        finite; a child that merely received a non-finite input is not the origin. Backward: the first output
        gradient (in the order autograd produced them) that is non-finite, after a finite one. A non-finite loss
        from finite module outputs is named before the backward pass: the gradients it seeds are its consequence.
        """
        worst = np.full(len(p.entries), -1.0)
        np.maximum.at(worst, owner, peaks)
        prev_site = None
        for phase in (Phase.FWD, Phase.BWD, Phase.PARAM):
            if (
                phase == Phase.BWD
                and p.loss is not None
                and not _finite(p.loss)
                and all(_finite(float(worst[i])) for i, e in enumerate(p.entries) if e.phase == Phase.FWD)
            ):
                break  # finite forward outputs and a non-finite loss: the loss event below
            for i, e in enumerate(p.entries):
                if e.phase != phase:
                    continue
                out = float(worst[i])
                if _finite(out):
                    prev_site = e.site
                    continue
                if phase == Phase.FWD:
                    if not np.isfinite(tensor_peaks(values, e.inputs, p.bases)).all():
                        continue
                    msg = "first non-finite output in the forward pass (inputs finite)"
                elif phase == Phase.BWD:
                    msg = "first non-finite gradient in the backward pass"
                else:
                    msg = "non-finite parameter gradient"
                data = {"value": "nan" if math.isnan(out) else "inf", "after": prev_site}
                self._write_event(conn, EventMsg(p.step, EventKind.NONFINITE, e.site, phase, msg, data))
                return
        if p.loss is not None and not _finite(p.loss):
            data = {"value": "nan" if math.isnan(p.loss) else "inf"}
            message = "non-finite loss with finite module outputs"
            self._write_event(conn, EventMsg(p.step, EventKind.NONFINITE, None, "loss", message, data))
