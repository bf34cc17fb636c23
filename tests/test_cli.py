"""The CLI: exact output on a known run, one-line errors with exit code 2, every command documented."""

import os
import re
import subprocess
import sys

import pytest

import ampdoctor
from ampdoctor import cli

ROOT = os.path.dirname(os.path.dirname(__file__))


@pytest.fixture(scope="module")
def skipping_trace(tmp_path_factory):
    """FP16 + GradScaler with init scale 2^24 on a 64-wide MLP: the first steps overflow and are skipped."""
    from runs import mlp, train

    path = str(tmp_path_factory.mktemp("cli") / "skips.db")
    train(mlp(width=64), 20, init_scale=2.0**24, trace=path, attach_options={"every": 5, "hist_every": 5})
    return path


def run(*args):
    return subprocess.run(
        [sys.executable, "-m", "ampdoctor", *args], capture_output=True, text=True, cwd=ROOT, timeout=120
    )


def test_info(skipping_trace, capsys):
    assert cli.main(["info", skipping_trace]) == 0
    out = capsys.readouterr().out.splitlines()
    lines = {line[:10].strip(): line for line in out}
    # full statistics: steps 0-9 (calibration, all skipped), 10-14 (the flight recorder after the skips), 15 (every 5)
    assert lines["steps"] == "steps      20 recorded, full statistics at 16"
    assert lines["precision"] == "precision  O1-style: autocast float16, FP32 master weights"
    assert lines["scaler"] == (
        "scaler     GradScaler (enabled; growth_factor 2.0, backoff_factor 0.5, growth_interval 2000)"
    )
    assert lines["loss scale"] == (
        "loss scale 1.67772e+07 at step 0, last 16384 at step 19, range 16384 .. "
        "1.67772e+07; 16384 after the last update"
    )
    assert lines["skipped"] == "skipped    10 step(s): 0-9"
    assert lines["non-finite"].startswith("non-finite 10 step(s); first at step 0: 6 (grad_out), bwd phase, inf")
    assert lines["sites"] == "sites      act 8, grad_out 8, param_grad 8, weight 8"
    assert lines["observed"] == (
        "observed   mode default (peaks every 10, full every 5, first 10 in full); "
        "full statistics + histograms 16, sentinel only 4; why: calibration 10, anomaly 5, "
        "sampled 1"
    )
    st = ampdoctor.load(skipping_trace).steps()
    share = st["observer_time"].sum() / st["step_time"].sum()
    assert 0 < share < 1
    assert lines["overhead"].startswith(f"overhead   ampdoctor cost {100 * share:.1f}% of this run (")


def test_layers_table(skipping_trace, capsys):
    assert cli.main(["layers", skipping_trace, "--step", "10", "--kind", "act", "--sort", "absmax"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "act at step 10, sorted by absmax"
    assert out[1].split()[:4] == ["layer", "type", "dtype", "abs"]
    rows = [line.split() for line in out[2:]]
    assert len(rows) == 8 and {r[0] for r in rows} == {"0", "1", "2", "3", "4", "5", "6", "(model)"}
    absmax = [float(r[3]) for r in rows]
    assert absmax == sorted(absmax, reverse=True)
    assert all(r[2] == "float16" for r in rows)
    assert cli.main(["layers", skipping_trace, "--kind", "grad_out"]) == 0
    assert "grad_out at step 15 (values scaled by the loss scale 16384)" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args,message",
    [
        (["info", "/no/such/trace.db"], "ampdoctor: /no/such/trace.db: no such file"),
        (["layers", "{trace}", "--step", "17"], "step 17 has no full statistics; nearest full step: 15"),
        (["layers", "{trace}", "--kind", "gradient"], "argument --kind: invalid choice: 'gradient'"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        (["info"], "the following arguments are required: trace"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(skipping_trace, args, message):
    out = run(*[a.format(trace=skipping_trace) for a in args])
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and message in out.stderr and "Traceback" not in out.stderr
    assert out.stdout == ""


def test_help_and_module_entry_point():
    out = run("--help")
    assert out.returncode == 0 and "info" in out.stdout and "layers" in out.stdout
    script = os.path.join(os.path.dirname(sys.executable), "ampdoctor")
    if os.path.exists(script):
        assert subprocess.run([script, "--version"], capture_output=True, text=True).stdout.startswith("ampdoctor ")


def test_every_command_is_listed_importable_and_documented():
    """Each command of the table: in --help, its module imports (add_arguments, run), and the documentation
    (docs/cli.md) shows it."""
    readme = open(os.path.join(ROOT, "docs", "cli.md")).read()
    helped = run("--help")
    assert helped.returncode == 0 and set(cli.COMMANDS) == {
        "info",
        "layers",
        "diagnose",
        "replay",
        "serve",
        "report",
        "export",
    }
    for name in cli.COMMANDS:
        assert re.search(rf"^    {name} +\S", helped.stdout, re.M), f"{name} is not in --help"
        mod = cli.command_module(name)
        assert callable(mod.add_arguments) and callable(mod.run), name
        assert re.search(rf"`ampdoctor {name}\b", readme), f"ampdoctor {name} is not in docs/cli.md"


def test_help_and_version_load_only_the_command_line():
    """--help and --version import no command, no pandas, no rules: the table alone (they start in milliseconds)."""
    code = (
        "import sys; from ampdoctor.cli import main\n"
        "try: main(['--version'])\nexcept SystemExit: pass\n"
        "try: main(['--help'])\nexcept SystemExit: pass\n"
        "print(sorted(m for m in sys.modules if m.startswith('ampdoctor.') or m in ('pandas', 'numpy', 'torch')))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "['ampdoctor.cli', 'ampdoctor.commands', 'ampdoctor.commands.common']"


def test_a_command_that_fails_to_import_fails_loudly():
    """A broken command module is a traceback naming it, never a command quietly missing from --help."""
    code = (
        "import sys, ampdoctor.commands\n"
        "sys.modules['ampdoctor.commands.layers'] = None   # what a failing import leaves behind\n"
        "from ampdoctor.cli import main\nmain(['layers', 'x.db'])"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 1 and "ampdoctor.commands.layers" in r.stderr and "Traceback" in r.stderr


def test_info_says_when_the_loss_was_never_finite(tmp_path, capsys):
    """Every step's loss NaN (inputs that overflow FP16 in the first layer): info says so instead of no loss line."""
    from runs import batches, mlp, train

    path = str(tmp_path / "nan.db")
    data = ((x * 1e5, y) for x, y in batches(6))
    train(mlp(width=32), 6, trace=path, data=data)
    assert cli.main(["info", path]) == 0
    lines = {line[:10].strip(): line for line in capsys.readouterr().out.splitlines()}
    assert lines["loss"] == "loss       not finite at any of the 6 step(s)"
