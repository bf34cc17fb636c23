"""Loss-scale replay: exact reproduction of recorded GradScaler histories, the scaler dynamics against torch's own
kernel, predictions checked against real runs with the other settings, underflow, --suggest and the CLI."""

import os

import numpy as np
import pytest
import torch
from runs import batches, mlp, train
from torch.optim.optimizer import register_optimizer_step_pre_hook

import ampdoctor
from ampdoctor.cli import main
from ampdoctor.lossscale import Replay, scaler, suggest
from ampdoctor.lossscale.evidence import Evidence
from ampdoctor.lossscale.scaler import lost_many, simulate

# the reference captures gradients with full backward hooks, which warn when a model's input needs no gradient
pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook is firing")


def _run(path, steps=40, init_scale=2.0**16, growth_interval=2000, **kw):
    train(mlp(), steps, init_scale=init_scale, growth_interval=growth_interval, trace=path, **kw)
    return ampdoctor.load(path)


# -- exact reproduction ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "init_scale, growth_interval, extra",
    [
        (2.0**24, 2000, {}),  # skips while calibrating at the start
        (2.0**8, 3, {}),  # growth every 3 steps, then overflow/backoff cycles
        (2.0**24, 5, {"accumulation": 2}),  # both, with gradient accumulation
        (2.0**16, 2000, {"optimizer": "adam", "lr": 1e-3}),  # torch's defaults
    ],
)
def test_replay_with_the_run_settings_reproduces_the_recorded_history_exactly(
    trace_path, init_scale, growth_interval, extra
):
    tr = _run(trace_path, 40, init_scale, growth_interval, **extra)
    st = tr.steps()
    r = ampdoctor.replay(trace_path)
    assert isinstance(r, Replay)
    assert np.array_equal(r.scales, st["loss_scale"].to_numpy())
    assert np.array_equal(r.skipped, st["skipped"].to_numpy())
    assert r.final_scale == st["loss_scale_next"].iloc[-1]
    assert r.settings == {
        "init_scale": init_scale,
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": growth_interval,
    }
    assert r.summary()["skipped"] == int(st["skipped"].sum()) and not r.estimated.any()
    if growth_interval == 3:  # the scenario shows both dynamics
        assert (st["loss_scale_next"] > st["loss_scale"]).any() and st["skipped"].any()
    if init_scale == 2.0**24:
        assert st["skipped"].iloc[:3].all()
    # the same settings passed explicitly change nothing
    same = ampdoctor.replay(
        tr, init_scale=init_scale, growth_interval=growth_interval, growth_factor=2.0, backoff_factor=0.5
    )
    assert np.array_equal(same.scales, r.scales)


