"""The precision-loss probe and rule on real CPU training runs: fragile layers (catastrophic cancellation in FP16)
are named and nothing else, the printed fix removes the error and the symptom, healthy models stay quiet, and
training with the probe on is bit-identical to training without ampdoctor."""

import math
import re
import sqlite3

import numpy as np
import probe_models as M
import pytest
import torch
from runs import live_tensors
from torch import nn

import ampdoctor
from ampdoctor.rules import precision as P
from ampdoctor.rules import validation as V
from ampdoctor.rules.engine import Run

torch.set_num_threads(1)
STEPS = 120
PROBE = {"probe_every": 10, "every": 10, "hist_every": 10}
CASES = {"standardize": (M.standardize_model, M.OFFSET), "rbf": (M.rbf_model, M.RBF_OFFSET)}


def _by_rule(path, **kw):
    return {d.rule: d for d in ampdoctor.diagnose(path, **kw)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Per case: the fragile FP16 run (probed) and the FP32 reference (same model, same data)."""
    d = tmp_path_factory.mktemp("probe")
    out = {}
    for name, (make, offset) in CASES.items():
        frag, ref = str(d / f"{name}.db"), str(d / f"{name}-fp32.db")
        out[name] = {
            "frag": frag,
            "ref": ref,
            "frag_loss": M.train(make(), M.tabular(STEPS, offset=offset), STEPS, frag, attach_options=PROBE),
            "ref_loss": M.train(
                make(), M.tabular(STEPS, offset=offset), STEPS, ref, precision="fp32", attach_options=PROBE
            ),
        }
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_probe_names_the_fragile_layer_and_no_other(runs, case):
    r = runs[case]
    found = _by_rule(r["frag"])
    d = found["precision-loss"]
    assert d.severity == "warning" and d.layers == ["0"]
    ev = d.evidence["layers"]["0"]
    assert ev["ratio"] >= 5 * P.MIN_RATIO and ev["share_over"] == 1.0 and ev["probed_steps"] == STEPS // 10
    assert ev["k"] == M.D_IN and math.isclose(ev["bound"], math.sqrt(M.D_IN) * 2.0**-11)
    # every other probed layer, the parents of "0" included, measured within sqrt(k)*u
    tr = ampdoctor.load(r["frag"])
    verdicts = P.layer_verdicts(Run(tr))
    assert {v["path"] for v in verdicts} == {"(model)", "0", "1", "2", "3"} | (
        {"4"} if case == "standardize" else set()
    )
    assert all(v["ratio"] < 1 for v in verdicts if v["path"] not in ("0", "(model)"))
    # the FP32 reference of the same model: nothing to name (FP32 against FP32 is exact)
    assert "precision-loss" not in _by_rule(r["ref"])
    assert (ampdoctor.load(r["ref"]).probes()["rel_err"] == 0).all()


def _loss_gap(model, offset):
    """The symptom at the model's output: |loss in FP16 - loss in FP32| / loss in FP32 on a held-out batch."""
    rep = ampdoctor.probe(model, next(M.tabular(1, batch=256, offset=offset, seed=5)), M.mse)
    return abs(rep.loss_half / rep.loss_fp32 - 1)


@pytest.mark.parametrize("case", list(CASES))
def test_printed_fix_removes_the_error_and_the_symptom(runs, case, tmp_path):
    r = runs[case]
    make, offset = CASES[case]
    code = _by_rule(r["frag"])["precision-loss"].recommendation.split(":\n", 1)[1]
    assert code.startswith('handle = ampdoctor.keep_fp32(model, "0")')
    before = _loss_gap(make(), offset)
    model = make()
    exec(code, {"model": model, "ampdoctor": ampdoctor, "torch": torch})
    after = _loss_gap(model, offset)
    assert before > 1e-3 and after < before / 20  # the loss the model computes in FP16 is the FP32 one again
    fixed = str(tmp_path / "fixed.db")
    losses = M.train(model, M.tabular(STEPS, offset=offset), STEPS, fixed, attach_options=PROBE)
    assert "precision-loss" not in _by_rule(fixed)
    pr = ampdoctor.load(fixed).probes()
    assert (pr[pr["path"] == "0"]["rel_err"] == 0).all()  # FP32 inside autocast: nothing left to lose
    frag, ref = np.median(r["frag_loss"][-30:]), np.median(r["ref_loss"][-30:])
    if case == "standardize":  # its features are noise in FP16: it trains to ~2.7x the FP32 run's loss
        assert frag > 2 * ref
    assert abs(np.median(losses[-30:]) - ref) < 0.05 * ref  # the fixed run trains like the FP32 run


def test_one_off_probe_names_the_layer_and_compares_the_loss():
    model = M.standardize_model(dropout=0.2)
    x, y = next(M.tabular(1, batch=64))
    rep = ampdoctor.probe(model, (x, y), M.mse)
    assert [r["path"] for r in rep.flagged] == ["0"] and rep.dtype == "float16"
    assert rep.fix == 'handle = ampdoctor.keep_fp32(model, "0")  # these modules compute in FP32 inside autocast'
    model.eval()
    rep_eval = ampdoctor.probe(model, (x, y), M.mse)
    with torch.no_grad():
        assert rep_eval.loss_fp32 == pytest.approx(M.mse(model(x.float()), y).item(), rel=1e-6)
    assert rep_eval.loss_half > 1.5 * rep_eval.loss_fp32
    text = str(rep)
    assert "<- precision loss" in text and 'keep_fp32(model, "0")' in text and "loss:" in text
    # the same in BF16 (u = 2^-8; features fed in BF16): named, and the bound is BF16's
    bf = ampdoctor.probe(model, (x.bfloat16(), y), M.mse, dtype=torch.bfloat16)
    assert bf.dtype == "bfloat16" and [r["path"] for r in bf.flagged] == ["0"]
    assert bf.flagged[0]["bound"] == pytest.approx(math.sqrt(M.D_IN) * 2.0**-8)


def test_healthy_models_get_no_precision_loss(tmp_path):
    """Dropout, LayerNorm, BatchNorm, GELU, convolutions, pooling: every layer within sqrt(k)*u."""
    path = str(tmp_path / "cnn.db")
    M.train(M.cnn(), M.images(20), 20, path, loss_fn=M.ce, attach_options={"probe_every": 5})
    path2 = str(tmp_path / "mlp.db")
    M.train(
        M.standardize_model(fragile=False, dropout=0.1), M.tabular(20), 20, path2, attach_options={"probe_every": 5}
    )
    for p in (path, path2):
        assert "precision-loss" not in _by_rule(p)
        verdicts = P.layer_verdicts(Run(ampdoctor.load(p)))
        assert len(verdicts) >= 6 and max(v["ratio"] for v in verdicts) < 1
    # attention (softmax, MultiheadAttention, LayerNorm, dropout), one-off, in FP16 and BF16
    torch.manual_seed(0)
    enc = nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, dropout=0.1, batch_first=True)
    x = torch.randn(8, 12, 32)
    for dtype in (torch.float16, torch.bfloat16):
        rep = ampdoctor.probe(enc, x, dtype=dtype)
        assert not rep.flagged and len(rep.layers) >= 8
        assert max(r["rel_err"] / P.bound(r["k"], rep.dtype) for r in rep.layers) < 1


