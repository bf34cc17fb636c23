"""The notebooks in notebooks/ run top to bottom on a real trace (Cockpit-style: examples are executed)."""

import os

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = os.path.dirname(os.path.dirname(__file__))


@pytest.fixture(scope="module")
def faulty_trace(tmp_path_factory):
    from runs import mlp, train

    path = str(tmp_path_factory.mktemp("nb") / "faulty.db")
    train(mlp(width=64), 40, init_scale=2.0**30, trace=path, attach_options={"every": 10, "hist_every": 10})
    return path


def execute(name):
    """Run notebooks/NAME top to bottom; (the notebook with its outputs, all text output joined)."""
    nb = nbformat.read(os.path.join(ROOT, "notebooks", name), as_version=4)
    NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": os.path.join(ROOT, "notebooks")}}
    ).execute()
    text = "\n".join(
        o.get("text", "") or str(o.get("data", {}).get("text/plain", ""))
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.get("outputs", [])
    )
    return nb, text


def test_trace_analysis_notebook_runs(faulty_trace, monkeypatch):
    monkeypatch.setenv("AMPDOCTOR_TRACE", faulty_trace)
    nb, text = execute("trace_analysis.ipynb")
    assert "40 steps" in text and "skipped" in text
    assert "init-scale-too-high" in text
    assert "loss scale" in text and "flushed %" in text
    assert any(
        "application/vnd.plotly.v1+json" in o.get("data", {})
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.get("outputs", [])
    )


def test_fp16_readiness_notebook_runs(tmp_path, monkeypatch):
    """A real FP32 run recorded in the notebook; its FP16 verdict agrees with a real FP16 forward of the model."""
    monkeypatch.setenv("AMPDOCTOR_NB_DIR", str(tmp_path))
    nb, text = execute("fp16_readiness.ipynb")
    assert "40 steps recorded in" in text and (tmp_path / "fp16_readiness.db").exists()
    assert "[info] fp16-readiness: In FP16 this run would not train as is" in text
    assert 'handle = ampdoctor.keep_fp32(model, "0"' in text and "scaler = torch.amp.GradScaler(" in text
    assert "binades below FP16 max" in text and "underflow % / overflow %" in text
    assert "first module with NaN/Inf: 0 | named first by fp16-readiness: 0" in text
    assert any(
        "application/vnd.plotly.v1+json" in o.get("data", {})
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.get("outputs", [])
    )


def test_precision_budget_notebook_runs(tmp_path, monkeypatch):
    import probe_models as M

    path = str(tmp_path / "fragile.db")
    M.train(
        M.standardize_model(),
        M.tabular(20),
        20,
        path,
        attach_options={"probe_every": 5, "every": 5, "hist_every": 5, "live": False},
    )
    monkeypatch.setenv("AMPDOCTOR_TRACE", path)
    nb, text = execute("precision_budget.ipynb")
    assert "probed steps: [0, 5, 10, 15]" in text
    assert "FastStandardize" in text and "<- precision loss" in text
    assert "e4m3_lost" in text and "history  1024: margin 0" in text
    assert "WARNING precision-loss ['0']" in text and 'keep_fp32(model, "0")' in text
    assert (
        sum(
            "application/vnd.plotly.v1+json" in o.get("data", {})
            for c in nb.cells
            if c.cell_type == "code"
            for o in c.get("outputs", [])
        )
        == 2
    )
