"""``ampdoctor diagnose``: report, --json, --fail-on, --disable, exit codes 0 / 1 / 2."""

import json

import pytest

from ampdoctor.cli import main


def test_report_and_exit_1_on_a_warning(traces, capsys):
    assert main(["diagnose", traces["init"]]) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"{traces['init']}: 1 warning\n")
    assert "[WARNING] init-scale-too-high: Initial loss scale too high" in out
    assert "  fix:\n" in out and 'torch.amp.GradScaler("cpu", init_scale=' in out


def test_healthy_exit_0(traces, capsys):
    assert main(["diagnose", traces["healthy"]]) == 0
    assert "no findings" in capsys.readouterr().out


@pytest.mark.parametrize("fail_on, code", [("info", 1), ("warning", 1), ("critical", 0)])
def test_fail_on(traces, fail_on, code, capsys):
    assert main(["diagnose", traces["inactive"], "--fail-on", fail_on]) == code


def test_json(traces, capsys):
    assert main(["diagnose", traces["inactive"], "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert [d["rule"] for d in data] == ["amp-inactive"]
    assert set(data[0]) == {
        "rule",
        "severity",
        "title",
        "summary",
        "layers",
        "steps",
        "evidence",
        "recommendation",
        "ranks",
        "fix",
    }
    assert data[0]["ranks"] == []  # one trace: no ranks to name
    fix = data[0]["fix"]  # the fix as parts: prose, then code that runs as printed
    assert [p["kind"] for p in fix][:2] == ["text", "code"] and "\n".join(p["text"] for p in fix) == data[0][
        "recommendation"
    ]
    assert fix[1]["text"].startswith("with torch.autocast(")
    compile(fix[1]["text"], "fix", "exec")


def test_disable(traces, capsys):
    assert main(["diagnose", traces["inactive"], "--disable", "amp-inactive"]) == 0


@pytest.mark.parametrize(
    "args, text",
    [
        (["--disable", "nope"], "unknown rule id 'nope'"),
        (["--fail-on", "fatal"], "invalid choice"),
    ],
)
def test_usage_errors_exit_2(traces, args, text, capsys):
    assert main(["diagnose", traces["healthy"], *args]) == 2
    assert text in capsys.readouterr().err


def test_bad_trace_exit_2(tmp_path, capsys):
    bad = tmp_path / "x.db"
    bad.write_text("not a trace")
    assert main(["diagnose", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ampdoctor: ") and len(err.strip().splitlines()) == 1
    assert main(["diagnose", str(tmp_path / "x.db"), "--reference", str(tmp_path / "none.db")]) == 2


def test_diagnose_runs_without_importing_torch(traces):
    import subprocess
    import sys

    code = (
        "import sys; from ampdoctor.cli import main; rc = main(['diagnose', sys.argv[1], '--reference', "
        "sys.argv[1]]); assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)"
    )
    res = subprocess.run([sys.executable, "-c", code, traces["init"]], capture_output=True, text=True)
    assert res.returncode == 1, res.stderr
    assert "init-scale-too-high" in res.stdout
