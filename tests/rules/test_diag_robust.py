"""A rule never takes the diagnosis down: out-of-range settings in a trace give findings or silence, never a
traceback, and a rule that raises anyway is reported in its place while the others run (issue 21 item 5)."""

import json
import shutil
import sqlite3

import pytest

import ampdoctor
from ampdoctor.rules import registry
from ampdoctor.rules.result import Rule, finding

BAD_SETTINGS = [
    {"growth_interval": 0},
    {"growth_interval": float("inf")},
    {"growth_interval": float("nan")},
    {"growth_interval": 1e300},
    {"growth_factor": 0.5},
    {"backoff_factor": 2.0},
    {"backoff_factor": float("nan")},
    {"init_scale": float("inf")},
    {"init_scale": -1.0},
    {"init_scale": None, "growth_factor": None},
]


def _with_scaler(src: str, dst, settings: dict) -> str:
    path = str(dst)
    shutil.copy(src, path)
    con = sqlite3.connect(path)
    (raw,) = con.execute("SELECT value FROM meta WHERE key = 'config'").fetchone()
    cfg = json.loads(raw)
    cfg["scaler"].update(settings)
    con.execute("UPDATE meta SET value = ? WHERE key = 'config'", (json.dumps(cfg),))  # NaN/Infinity as Python writes
    con.commit()
    con.close()
    return path


@pytest.mark.parametrize("settings", BAD_SETTINGS, ids=[json.dumps(s) for s in BAD_SETTINGS])
def test_out_of_range_scaler_settings_never_raise(traces, tmp_path, settings):
    for name in ("init", "healthy"):
        path = _with_scaler(traces[name], tmp_path / f"{name}.db", settings)
        found = ampdoctor.diagnose(path)  # no traceback from any rule
        errors = [d for d in found if "rule_error" in d.evidence]
        assert errors == [], [(d.rule, d.evidence["rule_error"]) for d in errors]


def test_a_rule_that_raises_is_reported_and_the_others_run(traces, monkeypatch):
    def broken(run):
        raise ZeroDivisionError("boom")

    def fine(run):
        return finding("warning", "w", "s", evidence={"x": 1})

    fake = {
        "broken": Rule("broken", broken, ""),
        "fine": Rule("fine", fine, ""),
    }
    monkeypatch.setattr(registry, "RULES", fake)
    found = ampdoctor.diagnose(traces["healthy"])
    assert [(d.rule, d.severity) for d in found] == [("fine", "warning"), ("broken", "info")]
    notice = found[1]
    assert notice.evidence["rule_error"] == "ZeroDivisionError: boom" and "could not judge" in notice.title
    # a rule that raised suppresses nothing (it found nothing) and is hidden like any rule when disabled
    assert [d.rule for d in ampdoctor.diagnose(traces["healthy"], rules={"broken": None})] == ["fine"]


def test_a_raising_suppressor_does_not_hide_or_break(traces, monkeypatch):
    """A rule suppressed by a rule that raises is shown: the raising rule found nothing."""
    from ampdoctor.rules.result import suppressed_by

    def broken(run):
        raise RuntimeError("no")

    def shown(run):
        return finding("warning", "w", "s", evidence={"x": 1})

    fake = {
        "broken": Rule("broken", broken, ""),
        "shown": Rule("shown", shown, "", suppressed_by=suppressed_by("broken")),
    }
    monkeypatch.setattr(registry, "RULES", fake)
    assert [d.rule for d in ampdoctor.diagnose(traces["healthy"])] == ["shown", "broken"]