def test_a_trace_attached_mid_run_is_reproduced(trace_path):
    """The growth tracker the scaler had counted before attach() is read off the first growth."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=7)
    data = batches(24)

    def step():
        x, y = next(data)
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        scaler.scale(torch.nn.functional.mse_loss(out.float(), y)).backward()
        scaler.step(opt)
        scaler.update()

    for _ in range(4):
        step()
    with ampdoctor.attach(model, optimizer=opt, scaler=scaler, trace=trace_path):
        for _ in range(20):
            step()
    st = ampdoctor.load(trace_path).steps()
    r = ampdoctor.replay(trace_path)
    assert r.growth_tracker == 4
    assert np.array_equal(r.scales, st["loss_scale"].to_numpy()) and r.final_scale == scaler.get_scale()


# -- the dynamics against torch's own update kernel --------------------------------------------------------------
def _bare(over: np.ndarray, threshold: np.ndarray) -> Evidence:
    """Evidence of a run without recorded scales: steps that overflow at any scale (``over``) and the largest scale
    each step takes without overflowing (``threshold``)."""
    n = len(over)
    return Evidence(
        steps=np.arange(n),
        rec_scale=np.full(n, np.nan),
        rec_next=np.full(n, np.nan),
        rec_over=over,
        always=over,
        threshold=threshold,
        from_neighbours=np.zeros(n, bool),
        hist={},
        run_settings={},
        has_scaler=False,
        assumed_fp16=False,
        device="cpu",
    )


def _setting(init_scale: float, growth: float, backoff: float, interval: int) -> dict:
    return {"init_scale": init_scale, "growth_factor": growth, "backoff_factor": backoff, "growth_interval": interval}


@pytest.mark.parametrize(
    "init_scale, growth, backoff, interval",
    [(2.0**16, 2.0, 0.5, 3), (3.0, 1.7, 0.3, 2), (2.0**126, 2.0, 0.5, 1), (1e-3, 1.1, 0.9, 1)],
)
def test_simulated_dynamics_match_torch_amp_update_scale(init_scale, growth, backoff, interval):
    rng = np.random.default_rng(0)
    over = rng.random(200) < 0.2
    r = simulate(_bare(over, np.full(len(over), np.inf)), _setting(init_scale, growth, backoff, interval))
    scale, tracker = torch.tensor(init_scale), torch.tensor(0, dtype=torch.int32)
    expected = []
    for o in over:
        expected.append(scale.item())
        torch._amp_update_scale_(scale, tracker, torch.tensor(float(o)), growth, backoff, interval)
    assert r.scales.tolist() == expected and r.final_scale == scale.item()
    assert np.array_equal(r.skipped, over)


@pytest.mark.parametrize(
    "init_scale, growth, backoff, interval",
    [(2.0**16, 2.0, 0.5, 50), (3.0, 1.7, 0.3, 40), (2.0**120, 2.0, 0.5, 1), (1e-3, 1.1, 0.9, 3)],
)
def test_long_runs_between_overflows_match_torch_amp_update_scale(init_scale, growth, backoff, interval):
    """The replay passes over long stretches without an overflow in blocks and rebuilds the scale of each step from
    the growth schedule; step by step with torch's kernel, overflowing where the scale in force exceeds the step's
    threshold (rare dips, a stretch where nothing overflows and the scale grows to the FP32 max), every scale, skip
    and the final scale are torch's."""
    rng = np.random.default_rng(2)
    n = 3000
    threshold = np.full(n, 2.0**30)
    dips = rng.random(n) < 0.003
    threshold[dips] = 2.0 ** rng.uniform(5, 25, int(dips.sum()))
    threshold[2000:2600] = np.inf
    r = simulate(_bare(np.zeros(n, bool), threshold), _setting(init_scale, growth, backoff, interval))
    scale, tracker = torch.tensor(init_scale), torch.tensor(0, dtype=torch.int32)
    expected, skipped = [], []
    for t in range(n):
        expected.append(scale.item())
        skipped.append(scale.item() > threshold[t])
        torch._amp_update_scale_(scale, tracker, torch.tensor(float(skipped[-1])), growth, backoff, interval)
    clean = np.diff(np.flatnonzero(np.r_[True, skipped, True])) - 1
    assert any(skipped) and clean.max() >= 4 * 64  # overflows, and stretches of several blocks without one
    assert r.scales.tolist() == expected and r.final_scale == scale.item()
    assert r.skipped.tolist() == skipped


@pytest.mark.parametrize("has_scaler", [True, False])
def test_the_search_loses_exactly_what_each_replay_loses(has_scaler, monkeypatch):
    """lost_many steps a whole grid side by side; each setting's lost is simulate's to the last bit, whatever the
    evidence (recorded scales missing on some steps, thresholds at 0, inf or NaN, empty histograms, scales that
    would grow past the FP32 max), also when the settings go in groups."""
    rng = np.random.default_rng(1)
    n = 300
    rec = np.where(rng.random(n) < 0.1, np.nan, 2.0 ** rng.integers(4, 20, n).astype(float))
    over = rng.random(n) < 0.15
    threshold = np.choose(
        rng.integers(0, 4, n), [2.0 ** rng.uniform(2, 22, n), np.zeros(n), np.full(n, np.inf), np.full(n, np.nan)]
    )
    hist = {
        int(t): (rng.integers(-150, 0, 6).astype(float), rng.integers(0, 3, 6).astype(float))
        for t in rng.choice(n, 40, replace=False)
    }
    ev = Evidence(
        steps=np.arange(n),
        rec_scale=rec,
        rec_next=rec,
        rec_over=over,
        always=rng.random(n) < 0.05,
        threshold=threshold,
        from_neighbours=rng.random(n) < 0.5,
        hist=hist,
        run_settings={},
        has_scaler=has_scaler,
        assumed_fp16=False,
        device="cpu",
    )
    settings = [
        {"init_scale": init, "growth_factor": growth, "backoff_factor": backoff, "growth_interval": gi}
        for init in (1.0, 2.0**12, 3.0e4, 2.0**126)
        for growth, backoff in ((2.0, 0.5), (1.7, 0.3))
        for gi in (1, 3, 50)
    ]
    expected = [simulate(ev, s).lost for s in settings]
    told = []
    assert lost_many(ev, settings, advance=told.append) == expected and sum(told) == len(settings)
    monkeypatch.setattr(scaler, "_SEARCH_CELLS", 100)  # groups of 2 settings
    assert lost_many(ev, settings) == expected


