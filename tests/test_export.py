"""Exporters from a plain loop (``attach(export=...)``) and after the fact (``ampdoctor export``): what the files
hold is read back (tensorboard's EventAccumulator, csv, pyarrow) and compared with the trace, step by step; the
cadence; a trace read as it grows; bad input and a missing package as one line, exit 2."""

import csv
import math
import os
import subprocess
import sys

import pyarrow.parquet as pq
import pytest
import torch
from runs import mlp, train

import ampdoctor
from ampdoctor.cli import main
from ampdoctor.export import CSV, StepRows, TensorBoard

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "integrations"))
from readback import tb_scalars, tb_texts, tensorboard

STEPS = 24


@pytest.fixture(scope="module")
def overflow_run(tmp_path_factory):
    """An FP16 run whose scaler starts far too high (skipped steps), exported live to TensorBoard (every 5th step)
    and CSV (every step) from the plain loop."""
    tmp = tmp_path_factory.mktemp("export")
    trace = str(tmp / "run.db")
    export = [TensorBoard(str(tmp / "tb"), every=5), "csv:" + str(tmp / "csv")]
    train(mlp(width=32), steps=STEPS, init_scale=2.0**30, trace=trace, attach_options={"export": export, "live": False})
    return tmp, trace


def trace_rows(trace):
    return ampdoctor.load(trace).steps()


def same(a, b):
    return (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-6)


def test_plain_loop_export_to_tensorboard_at_the_cadence_and_every_anomalous_step(overflow_run):
    tmp, trace = overflow_run
    st = trace_rows(trace)
    acc = tensorboard(str(tmp / "tb"))
    scale = tb_scalars(acc, "ampdoctor/loss_scale")
    skipped = set(st["step"][st["skipped"]].astype(int))
    assert len(skipped) >= 5
    assert sorted(scale) == sorted({s for s in range(STEPS) if s % 5 == 0} | skipped)
    assert all(scale[s] == st["loss_scale"][s] for s in scale)
    assert tb_scalars(acc, "ampdoctor/skipped_total") == {s: float(st["skipped"][: s + 1].sum()) for s in scale}
    # wall time of each point is the step's own time in the trace
    assert [e.wall_time for e in acc.Scalars("ampdoctor/loss_scale")] == pytest.approx(
        [st["time"][s] for s in sorted(scale)]
    )
    (text,) = [t for _, t in tb_texts(acc, "ampdoctor/findings") if "init-scale-too-high" in t]
    assert "torch.amp.GradScaler(" in text  # the fix, as code


def test_plain_loop_export_to_csv_holds_every_step_as_the_trace(overflow_run):
    tmp, trace = overflow_run
    st = trace_rows(trace)
    rows = list(csv.DictReader(open(tmp / "csv" / "steps.csv")))
    assert [int(r["step"]) for r in rows] == list(range(STEPS))
    for r in rows:
        s = int(r["step"])
        for col, name in (("loss", "loss"), ("loss_scale", "loss_scale"), ("grad_norm", "grad_norm")):
            assert same(float(r[name]), float(st[col][s]))
        assert int(r["skipped"]) == int(st["skipped"][s])
    cost = float(rows[-1]["cost"])
    assert cost == pytest.approx(st["observer_time"].sum() / st["step_time"].sum(), rel=1e-9)
    found = list(csv.DictReader(open(tmp / "csv" / "findings.csv")))
    assert "init-scale-too-high" in [f["rule"] for f in found]


def test_export_command_writes_what_the_live_export_wrote(overflow_run, tmp_path, capsys):
    _, trace = overflow_run
    assert main(["export", trace, "--to", "parquet", "--out", str(tmp_path / "pq")]) == 0
    assert main(["export", trace, "--to", "csv", "--out", str(tmp_path / "c")]) == 0
    assert main(["export", trace, "--to", "tensorboard", "--out", str(tmp_path / "tb"), "--every", "1"]) == 0
    table = pq.read_table(tmp_path / "pq" / "steps.parquet").to_pandas()
    st = trace_rows(trace)
    assert table["step"].tolist() == list(range(STEPS))
    assert table["loss_scale"].tolist() == st["loss_scale"].tolist()
    assert table["skipped_total"].tolist() == st["skipped"].cumsum().tolist()
    assert "init-scale-too-high" in pq.read_table(tmp_path / "pq" / "findings.parquet").to_pandas()["rule"].tolist()
    assert open(tmp_path / "c" / "steps.csv").read() == open(overflow_run[0] / "csv" / "steps.csv").read()
    assert sorted(tb_scalars(tensorboard(str(tmp_path / "tb")), "ampdoctor/loss")) == list(range(STEPS))
    assert "24 step(s) and their findings written to" in capsys.readouterr().out