class _Twice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2


class Custom(nn.Module):
    def forward(self, x):
        return _Twice.apply(x)


class Counter(nn.Module):
    """Keeps a forward count in a plain tensor attribute (not a buffer), updated in place."""

    def __init__(self):
        super().__init__()
        self.calls = torch.zeros(())

    def forward(self, x):
        self.calls += 1
        return x


def _bn_dropout_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 1))


def test_training_with_the_probe_is_bit_identical(tmp_path):
    """FP16 + GradScaler, dropout (RNG) and BatchNorm (running statistics), the probe on every step."""
    data = list(M.tabular(15, offset=0.0))
    states = []
    for trace in (None, str(tmp_path / "p.db")):
        model = _bn_dropout_model()
        M.train(model, iter(data), 15, trace, attach_options={"probe_every": 1, "every": 1})
        states.append(({k: v.clone() for k, v in model.state_dict().items()}, torch.get_rng_state()))
    (a, rng_a), (b, rng_b) = states
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(rng_a, rng_b)
    pr = ampdoctor.load(str(tmp_path / "p.db")).probes()
    assert sorted(pr["step"].unique()) == list(range(15))
    assert set(pr["path"]) == {"(model)", "0", "1", "2", "3", "4"}
    drop = pr[pr["path"] == "3"]["rel_err"]
    assert (drop < 2.0**-10).all()  # the FP32 pass drew the same dropout mask