# -- predictions: replay one run with other settings, compare with a real run that used them ---------------------------
@pytest.mark.parametrize("interval", [5, 2000])
def test_replay_predicts_a_real_run_with_other_settings(tmp_path, interval):
    high = _run(str(tmp_path / "high.db"), 50, 2.0**24, interval)
    low = _run(str(tmp_path / "low.db"), 50, 2.0**10, interval)
    for src, dst, init in ((high, low, 2.0**10), (low, high, 2.0**24)):
        r = ampdoctor.replay(src, init_scale=init)
        actual = dst.steps()
        skipped = actual["skipped"].to_numpy()
        assert abs(r.n_skipped - int(skipped.sum())) <= 1
        assert np.array_equal(r.skipped[:12], skipped[:12])  # the calibration at the start
        assert r.final_scale == actual["loss_scale_next"].iloc[-1]
    # overflowed steps replayed at a lower scale rest on their neighbours, and say so
    assert ampdoctor.replay(high, init_scale=2.0**10).estimated[:5].all()


def test_a_forward_overflow_skips_at_every_scale(trace_path):
    model = mlp(width=32)
    with torch.no_grad():
        model[0].weight.mul_(4e4)  # first layer outputs beyond 65504: inf in the forward pass
    train(model, 8, init_scale=2.0**16, trace=trace_path)
    st = ampdoctor.load(trace_path).steps()
    assert st["skipped"].all()
    for init in (2.0**16, 1.0, 2.0**-20):
        r = ampdoctor.replay(trace_path, init_scale=init)
        assert r.skipped.all() and not r.estimated.any()
        assert r.scales[-1] == init * 0.5**7


# -- underflow and the overflow threshold, against real casts of the run's real gradients ---------------------------
def _capture(model):
    """The gradients of a run as torch produced them, per step, independent of ampdoctor: every leaf module's output
    gradient (backward hooks) and, at each optimizer step, every parameter's .grad."""
    steps = [[]]

    def grad_out(module, grad_input, grad_output):
        steps[-1].append(grad_output[0].detach().clone())

    def at_step(opt, args, kwargs):
        steps[-1].extend(p.grad.detach().clone() for g in opt.param_groups for p in g["params"] if p.grad is not None)
        steps.append([])

    handles = [m.register_full_backward_hook(grad_out) for m in model.modules() if not list(m.children())]
    handles.append(register_optimizer_step_pre_hook(at_step))
    return steps, handles


def _real_shares(grads, scale):
    """(share below the smallest normal, share flushed to zero) of the non-zero FP16-computed gradient elements
    when multiplied by ``scale`` (a power of two: exact) and cast with ``.half()``; plus the shares the one-bin-per-
    binade histogram cannot place (documented in docs/trace-format.md): exact ties at half the smallest subnormal
    (they flush), and values in the sliver just below the smallest normal that round up to it."""
    fi = torch.finfo(torch.float16)
    tie = torch.nextafter(torch.zeros((), dtype=torch.float16), torch.ones((), dtype=torch.float16)).float() / 2
    normal = torch.tensor(fi.smallest_normal, dtype=torch.float16)
    top_sub = torch.nextafter(normal, torch.zeros((), dtype=torch.float16))
    sliver = (top_sub.float() + fi.smallest_normal) / 2
    vals = torch.cat([g.float().reshape(-1) for g in grads])
    vals = vals[vals != 0].abs() * scale
    h = vals.half().float()
    n = len(vals)
    return (
        (h < fi.smallest_normal).sum().item() / n,
        (h == 0).sum().item() / n,
        (vals == tie).sum().item() / n,
        ((vals >= sliver) & (vals < fi.smallest_normal)).sum().item() / n,
    )


def _captured_run(trace_path, steps=6):
    """No scaler and a small loss weight: FP16 gradients underflow (the grad-underflow fault). Every Linear runs in
    FP16 under autocast, so every output gradient and every parameter gradient here was computed in FP16."""
    model = mlp()
    grads, handles = _capture(model)
    train(model, steps, scaler=False, loss_weight=1e-3, trace=trace_path, attach_options={"every": 1, "hist_every": 1})
    for h in handles:
        h.remove()
    grads = [[g for g in step if g.dtype == torch.float16 or g.dtype == torch.float32] for step in grads[:steps]]
    return ampdoctor.load(trace_path), grads


