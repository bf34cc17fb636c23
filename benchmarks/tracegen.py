"""Generated traces of long runs and wide models, written fast (vectorised rows, no model trained) in the very format
the trace writer writes: the file is laid out by the real schema (ampdoctor.trace.newfile), and every row has the shape
and encoding the writer gives it (a NaN loss as the text 'nan', peaks as float32 blobs with -1 for a site not seen,
histograms trimmed to their occupied binades, learning rates as JSON lists, event data as strict JSON).

The run: a GPT-like model on a GPU (embedding, ``blocks`` pre-norm blocks of attention and MLP, final norm, head;
FP32 parameters, FP16 autocast with LayerNorm and softmax in FP32, AdamW with warm-up and a cosine schedule, a
GradScaler at torch's defaults) observed with ampdoctor's default tiers: the sentinel every step, per-site peaks every
``peak_every``, full statistics every ``every``, histograms every ``hist_every``, weights and updates every
``weight_every``, the first ``calibration`` steps in full and the flight recorder's 5 steps after each anomaly.
Anomalies are those of a real FP16 run: the scaler grows its scale every 2000 clean steps and each growth that
overflows skips a step (non-finite gradients: an event, located to a site when the step observed its sites); the
unscaled gradients shrink ~3 binades over the run, so the scale keeps climbing. A few output-gradient sites carry
gradients deep in FP16's subnormal range (grad-underflow), a few activations span more binades than FP8 holds
(fp8-readiness), and a validation loss is logged every ``val_every`` steps.

``generate(path, steps=..., blocks=...)`` writes one; ``cached(...)`` reuses a file generated before with the same
arguments (its ``generator`` meta entry says how it was made). Run as a script to write one:
``.venv/bin/python benchmarks/tracegen.py OUT.db --steps 20000``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sqlite3
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from ampdoctor.trace import blocks, newfile, schema
from ampdoctor.trace.messages import EventKind, EventMsg
from ampdoctor.trace.vectors import Phase
from ampdoctor.trace.writer import _event_json

GENERATOR_VERSION = 3  # bump when the content changes: files of another version are made again (a name of their own)
# (3: the step blocks the writer packs, trace.blocks)
FP16_LIMIT = 65520.0  # a value scaled at or past this rounds to Inf in FP16
CLEAN_RUN = 5  # steps observed in full after an anomaly (the cadence's flight recorder)
GROWTH_INTERVAL = 2000
CHUNK = 20_000  # steps generated and inserted at a time (bounded memory whatever the length)
_BINADES = np.arange(schema.HIST_LO, schema.HIST_HI + 1, dtype=np.float64)


# -- the model ---------------------------------------------------------------------------------------------------------
def model_modules(blocks: int) -> list[tuple[str, str, str, str, list[tuple[str, str]]]]:
    """(path, module type, act dtype, shape, [(param name, param shape)]) in forward completion order (children
    before their container, the root last): the order in which a real run's act sites get their ids."""
    d, t = 768, 1024  # model width, tokens per batch row
    mods = [("embed", "Embedding", "float32", f"8x{t}x{d}", [("weight", f"50304x{d}")])]
    mods.append(("drop", "Dropout", "float32", f"8x{t}x{d}", []))
    for b in range(blocks):
        p = f"blocks.{b}"
        mods += [
            (f"{p}.ln1", "LayerNorm", "float32", f"8x{t}x{d}", [("weight", f"{d}"), ("bias", f"{d}")]),
            (f"{p}.attn.qkv", "Linear", "float16", f"8x{t}x{3 * d}", [("weight", f"{3 * d}x{d}")]),
            (f"{p}.attn.softmax", "Softmax", "float32", f"8x12x{t}x{t}", []),
            (f"{p}.attn.proj", "Linear", "float16", f"8x{t}x{d}", [("weight", f"{d}x{d}")]),
            (f"{p}.attn", "Attention", "float16", f"8x{t}x{d}", []),
            (f"{p}.ln2", "LayerNorm", "float32", f"8x{t}x{d}", [("weight", f"{d}"), ("bias", f"{d}")]),
            (f"{p}.mlp.fc1", "Linear", "float16", f"8x{t}x{4 * d}", [("weight", f"{4 * d}x{d}"), ("bias", f"{4 * d}")]),
            (f"{p}.mlp.act", "GELU", "float16", f"8x{t}x{4 * d}", []),
            (f"{p}.mlp.fc2", "Linear", "float16", f"8x{t}x{d}", [("weight", f"{d}x{4 * d}"), ("bias", f"{d}")]),
            (f"{p}.mlp", "MLP", "float16", f"8x{t}x{d}", []),
            (p, "Block", "float32", f"8x{t}x{d}", []),
        ]
    mods += [
        ("ln_f", "LayerNorm", "float32", f"8x{t}x{d}", [("weight", f"{d}"), ("bias", f"{d}")]),
        ("head", "Linear", "float16", f"8x{t}x50304", [("weight", f"50304x{d}")]),
        (schema.ROOT, "GPT", "float16", f"8x{t}x50304", []),
    ]
    return mods