def test_export_command_never_overwrites_and_bad_input_is_one_line(overflow_run, tmp_path):
    _, trace = overflow_run
    out = str(tmp_path / "x")
    assert main(["export", trace, "--to", "csv", "--out", out]) == 0
    before = open(os.path.join(out, "steps.csv")).read()
    for argv in (
        ["export", trace, "--to", "csv", "--out", out],  # exists
        ["export", str(tmp_path / "missing.db"), "--to", "csv"],
        ["export", trace, "--to", "excel"],
        ["export", trace, "--to", "csv", "--every", "0"],
    ):
        r = subprocess.run([sys.executable, "-m", "ampdoctor", *argv], capture_output=True, text=True)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, (argv, r.stderr)
    assert open(os.path.join(out, "steps.csv")).read() == before


def test_export_without_pyarrow_is_one_line_naming_the_extra(overflow_run, tmp_path):
    code = (
        "import sys; sys.modules['pyarrow'] = None; from ampdoctor.cli import main; "
        f"sys.exit(main(['export', {overflow_run[1]!r}, '--to', 'parquet', '--out', {str(tmp_path)!r}]))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 2
    assert (
        r.stderr.strip()
        == 'ampdoctor export: exporting to parquet needs the pyarrow package: pip install "ampdoctor[parquet]"'
    )


def test_attach_export_errors_are_raised_before_training(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"Argument export should be 'tensorboard\[:DIR\]'.* but given 'tensorbord'"):
        ampdoctor.attach(mlp(), trace=str(tmp_path / "a.db"), export="tensorbord")
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(
        Exception, match=r'exporting to wandb needs the wandb package: pip install "ampdoctor\[wandb\]"'
    ):
        ampdoctor.attach(mlp(), trace=str(tmp_path / "b.db"), export="wandb")
    assert not os.path.exists(tmp_path / "a.db") and not os.path.exists(tmp_path / "b.db")  # nothing left behind


def test_rows_are_read_as_the_trace_grows_only_the_new_ones(tmp_path):
    """The live path: each read returns the steps committed since the last one, never one twice; NaN losses are
    exported as NaN, a figure the run did not record (no scaler: no loss scale) is absent."""
    model = mlp(width=16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    trace = str(tmp_path / "grow.db")
    with ampdoctor.attach(model, optimizer=opt, trace=trace, live=False) as doc:
        rows = None
        seen = []
        for i in range(12):
            x = torch.randn(8, 32)
            loss = model(x).pow(2).mean() * (float("nan") if i == 7 else 1.0)
            opt.zero_grad()
            loss.backward()
            opt.step()
            doc.log_loss(loss)
            if i in (4, 9):
                assert doc.flush()
                rows = rows or StepRows(trace)
                seen.append([p.step for p in rows.read()])
                assert rows.read() == []
    seen.append([p.step for p in rows.read()])
    assert seen == [[0, 1, 2, 3], [4, 5, 6, 7, 8], [9, 10, 11]]
    rows.close()
    again = StepRows(trace, page=5)
    pages = list(again.read_all())
    assert [len(p) for p in pages] == [5, 5, 2]
    points = [p for page in pages for p in page]
    assert math.isnan(points[7].values["loss"]) and points[7].anomalous
    assert "loss_scale" not in points[0].values and points[0].values["loss"] == pytest.approx(
        trace_rows(trace)["loss"][0]
    )


def test_csv_sink_refuses_an_existing_file(tmp_path):
    (tmp_path / "steps.csv").write_text("mine")
    with pytest.raises(Exception, match="steps.csv exists; nothing was written"):
        CSV(str(tmp_path))
    assert (tmp_path / "steps.csv").read_text() == "mine"