def test_underflow_at_the_simulated_scale(trace_path):
    tr, grads = _captured_run(trace_path)
    assert all(any(g.dtype == torch.float16 for g in step) for step in grads)
    what_happened = ampdoctor.replay(tr, init_scale=1.0, growth_interval=10**6)
    with_scaler = ampdoctor.replay(tr)  # torch's defaults: 65536
    assert np.all(with_scaler.scales == 2.0**16) and not with_scaler.skipped.any()
    low = ampdoctor.replay(tr, init_scale=2.0**-8, growth_interval=10**6)
    for t in range(6):
        # scaling FP16 values up by a power of two is exact: the histogram what-if equals the real cast
        for r, scale in ((what_happened, 1.0), (with_scaler, 2.0**16)):
            under, flushed, _, _ = _real_shares(grads[t], scale)
            assert r.underflow[t] == pytest.approx(under, abs=1e-12)
            assert r.flushed[t] == pytest.approx(flushed, abs=1e-12)
        # scaled down, values round: the what-if is exact up to the ties and the sliver below 2^-14 it cannot see
        under, flushed, ties, sliver = _real_shares(grads[t], 2.0**-8)
        assert low.flushed[t] <= flushed + 1e-12 and flushed <= low.flushed[t] + ties + 1e-12
        assert under <= low.underflow[t] + 1e-12 and low.underflow[t] <= under + sliver + 1e-12
    assert low.mean_flushed > 0.1 and what_happened.mean_underflow > 0.5  # the scenario has something to count
    assert with_scaler.mean_underflow < what_happened.mean_underflow / 10
    shares = [ampdoctor.replay(tr, init_scale=2.0**k).mean_underflow for k in range(0, 17, 4)]
    assert shares == sorted(shares, reverse=True)


def test_overflow_threshold_is_where_the_cast_overflows(trace_path):
    """A scaled gradient between 65504 and 65520 rounds down to 65504 (no overflow, no skip); from 65520 on it is
    inf. The largest FP16-computed gradient of step 0, times the simulated scale, cast like GradScaler computes it."""
    tr, grads = _captured_run(trace_path, steps=2)
    peak = max(g.abs().max().item() for g in grads[0])
    for target in (65503.0, 65505.0, 65519.9, 65520.1, 65530.0):
        r = ampdoctor.replay(tr, init_scale=target / peak, growth_interval=10**6)
        scaled = (torch.tensor(peak, dtype=torch.float32) * torch.tensor(r.scales[0], dtype=torch.float32)).half()
        assert bool(r.skipped[0]) == bool(torch.isinf(scaled)), target


# -- --suggest --------------------------------------------------------------------------------------------------------
def test_suggest_removes_the_skips_and_the_printed_scaler_does_so_in_a_real_run(tmp_path):
    tr = _run(str(tmp_path / "high.db"), 40, 2.0**24, 2000)
    assert tr.steps()["skipped"].sum() >= 8
    sg = suggest(tr)
    assert sg.improves and sg.replay.n_skipped == 0 and sg.baseline.n_skipped == tr.steps()["skipped"].sum()
    assert sg.replay.lost < sg.baseline.lost
    scaler = eval(sg.code, {"torch": torch})  # the line exactly as printed
    assert isinstance(scaler, torch.amp.GradScaler) and scaler.get_growth_interval() == sg.settings["growth_interval"]
    _run(str(tmp_path / "fixed.db"), 40, scaler._init_scale, scaler.get_growth_interval())
    fixed = ampdoctor.load(str(tmp_path / "fixed.db")).steps()
    assert fixed["skipped"].sum() <= 1