def test_one_off_probe_changes_nothing():
    model = _bn_dropout_model()
    x = torch.randn(8, 16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    rep = ampdoctor.probe(model, x)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(rng, torch.get_rng_state())
    assert all(p.grad is None for p in model.parameters())
    assert rep.loss_half is None and len(rep.layers) == 6 and not rep.flagged
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_modules_that_cannot_be_recomputed_are_skipped_and_listed(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(inplace=True), Custom(), Counter(), nn.Linear(32, 1))
    path = str(tmp_path / "skip.db")
    M.train(model, M.tabular(4, offset=0.0), 4, path, attach_options={"probe_every": 2})
    tr = ampdoctor.load(path)
    ev = tr.events("probe")
    assert ev["step"].tolist() == [0, 2]
    skipped = ev["data"].iloc[0]["skipped"]
    assert set(skipped) == {"1", "2", "3", "(model)"}  # the root holds the counter too: not run twice either
    assert "in place" in skipped["1"] and "custom autograd" in skipped["2"] and "'calls'" in skipped["3"]
    assert model[3].calls.item() == 4  # one count per real forward: never run twice
    assert set(tr.probes()["path"]) == {"0", "4"}
    assert not any(m._forward_pre_hooks for m in model.modules())  # nothing left armed after the run


def test_val_oscillation_blames_the_measured_layer(runs):
    culprits = V.culprits(Run(ampdoctor.load(runs["standardize"]["frag"])))
    assert culprits[0][0] == "0" and "measured" in culprits[0][1]


def test_probe_table_is_optional_in_old_traces(runs, tmp_path):
    import shutil

    old = str(tmp_path / "old.db")
    shutil.copy(runs["rbf"]["ref"], old)
    with sqlite3.connect(old) as conn:
        conn.execute("DROP TABLE probes")
    tr = ampdoctor.load(old)
    assert tr.probes().empty and list(tr.probes().columns)[:3] == ["step", "site", "path"]
    assert "precision-loss" not in _by_rule(old)


def test_a_corrupt_probes_table_is_one_trace_error(runs, tmp_path):
    """The probes table is checked at open like every other table: a bad value is a TraceError naming it."""
    import shutil

    bad = str(tmp_path / "bad.db")
    shutil.copy(runs["rbf"]["ref"], bad)
    with sqlite3.connect(bad) as conn:
        assert conn.execute("UPDATE probes SET rel_err = 'abc'").rowcount > 0
    with pytest.raises(ampdoctor.TraceError, match="table probes: column rel_err holds 'abc'"):
        ampdoctor.load(bad)


def test_probe_every_is_validated():
    with pytest.raises(ValueError, match=re.escape("probe_every should be a positive int")):
        ampdoctor.attach(nn.Linear(2, 2), probe_every=0, trace="unused.db")


def test_layers_probe_command(runs, capsys):
    from ampdoctor.cli import main

    path = runs["standardize"]["frag"]
    assert main(["layers", path, "--probe"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == (
        f"probe at step {STEPS - 10} ({STEPS // 10} probed steps): float16 output against FP32 from "
        "the same inputs; bound sqrt(k)*u, u = 0.000488"
    )
    assert out[1].split() == ["layer", "type", "dtype", "k", "rel", "err", "max", "err", "sqrt(k)u", "ratio"]
    assert out[2].startswith("0 ") and out[2].endswith("<- precision loss") and "FastStandardiz" in out[2]
    assert sum("<- precision loss" in line for line in out) == 1
    assert out[-2:] == [
        "precision loss over the probed steps: 0; fix:",
        'handle = ampdoctor.keep_fp32(model, "0")  # these modules compute in FP32 inside autocast',
    ]
    assert main(["layers", path, "--probe", "--step", "15"]) == 2
    assert capsys.readouterr().err.strip() == "step 15 was not probed; nearest probed step: 10"
    assert main(["layers", runs["rbf"]["ref"], "--probe", "--step", "0"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "no layer loses more precision than its size explains"


class _Unsized(nn.Module):
    """A module whose input the probe cannot size (a failure inside the probe, not in the user's code)."""

    def forward(self, x):
        return x * 1.0


def test_a_failure_inside_the_probe_stops_collection_not_training(tmp_path, monkeypatch):
    from ampdoctor.collect import recompute

    def broken(module, args):
        if isinstance(module, _Unsized):
            raise RuntimeError("probe bug")
        return 1

    monkeypatch.setattr(recompute, "accumulation_length", broken)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8), _Unsized(), nn.Linear(8, 1))
    with pytest.warns(RuntimeWarning, match="collection stopped after an internal error .RuntimeError: probe bug"):
        losses = M.train(model, M.tabular(6, offset=0.0), 6, str(tmp_path / "b.db"), attach_options={"probe_every": 1})
    assert len(losses) == 6 and all(math.isfinite(v) for v in losses)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def _train_half(model, path):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with ampdoctor.attach(model, opt, trace=path, probe_every=2, live=False) as doc:
        for x, y in M.tabular(6):
            opt.zero_grad()
            loss = M.mse(model(x), y)
            loss.backward()
            doc.log_loss(loss)
            opt.step()


def test_half_model_without_autocast_gets_a_conversion_fix(tmp_path):
    """O3-style (model.half(), half inputs, no autocast): keep_fp32 would change nothing, so the printed fix runs
    the layer in FP32 by hand; applied as printed, the error and the loss gap are gone."""
    path = str(tmp_path / "o3.db")
    _train_half(M.standardize_model().half(), path)
    d = _by_rule(path)["precision-loss"]
    assert d.layers == ["0"] and "keep_fp32(" not in d.recommendation
    code = d.recommendation.split(":\n", 1)[1]
    assert code.startswith("model[0].float()\n")
    model = M.standardize_model().half()
    x, y = next(M.tabular(1, batch=256, seed=5))
    with torch.no_grad():
        ref = M.mse(M.standardize_model()(x.float()), y).item()  # the same weights in FP32
        before = M.mse(model(x), y).item()
        exec(code, {"model": model, "torch": torch})
        after = M.mse(model(x), y).item()
    assert abs(before / ref - 1) > 0.1 and abs(after / ref - 1) < 0.01
    rep = ampdoctor.probe(model, x)
    assert not rep.flagged and rep.skipped == {"(model)": rep.skipped["(model)"]}  # its hooks cast back to half
    fixed = str(tmp_path / "fixed.db")
    _train_half(model, fixed)
    assert "precision-loss" not in _by_rule(fixed)


def test_measured_precision_loss_explains_slow_convergence(tmp_path, monkeypatch):
    """Against the FP32 reference the fragile run converges slower; the measured layer explains it, so
    slow-convergence ("nothing numeric explains the gap") stays silent while precision-loss names the layer."""
    cadence = {"probe_every": 50, "every": 50, "hist_every": 50, "live": False}
    frag, ref = str(tmp_path / "frag.db"), str(tmp_path / "ref.db")
    M.train(M.standardize_model(), M.tabular(300), 300, frag, lr=0.05, attach_options=cadence)
    M.train(M.standardize_model(), M.tabular(300), 300, ref, precision="fp32", lr=0.05, attach_options=cadence)
    found = _by_rule(frag, reference=ref)
    assert "precision-loss" in found and "slow-convergence" not in found
    monkeypatch.setattr(P, "measured_culprits", lambda run: [])  # without the measurement ...
    assert "slow-convergence" in _by_rule(frag, reference=ref)  # ... it would blame the learning rate


def test_a_probed_step_keeps_no_tensor(tmp_path):
    """Between steps, training with a probe on every step holds exactly the tensors training without one holds."""
    counts = []
    for run, probe_every in enumerate((None, 1)):
        before = live_tensors()  # held: a freed tensor's id reused by a new one would hide it
        model = _bn_dropout_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        scaler = torch.amp.GradScaler("cpu")
        doc = ampdoctor.attach(model, opt, scaler, str(tmp_path / f"m{run}.db"), probe_every=probe_every, live=False)
        for i, (x, y) in enumerate(M.tabular(4, offset=0.0)):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = M.mse(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            del loss
            if i == 2:
                doc.flush()  # the writer thread holds the finished steps' packets until it drains
                counts.append(len(live_tensors(before)))
        doc.close()
        del model, opt, scaler, doc
    del before
    assert counts[0] == counts[1]
