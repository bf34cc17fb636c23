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
    return subprocess.run([sys.executable, "-m", "ampdoctor", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)


def test_info(skipping_trace, capsys):
    assert cli.main(["info", skipping_trace]) == 0
    out = capsys.readouterr().out.splitlines()
    lines = {line[:10].strip(): line for line in out}
    # full statistics: steps 0-9 (calibration, all skipped), 10-14 (the flight recorder after the skips), 15 (every 5)
    assert lines["steps"] == "steps      20 recorded, full statistics at 16"
    assert lines["precision"] == "precision  O1-style: autocast float16, FP32 master weights"
    assert lines["scaler"] == ("scaler     GradScaler (enabled; growth_factor 2.0, backoff_factor 0.5, "
                               "growth_interval 2000)")
    assert lines["loss scale"] == "loss scale 1.67772e+07 at step 0, range 16384 .. 1.67772e+07, last 16384"
    assert lines["skipped"] == "skipped    10 step(s): 0-9"
    assert lines["non-finite"].startswith("non-finite 10 step(s); first at step 0: 6 (grad_out), bwd phase, inf")
    assert lines["sites"] == "sites      act 8, grad_out 8, param_grad 8, weight 8"
    assert lines["observed"] == ("observed   mode default (peaks every 10, full every 5, first 10 in full); "
                                 "full statistics + histograms 16, sentinel only 4; why: calibration 10, anomaly 5, "
                                 "sampled 1")
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


@pytest.mark.parametrize("args,message", [
    (["info", "/no/such/trace.db"], "ampdoctor: /no/such/trace.db: no such file"),
    (["layers", "{trace}", "--step", "17"], "step 17 has no full statistics; nearest full step: 15"),
    (["layers", "{trace}", "--kind", "gradient"], "argument --kind: invalid choice: 'gradient'"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    (["info"], "the following arguments are required: trace"),
])
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


def test_every_command_is_documented_in_the_readme():
    readme = open(os.path.join(ROOT, "README.md")).read()
    parser = cli.build_parser()
    commands = [a for a in parser._subparsers._group_actions[0].choices]
    assert commands, "no commands"
    for name in commands:
        assert re.search(rf"`ampdoctor {name}\b", readme), f"ampdoctor {name} is not in README.md"