# -- CLI ------------------------------------------------------------------------------------------------------------
def test_cli_prints_recorded_versus_simulated(trace_path, capsys):
    tr = _run(trace_path, 30, 2.0**20, 2000)
    n_skip = int(tr.steps()["skipped"].sum())
    assert main(["replay", trace_path]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"replay of {trace_path}: 30 steps"
    assert out[1] == "recorded   init_scale 1048576, growth_factor 2, backoff_factor 0.5, growth_interval 2000"
    assert out[2] == "simulated  init_scale 1048576, growth_factor 2, backoff_factor 0.5, growth_interval 2000"
    row = next(line for line in out if line.startswith("skipped steps"))
    pct = f"({100 * n_skip / 30:.2f}%)"
    assert row.split() == ["skipped", "steps", str(n_skip), pct, str(n_skip), pct]
    assert "(the run's own settings: the replay reproduces the recorded scale history)" in out

    assert main(["replay", trace_path, "--init-scale", "1024", "--suggest"]) == 0
    out = capsys.readouterr().out
    assert "simulated  init_scale 1024, growth_factor 2, backoff_factor 0.5, growth_interval 2000" in out
    assert "skipped steps" in out and "0 (0.00%)" in out
    line = next(x for x in out.splitlines() if x.strip().startswith("scaler = "))
    assert line.strip().startswith('scaler = torch.amp.GradScaler("cpu", init_scale=')


@pytest.mark.parametrize(
    "args, message",
    [
        (["--growth-factor", "0.5"], "Argument growth_factor should be a number > 1.0, but given 0.5"),
        (["--backoff-factor", "1.5"], "Argument backoff_factor should be a number in (0, 1), but given 1.5"),
        (["--growth-interval", "0"], "Argument growth_interval should be a positive int, but given 0"),
        (["--init-scale", "-1"], "Argument init_scale should be a positive finite number, but given -1.0"),
        (["--init-scale", "lots"], "argument --init-scale: invalid float value: 'lots'"),
    ],
)
def test_cli_bad_arguments_are_one_line_and_exit_2(trace_path, capsys, args, message):
    _run(trace_path, 2)
    assert main(["replay", trace_path, *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_cli_bad_traces_exit_2(tmp_path, capsys):
    empty = str(tmp_path / "empty.db")
    ampdoctor.attach(mlp(), trace=empty).close()
    for path, message in ((str(tmp_path / "missing.db"), "no such file"), (empty, "the trace has no steps yet")):
        assert main(["replay", path]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err
    assert os.path.exists(empty)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_a_run_without_fp16_is_replayed_as_if_it_were_fp16(trace_path, capsys, precision):
    train(mlp(), 6, precision=precision, trace=trace_path)
    r = ampdoctor.replay(trace_path)
    assert r.assumed_fp16 and r.settings == {
        "init_scale": 65536.0,
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": 2000,
    }
    assert r.scales[0] == 65536.0 and len(r.scales) == 6
    assert main(["replay", trace_path]) == 0
    out = capsys.readouterr().out
    assert "recorded   no GradScaler (unscaled gradients); simulated with torch's defaults unless given" in out
    assert "note: the run computed no gradient in FP16; replayed as if it had (what FP16 would do)" in out


def test_a_manual_scale_change_is_reported_not_hidden(trace_path, capsys):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    with ampdoctor.attach(model, optimizer=opt, scaler=scaler, trace=trace_path):
        for i, (x, y) in enumerate(batches(8)):
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
            scaler.scale(torch.nn.functional.mse_loss(out.float(), y)).backward()
            scaler.step(opt)
            scaler.update(new_scale=64.0 if i == 4 else None)
    r = ampdoctor.replay(trace_path)
    assert r.scales[5] == 1024.0 and ampdoctor.load(trace_path).steps()["loss_scale"][5] == 64.0
    assert main(["replay", trace_path]) == 0
    assert (
        "note: the recorded scale departs from GradScaler's rule at step 5 (a manual update(new_scale)"
        in capsys.readouterr().out
    )


@pytest.mark.parametrize(
    "kwargs, exc, message",
    [
        ({"init_scale": 0.0}, ValueError, "Argument init_scale should be a positive finite number, but given 0.0"),
        ({"init_scale": True}, ValueError, "Argument init_scale should be a positive finite number, but given True"),
        ({"growth_factor": 1.0}, ValueError, "Argument growth_factor should be a number > 1.0, but given 1.0"),
        ({"backoff_factor": 0.0}, ValueError, "Argument backoff_factor should be a number in (0, 1), but given 0.0"),
        ({"growth_interval": 2.5}, ValueError, "Argument growth_interval should be a positive int, but given 2.5"),
    ],
)
def test_library_arguments_are_validated(trace_path, kwargs, exc, message):
    _run(trace_path, 2)
    with pytest.raises(exc, match=message.replace("(", r"\(").replace(")", r"\)")):
        ampdoctor.replay(trace_path, **kwargs)
    with pytest.raises(TypeError, match="Argument trace_or_path should be an ampdoctor.Trace or a path"):
        ampdoctor.replay(3)
