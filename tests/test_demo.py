"""make demo's cycle: a fault on scikit-learn's digits is diagnosed, the printed fix is applied, the rerun is healthy;
and the progress bars (tqdm) show on a terminal. The init-scale fault runs through main() (what make demo prints)."""

import fcntl
import importlib.util
import os
import pty
import re
import struct
import sys
import termios
import threading

import pytest
import torch
from runs import mlp, train

import ampdoctor
from ampdoctor import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location("ampdoctor_demo", os.path.join(ROOT, "examples", "demo.py"))
demo = sys.modules["ampdoctor_demo"] = importlib.util.module_from_spec(spec)  # dataclasses look it up there
spec.loader.exec_module(demo)

pytestmark = pytest.mark.slow
STEPS = 60


@pytest.fixture(autouse=True)
def one_thread():
    """Matrices this small gain nothing from intra-op threads; on a loaded 2-core machine they cost ~10x."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _serious(findings):
    return [(d.rule, d.summary) for d in findings if d.severity != "info"]


def test_demo_end_to_end_init_scale(tmp_path, capsys):
    out = str(tmp_path / "demo.db")
    assert demo.main(["--fault", "init-scale", "--steps", str(STEPS), "--out", out]) == 0
    text = capsys.readouterr().out
    fixed = str(tmp_path / "demo-fixed.db")
    # the diagnosis as the user sees it, with the fix; the fix applied is the printed GradScaler line
    assert "[WARNING] init-scale-too-high: Initial loss scale too high" in text
    printed = re.search(r'^    (scaler = torch\.amp\.GradScaler\("cpu", init_scale=[^)]*\))$', text, re.M).group(1)
    assert f"applying the fix printed for init-scale-too-high:\n    {printed}\n" in text
    finding = next(d for d in ampdoctor.diagnose(out) if d.rule == "init-scale-too-high")
    recorded = ampdoctor.load(fixed).steps()
    assert recorded["loss_scale"].iloc[0] == finding.evidence["suggested_init_scale"] < 2**30
    assert recorded["skipped"].sum() < ampdoctor.load(out).steps()["skipped"].sum()
    assert f"{fixed}: no findings" in text and "the fixed run is healthy" in text
    assert "suggested  init_scale" in text  # replay --suggest ran on the faulty trace
    report = str(tmp_path / "demo.html")
    assert open(report).read().startswith("<!DOCTYPE html>") and f"wrote {report}" in text
    # the last word: one command that opens the dashboard on both traces, and serve accepts it as printed
    line = re.search(r"^dashboard: (.+)$", text, re.M).group(1)
    assert line.split()[1:] == ["serve", out, "--reference", fixed]
    args = cli.build_parser().parse_args(line.split()[1:])
    assert (args.path, args.reference) == ([out], fixed)  # serve takes one or more paths


@pytest.mark.parametrize("fault", ["overflow", "no-scaler", "half-weights"])
def test_demo_fault_is_diagnosed_and_the_printed_fix_heals_it(fault, tmp_path, capsys):
    r = demo.cycle(fault, str(tmp_path / f"{fault}.db"), STEPS, show=False)
    assert r["finding"].rule == demo.FAULTS[fault].rule
    assert r["finding"].severity in ("warning", "critical")
    assert r["setup"].applied and all(ln in r["finding"].recommendation.splitlines() for ln in r["setup"].applied)
    assert _serious(r["after"]) == []
    fixed = ampdoctor.load(r["fixed"])
    cfg = fixed.config
    assert cfg["scaler"]["enabled"] and cfg["autocast"]["dtype"] == "float16"
    if fault == "overflow":  # the module named runs in FP32, the others in FP16
        acts = fixed.sites("act").set_index("path")["dtype"]
        assert r["finding"].layers[0] == "4" and acts["4"] == "float32" and acts["2"] == "float16"
        assert r["acc"][1] > r["acc"][0] + 0.5  # the faulty run never trains (every step NaN)
    if fault == "half-weights":  # FP32 weights under FP16 autocast
        assert set(cfg["param_dtypes"]) == {"float32"}


def test_progress_bars_show_on_a_terminal(tmp_path, monkeypatch):
    """Training, replay --suggest and report draw tqdm bars on a terminal's stderr (and nothing in a pipe)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # a new pty is 0 columns wide
    seen = []
    reader = threading.Thread(target=_drain, args=(master, seen), daemon=True)
    reader.start()
    tty = os.fdopen(slave, "w", buffering=1)
    monkeypatch.setattr(sys, "stderr", tty)
    trace = str(tmp_path / "t.db")
    train(mlp(width=32), 20, init_scale=2.0**30, trace=trace, attach_options={"every": 5})
    setup = demo.build(demo.FAULTS["init-scale"])
    demo.train(setup, str(tmp_path / "d.db"), 5, "demo-train")
    assert cli.main(["replay", trace, "--suggest"]) == 0
    assert cli.main(["report", trace, "-o", str(tmp_path / "r.html")]) == 0
    tty.close()
    reader.join(timeout=10)
    text = b"".join(seen).decode(errors="replace")
    assert re.search(r"demo-train: 100%\|.*\| 5/5", text)
    assert re.search(r"replaying scaler settings: +\d+%\|", text)
    assert re.search(r"report: +\d+%\|", text)


def _drain(fd, out):
    while True:
        try:
            chunk = os.read(fd, 4096)
        except OSError:
            return
        if not chunk:
            return
        out.append(chunk)
