"""Background writer: the training thread only enqueues; this thread turns raw step packets into rows.

All number crunching that need not happen on the training thread (merging calls, deriving counts from the
histograms, locating the first non-finite value) happens here, in numpy.
"""

from __future__ import annotations

import json
import logging
import math
import sqlite3
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import numpy.typing as npt

from .. import formats
from . import blocks, newfile, schema, vectors
from .messages import Close, EventKind, EventMsg, MetaMsg, MetricMsg, ProbeMsg, SiteMsg, StepPacket, Sync
from .vectors import Entry, FullPlan, Layout, Phase, tensor_peaks

if TYPE_CHECKING:  # (typing names past Python 3.9: for the type checker only)
    from typing import TypeAlias

    # what the training side puts on the queue (messages.py), and what the writer thread stores one by one
    Message: TypeAlias = SiteMsg | MetaMsg | MetricMsg | ProbeMsg | EventMsg
    Item: TypeAlias = Message | StepPacket | Sync | Close

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
    def put(self, item: SiteMsg | MetaMsg | MetricMsg | EventMsg | ProbeMsg | StepPacket) -> None:
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
        """Write consecutive step packets; runs of steps with one layout are reduced together (one numpy pass and
        one executemany per run instead of a few dozen small calls per step: the writer shares the GIL with the
        training thread). NaN/Inf are data here, not errors (and -W error must not stop the writer)."""
        with np.errstate(all="ignore"):
            self._write_packets(conn, packets)

    def _write_packets(self, conn: sqlite3.Connection, packets: list[StepPacket]) -> None:
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
            self._write_run(conn, packets[i:j], layout)
            i = j

    def _write_run(self, conn: sqlite3.Connection, run: list[StepPacket], layout: Layout) -> None:
        values = np.stack([p.values for p in run])
        peaks = layout.peaks(values)

        # 1. per-site peak (worst over calls and tensors)
        uniq, site_peak = layout.sites, layout.site_peaks(peaks)
        n = max(self.n_sites, int(uniq[-1]) + 1 if len(uniq) else 0)
        blobs = np.full((len(run), n), -1.0, dtype="<f4")
        blobs[:, uniq] = site_peak
        conn.executemany(
            "INSERT INTO peaks (step, data) VALUES (?, ?)",  # none for a sentinel-only step
            [(p.step, blobs[k].tobytes()) for k, p in enumerate(run) if p.row.get("level") != schema.LEVEL_SENTINEL],
        )

        # 2. full statistics, where every call of a site had them
        if layout.full_plan is not None:
            self._write_full(conn, run, values, layout.full_plan)

        rows, block_rows = [], []
        for k, p in enumerate(run):
            # 3. where a non-finite value came from (the training thread decided whether there was one)
            if p.nonfinite and p.row.get("level") == schema.LEVEL_SENTINEL:
                self._unknown_origin(conn, p)
            elif p.nonfinite:
                self._locate(conn, p, values[k], peaks[k], layout.owner)

            row = p.row
            step_time, samples, lr = row.get("step_time"), row.get("samples"), row.get("lr")
            row.update(
                step=p.step,
                loss=p.loss,
                loss_scale=p.scale,
                loss_scale_next=p.scale_next,
                skipped=int(p.skipped),
                grad_norm=p.grad_norm,
                nonfinite=int(p.nonfinite),
                samples_per_s=(samples / step_time) if samples and step_time else None,
                lr=self._lr_text(lr),
            )
            rows.append([_sql(v) for v in map(row.get, schema.STEP_FIELDS)])
            packed = self._blocks.add(
                p.step, [*map(blocks.number, map(row.get, schema.STEP_NUMBERS)), self._lr_json[2]], row.get("reason")
            )
            if packed is not None:
                block_rows.append(packed)
            self._skipped_total += int(p.skipped)
            if self.log_every and (p.step + 1) % self.log_every == 0:
                log.info(self._health(p, uniq, site_peak[k]))
        conn.executemany(
            f"INSERT INTO steps ({','.join(schema.STEP_FIELDS)}) VALUES ({','.join('?' * len(schema.STEP_FIELDS))})",
            rows,
        )
        conn.executemany(blocks.INSERT, block_rows)

    def _lr_text(self, lr: object) -> str | None:
        """The learning rates as JSON, encoded again only when they change (most steps repeat the last ones)."""
        if lr is None:
            self._lr_json = (None, None, math.nan)
            return None
        last, text, _ = self._lr_json
        if lr != last or text is None:
            text = json.dumps(lr)
            self._lr_json = (lr, text, blocks.first_lr(text))
        return text

    def _health(self, p: StepPacket, sites: np.ndarray, peaks: np.ndarray) -> str:
        """One line: loss, loss scale, skipped steps so far, the layer closest to the FP16 max (or non-finite)."""
        parts = [f"ampdoctor: step {p.step}"]
        if p.loss is not None:
            parts.append(f"loss {p.loss:.4g}")
        if p.scale is not None:
            parts.append(f"loss scale {p.scale:g}")
        parts.append(f"skipped {self._skipped_total} so far")
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
        conn.executemany(
            f"INSERT INTO stats VALUES ({','.join('?' * (4 + len(schema.STATS_FIELDS)))})",
            zip(steps, sites, scales, plan.calls * k, *cols),
        )
        due = np.repeat([p.store_hist for p in run], n_sites)
        if not due.any():
            return
        rows = np.flatnonzero(due)
        occupied = bins[rows] > 0
        any_: npt.NDArray[np.bool_] = occupied.any(axis=1)  # type: ignore[assignment]  # (by axis: an array)
        lo = occupied.argmax(axis=1)
        hi = bins.shape[1] - 1 - occupied[:, ::-1].argmax(axis=1)
        counts = bins[rows].astype("<i8")
        conn.executemany(
            "INSERT INTO hists VALUES (?, ?, ?, ?)",
            [
                (steps[r], sites[r], int(lo[i]) + schema.HIST_LO, counts[i, lo[i] : hi[i] + 1].tobytes())
                for i, r in enumerate(rows.tolist())
                if any_[i]
            ],
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
