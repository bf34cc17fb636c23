"""The writer thread's steps rows: every field stored as the trace format says, however the steps were batched."""

import json
import math
import shutil
import sqlite3

import numpy as np
import pytest

import ampdoctor
from ampdoctor.trace import blocks, schema
from ampdoctor.trace.messages import StepPacket
from ampdoctor.trace.writer import Writer

INTEGERS = {"step", "samples", "skipped", "microbatches", "peak_mem", "level", "nonfinite"}  # (the schema's types)
TEXTS = {"lr", "reason"}


def packet(step: int, rng: np.random.Generator) -> StepPacket:
    """A sentinel step as the training side sends it, with the values that need care now and then: a NaN or a
    missing loss, an infinite gradient norm, numpy's bool for a verdict, learning rates that change or are absent,
    fields a tool's row leaves out, no samples, a zero step time."""
    row = {
        "time": 1.7e9 + step * 0.01,
        "step_time": 0.01 + step * 1e-6,
        "data_time": None if step % 3 else 0.001,
        "samples": 64,
        "lr": [1e-3 / (1 + step // 50), 5e-4],
        "microbatches": 1,
        "peak_mem": None,
        "level": schema.LEVEL_SENTINEL,
        "reason": "sentinel" if step % 7 else None,
        "grad_max": 0.5 + step,
        "observer_time": 1e-4,
    }
    loss, grad_norm, skipped, nonfinite = 1.0 / (1 + step), 2.0 + step, False, False
    r = rng.random()
    if r < 0.04:
        loss = math.nan
        nonfinite = True
    elif r < 0.08:
        loss = None
    elif r < 0.12:
        grad_norm, skipped, nonfinite = math.inf, True, np.bool_(True)
    elif r < 0.16:
        row["lr"] = None
    elif r < 0.2:
        del row["reason"], row["observer_time"]
    elif r < 0.24:
        row["samples"] = 0
    elif r < 0.28:
        row["step_time"] = 0.0
    elif r < 0.32:
        row["grad_max"] = math.nan
        nonfinite = True
    return StepPacket(
        step=step,
        row=row,
        values=np.zeros(0),
        bases={},
        entries=[],
        loss=loss,
        scale=65536.0,
        scale_next=32768.0 if skipped else 65536.0,
        grad_norm=grad_norm,
        skipped=skipped,
        nonfinite=nonfinite,
        store_hist=False,
    )


def stored(field: str, v: object) -> tuple[str, object]:
    """What the steps table holds for a value (docs/trace-format.md): NULL for none, the text 'nan' for a NaN
    (SQLite would store a NaN REAL as NULL: "no value"), integers and reals by the column's type, the learning
    rates as a JSON list."""
    if v is None:
        return "null", None
    if field == "lr":
        return "text", json.dumps(v)
    if field in TEXTS:
        return "text", v
    if isinstance(v, float) and math.isnan(v):
        return "text", "nan"
    if field in INTEGERS:
        return "integer", int(v)  # type: ignore[call-overload]
    return "real", float(v)  # type: ignore[arg-type]


@pytest.mark.parametrize("pace", ["batched", "one by one"])
def test_every_step_field_is_stored_as_the_format_says(tmp_path, pace):
    """Steps reach the writer in batches (a fast loop) or one at a time (flush after each); the rows are the same,
    field by field, and the step blocks read as the rows (4,100 steps: a whole block and the steps after it)."""
    rng = np.random.default_rng(0)
    packets = [packet(i, rng) for i in range(blocks.SIZE + 4)]
    # the rows as sent (the writer fills the packet's own fields into the row it stores)
    want = []
    for p in packets:
        row = {f: p.row.get(f) for f in schema.STEP_FIELDS}
        samples, step_time = row["samples"], row["step_time"]
        row.update(
            step=p.step,
            loss=p.loss,
            loss_scale=p.scale,
            loss_scale_next=p.scale_next,
            skipped=p.skipped,
            grad_norm=p.grad_norm,
            nonfinite=p.nonfinite,
            samples_per_s=samples / step_time if samples and step_time else None,
        )
        want.append([stored(f, row[f]) for f in schema.STEP_FIELDS])
    path = str(tmp_path / "t.db")
    w = Writer(path)
    w.start()
    for i, p in enumerate(packets):
        w.put(p)
        if pace == "one by one" and i < 300:
            assert w.sync(timeout=30)
    w.close()
    assert w.error is None
    with sqlite3.connect(path) as c:
        cols = ", ".join(f"typeof({f}), {f}" for f in schema.STEP_FIELDS)
        got = [list(zip(r[::2], r[1::2])) for r in c.execute(f"SELECT {cols} FROM steps ORDER BY step")]
        n_blocks = c.execute("SELECT count(*) FROM step_blocks").fetchone()[0]
    assert len(got) == len(want)
    for step, (g, e) in enumerate(zip(got, want)):
        assert g == e, (step, [(f, a, b) for f, a, b in zip(schema.STEP_FIELDS, g, e) if a != b])
    # unknown-origin events for the non-finite sentinel steps, in step order
    events = ampdoctor.load(path).events()
    bad = [p.step for p in packets if p.nonfinite]
    assert events.loc[events["kind"] == "nonfinite_unknown", "step"].tolist() == bad

    assert n_blocks == 1
    rows_only = str(tmp_path / "rows.db")
    shutil.copy(path, rows_only)
    with sqlite3.connect(rows_only) as c:
        c.execute("DROP TABLE step_blocks")
    pd_testing = pytest.importorskip("pandas.testing")
    pd_testing.assert_frame_equal(
        ampdoctor.load(path).steps(lr_groups=False), ampdoctor.load(rows_only).steps(lr_groups=False), check_exact=True
    )
