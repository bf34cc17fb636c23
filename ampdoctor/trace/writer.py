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
from dataclasses import dataclass

import numpy as np

from .. import formats
from . import newfile, schema
from . import vectors as V
from .vectors import Entry, FullPlan, Layout, tensor_peaks

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


@dataclass
class StepPacket:
    step: int
    row: dict  # steps-table fields known on the training thread
    values: np.ndarray  # the step's one host transfer
    bases: dict  # where each block starts in values: "p<dtype>" peaks, "f" full vectors, "x" extras
    entries: list[Entry]
    loss: float | None
    scale: float | None
    scale_next: float | None
    grad_norm: float | None
    skipped: bool | None  # None: infer from the scale (no optimizer to tell)
    store_hist: bool
    late_loss: object = None  # a loss logged after the step boundary, resolved before writing


def _sql(v):
    """SQLite stores a NaN REAL as NULL ("no value"); a NaN loss is data, so it is stored as the text 'nan'."""
    return "nan" if isinstance(v, float) and math.isnan(v) else v


def _event_json(data) -> str:
    """Event data as strict JSON: a NaN/Inf number becomes the text 'nan', 'inf' or '-inf' (JSON has no such
    numbers; Python would write NaN/Infinity, which SQLite's json functions, and the reader's checks, reject)."""

    def plain(v):
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
        self._items: deque = deque()
        self._wake = threading.Event()
        self.error: BaseException | None = None
        self.n_sites = 0
        self.log_every: int | None = None
        self._site_names: dict[int, tuple[str, str]] = {}
        self._layouts: dict = {}  # id(entries) -> (entries, bases, Layout), the entries kept alive
        self._lr_json = (None, None)
        self._skipped_total = 0
        self.path = newfile.claim(path, free_name)
        self._conn = newfile.open_new(self.path)

    # -- training-thread side ----------------------------------------------------------------------------------
    def put(self, item) -> None:
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
        self._items.append(("sync", done))
        self._wake.set()
        while not done.wait(0.05):
            timeout -= 0.05
            if timeout <= 0 or not self.is_alive():
                return False
        return self.error is None

    def close(self, timeout: float = 30.0) -> None:
        if self.is_alive():
            self._items.append(("close",))
            self._wake.set()
            self.join(timeout)
        elif self._conn is not None and not self._started.is_set():
            self._conn.close()
            self._conn = None

    # -- writer thread -------------------------------------------------------------------------------------------
    def run(self) -> None:
        conn = self._conn
        items = self._items
        last_commit = -math.inf  # the first drain commits at once: a new trace is readable soon
        dirty = closing = False
        try:
            conn.execute("BEGIN")
            while not closing:
                self._wake.wait(WAKE_S)
                self._wake.clear()
                synced, steps = [], []
                while items:
                    item = items.popleft()
                    if item[0] == "step":  # gathered, written together (in order with the rest)
                        steps.append(item[1])
                        continue
                    if steps:
                        self._handle(conn, ("steps", steps))
                        steps, dirty = [], True
                    if item[0] == "close":
                        closing = True
                        break
                    if item[0] == "sync":
                        synced.append(item[1])
                        continue
                    self._handle(conn, item)
                    dirty = True
                if steps:
                    self._handle(conn, ("steps", steps))
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

    def _handle(self, conn: sqlite3.Connection, item: tuple) -> None:
        tag = item[0]
        if tag == "steps":
            with np.errstate(all="ignore"):  # NaN/Inf are data here, not errors (and -W error must not stop us)
                self._write_steps(conn, item[1])
        elif tag == "site":
            conn.execute(
                "INSERT INTO sites (id, path, module, kind, module_type, dtype, shape, first_step) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                item[1:],
            )
            self.n_sites = max(self.n_sites, item[1] + 1)
            self._site_names[item[1]] = (item[2], item[4])
        elif tag == "meta":
            conn.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (item[1], json.dumps(item[2])))
        elif tag == "metric":
            conn.execute("INSERT INTO metrics (step, name, value, time) VALUES (?, ?, ?, ?)", item[1:])
        elif tag == "probe":  # a probed step: per-module errors against FP32, and what was skipped
            step, rows, info = item[1:]
            conn.executemany(
                f"INSERT OR REPLACE INTO probes VALUES ({','.join('?' * (6 + len(schema.PROBE_FIELDS)))})",
                [tuple(_sql(v) if isinstance(v, float) else v for v in r) for r in rows],
            )
            conn.execute(
                "INSERT INTO events (step, kind, site, phase, message, data) VALUES (?, 'probe', NULL, 'fwd', ?, ?)",
                (
                    step,
                    f"{len(rows)} module(s) compared with FP32, {len(info.get('skipped', {}))} skipped",
                    json.dumps(info),
                ),
            )
        elif tag == "event":
            step, kind, site, phase, message, data = item[1:]
            conn.execute(
                "INSERT INTO events (step, kind, site, phase, message, data) VALUES (?, ?, ?, ?, ?, ?)",
                (step, kind, site, phase, message, _event_json(data) if data is not None else None),
            )
        else:
            raise ValueError(f"unknown packet {tag!r}")

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
        training thread)."""
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
        bad_peak = (~np.isfinite(site_peak)).any(axis=1).tolist()

        # 2. full statistics, where every call of a site had them
        if layout.full_plan is not None:
            self._write_full(conn, run, values, layout.full_plan)

        rows = []
        for k, p in enumerate(run):
            # 3. skipped steps and non-finite values
            skipped = p.skipped
            if skipped is None:
                skipped = p.scale is not None and p.scale_next is not None and p.scale_next < p.scale
            grads_bad = not all(v is None or _finite(v) for v in (p.grad_norm, p.row.get("grad_max")))
            nonfinite = bad_peak[k] or grads_bad or (p.loss is not None and not _finite(p.loss))
            if nonfinite and p.row.get("level") == schema.LEVEL_SENTINEL:
                self._unknown_origin(conn, p)
            elif nonfinite:
                self._locate(conn, p, values[k], peaks[k], layout.owner)

            row = p.row
            step_time, samples, lr = row.get("step_time"), row.get("samples"), row.get("lr")
            row.update(
                step=p.step,
                loss=p.loss,
                loss_scale=p.scale,
                loss_scale_next=p.scale_next,
                skipped=int(bool(skipped)),
                grad_norm=p.grad_norm,
                nonfinite=int(nonfinite),
                samples_per_s=(samples / step_time) if samples and step_time else None,
                lr=self._lr_text(lr),
            )
            rows.append([_sql(v) for v in map(row.get, schema.STEP_FIELDS)])
            self._skipped_total += int(bool(skipped))
            if self.log_every and (p.step + 1) % self.log_every == 0:
                log.info(self._health(p, uniq, site_peak[k]))
        conn.executemany(
            f"INSERT INTO steps ({','.join(schema.STEP_FIELDS)}) VALUES ({','.join('?' * len(schema.STEP_FIELDS))})",
            rows,
        )

    def _lr_text(self, lr) -> str | None:
        """The learning rates as JSON, encoded again only when they change (most steps repeat the last ones)."""
        if lr is None:
            return None
        last, text = self._lr_json
        if lr != last:
            text = json.dumps(lr)
            self._lr_json = (lr, text)
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
            room = "non-finite" if worst_room == -math.inf else f"{worst_room:.1f} binades below 65504"
            parts.append(f"worst FP16 headroom {worst[0]} ({worst[1]}): {room}")
        return " | ".join(parts)

    def _write_full(self, conn: sqlite3.Connection, run: list[StepPacket], values: np.ndarray, plan: FullPlan) -> None:
        """One stats row (and a histogram when due) per site with full statistics, derived for every site of every
        step of the run at once (one numpy pass and one executemany per table, whatever the number of steps)."""
        n_sites, n_tensors = len(plan.sites), len(plan.offs)
        if not n_sites:
            return
        k = len(run)
        cols = (plan.offs[:, None] + np.arange(V.FULL_LEN)).reshape(-1)
        mat = values.take(cols, axis=1).reshape(k * n_tensors, V.FULL_LEN)  # (take: contiguous, no second copy)
        starts = (np.arange(k)[:, None] * n_tensors + plan.starts[None, :]).reshape(-1)
        st, bins = V.derive_many(V.merge_rows(mat, starts), np.tile(plan.numel, k))
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
        any_ = occupied.any(axis=1)
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
        conn.execute(
            "INSERT INTO events (step, kind, site, phase, message, data) VALUES (?, ?, ?, ?, ?, ?)",
            (
                p.step,
                "nonfinite_unknown",
                None,
                None,
                f"non-finite {what} on a step observed by the sentinel only: origin unknown",
                _event_json({"loss": p.loss, "grad_norm": p.grad_norm, "grad_max": p.row.get("grad_max")}),
            ),
        )

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
        for phase in ("fwd", "bwd", "param"):
            if (
                phase == "bwd"
                and p.loss is not None
                and not _finite(p.loss)
                and all(_finite(float(worst[i])) for i, e in enumerate(p.entries) if e.phase == "fwd")
            ):
                break  # the loss event below
            for i, e in enumerate(p.entries):
                if e.phase != phase:
                    continue
                out = float(worst[i])
                if _finite(out):
                    prev_site = e.site
                    continue
                if phase == "fwd":
                    if not np.isfinite(tensor_peaks(values, e.inputs, p.bases)).all():
                        continue
                    msg = "first non-finite output in the forward pass (inputs finite)"
                elif phase == "bwd":
                    msg = "first non-finite gradient in the backward pass"
                else:
                    msg = "non-finite parameter gradient"
                data = {"value": "nan" if math.isnan(out) else "inf", "after": prev_site}
                conn.execute(
                    "INSERT INTO events (step, kind, site, phase, message, data) VALUES (?, ?, ?, ?, ?, ?)",
                    (p.step, "nonfinite", e.site, phase, msg, json.dumps(data)),
                )
                return
        if p.loss is not None and not _finite(p.loss):
            conn.execute(
                "INSERT INTO events (step, kind, site, phase, message, data) VALUES (?, ?, ?, ?, ?, ?)",
                (
                    p.step,
                    "nonfinite",
                    None,
                    "loss",
                    "non-finite loss with finite module outputs",
                    json.dumps({"value": "nan" if math.isnan(p.loss) else "inf"}),
                ),
            )
