"""A real ``torchrun --nproc_per_node=2`` run (gloo, CPU, FP16 autocast + GradScaler) with faults on rank 1 only:
per-rank traces and their metadata, the run read as one (library, CLI, report, dashboard data), and the rank rules
naming rank 1. The scales are compared with what each rank's GradScaler really held."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import ampdoctor
from ampdoctor.cli import main as cli

pytestmark = pytest.mark.slow  # two torchrun launches (~5 s each on a quiet 2-core machine)

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "ddp_train.py")
NAN_STEPS = [6, 14]  # ddp_train.py's defaults: the steps rank 1 gets an overflowing input


def torchrun(out, *args):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="default")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        SCRIPT,
        "--out",
        str(out),
        *args,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    proc = torchrun(out)
    return out, proc


def _real_scales(out, phase, rank):
    return json.load(open(out / f"scales-{phase}-{rank}.json"))


def test_each_rank_writes_its_own_trace_with_rank_and_world_size(ddp_run):
    out, proc = ddp_run
    names = sorted(p.name for p in out.glob("*.db"))
    # {rank} in the path, and a path without it gets .rank<N>: never one shared file
    assert names == ["ddp-0.db", "ddp-1.db", "manual.rank0.db", "manual.rank1.db"]
    assert "no {rank} in trace=" in proc.stderr and "manual.rank<N>.db" in proc.stderr
    metas = [ampdoctor.load(out / f"ddp-{r}.db").meta["run"] for r in (0, 1)]
    for r, m in enumerate(metas):
        assert (m["rank"], m["world_size"], m["local_rank"], m["backend"]) == (r, 2, r, "gloo")
    assert metas[0]["run_id"] and metas[0]["run_id"] == metas[1]["run_id"]  # torchrun's id of this job
    assert metas[0]["pid"] != metas[1]["pid"]
    for phase in ("ddp", "manual"):  # each trace's loss scale is what that rank's GradScaler held
        for r in (0, 1):
            tr = ampdoctor.load_run(str(out / f"{phase}*.db"))[r]
            assert tr.steps()["loss_scale_next"].tolist() == _real_scales(out, phase, r)


def test_the_ranks_read_as_one_run(ddp_run, capsys):
    out, _ = ddp_run
    rr = ampdoctor.load(str(out / "ddp-*.db"))
    assert isinstance(rr, ampdoctor.RankRun) and rr.ranks == [0, 1] and rr.world_size == 2 and not rr.missing
    assert ampdoctor.load_run([str(out / "ddp-0.db"), str(out / "ddp-1.db")]).ranks == [0, 1]
    assert isinstance(ampdoctor.load(out / "ddp-1.db"), ampdoctor.Trace)  # one file: as before
    # a directory that holds two runs is not one run: one line naming them, exit 2
    assert cli(["info", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "ddp-*.db" in err and "manual.rank*.db" in err
    assert cli(["info", str(out / "ddp-0.db"), str(out / "ddp-1.db")]) == 0  # a shell-expanded glob
    lines = capsys.readouterr().out.splitlines()
    assert "2 rank(s) of world size 2" in lines[0]
    row1 = next(ln for ln in lines if ln.split()[:1] == ["1"])
    assert row1.split()[1:5] == ["24", "4", "4", "4.1e+03"]  # steps, skipped (2 calibration + 2 faults)


def test_rank_rules_name_rank_1(ddp_run, capsys):
    out, _ = ddp_run
    found = {d.rule: d for d in ampdoctor.diagnose(str(out / "ddp-*.db"))}
    nf = found["rank-nonfinite"]
    assert nf.ranks == [1] and nf.steps == [NAN_STEPS[0], NAN_STEPS[-1]] and nf.layers == ["module.0"]
    assert nf.evidence["one_rank_steps"] == NAN_STEPS and nf.evidence["skipped_on_every_rank"] is True
    assert nf.evidence["steps_nonfinite_by_rank"] == {"rank 0": 0, "rank 1": 2}
    st = found["rank-straggler"]
    assert st.ranks == [1] and "input pipeline" in st.title
    assert st.evidence["data_time_median_s"]["rank 1"] >= 0.035 > st.evidence["data_time_median_s"]["rank 0"]
    assert "rank-scale-divergence" not in found  # DDP: every rank's scaler saw the all-reduced Inf
    lag = st.evidence["data_time_median_s"]["rank 1"] - st.evidence["data_time_median_s"]["rank 0"]
    share = lag / min(st.evidence["step_time_median_s"].values())
    # rank rules are disabled and re-thresholded by id, like any rule
    quieter = {
        d.rule
        for d in ampdoctor.diagnose(
            str(out / "ddp-*.db"),
            rules={"rank-nonfinite": None, "rank-straggler": {"min_lag_share": min(share * 1.2, 0.999)}},
        )
    }
    assert not quieter & {"rank-nonfinite", "rank-straggler"} and "forward-overflow" in quieter
    assert found["forward-overflow"].ranks == [1]  # a per-rank finding says which rank it fired on
    assert not any(0 in d.ranks for d in found.values() if d.rule.startswith("rank-"))
    # the single traces know nothing of the other rank: the rank rules stay silent there
    assert not [d for d in ampdoctor.diagnose(out / "ddp-1.db") if d.rule.startswith("rank-")]
    assert cli(["diagnose", str(out / "ddp-*.db")]) == 1
    text = capsys.readouterr().out
    assert "[CRITICAL] rank-nonfinite (rank 1): NaN/Inf produced on rank 1 only" in text
    assert "[WARNING] rank-straggler (rank 1): Rank 1 is a straggler" in text


def test_scale_divergence_names_rank_1_and_its_printed_fix_works(ddp_run, tmp_path):
    out, _ = ddp_run
    found = {d.rule: d for d in ampdoctor.diagnose(str(out / "manual.rank*.db"))}
    dv = found["rank-scale-divergence"]
    real = {r: _real_scales(out, "manual", r) for r in (0, 1)}
    first = next(i for i, (a, b) in enumerate(zip(real[0], real[1])) if a != b)
    assert first == NAN_STEPS[0] and dv.steps[0] == first and dv.ranks == [1]
    assert dv.evidence["loss_scale_after"] == {"rank 0": real[0][first], "rank 1": real[1][first]}
    assert dv.evidence["skipped"] == {"rank 0": False, "rank 1": True}
    assert dv.evidence["applied_with_nonfinite_gradients"] == [0]
    # the fix as printed (the code block a user copies), run in place of the run's own backward-to-update lines
    code = next(p.text for p in dv.fix if p.kind == "code")
    (tmp_path / "step.py").write_text(code)
    torchrun(tmp_path, "--phases", "fixed", "--step-code", str(tmp_path / "step.py"), "--slow-ms", "0")
    fixed = {d.rule: d for d in ampdoctor.diagnose(str(tmp_path / "fixed-*.db"))}
    assert "rank-scale-divergence" not in fixed and "loss-scale-collapse" not in fixed
    assert "rank-straggler" not in fixed  # --slow-ms 0: two concurrent ranks at one pace
    assert fixed["rank-nonfinite"].ranks == [1]  # rank 1's data is still bad: that finding stays
    assert _real_scales(tmp_path, "fixed", 0) == _real_scales(tmp_path, "fixed", 1)
    for r in (0, 1):
        st = ampdoctor.load(tmp_path / f"fixed-{r}.db").steps()
        assert st["skipped"].tolist() == [s in NAN_STEPS for s in range(24)]  # both skip the faulty steps


def test_report_and_dashboard_read_the_run(ddp_run, tmp_path, capsys):
    out, _ = ddp_run
    html_out = tmp_path / "ranks.html"
    assert cli(["report", str(out / "ddp-0.db"), str(out / "ddp-1.db"), "-o", str(html_out)]) == 0
    page = html_out.read_text()
    assert "2 ranks" in page and "rank-straggler" in page and "rank 1" in page and "ddp-1.db" in page
    from ampdoctor.dashboards.app import create_app

    ctx = create_app(str(out)).ampdoctor  # named from {rank}: grouped by the rank in the metadata
    runs = ctx.runs()
    assert (runs["ddp-1.db"].group, runs["ddp-1.db"].rank) == ("ddp", 1)
    found, error = ctx.findings_and_error("ddp-0.db")  # rank 0's page shows the run's rank findings too
    assert error is None and {"rank-nonfinite", "rank-straggler"} <= {d.rule for d in found}
    # serve a glob of one run: only its files are served (the manual run next to them is not)
    from ampdoctor.cli import build_parser
    from ampdoctor.commands.serve import check

    args = build_parser().parse_args(["serve", str(out / "ddp-0.db"), str(out / "ddp-1.db")])
    check(args)
    assert set(create_app(args.path, files=args.files).ampdoctor.runs()) == {"ddp-0.db", "ddp-1.db"}
    assert cli(["serve", str(out / "*.db")]) == 2  # two runs in one glob: one line, no server
    err = capsys.readouterr().err
    assert "two traces of rank 0" in err and err.count("\n") == 1
