"""The trace file: one SQLite database per rank. Tables, version and the error every reader raises.

Documented for people in docs/trace-format.md; keep the two in step.
"""

from __future__ import annotations

import sqlite3

VERSION = 1  # PRAGMA user_version; bump on any incompatible change
APPLICATION_ID = 0x414D5044  # PRAGMA application_id, "AMPD": tells a trace from any other SQLite file

STATS_FIELDS = (
    "numel",
    "nan",
    "inf",
    "zeros",
    "absmax",
    "minabs",
    "mean",
    "rms",
    "fp16_over",
    "fp16_sub",
    "fp16_flush",
    "bf16_over",
    "bf16_sub",
    "bf16_flush",
)
STEP_FIELDS = (
    "step",
    "time",
    "step_time",
    "data_time",
    "samples",
    "samples_per_s",
    "loss",
    "lr",
    "loss_scale",
    "loss_scale_next",
    "skipped",
    "grad_norm",
    "microbatches",
    "peak_mem",
    "level",
    "nonfinite",
    "reason",
    "grad_max",
    "observer_time",
)
# the numeric step columns (not the step, the learning rates' JSON text, the reason's text)
STEP_NUMBERS = tuple(f for f in STEP_FIELDS if f not in ("step", "lr", "reason"))
# Columns added after the first traces were written (same format version: a reader gives them as missing there).
LATER_STEP_FIELDS = ("reason", "grad_max", "observer_time")
PROBE_FIELDS = ("rel_err", "max_err", "ref_norm", "ref_absmax")  # probes table (added in 0.1; absent before)
OPTIONAL_TABLES = ("probes", "step_blocks")  # added after the first traces were written: traces without them read
KINDS = ("act", "grad_out", "param_grad", "weight", "update")
ROOT = "(model)"  # how the root module is named in site paths


def observed_ancestor(path: str, paths: set[str]) -> str:
    """The module itself when among the observed ``paths``, else its nearest observed ancestor (the root at worst)."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in paths:
            return ".".join(parts[:i])
    return ROOT


# the binades a histogram row can hold: e = -127 also takes every non-zero |x| < 2^-126 (FP32 subnormals), 127 is
# FP32's largest binade; column j of a histogram is binade HIST_LO + j
HIST_LO, HIST_HI = -127, 127

# level of a step: what was recorded of its sites (the sentinel's step figures are recorded at every level)
LEVEL_SENTINEL, LEVEL_PEAK, LEVEL_FULL, LEVEL_HIST = -1, 0, 1, 2

DDL = f"""
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE sites (
    id INTEGER PRIMARY KEY, path TEXT NOT NULL, module TEXT NOT NULL, kind TEXT NOT NULL,
    module_type TEXT, dtype TEXT, shape TEXT, first_step INTEGER, UNIQUE (path, kind));
CREATE TABLE steps (
    step INTEGER PRIMARY KEY, time REAL, step_time REAL, data_time REAL, samples INTEGER, samples_per_s REAL,
    loss REAL, lr TEXT, loss_scale REAL, loss_scale_next REAL, skipped INTEGER, grad_norm REAL,
    microbatches INTEGER, peak_mem INTEGER, level INTEGER, nonfinite INTEGER, reason TEXT, grad_max REAL,
    observer_time REAL);
CREATE TABLE step_blocks (first INTEGER PRIMARY KEY, n INTEGER NOT NULL, fields TEXT NOT NULL, data BLOB NOT NULL,
    reasons TEXT);
CREATE TABLE peaks (step INTEGER PRIMARY KEY, data BLOB NOT NULL);
CREATE TABLE stats (
    step INTEGER NOT NULL, site INTEGER NOT NULL, scale REAL, calls INTEGER,
    {", ".join(f + " REAL" for f in STATS_FIELDS)},
    PRIMARY KEY (step, site)) WITHOUT ROWID;
CREATE TABLE hists (step INTEGER NOT NULL, site INTEGER NOT NULL, lo INTEGER NOT NULL, counts BLOB NOT NULL,
    PRIMARY KEY (step, site)) WITHOUT ROWID;
CREATE TABLE events (
    id INTEGER PRIMARY KEY, step INTEGER, kind TEXT NOT NULL, site INTEGER, phase TEXT, message TEXT, data TEXT);
CREATE TABLE metrics (step INTEGER, name TEXT NOT NULL, value REAL, time REAL);
CREATE TABLE probes (
    step INTEGER NOT NULL, site INTEGER NOT NULL, calls INTEGER, k INTEGER, numel INTEGER, dtype TEXT,
    {", ".join(f + " REAL" for f in PROBE_FIELDS)}, PRIMARY KEY (step, site)) WITHOUT ROWID;
CREATE INDEX metrics_name ON metrics (name, step);
CREATE INDEX events_step ON events (step);
"""


class TraceError(Exception):
    """A trace file that cannot be read; the message is one line saying what is wrong."""


def create(conn: sqlite3.Connection) -> None:
    """Lay out a new trace (autocommit connection)."""
    mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
    if mode.lower() != "wal":
        raise sqlite3.OperationalError(f"the file system does not support WAL mode (got {mode})")
    conn.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: durable against a killed process
    conn.executescript(
        "BEGIN;" + DDL + f"PRAGMA application_id={APPLICATION_ID};PRAGMA user_version={VERSION}; COMMIT;"
    )
