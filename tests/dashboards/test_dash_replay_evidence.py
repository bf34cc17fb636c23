"""The what-if page's replay evidence, read once per trace content: the diagnosis' pass over the peaks serves the
formats table, the rules' search and every scaler setting the page tries; kept on disk across restarts; a trace that
grows is read again. Real CPU training runs, real dashboard callbacks."""

import os
import threading
import time

import numpy as np
import pandas as pd
import pytest
import runs
from ampdoctor.dashboards import cache, data, diagjob
from ampdoctor.dashboards.app import create_app
from ampdoctor.dashboards.pages import whatif

import ampdoctor
from ampdoctor.lossscale import Evidence, evidence, gather, replay

SETTINGS = (("1024", "10", "2", "0.5"), ("65536", "100", "2", "0.5"), (None, None, None, None))


@pytest.fixture
def gathers(monkeypatch):
    """Every reading of a trace's evidence (lossscale.gather's pass over the peaks and histograms), counted."""
    calls = []
    real = evidence._gather

    def counted(view):
        calls.append(view.trace.path)
        return real(view)

    monkeypatch.setattr(evidence, "_gather", counted)
    return calls


def _replayed(ctx, run, init, interval, growth, backoff, timeout=25.0):
    """The what-if callback, called as the page's redraws call it, until the replay is drawn: its summary line."""
    search = f"?run={run}"
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        _, text, _, _ = whatif.update(ctx, init, interval, growth, backoff, {"run": run}, search)
        if str(text).startswith("simulated:"):
            return text
        assert str(text).startswith("replaying GradScaler"), text  # never blank meanwhile: the recorded scale
        time.sleep(0.1)
    raise AssertionError(f"no replay within {timeout} s")


def _replay_value(ctx, run, init, interval, growth, backoff):
    args, _ = whatif.settings(init, interval, growth, backoff)
    return args, ctx.jobs.peek((run, ("whatif", tuple(sorted(args.items()))))).value


def _same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], np.ndarray):
            assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k], equal_nan=a[k].dtype.kind == "f"), k
        else:
            assert a[k] == b[k], k


def test_the_evidence_round_trips_through_the_cache_bit_for_bit(traces, tmp_path, monkeypatch):
    monkeypatch.setenv("AMPDOCTOR_CACHE_DIR", str(tmp_path))
    tr = ampdoctor.load(str(traces / "fp16_bad.db"))
    ev = gather(tr)
    assert ev.hist and ev.rec_over.any()  # (histograms and overflowed steps: every part of the evidence is there)
    assert cache.save_evidence("evidence-test", ev)
    back = cache.load_evidence("evidence-test")
    _same(ev.to_arrays(), back.to_arrays())
    assert list(back.hist) == list(ev.hist) and back.run_settings == ev.run_settings
    assert type(back.run_settings["growth_interval"]) is int and isinstance(back, Evidence)
    for kw in ({}, {"init_scale": 1024.0, "growth_interval": 10}):
        a, b = replay(tr, **kw), replay(back, **kw)
        assert np.array_equal(a.scales, b.scales) and np.array_equal(a.skipped, b.skipped) and a.lost == b.lost
    assert cache.load_evidence("evidence-none") is None
    npz = tmp_path / f"views-{cache.FORMAT}" / "evidence-test.npz"
    npz.write_bytes(npz.read_bytes()[:1000])  # a file cut short (not written by cache.py, which renames a whole file)
    assert cache.load_evidence("evidence-test") is None  # as if none were kept: read from the trace again


def test_one_reading_serves_the_diagnosis_and_every_setting_and_a_restart(traces, tmp_path, monkeypatch, gathers):
    """The diagnosis (here in a thread: its reads are counted) reads the evidence with the formats table, hands it to
    the what-if page and its own search; three settings replay from it; a restarted server reads it from disk."""
    monkeypatch.setenv("AMPDOCTOR_CACHE_DIR", str(tmp_path))
    run = "fp16_bad.db"
    path = str(traces / run)
    ctx = create_app(path, diagnose_in="thread").ampdoctor
    for init, interval, growth, backoff in SETTINGS:
        _replayed(ctx, run, init, interval, growth, backoff)
    assert ctx.findings_and_error(run)[1] is None
    assert gathers == [path]  # one pass: the diagnosis' (its search included), then every setting from it
    for setting in SETTINGS:  # the very values a fresh replay of the file gives
        args, value = _replay_value(ctx, run, *setting)
        _same(value, data.whatif(ampdoctor.load(path), **args))
    del gathers[:]  # (the fresh replays above read the file themselves)
    again = create_app(path, diagnose_in="thread").ampdoctor  # a restart: findings and evidence from the disk
    _replayed(again, run, *SETTINGS[0])
    assert gathers == []
    _same(_replay_value(again, run, *SETTINGS[0])[1], _replay_value(ctx, run, *SETTINGS[0])[1])