def _numel(shape: str) -> int:
    return int(np.prod([int(x) for x in shape.split("x")])) if shape else 1


class Sites:
    """The sites table, with what the generator needs per site: kind, dtype, numel, and the magnitudes it draws."""

    def __init__(self, blocks: int, rng: np.random.Generator):
        mods = model_modules(blocks)
        rows = []
        for path, mtype, dtype, shape, _ in mods:
            rows.append((path, path, "act", mtype, dtype, shape))
        for path, mtype, dtype, shape, _ in reversed(mods):  # backward order
            rows.append((path, path, "grad_out", mtype, dtype, shape))
        params = [(path, mtype, name, pshape) for path, mtype, _, _, ps in mods for name, pshape in ps]
        for kind in ("param_grad", "weight", "update"):
            rows += [(f"{m}.{n}", m, kind, mtype, "float32", s) for m, mtype, n, s in params]
        self.rows = [(i, *r, 0) for i, r in enumerate(rows)]
        self.n = len(rows)
        kinds = np.array([r[2] for r in rows])
        self.kind = kinds
        self.dtype = np.array([r[4] for r in rows])
        self.numel = np.array([_numel(r[5]) for r in rows], dtype=np.float64)
        self.ids = {k: np.flatnonzero(kinds == k) for k in schema.KINDS}
        n = self.n
        # log2 of each site's RMS (unscaled for gradients) and the spread of its values in binades
        mu = np.empty(n)
        mu[self.ids["act"]] = rng.normal(-0.5, 1.5, len(self.ids["act"]))
        mu[self.ids["grad_out"]] = rng.normal(-9.0, 2.0, len(self.ids["grad_out"]))
        mu[self.ids["param_grad"]] = rng.normal(-12.0, 2.0, len(self.ids["param_grad"]))
        mu[self.ids["weight"]] = rng.normal(-4.5, 1.0, len(self.ids["weight"]))
        mu[self.ids["update"]] = rng.normal(-15.0, 1.5, len(self.ids["update"]))
        width = rng.uniform(1.6, 2.4, n)
        go = self.ids["grad_out"]
        linear = np.array([r[3] == "Linear" for r in rows])
        go_lin = go[linear[go]]
        deep = go_lin[rng.choice(len(go_lin), size=max(1, len(go) // 40), replace=False)]
        mu[deep] = rng.uniform(-30.0, -28.0, len(deep))  # gradients partly in FP16's subnormal range when scaled
        acts = self.ids["act"]
        acts_lin = acts[linear[acts]]
        wide = acts_lin[rng.choice(len(acts_lin), size=max(1, len(acts) // 25), replace=False)]
        width[wide] = rng.uniform(7.0, 8.0, len(wide))  # activations spanning more binades than E4M3 holds
        self.mu, self.width = mu, width
        self.zeros = np.where(np.array([r[3] for r in rows]) == "Dropout", 0.1, 0.0)
        self.peak_over_rms = np.log2(np.sqrt(2 * np.log(np.maximum(self.numel, 2.0))))  # Gaussian max / rms
        # the largest unscaled gradient of a trained step sits at 2^-2: the scale settles near 2^17
        mu[go] += -2.0 - float(np.max(mu[go] + self.peak_over_rms[go]))
        self.grad_top = -2.0


# -- the run: steps, scaler, cadence -------------------------------------------------------------------------------
def _scaler(log2_g: np.ndarray, init: float, always: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """GradScaler (growth 2, backoff 0.5, interval 2000) over the unscaled largest gradient per step, ``always``
    the steps that overflow at any scale: (scale, next scale, skipped)."""
    n = len(log2_g)
    g = np.exp2(log2_g).tolist()
    bad = always.tolist()
    scale, next_, skipped = np.empty(n), np.empty(n), np.zeros(n, bool)
    s, tracker = init, 0
    for t in range(n):
        scale[t] = s
        if bad[t] or s * g[t] >= FP16_LIMIT:
            skipped[t] = True
            s, tracker = s * 0.5, 0
        else:
            tracker += 1
            if tracker == GROWTH_INTERVAL:
                s, tracker = s * 2.0, 0
        next_[t] = s
    return scale, next_, skipped


def _levels(
    n: int,
    anomalies: np.ndarray,
    every: int,
    peak_every: int,
    hist_every: int,
    calibration: int,
    replay: bool = False,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(level, reason, stores histograms) per step: the default cadence, with the flight recorder after anomalies;
    with ``replay``, an anomalous step that observed nothing is replayed and observed in full (reason "replay")."""
    step = np.arange(n)
    level = np.full(n, schema.LEVEL_SENTINEL, dtype=np.int64)
    reason = np.full(n, "sentinel", dtype=object)
    hist = np.zeros(n, bool)
    peak = step % peak_every == 0
    level[peak], reason[peak] = schema.LEVEL_PEAK, "sampled"
    full = (step % every == 0) | (step % hist_every == 0)
    level[full], reason[full] = schema.LEVEL_FULL, "sampled"
    hist[step % hist_every == 0] = True
    alarm = np.zeros(n, bool)
    for a in np.flatnonzero(anomalies):  # the next CLEAN_RUN steps in full (a later anomaly re-arms it)
        alarm[a + 1 : a + 1 + CLEAN_RUN] = True
    for mask, why in ((alarm, "anomaly"), (step < calibration, "calibration")):
        level[mask], reason[mask], hist[mask] = schema.LEVEL_HIST, why, True
    level[hist] = schema.LEVEL_HIST
    if replay:
        again = anomalies & (level == schema.LEVEL_SENTINEL)
        level[again], reason[again], hist[again] = schema.LEVEL_HIST, "replay", True
    return level, reason, hist


# -- rows ----------------------------------------------------------------------------------------------------------
def _hist_counts(centre: np.ndarray, width: np.ndarray, numel: np.ndarray, top: np.ndarray) -> np.ndarray:
    """Counts per binade (rows: sites) of a Gaussian over log2|x| of ``numel`` values, cut at the binade of ``top``."""
    z = (_BINADES[None, :] + 0.5 - centre[:, None]) / width[:, None]
    dens = np.exp(-0.5 * z * z)
    dens[_BINADES[None, :] > np.floor(top)[:, None]] = 0.0
    dens /= np.maximum(dens.sum(axis=1, keepdims=True), 1e-300)
    return np.floor(dens * numel[:, None]).astype(np.int64)


def _edges_counts(counts: np.ndarray, below: float) -> np.ndarray:
    """Values per row in the binades under 2^below."""
    return counts[:, : int(below) - schema.HIST_LO].sum(axis=1)


class _Writer:
    """Inserts the rows of a generated run in the writer's column order."""

    def __init__(self, conn: sqlite3.Connection, sites: Sites, rng: np.random.Generator):
        self.c, self.sites, self.rng = conn, sites, rng
        self.stats_sql = f"INSERT INTO stats VALUES ({','.join('?' * (4 + len(schema.STATS_FIELDS)))})"

    def step_sites(self, steps: np.ndarray, level: np.ndarray, hist: np.ndarray, weight_every: int, ctx: dict):
        """Peaks, statistics and histograms of the observed steps among ``steps``."""
        s, rng = self.sites, self.rng
        obs = steps[level[steps] >= schema.LEVEL_PEAK]
        if not len(obs):
            return
        base = np.sort(np.concatenate([s.ids["act"], s.ids["grad_out"], s.ids["param_grad"]]))
        wsites = np.sort(np.concatenate([s.ids["weight"], s.ids["update"]]))
        is_go = s.kind == "grad_out"
        peaks_rows, stats_rows, hist_rows, events = [], [], [], []
        for t in obs.tolist():
            ids = np.concatenate([base, wsites]) if t % weight_every == 0 else base
            scale = ctx["scale"][t]
            drift = ctx["drift"][t]
            mu = s.mu[ids] + np.where(s.kind[ids] == "act", 0.0, drift) + rng.normal(0.0, 0.15, len(ids))
            carried = np.where(is_go[ids], scale, 1.0)  # output gradients are stored scaled
            log2_rms = mu + np.log2(carried)
            log2_peak = log2_rms + s.peak_over_rms[ids] + rng.normal(0.0, 0.1, len(ids))
            peak = np.exp2(log2_peak)
            inf = np.zeros(len(ids))
            if ctx["forward"][t]:  # a module's forward overflowed: it and every module after it output Inf/NaN
                order = np.flatnonzero(s.kind[ids] == "act")
                hit = order[np.searchsorted(ids[order], ctx["culprit"]) :]
                grads = np.flatnonzero(s.kind[ids] != "act")
                peak[hit], inf[hit] = np.inf, 1.0
                peak[grads], inf[grads] = np.nan, 1.0
                prev = int(ids[order[np.searchsorted(ids[order], ctx["culprit"]) - 1]])
                events.append(
                    EventMsg(
                        t,
                        EventKind.NONFINITE,
                        int(ctx["culprit"]),
                        Phase.FWD,
                        "first non-finite output in the forward pass (inputs finite)",
                        {"value": "inf", "after": prev},
                    )
                )
            elif ctx["skipped"][t]:  # this step's gradients overflowed: the largest grad_out sites hold Inf
                over = is_go[ids] & (log2_peak >= ctx["log2_g"][t] + math.log2(scale) - 1.0)
                over[np.flatnonzero(is_go[ids])[np.argmax(log2_peak[is_go[ids]])]] = True
                peak[over], inf[over] = np.inf, 1.0
                first = int(ids[np.flatnonzero(over)[0]])
                events.append(
                    EventMsg(
                        t,
                        EventKind.NONFINITE,
                        first,
                        Phase.BWD,
                        "first non-finite gradient in the backward pass",
                        {"value": "inf", "after": int(ids[np.flatnonzero(is_go[ids])[0]])},
                    )
                )
            log2_peak = np.where(np.isfinite(peak), log2_peak, np.nan)
            blob = np.full(s.n, -1.0, dtype="<f4")
            blob[ids] = peak
            peaks_rows.append((t, blob.tobytes()))
            if level[t] < schema.LEVEL_FULL:
                continue
            numel = s.numel[ids]
            top = np.where(np.isfinite(log2_peak), log2_peak, log2_rms + 3.0)
            counts = _hist_counts(log2_rms, s.width[ids], numel * (1 - s.zeros[ids]), top)
            zeros = numel - counts.sum(axis=1) - inf
            occupied = counts > 0
            lowest = np.where(occupied.any(axis=1), occupied.argmax(axis=1), 0)
            minabs = np.exp2(lowest + schema.HIST_LO)
            sub16 = counts[:, 127 - 24 : 127 - 14].sum(axis=1).astype(float)
            flush16 = _edges_counts(counts, -24).astype(float)
            sub_bf = counts[:, : 127 - 126].sum(axis=1).astype(float)
            rms = np.exp2(log2_rms)
            absmax = np.where(np.isfinite(peak), peak, np.exp2(top))
            mean = rms * rng.normal(0.0, 0.05, len(ids))
            fp16_over = np.where(np.isfinite(peak), 0.0, inf)
            cols = [
                numel,
                np.zeros(len(ids)),
                inf,
                zeros,
                absmax,
                minabs,
                mean,
                rms,
                fp16_over,
                sub16,
                flush16,
                np.zeros(len(ids)),
                sub_bf,
                np.zeros(len(ids)),
            ]
            stats_rows += zip(
                [t] * len(ids), ids.tolist(), carried.tolist(), [1] * len(ids), *[c.tolist() for c in cols]
            )
            if hist[t]:
                hi = counts.shape[1] - 1 - occupied[:, ::-1].argmax(axis=1)
                for k, sid in enumerate(ids.tolist()):
                    if occupied[k].any():
                        row = counts[k, lowest[k] : hi[k] + 1]
                        hist_rows.append((t, sid, int(lowest[k]) + schema.HIST_LO, row.astype("<i8").tobytes()))
        c = self.c
        c.executemany("INSERT INTO peaks (step, data) VALUES (?, ?)", peaks_rows)
        c.executemany(self.stats_sql, stats_rows)
        c.executemany("INSERT INTO hists VALUES (?, ?, ?, ?)", hist_rows)
        write_events(c, events)


def write_events(c: sqlite3.Connection, events: list[EventMsg]) -> None:
    """Events as the writer writes them (trace.writer: the kind and phase as stored, the data as strict JSON)."""
    c.executemany(
        "INSERT INTO events (step, kind, site, phase, message, data) VALUES (?, ?, ?, ?, ?, ?)",
        [
            (
                int(m.step),
                EventKind(m.kind).value,
                m.site,
                Phase(m.phase).value if m.phase else None,
                m.message,
                _event_json(m.data) if m.data is not None else None,
            )
            for m in events
        ],
    )


def _nan_text(v: float):
    """The writer's encoding: SQLite stores a NaN REAL as NULL, so a NaN is written as the text 'nan'."""
    return "nan" if v != v else v


def generate(
    path: str,
    *,
    steps: int = 20_000,
    blocks: int = 19,
    every: int = 100,
    peak_every: int = 10,
    hist_every: int = 200,
    weight_every: int = 200,
    calibration: int = 10,
    val_every: int = 1000,
    init_scale: float = 65536.0,
    forward_fault: int | None = None,
    replay: bool = False,
    seed: int = 0,
) -> str:
    """Write a generated trace at ``path`` (which must not exist); returns the path. ``blocks`` transformer blocks
    make 11 * blocks + 5 modules and 52 * blocks + 22 sites (19 blocks: 214 modules, 1,010 sites).
    ``init_scale``: the GradScaler's start (2^24 makes the handful of early skips a dozen); ``forward_fault``: the
    first of 5 steps on which the last block's fc1 outputs Inf (a forward overflow: skipped steps, an Inf loss);
    ``replay``: the anomaly replay of attach() (its events, and the replayed steps observed in full), a loss spike and
    the overhead budget's cadence events."""
    args = dict(
        steps=steps,
        blocks=blocks,
        every=every,
        peak_every=peak_every,
        hist_every=hist_every,
        weight_every=weight_every,
        calibration=calibration,
        val_every=val_every,
        init_scale=init_scale,
        forward_fault=forward_fault,
        seed=seed,
    )
    if replay:  # (absent otherwise: files cached without it keep their arguments)
        args["replay"] = True
    rng = np.random.default_rng(seed)
    sites = Sites(blocks, rng)
    path = newfile.claim(path, False)
    conn = newfile.open_new(path)
    try:
        conn.execute("PRAGMA synchronous=OFF")  # a generated file: nothing to lose on a crash
        _write(conn, sites, rng, args)
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        conn.close()
    return path


def _write(conn: sqlite3.Connection, sites: Sites, rng: np.random.Generator, a: dict) -> None:
    n = a["steps"]
    t = np.arange(n, dtype=np.float64)
    frac = t / max(n - 1, 1)
    # the largest unscaled gradient: above 2^-4 while the model is fresh, then shrinking 3 binades over the run
    drift = -3.0 * frac + 3.0 * np.exp(-t / 50.0)
    log2_g = sites.grad_top + drift + rng.normal(0.0, 0.25, n)
    forward = np.zeros(n, bool)
    if a["forward_fault"] is not None:
        forward[a["forward_fault"] : a["forward_fault"] + CLEAN_RUN] = True
    scale, nxt, skipped = _scaler(log2_g, float(a["init_scale"]), forward)
    level, reason, hist = _levels(
        n, skipped, a["every"], a["peak_every"], a["hist_every"], a["calibration"], bool(a.get("replay"))
    )
    warm = min(2000, max(n // 10, 1))
    lr = np.where(t < warm, 3e-4 * (t + 1) / warm, 3e-5 + 0.5 * (3e-4 - 3e-5) * (1 + np.cos(np.pi * frac)))
    loss = np.exp(np.log(2.2) + (np.log(10.8) - np.log(2.2)) * np.exp(-t / max(n / 20, 50)) + rng.normal(0, 0.03, n))
    grad_norm = np.exp2(drift + 0.5 + rng.normal(0.0, 0.2, n))
    grad_max = np.exp2(log2_g - 1.0)  # the largest parameter gradient sits below the largest output gradient
    grad_norm[skipped], grad_max[skipped] = np.inf, np.inf
    loss[forward], grad_norm[forward], grad_max[forward] = np.inf, np.nan, np.nan
    observer = np.where(level >= schema.LEVEL_FULL, 0.025, np.where(level == schema.LEVEL_PEAK, 0.003, 0.0001))
    step_time = 0.25 * np.exp(rng.normal(0.0, 0.03, n)) + observer
    data_time = 0.004 * np.exp(rng.normal(0.0, 0.2, n))
    started = 1.7e9
    times = started + np.cumsum(step_time)
    culprit = sites.ids["act"][
        [r[1] == f"blocks.{a['blocks'] - 1}.mlp.fc1" for r in sites.rows[: len(sites.ids["act"])]]
    ]
    ctx = {
        "scale": scale,
        "skipped": skipped,
        "drift": drift,
        "log2_g": log2_g,
        "forward": forward,
        "culprit": int(culprit[0]),
    }
    meta = _meta(sites, a, started)
    c = conn
    c.execute("BEGIN")
    c.executemany("INSERT INTO meta (key, value) VALUES (?, ?)", [(k, json.dumps(v)) for k, v in meta.items()])
    c.executemany(
        "INSERT INTO sites (id, path, module, kind, module_type, dtype, shape, first_step) VALUES (?,?,?,?,?,?,?,?)",
        sites.rows,
    )
    w = _Writer(c, sites, rng)
    step_sql = f"INSERT INTO steps ({','.join(schema.STEP_FIELDS)}) VALUES ({','.join('?' * len(schema.STEP_FIELDS))})"
    packer = blocks.Packer()  # the step blocks the writer packs (trace.blocks)
    for lo in range(0, n, CHUNK):
        hi = min(n, lo + CHUNK)
        idx = np.arange(lo, hi)
        lr_text = [json.dumps([v]) for v in lr[lo:hi].tolist()]
        rows = zip(
            idx.tolist(),
            times[lo:hi].tolist(),
            step_time[lo:hi].tolist(),
            data_time[lo:hi].tolist(),
            [256] * (hi - lo),
            (256 / step_time[lo:hi]).tolist(),
            [_nan_text(v) for v in loss[lo:hi].tolist()],
            lr_text,
            scale[lo:hi].tolist(),
            nxt[lo:hi].tolist(),
            skipped[lo:hi].astype(int).tolist(),
            [_nan_text(v) for v in grad_norm[lo:hi].tolist()],
            [1] * (hi - lo),
            [40_000_000_000] * (hi - lo),
            level[lo:hi].tolist(),
            skipped[lo:hi].astype(int).tolist(),
            reason[lo:hi].tolist(),
            [_nan_text(v) for v in grad_max[lo:hi].tolist()],
            observer[lo:hi].tolist(),
        )
        c.executemany(step_sql, rows)
        columns = {
            "time": times[lo:hi],
            "step_time": step_time[lo:hi],
            "data_time": data_time[lo:hi],
            "samples": np.full(hi - lo, 256.0),
            "samples_per_s": 256 / step_time[lo:hi],
            "loss": loss[lo:hi],
            "loss_scale": scale[lo:hi],
            "loss_scale_next": nxt[lo:hi],
            "skipped": skipped[lo:hi],
            "grad_norm": grad_norm[lo:hi],
            "microbatches": np.ones(hi - lo),
            "peak_mem": np.full(hi - lo, 40e9),
            "level": level[lo:hi],
            "nonfinite": skipped[lo:hi],
            "grad_max": grad_max[lo:hi],
            "observer_time": observer[lo:hi],
            "lr": lr[lo:hi],
        }
        numbers = np.column_stack([np.asarray(columns[f], dtype=np.float64) for f in blocks.FIELDS])
        c.executemany(blocks.INSERT, packer.add_many(lo, numbers, reason[lo:hi].tolist()))
        w.step_sites(idx, level, hist, a["weight_every"], ctx)
        unknown = [int(s) for s in idx[skipped[lo:hi] & (level[lo:hi] == schema.LEVEL_SENTINEL)]]
        write_events(
            c,
            [
                EventMsg(
                    s,
                    EventKind.NONFINITE_UNKNOWN,
                    None,
                    None,
                    f"non-finite {'loss' if forward[s] else 'gradients'} on a step observed by the sentinel only: "
                    "origin unknown",
                    {"loss": float(loss[s]), "grad_norm": grad_norm[s], "grad_max": grad_max[s]},
                )
                for s in unknown
            ],
        )
        if a.get("replay"):
            write_events(c, _replay_events(idx[reason[lo:hi] == "replay"], grad_norm, loss))
        vals = idx[(idx % a["val_every"] == 0) & (idx > 0)]
        c.executemany(
            "INSERT INTO metrics (step, name, value, time) VALUES (?, 'val/loss', ?, ?)",
            [(int(s), float(loss[s] * 1.05 * np.exp(rng.normal(0, 0.01))), float(times[s])) for s in vals],
        )
        c.execute("COMMIT")
        c.execute("BEGIN")
    c.execute("INSERT INTO meta (key, value) VALUES ('closed', ?)", (json.dumps({"steps": n, "time": times[-1]}),))
    c.execute("COMMIT")


def _meta(sites: Sites, a: dict, started: float) -> dict:
    mods = model_modules(a["blocks"])
    n_params = sum(_numel(s) for _, _, _, _, ps in mods for _, s in ps)
    return {
        "run": {
            "ampdoctor": "0.1.0",
            "torch": "2.13.0",
            "python": "3.11.7",
            "host": "gpu-node-7",
            "pid": 4242,
            "rank": 0,
            "world_size": 1,
            "started": started,
            "model": "GPT",
            "device": "cuda",
            "params": n_params,
            "cpu_count": 32,
            "threads": 16,
            "mode": "default",
            "every": a["every"],
            "peak_every": a["peak_every"],
            "hist_every": a["hist_every"],
            "weight_every": a["weight_every"],
            "calibration": a["calibration"],
            "clean_run": CLEAN_RUN,
            "probe_every": None,
            "device_name": "NVIDIA A100-SXM4-80GB",
            "capability": [8, 0],
            "bf16_supported": True,
        },
        "config": {
            "autocast": {"device_type": "cuda", "enabled": True, "dtype": "float16"},
            "param_dtypes": {"float32": n_params},
            "module_param_dtypes": {path: "float32" for path, _, _, _, ps in mods if ps},
            "loss_dtype": "float32",
            "boundary": "scaler",
            "step_start": "forward",
            "optimizer": {
                "class": "AdamW",
                "groups": [{"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}],
            },
            "scaler": {
                "class": "GradScaler",
                "enabled": True,
                "init_scale": a["init_scale"],
                "growth_factor": 2.0,
                "backoff_factor": 0.5,
                "growth_interval": GROWTH_INTERVAL,
            },
        },
        "generator": {"name": "benchmarks/tracegen.py", "version": GENERATOR_VERSION, **a},
    }


def cached(directory: str, **kwargs) -> str:
    """A generated trace with these arguments in ``directory``: the one made before if it is there and complete
    (its ``generator`` entry matches), else a new one (an incomplete or stale one is replaced)."""
    os.makedirs(directory, exist_ok=True)
    defaults = generate.__kwdefaults__ or {}
    a = {**defaults, **kwargs}
    if not a.get("replay"):  # (a trace without the replay records no such argument: see generate)
        a.pop("replay", None)
    keys = ("steps", "blocks", "every", "hist_every", "seed")
    name = (
        f"gen-v{GENERATOR_VERSION}-"
        + ("replay-" if a.get("replay") else "")
        + "-".join(f"{k}{a[k]}" for k in keys)
        + ".db"
    )
    path = os.path.join(directory, name)
    if os.path.exists(path):
        try:
            c = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
            got = dict(c.execute("SELECT key, value FROM meta").fetchall())
            c.close()
            gen = json.loads(got.get("generator", "{}"))
            if "closed" in got and gen == {"name": "benchmarks/tracegen.py", "version": GENERATOR_VERSION, **a}:
                return path
        except sqlite3.Error:
            pass
        for suffix in ("", "-wal", "-shm"):
            if os.path.exists(path + suffix):
                os.remove(path + suffix)
    return generate(path, **kwargs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=20_000)
    ap.add_argument("--blocks", type=int, default=19)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    t0 = time.perf_counter()
    path = generate(args.out, steps=args.steps, blocks=args.blocks, seed=args.seed)
    print(f"{path}: {os.path.getsize(path) / 1e6:.1f} MB in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()


def sparse(path: str, *, steps: int = 10_000, sites: int = 10_000, rows: int = 2_000, seed: int = 0) -> str:
    """A small but valid trace that claims many steps and sites and holds little: ``steps`` sentinel steps (a
    few observed), ``sites`` act sites, ``rows`` statistics rows and histograms scattered one per (step, site) on a
    diagonal, a few peaks rows. What a reader must not turn into a [steps x sites] array (10^8 cells, 0.8 GB each)."""
    rng = np.random.default_rng(seed)
    path = newfile.claim(path, False)
    conn = newfile.open_new(path)
    try:
        c = conn
        c.execute("BEGIN")
        meta = {
            "run": {"model": "Wide", "device": "cuda", "mode": "default", "every": 100, "peak_every": 10},
            "config": {
                "autocast": {"enabled": True, "dtype": "float16", "device_type": "cuda"},
                "scaler": {
                    "class": "GradScaler",
                    "enabled": True,
                    "init_scale": 65536.0,
                    "growth_factor": 2.0,
                    "backoff_factor": 0.5,
                    "growth_interval": 2000,
                },
            },
        }
        c.executemany("INSERT INTO meta (key, value) VALUES (?, ?)", [(k, json.dumps(v)) for k, v in meta.items()])
        c.executemany(
            "INSERT INTO sites (id, path, module, kind, module_type, dtype, shape, first_step) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            [(i, f"m{i}", f"m{i}", "act", "Linear", "float16", "8x8", 0) for i in range(sites)],
        )
        level = np.full(steps, schema.LEVEL_SENTINEL)
        diag = np.linspace(0, steps - 1, rows).astype(int)
        level[diag] = schema.LEVEL_HIST
        c.executemany(
            "INSERT INTO steps (step, loss, loss_scale, loss_scale_next, skipped, level, nonfinite, reason) "
            "VALUES (?, ?, 65536.0, 65536.0, 0, ?, 0, ?)",
            [
                (t, float(2.0 + rng.random()), int(level[t]), "sampled" if level[t] >= 0 else "sentinel")
                for t in range(steps)
            ],
        )
        site = np.linspace(0, sites - 1, rows).astype(int)
        vals = [
            (int(t), int(s), 1.0, 1, 64.0, 0.0, 0.0, 0.0, 1.0, 0.01, 0.0, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
            for t, s in zip(diag, site)
        ]
        c.executemany(f"INSERT OR IGNORE INTO stats VALUES ({','.join('?' * 18)})", vals)
        counts = np.array([4, 20, 30, 10], dtype="<i8").tobytes()
        c.executemany(
            "INSERT OR IGNORE INTO hists VALUES (?, ?, -3, ?)", [(int(t), int(s), counts) for t, s in zip(diag, site)]
        )
        blob = np.full(sites, -1.0, dtype="<f4")
        blob[:: max(1, sites // 100)] = 1.5
        c.executemany("INSERT INTO peaks (step, data) VALUES (?, ?)", [(int(t), blob.tobytes()) for t in diag[:5]])
        c.execute("COMMIT")
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        conn.close()
    return path


def _replay_events(steps: np.ndarray, grad_norm: np.ndarray, loss: np.ndarray) -> list[EventMsg]:
    """What attach()'s anomaly replay writes for a skipped step that observed nothing (collect/anomaly.Replay's
    fields: the overflow reproduced, no operation from finite inputs: the scale's), one loss spike and the overhead
    budget's cadence change, at the first of these steps."""
    out = []
    for s in steps.tolist():
        data = {
            "step": s,
            "why": "skipped",
            "exact": True,
            "not_exact": [],
            "backward": True,
            "observed": True,
            "outputs_finite": True,
            "seeds_finite": True,
            "loss_made_it": False,
            "reproduced": True,
            "grad_norm": float(grad_norm[s]) if np.isfinite(grad_norm[s]) else float("inf"),
            "operation": None,
            "producers": [],
            "batch": {},
            "checks": [],
            "seconds": 0.05,
        }
        out.append(EventMsg(s, EventKind.REPLAY, None, None, f"step {s} replayed: the overflow reproduced", data))
    if len(steps):
        s = int(steps[0])
        spike = {"loss": float(loss[s]) * 8, "running_mean": float(loss[s])}
        out.append(EventMsg(s, EventKind.LOSS_SPIKE, None, None, "loss jumped far above its running mean", spike))
        change = {"every": 200, "peak_every": 20, "share": 0.031}
        out.append(EventMsg(s, EventKind.CADENCE, None, None, "the sampled tiers stretched to keep the budget", change))
    return out
