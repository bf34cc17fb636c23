"""Real ``torchrun --nproc_per_node=2`` FSDP runs (gloo, CPU; tests/distributed/fsdp_train.py): FSDP2 with
``MixedPrecisionPolicy(param_dtype=bfloat16)`` and a corrupt sample on rank 1, FSDP2 in FP16 without a scaler, FSDP1
with flat parameters, and a rank observed alone. Each rank's trace holds every step; the ranks' shards combined
equal the statistics of the whole tensors the script gathered itself; the rank rules name rank 1; FSDP's policy is
recorded, shown and judged; the printed fixes are run as printed in a second launch."""

from __future__ import annotations

import json
import math
import os
import sqlite3
import subprocess
import sys

import numpy as np
import pytest

import ampdoctor
from ampdoctor.cli import main as cli

pytestmark = pytest.mark.slow  # two torchrun launches

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "fsdp_train.py")
STEPS = 20  # fsdp_train.py's default; its short phases:
SHORT = {"fp16": 8, "fsdp1orig": 8, "hsdp": 8, "lonely": 6, "fp16fixed": 8}
NAN_STEPS = [5, 13]  # fsdp_train.py's defaults: the steps rank 1 gets a corrupt sample
SHARDED = ("param_grad", "weight", "update")
REF_KIND = {"param_grad": "grad", "weight": "weight", "update": "update"}
COUNTS = ("numel", "nan", "inf", "zeros", "fp16_over", "fp16_sub", "fp16_flush", "bf16_over", "bf16_sub", "bf16_flush")


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
    ]
    proc = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def run1(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    return out, torchrun(out)


@pytest.fixture(scope="module")
def found(run1):
    out, _ = run1
    return {phase: {d.rule: d for d in ampdoctor.diagnose(str(out / f"{phase}-*.db"))} for phase in ("bf16", "fp16")}


@pytest.fixture(scope="module")
def run2(run1, found, tmp_path_factory):
    """The second launch: the fixes the diagnoses printed, run as printed."""
    out = tmp_path_factory.mktemp("fsdp-fixed")
    policy = [p.text for p in found["bf16"]["fsdp-reduce-dtype"].fix if p.kind == "code"]
    scaler = [p.text for p in found["fp16"]["fsdp-fp16-scaler"].fix if p.kind == "code"]
    (out / "policy.py").write_text(policy[0])
    (out / "scaler.py").write_text(scaler[0])
    (out / "step.py").write_text(scaler[1])
    args = ["--phases", "fixed", "fp16fixed"]
    files = ["--policy-code", str(out / "policy.py"), "--scaler-code", str(out / "scaler.py")]
    return out, torchrun(out, *args, *files, "--step-code", str(out / "step.py"))


def test_every_rank_records_every_step_and_its_shards(run1):
    out, proc = run1
    assert "collection stopped" not in proc.stderr and "Traceback" not in proc.stderr
    for phase in ("bf16", "fp16", "fsdp1", "fsdp1orig", "hsdp"):
        for r in (0, 1):
            assert json.load(open(out / f"active-{phase}-{r}.json")) is True
            assert ampdoctor.load(out / f"{phase}-{r}.db").n_steps == SHORT.get(phase, STEPS)
    # what each shard is: placements, mesh, this rank's share; Linear(32, 1)'s one row lives on rank 0 only
    for r in (0, 1):
        sh = ampdoctor.load(out / f"bf16-{r}.db").meta["sharding"]
        assert sh["engine"] == "fsdp2" and sh["world_size"] == 2 and sh["rank"] == r
        assert sh["specs"] == [
            {"placements": ["Shard(dim=0)"], "mesh": [2], "coordinate": [r], "shards": 2, "replica": 0}
        ]
        assert sh["params"]["0.weight"] == [0, 16 * 16, [32, 16]]
        assert sh["params"]["4.weight"] == [0, 32 if r == 0 else 0, [1, 32]]
        sites = ampdoctor.load(out / f"bf16-{r}.db").sites("param_grad")
        assert dict(zip(sites["path"], sites["shape"]))["0.weight"] == "16x16"  # the rank's shard
    fl = ampdoctor.load(out / "fsdp1-1.db").meta["sharding"]  # FSDP1: the flat shard cut into the parameters
    assert fl["engine"] == "fsdp1" and fl["specs"][0]["placements"] == ["flat (FULL_SHARD)"]
    assert sum(v[1] for v in fl["params"].values()) + sum(
        v[1] for v in ampdoctor.load(out / "fsdp1-0.db").meta["sharding"]["params"].values()
    ) == sum(math.prod(v[2]) for v in fl["params"].values())  # the pieces, padding left out, make the model
    assert ampdoctor.load(out / "fsdp1-0.db").meta["run"]["params"] == 1633  # counted whole


def test_a_rank_observed_alone_runs_no_collective(run1):
    """Only rank 1 attached (every site, every step, probed): a collective started by the observer would hang."""
    out, _ = run1
    assert not (out / "lonely-0.db").exists() and json.load(open(out / "active-lonely-1.json")) is True
    tr = ampdoctor.load(out / "lonely-1.db")
    assert tr.n_steps == SHORT["lonely"] and len(tr.full_steps()) == SHORT["lonely"]
    skipped = tr.events("probe")["data"].iloc[0]["skipped"]
    assert {"0", "2", "4", "(model)"} <= set(skipped)  # FSDP units are never recomputed


@pytest.mark.parametrize("phase", ["bf16", "fsdp1", "fsdp1orig", "hsdp"])
def test_combined_statistics_equal_the_whole_tensors(run1, phase):
    """FSDP2, FSDP1 (flat parameters; original parameters) and HSDP (two replicas: one copy counts)."""
    out, _ = run1
    ref = json.load(open(out / f"ref-{phase}.json"))["steps"]
    rr = ampdoctor.load_run(str(out / f"{phase}-*.db"))
    assert rr.sharded and not rr.combined.incomplete
    compared = peaks = 0
    for view in rr.views().values():
        st = view.steps()
        for s, r in ref.items():
            s = int(s)
            if r["grad_norm"] is None:  # the loop dropped the gradients of a non-finite step
                assert s in NAN_STEPS and phase == "bf16" and np.isnan(st["grad_norm"][s])
                continue
            assert st["grad_norm"][s] == pytest.approx(r["grad_norm"], rel=1e-5)
            assert st["grad_max"][s] == r["grad_max"]  # a max of float32 values: exact
            if phase != "hsdp":  # (an HSDP rank holds a whole copy)
                assert st["grad_norm_shard"][s] < st["grad_norm"][s]  # a rank's own figure is its shard's
        for kind in SHARDED:
            paths = view.sites(kind)["path"].tolist()
            rec = {f: view.records(f, kind) for f in (*COUNTS, "absmax", "minabs", "mean", "rms", "peak")}
            hists = {path: view.hist(path, kind) for path in paths}
            for s, r in ref.items():
                whole = r.get(REF_KIND[kind], {})
                s = int(s)
                for j, path in enumerate(paths):
                    name = path.replace("_fsdp_wrapped_module.", "")  # (FSDP1's prefix)
                    if name not in whole or np.isnan(rec["numel"][s, j]):
                        continue  # not recorded (weights every 4th step), or a rank had no full statistics
                    w = whole[name]
                    got = {f: rec[f][s, j] for f in rec}
                    for f in COUNTS:
                        assert got[f] == w[f], (phase, kind, path, s, f)
                    assert got["absmax"] == w["absmax"]
                    if not np.isnan(got["peak"]):  # (a step of a rank that observed no site has no peaks row)
                        assert got["peak"] == w["absmax"]
                        peaks += 1
                    assert got["rms"] == pytest.approx(w["norm"] / math.sqrt(w["numel"]), rel=1e-5)
                    assert got["mean"] == pytest.approx(w["sum"] / w["numel"], abs=1e-6 * max(w["absmax"], 1e-30))
                    low = min((int(k) for k in w["hist"]), default=None)
                    assert got["minabs"] == (2.0**low if low is not None else 0.0)
                    steps, counts = hists[path]
                    if s in steps:
                        row = counts[list(steps).index(s)]
                        assert {str(b - 127): int(c) for b, c in enumerate(row) if c} == w["hist"]
                    compared += 1
    assert compared >= 40 and peaks >= 20  # every kind at several steps


def test_a_missing_rank_leaves_figures_missing_never_partial(run1):
    out, _ = run1
    ref = json.load(open(out / "ref-bf16.json"))["steps"]["0"]
    rr = ampdoctor.load_run([str(out / "bf16-0.db")])
    assert list(map(str, rr.missing)) == ["1"] and rr.combined.incomplete == [
        "0.bias",
        "0.weight",
        "2.bias",
        "2.weight",
    ]
    view = rr.views()[0]
    assert view.steps()["grad_norm"].isna().all()  # the whole model's norm needs every shard
    numel = dict(zip(view.sites("param_grad")["path"], view.records("numel", "param_grad")[0]))
    assert np.isnan(numel["0.weight"]) and numel["4.weight"] == 32  # 4.weight lives on rank 0 alone
    rms = dict(zip(view.sites("param_grad")["path"], view.records("rms", "param_grad")[0]))
    assert rms["4.weight"] == pytest.approx(ref["grad"]["4.weight"]["norm"] / math.sqrt(32), rel=1e-5)


def test_one_rank_alone_says_it_is_a_shard(run1, capsys, tmp_path):
    out, _ = run1
    assert cli(["diagnose", str(out / "bf16-1.db")]) == 1
    note = capsys.readouterr().out.splitlines()[-1]
    assert note.startswith(f"note: {out / 'bf16-1.db'} is one rank of an FSDP run") and "bf16-*.db" in note
    bad = tmp_path / "bad.db"  # a sharding entry that is not one: one line, exit 2
    bad.write_bytes((out / "bf16-1.db").read_bytes())
    with sqlite3.connect(bad) as conn:
        conn.execute("UPDATE meta SET value = ? WHERE key = 'sharding'", (json.dumps({"engine": 3}),))
    conn.close()
    assert cli(["info", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "corrupt trace (meta sharding.engine is 3, not text)" in err


def test_rank_rules_name_the_faulty_rank(found):
    f = found["bf16"]
    nf = f["rank-nonfinite"]
    assert nf.ranks == [1] and nf.evidence["one_rank_steps"] == NAN_STEPS and nf.layers == ["0"]
    assert nf.evidence["steps_nonfinite_by_rank"] == {"rank 0": 0, "rank 1": 2}
    assert f["forward-overflow"].ranks == [1] and f["forward-overflow"].layers[0] == "0"
    assert "rank-scale-divergence" not in f


def test_precision_configuration_recorded_and_shown(run1, capsys):
    out, _ = run1
    cfg = ampdoctor.load(out / "bf16-1.db").config["fsdp"]
    assert cfg["engine"] == "fsdp2" and cfg["world_size"] == 2 and set(cfg["units"]) == {"(model)", "0", "2", "4"}
    assert cfg["units"]["0"] == {
        "param_dtype": "bfloat16",
        "reduce_dtype": None,  # as given: unset ...
        "output_dtype": None,
        "cast_forward_inputs": True,
        "compute": "bfloat16",
        "reduce": "bfloat16",  # ... so FSDP reduces in param_dtype
        "params": 32 * 16 + 32,
    }
    f1 = ampdoctor.load(out / "fsdp1-0.db").config["fsdp"]
    assert f1["engine"] == "fsdp1" and f1["units"]["(model)"]["reduce"] == "bfloat16"
    assert f1["sharding_strategy"] == "FULL_SHARD" and f1["use_orig_params"] is False
    assert cli(["info", str(out / "bf16-1.db")]) == 0
    lines = {ln[:10].strip(): ln[11:] for ln in capsys.readouterr().out.splitlines()}
    assert lines["precision"].startswith("FSDP mixed precision: computes in bfloat16, FP32 master weights")
    assert "param_dtype bfloat16, reduce_dtype unset (reduces in bfloat16)" in lines["fsdp"]
    assert lines["sharded"].startswith("6 parameter(s) (Shard(dim=0)); this rank holds 800 of their 1,633 values")
    assert cli(["info", str(out / "bf16-*.db")]) == 0
    text = capsys.readouterr().out
    assert "combined   gradient norm" in text and "from the ranks' shards" in text


def test_reduce_dtype_rule_fires_on_a_bf16_reduce_and_its_fix_works(found, run2):
    d = found["bf16"]["fsdp-reduce-dtype"]
    assert d.severity == "warning" and d.ranks == [0, 1] and d.layers == ["0", "2", "4"]
    assert d.evidence["reduce_dtype_unset_units"] == ["0", "2", "4"] and d.evidence["roundings_per_value"] == 1
    code = [p.text for p in d.fix if p.kind == "code"]
    assert "MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)" in code[0]
    out, proc = run2
    assert "collection stopped" not in proc.stderr
    for r in (0, 1):
        tr = ampdoctor.load(out / f"fixed-{r}.db")
        assert tr.n_steps == STEPS and tr.config["fsdp"]["reduce_dtypes"] == ["float32"]
        assert tr.config["fsdp"]["units"]["0"]["compute"] == "bfloat16"  # compute stays in BF16
        assert np.isfinite(tr.steps()["loss"]).all()
    fixed = {d.rule for d in ampdoctor.diagnose(str(out / "fixed-*.db"))}
    assert "fsdp-reduce-dtype" not in fixed and not {"rank-nonfinite", "forward-overflow"} & fixed


def test_fp16_without_a_sharded_scaler_and_its_fix(found, run2):
    d = found["fp16"]["fsdp-fp16-scaler"]
    assert d.severity == "critical" and d.evidence["scaler"] is None
    assert "fsdp-reduce-dtype" in found["fp16"]  # an FP16 reduce too
    out, _ = run2
    for r in (0, 1):
        tr = ampdoctor.load(out / f"fp16fixed-{r}.db")
        assert tr.n_steps == SHORT["fp16fixed"] and tr.config["scaler"]["class"] == "ShardedGradScaler"
        assert tr.steps()["loss_scale"].notna().all()  # the loss scale is read from the scaler every step
    fixed = {d.rule for d in ampdoctor.diagnose(str(out / "fp16fixed-*.db"))}
    assert "fsdp-fp16-scaler" not in fixed and "rank-scale-divergence" not in fixed