def test_a_growing_trace_is_replayed_from_what_it_holds_now(tmp_path, monkeypatch):
    """Replayed while training writes it, then again when it has grown: the kept evidence of the shorter trace is
    not used; both answers are those of a fresh replay of the file as it held then."""
    monkeypatch.setenv("AMPDOCTOR_CACHE_DIR", str(tmp_path / "cache"))
    path = str(tmp_path / "live.db")
    seen = {}

    def midway(step, model, doc):
        if step != 14:
            return
        assert doc.flush()
        ctx = seen["ctx"] = create_app(path).ampdoctor  # the diagnosis in its own process: the server's reads count
        _replayed(ctx, "live.db", *SETTINGS[0])
        args, value = _replay_value(ctx, "live.db", *SETTINGS[0])
        seen["midway"] = value
        with ampdoctor.load(path) as tr:
            _same(value, data.whatif(tr, **args))

    runs.train(
        runs.mlp(),
        30,
        precision="fp16",
        init_scale=2.0**24,
        trace=path,
        attach_options={"every": 5, "hist_every": 5},
        on_step=midway,
    )
    ctx = seen["ctx"]
    assert 0 < len(seen["midway"]["steps"]) < 30
    _replayed(ctx, "live.db", *SETTINGS[0])
    args, value = _replay_value(ctx, "live.db", *SETTINGS[0])
    assert len(value["steps"]) == 30
    _same(value, data.whatif(ampdoctor.load(path), **args))
    with ampdoctor.load(path) as tr, tr.snapshot():  # what is kept now is the grown trace's
        assert len(ctx.replay_inputs("live.db", tr)[0].steps) == 30


@pytest.mark.skipif(not diagjob.PER_THREAD_PRIORITY, reason="per-thread priorities are Linux's")
def test_the_diagnosis_lowers_its_priority_for_the_rules_only(traces, tmp_path, monkeypatch):
    """The diagnosis process reads the trace (the formats table, the replay's evidence) at the server's priority and
    runs the rules below it, in a thread whose priority ends with it: the next diagnosis reads at full priority."""
    monkeypatch.setenv("AMPDOCTOR_CACHE_DIR", str(tmp_path))
    me = threading.get_native_id()
    seen = []

    def read():
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        diagjob._yield_cpu(thread=True)
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    parts = []
    for _ in range(2):
        out = diagjob._in_thread(lambda: diagjob.run({"trace": str(traces / "fp16_bad.db")}, parts.append, read))
        assert out["error"] is None and out["findings"]
    start = os.getpriority(os.PRIO_PROCESS, me)
    assert seen == [start, min(start + 10, 19)] * 2  # each diagnosis: read at the server's, the rules below
    # the table twice (its FP16 / BF16 columns first), the replay's evidence, the step summary
    table = ["formats", "formats_error"]
    assert [sorted(p) for p in parts] == [table, table, ["evidence"], ["summary"]] * 2
    assert data.fp8_pending(pd.DataFrame(parts[0]["formats"])) and not data.fp8_pending(
        pd.DataFrame(parts[1]["formats"])
    )


def test_the_formats_table_is_shown_while_the_rules_run(traces, tmp_path, monkeypatch):
    """The formats page waits for the table the diagnosis hands over before its rules, not for the rules: the first
    rule held here (10 s at most) until the page has its table, the rules are still running when it gets it (what the
    file gives, computed afresh)."""
    from ampdoctor.rules.engine import Run

    monkeypatch.setenv("AMPDOCTOR_CACHE_DIR", str(tmp_path))
    release = threading.Event()
    shown = Run.shown_findings

    def held(self, rule):
        release.wait(10)  # the first rule only (a wait for the whole diagnosis would see it end, and not running)
        release.set()
        return shown(self, rule)

    monkeypatch.setattr(Run, "shown_findings", held)
    path = str(traces / "fp16_bad.db")
    ctx = create_app(path, diagnose_in="thread").ampdoctor
    try:
        table, st, error = ctx.formats_table("fp16_bad.db", wait=25)
        while table is not None and data.fp8_pending(table) and st is not None and st.running:
            time.sleep(0.05)  # (the FP16 / BF16 columns came first)
            table, st, error = ctx.formats_table("fp16_bad.db")
        assert error is None and table is not None and st.running  # the rules have not run
        pd.testing.assert_frame_equal(table, data.format_table(ampdoctor.load(path)))
        assert ctx.evidence_coming("fp16_bad.db") is False  # (handed over with it)
    finally:
        release.set()
    assert ctx.findings_and_error("fp16_bad.db")[1] is None
    pd.testing.assert_frame_equal(ctx.formats_table("fp16_bad.db")[0], table)


def test_the_step_summary_comes_from_the_diagnosis_reading(traces, tmp_path, monkeypatch):
    """A long run's step summary (here: any run, SYNC_SUMMARY_STEPS at 0) is built by the diagnosis from the steps
    table it reads anyway, and the server does not read every step itself; the same buckets as read from the file."""
    from ampdoctor.dashboards import context, series

    monkeypatch.setenv("AMPDOCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(context, "SYNC_SUMMARY_STEPS", 0)
    reads = []
    update = series.StepSummary.update

    def counted(self, tr, limit=None):
        reads.append(tr.path)
        return update(self, tr, limit)

    monkeypatch.setattr(series.StepSummary, "update", counted)
    path = str(traces / "fp16_bad.db")
    ctx = create_app(path, diagnose_in="thread").ampdoctor
    n = ctx.n_steps("fp16_bad.db")
    t0 = time.monotonic()
    while (ctx.summary("fp16_bad.db")[0].n_buckets * series.BUCKET < n // series.BUCKET * series.BUCKET) and (
        time.monotonic() - t0 < 25
    ):
        time.sleep(0.05)
    sm = ctx.summary("fp16_bad.db")[0]
    assert sm.n_buckets == n // series.BUCKET > 0 and reads == []  # the server read no step row for it
    fresh = series.StepSummary()
    fresh.update(ampdoctor.load(path))
    _same(sm.to_arrays(), fresh.to_arrays())
