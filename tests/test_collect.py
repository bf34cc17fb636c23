"""attach() on real CPU training runs: what the trace holds, and that training is left exactly as it was."""

import logging
import math
import os
import pathlib
import time
import warnings

import numpy as np
import pytest
import torch
import torch.utils.checkpoint
from runs import batches, mlp, train

import ampdoctor
from ampdoctor.collect import compiled


def params_of(model):
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize(
    "precision,options",
    [
        ("fp16", {}),
        ("fp16", {"mode": "debug"}),
        ("fp16", {"every": 1, "hist_every": 1, "weight_every": 7}),
        ("bf16", {}),
        ("bf16", {"mode": "debug"}),
        ("fp32", {"every": 3, "weight_every": 5}),
        ("fp32", {"mode": "debug", "weight_every": 1}),
    ],
)
def test_zero_observer_effect(tmp_path, precision, options):
    """50 steps with and without attach end with bit-identical parameters and the same loss scale, with the
    default tiers (sentinel steps, sampled steps, flight recorder after the skipped steps) and in debug mode."""
    init = 2.0**20 if precision == "fp16" else 2.0**16  # some skipped steps: the scaler path is exercised
    ref, _, ref_scaler, ref_losses = train(
        mlp(seed=3), 50, precision=precision, init_scale=init, growth_interval=7, optimizer="adam", lr=1e-3
    )
    got, _, scaler, losses = train(
        mlp(seed=3),
        50,
        precision=precision,
        init_scale=init,
        growth_interval=7,
        optimizer="adam",
        lr=1e-3,
        trace=str(tmp_path / "t.db"),
        attach_options=options,
    )
    assert all(torch.equal(a, b) for a, b in zip(params_of(ref), params_of(got)))
    assert losses == ref_losses
    if precision == "fp16":
        assert scaler.get_scale() == ref_scaler.get_scale()
        assert ampdoctor.load(tmp_path / "t.db").steps()["skipped"].any()


def test_steps_scale_history_loss_and_grad_norm(trace_path):
    """The per-step table agrees with what the loop itself saw, step by step."""
    torch.manual_seed(0)
    model = mlp(width=64)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24, growth_interval=5)
    seen = []
    with ampdoctor.attach(model, optimizer=opt, scaler=scaler, trace=trace_path):
        for x, y in batches(30, batch=16):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.mse_loss(model(x).float(), y)
            opt.zero_grad()
            before = scaler.get_scale()
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])).item()
            scaler.step(opt)
            scaler.update()
            seen.append((loss.item(), before, scaler.get_scale(), norm))
    df = ampdoctor.load(trace_path).steps()
    assert len(df) == 30 and df["step"].tolist() == list(range(30))
    assert df["loss"].tolist() == [s[0] for s in seen]
    assert df["loss_scale"].tolist() == [s[1] for s in seen]
    assert df["loss_scale_next"].tolist() == [s[2] for s in seen]
    expected_skips = [after < before for _, before, after, _ in seen]
    assert df["skipped"].tolist() == expected_skips and any(expected_skips) and not all(expected_skips)
    finite = [i for i, s in enumerate(seen) if math.isfinite(s[3])]
    assert np.allclose(df["grad_norm"].to_numpy()[finite], [seen[i][3] for i in finite], rtol=1e-5)
    assert (df["microbatches"] == 1).all() and (df["samples"] == 16).all()
    assert (df["lr"] == 0.01).all() and (df["step_time"] > 0).all() and (df["data_time"] >= 0).all()


def test_grad_out_is_stored_with_the_scale_in_force(trace_path):
    captured = {}
    model = mlp(width=32, depth=2)

    def keep(grad):
        captured.setdefault("g", grad.detach().float().abs().max().item())

    model[2].register_forward_hook(lambda m, i, o: o.register_hook(keep) and None)
    train(model, 1, init_scale=2.0**10, trace=trace_path, attach_options={"every": 1})
    tr = ampdoctor.load(trace_path)
    j = tr.sites("grad_out")["path"].tolist().index("2")
    assert tr.records("scale", "grad_out")[0, j] == 2.0**10
    assert tr.records("absmax", "grad_out")[0, j] == captured["g"]  # stored scaled, exactly as seen
    assert tr.records("scale", "param_grad")[0, 0] == 1.0  # .grad after unscale


def test_activation_statistics_equal_direct_computation(trace_path):
    """Full statistics of one layer at one step equal the same numbers computed on the captured output."""
    outs = {}
    model = mlp(width=48, depth=2)

    def keep(module, args, out):
        outs[len(outs)] = out.detach().clone()

    model[1].register_forward_hook(keep)
    train(
        model,
        4,
        precision="bf16",
        trace=trace_path,
        attach_options={"every": 3, "hist_every": 3, "peak_every": 1, "calibration": 0},
    )
    tr = ampdoctor.load(trace_path)
    j = tr.sites("act")["path"].tolist().index("1")
    o = outs[3].double()
    assert tr.records("numel", "act")[3, j] == o.numel()
    assert tr.records("zeros", "act")[3, j] == (o == 0).sum().item()
    assert tr.records("absmax", "act")[3, j] == o.abs().max().item()
    assert tr.records("mean", "act")[3, j] == pytest.approx(o.mean().item(), rel=1e-5)
    assert np.isnan(tr.records("absmax", "act")[1, j])  # step 1: peaks only
    assert tr.records("peak", "act")[1, j] == outs[1].abs().max().item()
    steps, counts = tr.hist("1", "act")
    assert steps.tolist() == [0, 3]
    nz = o[o != 0].abs()
    assert counts[1].sum() == nz.numel()
    assert counts[1][int(np.floor(np.log2(nz.max().item()))) + 127] > 0


def test_gradient_accumulation_belongs_to_the_optimizer_step(trace_path):
    train(mlp(width=32), 6, accumulation=4, trace=trace_path, attach_options={"every": 1})
    tr = ampdoctor.load(trace_path)
    df = tr.steps()
    assert len(df) == 6 and (df["microbatches"] == 4).all() and (df["samples"] == 4 * 32).all()
    j = tr.sites("act")["path"].tolist().index("0")
    assert tr.records("numel", "act")[:, j].tolist() == [4 * 32 * 32] * 6
    assert tr.records("calls", "act")[:, j].tolist() == [4] * 6


class Reuse(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.shared = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 1)

    def forward(self, x):
        return self.head(self.shared(torch.relu(self.shared(x))))


def test_module_called_twice_per_step(trace_path):
    data = [(torch.randn(8, 16), torch.randn(8, 1)) for _ in range(3)]
    train(Reuse(), 3, precision="bf16", data=data, trace=trace_path, attach_options={"every": 1})
    tr = ampdoctor.load(trace_path)
    j = tr.sites("act")["path"].tolist().index("shared")
    assert tr.records("calls", "act")[:, j].tolist() == [2, 2, 2]
    assert tr.records("numel", "act")[:, j].tolist() == [2 * 8 * 16] * 3
    g = tr.sites("grad_out")["path"].tolist().index("shared")
    assert tr.records("calls", "grad_out")[:, g].tolist() == [2, 2, 2]


class Checkpointed(torch.nn.Module):
    def __init__(self, reentrant):
        super().__init__()
        self.reentrant = reentrant
        self.block = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
        self.head = torch.nn.Linear(16, 1)

    def forward(self, x):
        x = x.requires_grad_() if self.reentrant else x
        h = torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=self.reentrant)
        return self.head(h)


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_not_double_counted(trace_path, reentrant):
    data = [(torch.randn(8, 16), torch.randn(8, 1)) for _ in range(3)]
    model = Checkpointed(reentrant)
    ref = Checkpointed(reentrant)
    ref.load_state_dict(model.state_dict())
    train(ref, 3, precision="bf16", data=list(data))
    train(model, 3, precision="bf16", data=list(data), trace=trace_path, attach_options={"every": 1})
    assert all(torch.equal(a, b) for a, b in zip(params_of(ref), params_of(model)))
    tr = ampdoctor.load(trace_path)
    acts = tr.sites("act")["path"].tolist()
    j = acts.index("block.0")
    assert tr.records("calls", "act")[:, j].tolist() == [1, 1, 1]
    assert tr.records("numel", "act")[:, j].tolist() == [8 * 32] * 3
    grads = tr.sites("grad_out")["path"].tolist()
    assert "block.0" in grads
    assert tr.records("calls", "grad_out")[:, grads.index("block.0")].tolist() == [1, 1, 1]


def test_no_grad_evaluation_is_not_a_training_step(trace_path):
    def evaluate(step, model, doc):
        with torch.no_grad():
            val = torch.nn.functional.mse_loss(model(torch.randn(64, 32)), torch.randn(64, 1))
        doc.log_metric("val/loss", val)

    train(mlp(width=32), 5, precision="fp32", trace=trace_path, attach_options={"every": 1}, on_step=evaluate)
    tr = ampdoctor.load(trace_path)
    df = tr.steps()
    assert len(df) == 5 and (df["microbatches"] == 1).all() and (df["samples"] == 32).all()
    j = tr.sites("act")["path"].tolist().index("0")
    assert (tr.records("numel", "act")[:, j] == 32 * 32).all()  # the 64-row eval batches are not in it
    m = tr.metrics()
    assert m["step"].tolist() == [0, 1, 2, 3, 4] and (m["name"] == "val/loss").all()


class Attention(torch.nn.Module):
    """q k^T without the 1/sqrt(d) scale, computed in the parent's own code: the overflow origin is the parent."""

    def __init__(self, d=32, gain=200.0):
        super().__init__()
        self.q = torch.nn.Linear(d, d)
        self.k = torch.nn.Linear(d, d)
        self.out = torch.nn.Linear(d, d)
        with torch.no_grad():
            self.q.weight.mul_(gain)
            self.k.weight.mul_(gain)

    def forward(self, x):
        scores = self.q(x) @ self.k(x).transpose(-1, -2)  # FP16 under autocast: overflows
        return self.out(torch.softmax(scores, dim=-1) @ x)


def test_first_nonfinite_in_forward_is_the_parent_not_the_child(trace_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), Attention(), torch.nn.Linear(32, 1))
    data = [(torch.randn(4, 16, 32), torch.randn(4, 16, 1)) for _ in range(2)]
    train(model, 2, precision="fp16", data=data, trace=trace_path)
    ev = ampdoctor.load(trace_path).events("nonfinite")
    assert len(ev) == 2
    assert ev["path"].tolist() == ["1", "1"] and ev["phase"].tolist() == ["fwd", "fwd"]


class Blowup(torch.nn.Module):
    def forward(self, x):
        return x * 1e5  # FP16 input -> values above 65504 -> inf


def test_first_nonfinite_in_forward_is_the_child_that_overflows(trace_path):
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 8),
        torch.nn.Sequential(torch.nn.ReLU(), Blowup(), torch.nn.Linear(8, 8)),
        torch.nn.Linear(8, 1),
    )
    data = [(torch.randn(4, 8) + 3, torch.randn(4, 1)) for _ in range(1)]
    train(model, 1, precision="fp16", data=data, trace=trace_path)
    ev = ampdoctor.load(trace_path).events("nonfinite")
    assert ev["path"].tolist() == ["1.1"] and ev["phase"].tolist() == ["fwd"]


def test_first_nonfinite_in_backward_with_too_high_scale(trace_path):
    train(mlp(width=64), 3, init_scale=2.0**24, trace=trace_path)
    tr = ampdoctor.load(trace_path)
    ev = tr.events("nonfinite")
    assert len(ev) == 3 and set(ev["phase"]) == {"bwd"}
    assert ev["path"].iloc[0] == "6"  # the output layer: where the scaled gradient first overflows
    df = tr.steps()
    assert df["skipped"].all() and (df["level"] == 2).iloc[1:].all()  # anomalies get full statistics after


def test_close_restores_everything(trace_path):
    model = mlp(width=16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    doc = ampdoctor.attach(model, optimizer=opt, scaler=scaler, trace=trace_path)
    assert "scale" in vars(scaler) and any(m._forward_hooks for m in model.modules())
    doc.close()
    doc.close()  # idempotent
    assert "scale" not in vars(scaler) and "update" not in vars(scaler)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert not opt._optimizer_step_post_hooks and not opt._optimizer_step_pre_hooks
    assert not doc.active


def test_hook_error_warns_once_and_training_finishes(trace_path, monkeypatch):
    from ampdoctor.collect import stats

    calls = {"n": 0}
    real = stats.full

    def flaky(x):
        calls["n"] += 1
        if calls["n"] > 5:
            raise RuntimeError("boom")
        return real(x)

    monkeypatch.setattr(stats, "full", flaky)
    ref = train(mlp(seed=5), 8, precision="bf16")[0]
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        got = train(mlp(seed=5), 8, precision="bf16", trace=trace_path, attach_options={"every": 1})[0]
    msgs = [str(x.message) for x in w if "ampdoctor" in str(x.message)]
    assert len(msgs) == 1 and "boom" in msgs[0] and "training continues" in msgs[0]
    assert all(torch.equal(a, b) for a, b in zip(params_of(ref), params_of(got)))
    assert not any(m._forward_hooks for m in got.modules())
    ampdoctor.load(trace_path)  # what was written before the error is readable


def test_writer_error_warns_and_training_finishes(trace_path, monkeypatch):
    from ampdoctor.trace import writer

    def broken(self, conn, packets):
        raise OSError("No space left on device")

    monkeypatch.setattr(writer.Writer, "_write_steps", broken)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        _, _, _, losses = train(mlp(), 10, precision="bf16", trace=trace_path)
    assert len(losses) == 10
    msgs = [str(x.message) for x in w if "ampdoctor" in str(x.message)]
    assert len(msgs) == 1 and "No space left" in msgs[0]


def test_read_only_directory_warns_and_training_runs(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    if os.geteuid() == 0:  # root writes through file modes: use a directory no one may write to
        ro = pathlib.Path("/sys/fs")
    try:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            _, _, _, losses = train(mlp(), 5, precision="bf16", trace=str(ro / "sub" / "t.db"))
        assert len(losses) == 5
        assert any("cannot write the trace" in str(x.message) for x in w)
        assert not (ro / "sub").exists()
    finally:
        (tmp_path / "ro").chmod(0o700)


def test_existing_trace_is_never_overwritten_and_rank_in_path(tmp_path):
    path = tmp_path / "exp-{rank}.db"
    train(mlp(), 2, precision="bf16", trace=str(path))
    first = tmp_path / "exp-0.db"
    before = first.read_bytes()
    with pytest.warns(RuntimeWarning, match="exp-0-1.db"):
        train(mlp(), 3, precision="bf16", trace=str(path))
    assert first.read_bytes() == before
    assert ampdoctor.load(tmp_path / "exp-0-1.db").n_steps == 3


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"model": "not a model"}, "Argument model should be of type torch.nn.Module, but given <class 'str'>"),
        ({"optimizer": 3}, "Argument optimizer should be of type torch.optim.Optimizer"),
        ({"scaler": object()}, "Argument scaler should be a torch.amp.GradScaler"),
        ({"every": 0}, "Argument every should be a positive int, but given 0"),
    ],
)
def test_arguments_are_validated_eagerly(trace_path, kwargs, message):
    args = {"model": mlp(), "trace": trace_path, **kwargs}
    with pytest.raises((TypeError, ValueError), match=message.replace("(", r"\(").replace(")", r"\)")):
        ampdoctor.attach(**args)


def test_manual_steps_without_optimizer(trace_path):
    model = mlp(width=16)
    with ampdoctor.attach(model, trace=trace_path) as doc:
        for x, y in batches(4):
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.01 * p.grad
                    p.grad = None
            doc.log_loss(loss)
            doc.step()
    df = ampdoctor.load(trace_path).steps()
    assert len(df) == 4 and df["loss"].notna().all()


def test_precision_configuration_is_recorded(trace_path):
    model = mlp(width=16)
    train(model, 2, precision="fp16", init_scale=1024.0, trace=trace_path)
    cfg = ampdoctor.load(trace_path).config
    assert cfg["autocast"] == {"device_type": "cpu", "enabled": True, "dtype": "float16"}
    assert cfg["param_dtypes"] == {"float32": sum(p.numel() for p in model.parameters())}
    assert cfg["scaler"]["init_scale"] == 1024.0 and cfg["scaler"]["growth_interval"] == 2000
    assert cfg["optimizer"]["class"] == "SGD" and cfg["optimizer"]["groups"][0]["lr"] == 0.01
    sites = ampdoctor.load(trace_path).sites("act")
    assert set(sites["dtype"]) == {"float16"}


def train_half(model, opt, trace_path, steps=4, **options):
    """O3-style loop: a half-precision model fed half inputs, no autocast, no scaler."""
    with ampdoctor.attach(model, optimizer=opt, trace=trace_path, **options) as doc:
        for x, y in batches(steps):
            loss = torch.nn.functional.mse_loss(model(x.half()).float(), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            doc.log_loss(loss)
    return ampdoctor.load(trace_path)


def test_half_model_records_weights_and_lost_updates(trace_path):
    """O3-style: model.half() with plain SGD. Updates below half an ULP of the weights vanish, and the trace
    shows it: the update is zero where the gradient is not."""
    torch.manual_seed(0)
    model = mlp(width=64).half()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    tr = train_half(model, opt, trace_path, every=1, weight_every=2)
    assert tr.config["param_dtypes"] == {"float16": sum(p.numel() for p in model.parameters())}
    ups = tr.sites("update")
    assert set(ups["dtype"]) == {"float16"} and len(ups) == 8
    j = ups["path"].tolist().index("0.weight")
    zero_update = tr.records("zeros", "update")[2, j] / tr.records("numel", "update")[2, j]
    g = tr.sites("param_grad")["path"].tolist().index("0.weight")
    zero_grad = tr.records("zeros", "param_grad")[2, g] / tr.records("numel", "param_grad")[2, g]
    assert zero_update > 0.5 and zero_grad < 0.05
    assert np.isnan(tr.records("numel", "update")[1]).all()  # only every weight_every steps
    assert tr.records("numel", "weight")[2, j] == 64 * 32


def test_weights_turned_nonfinite_by_the_update_are_an_event(trace_path):
    """model.half() + Adam: eps=1e-8 is 0 in FP16, so 0/0 turns weights NaN in the first update. The next forward
    is non-finite from finite inputs, but the origin is the update, and the trace says so."""
    torch.manual_seed(0)
    model = mlp(width=32).half()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    tr = train_half(model, opt, trace_path, live=False)
    wev = tr.events("nonfinite_weights")
    assert wev["step"].tolist()[0] == 0 and "0.weight" in wev["data"][0]["params"]
    assert tr.events("nonfinite")["step"].min() == 1  # the forward of step 1 is the first to see them
    assert "forward-overflow" not in [f.rule for f in ampdoctor.diagnose(tr)]


def train_compiled(trace_path, caplog, steps, *, attach_first, on_attach=None):
    """mlp() trained ``steps`` steps through torch.compile with a backend that counts the graphs dynamo compiles,
    attached (calibration=2, peak_every=3) to the compiled module, or (``attach_first``) to the eager model, compiled
    after; ``on_attach(model)`` runs once attached. Asserts that dynamo compiled the model, no graph after the first
    step and no recompilation (its warning, which traced hooks reach within the first step). Returns the trace."""
    compiles = []

    def counting_backend(gm, example_inputs):
        compiles.append(len(gm.graph.nodes))
        return gm.forward

    torch._dynamo.reset()
    model = mlp(width=32)
    fast = None if attach_first else torch.compile(model, backend=counting_backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    after_step = []
    with (
        caplog.at_level(logging.WARNING, logger="torch._dynamo"),
        ampdoctor.attach(
            model if attach_first else fast, optimizer=opt, trace=trace_path, live=False, calibration=2, peak_every=3
        ) as doc,
    ):
        if on_attach is not None:
            on_attach(model)
        if fast is None:
            fast = torch.compile(model, backend=counting_backend)
        for x, y in batches(steps):
            loss = torch.nn.functional.mse_loss(fast(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            doc.log_loss(loss)
            after_step.append(len(compiles))
        assert doc.active
    assert not [r for r in caplog.records if "recompil" in r.getMessage().lower()]
    assert after_step[0] > 0  # the model was compiled (the backend did run)
    assert after_step == [after_step[0]] * steps, after_step
    return ampdoctor.load(trace_path)


def test_torch_compile_runs_hooks_eagerly_without_recompiling(trace_path, caplog):
    """Under torch.compile the hooks run eagerly (torch.compiler.disable): traced, their identity bookkeeping
    would make dynamo recompile, per call or per step. A counting backend sees every graph dynamo compiles: none
    after the first step; and no frame reaches dynamo's recompile limit (its warning), which traced hooks reach
    within the first step. Steps that observe sites and steps that do not alternate."""
    tr = train_compiled(trace_path, caplog, 6, attach_first=False)
    assert tr.n_steps == 6 and tr.steps()["loss"].notna().all()
    assert "_orig_mod.0" in tr.sites("act")["path"].tolist()
    assert tr.steps()["level"].tolist() == [2, 2, -1, 0, -1, -1]
    assert np.isfinite(tr.records("peak", "grad_out")[[0, 1, 3]]).all()


def test_a_model_compiled_after_attach_runs_the_hooks_eagerly_without_recompiling(trace_path, caplog):
    """attach() on the eager model, torch.compile after it: the root's hooks (C++ EagerHook objects where the
    extension is loaded, hooks.eager's wrapper otherwise) run eagerly from the compiled region, never traced: no
    graph after the first step, no recompilation, every step recorded."""

    def hooks_in_c(model):
        if compiled.get() is not None:
            assert all(type(h).__name__ == "EagerHook" for h in model._forward_pre_hooks.values())

    st = train_compiled(trace_path, caplog, 8, attach_first=True, on_attach=hooks_in_c).steps()
    assert len(st) == 8 and st["loss"].notna().all() and (st["reason"] == "sentinel").sum() >= 3


def test_accelerator_path_writes_the_trace_the_host_path_writes(tmp_path, monkeypatch):
    """On an accelerator nothing is read before the step's one transfer (stats._full_device, device-side loss,
    scale and norm). Those paths run here on the CPU with host reads switched off and must record the same run:
    same steps, skips, peaks, statistics, histograms and non-finite events, and the same zero observer effect."""
    import sqlite3

    from ampdoctor.collect import stats as K

    paths, models = {}, {}
    for host in (True, False):
        monkeypatch.setattr(K, "HOST_READS", host)
        paths[host] = str(tmp_path / f"host_{host}.db")
        models[host], _, _, _ = train(
            mlp(seed=5),
            14,
            precision="fp16",
            init_scale=2.0**20,
            growth_interval=3,
            trace=paths[host],
            attach_options={"every": 2, "hist_every": 4, "weight_every": 5},
        )
    assert all(torch.equal(a, b) for a, b in zip(models[True].parameters(), models[False].parameters()))
    a, b = ampdoctor.load(paths[True]), ampdoctor.load(paths[False])
    sa, sb = a.steps(), b.steps()
    assert sa["skipped"].any() and (sa["skipped"] == sb["skipped"]).all()
    for col in ("loss", "loss_scale", "loss_scale_next", "grad_norm", "microbatches"):
        assert np.allclose(sa[col].astype(float), sb[col].astype(float), rtol=1e-6, equal_nan=True), col
    for field, kind in [("peak", k) for k in ("act", "grad_out", "param_grad")] + [
        ("absmax", "grad_out"),
        ("fp16_flush", "grad_out"),
        ("fp16_sub", "param_grad"),
        ("zeros", "act"),
        ("nan", "grad_out"),
        ("mean", "act"),
        ("rms", "grad_out"),
        ("minabs", "weight"),
        ("rms", "update"),
    ]:
        ra, rb = a.records(field, kind), b.records(field, kind)
        assert ra.shape == rb.shape and np.isfinite(ra).any(), (field, kind)
        assert np.allclose(ra, rb, rtol=1e-5, equal_nan=True), (field, kind)
    query = {
        "hists": "SELECT step, site, lo, counts FROM hists ORDER BY step, site",
        "events": "SELECT step, kind, site, phase FROM events ORDER BY id",
    }
    for table, sql in query.items():
        rows = [sqlite3.connect(paths[h]).execute(sql).fetchall() for h in (True, False)]
        assert rows[0] and rows[0] == rows[1], table


@pytest.mark.parametrize("every", [1, 100])
def test_sparse_embedding_gradients_are_observed(tmp_path, every):
    """nn.Embedding(sparse=True) gives sparse .grad tensors: their peak and their share of the gradient norm come
    from the stored values, and collection goes on (it used to stop at the first step)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(100, 16, sparse=True), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = str(tmp_path / "sparse.db")
    g = torch.Generator().manual_seed(1)
    expected = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "collection stopped" warning
        with ampdoctor.attach(model, optimizer=opt, trace=path, live=False, every=every) as doc:
            for _ in range(6):
                x = torch.randint(0, 100, (8, 4), generator=g)
                loss = model(x).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                emb = model[0].weight.grad.coalesce().values()
                dense = [emb] + [p.grad for p in model[1].parameters()]
                expected.append((emb.abs().max().item(), math.sqrt(sum(float(t.double().pow(2).sum()) for t in dense))))
                opt.step()
                doc.log_loss(loss)
            assert doc.active  # still collecting after the last step (checked before close)
    tr = ampdoctor.load(path)
    steps = tr.steps()
    assert len(steps) == 6
    assert np.allclose(steps["grad_norm"], [n for _, n in expected], rtol=1e-5)
    sites = tr.sites()
    col = sites.index[(sites["path"] == "0.weight") & (sites["kind"] == "param_grad")][0]
    peaks = tr.records("peak", "param_grad")[:, list(sites.index[sites["kind"] == "param_grad"]).index(col)]
    assert np.allclose(peaks, [m for m, _ in expected], rtol=1e-6)


# -- attach on the wrong objects: refused cleanly, or warned about once (issues 9 and 10) ---------------------------


def _ampdoctor_threads():
    import threading

    return [t for t in threading.enumerate() if t.name.startswith("ampdoctor")]


def test_failed_attach_leaves_nothing_behind(tmp_path):
    """A ScriptModule refuses the root pre-hook after the children got theirs: nothing of the attempt remains."""
    model = torch.jit.script(mlp(width=16))
    before = _ampdoctor_threads()
    path = tmp_path / "t.db"
    with pytest.raises(RuntimeError, match="not supported on ScriptModules"):
        ampdoctor.attach(model, trace=str(path))
    assert not any(m._forward_hooks for m in model.modules())
    assert not set(_ampdoctor_threads()) - set(before)  # no writer or live thread started and left
    assert not list(tmp_path.iterdir())
    with pytest.raises(RuntimeError, match="not supported on ScriptModules"):  # not "already observed"
        ampdoctor.attach(model, trace=str(path))


def test_unknown_rules_are_refused_at_attach(tmp_path):
    with pytest.raises(ValueError, match="Unknown rule id 'grad-undreflow'"):
        ampdoctor.attach(mlp(), trace=str(tmp_path / "t.db"), rules={"grad-undreflow": None})
    with pytest.raises(ValueError, match="has no threshold 'share'"):
        ampdoctor.attach(mlp(), trace=str(tmp_path / "t.db"), rules={"grad-underflow": {"share": 0.1}})
    assert not list(tmp_path.iterdir())


def test_second_doctor_on_the_same_model_or_scaler_is_refused(tmp_path):
    model, other = mlp(width=16), mlp(width=16, seed=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    first = ampdoctor.attach(model, optimizer=opt, scaler=scaler, trace=str(tmp_path / "a.db"))
    with pytest.raises(RuntimeError, match=r"already observed by the Doctor writing .*a\.db; close\(\) that one"):
        ampdoctor.attach(model, trace=str(tmp_path / "b.db"))
    with pytest.raises(RuntimeError, match="GradScaler is already observed"):
        ampdoctor.attach(other, scaler=scaler, trace=str(tmp_path / "c.db"))
    with pytest.raises(RuntimeError, match="Linear is already observed"):  # a part of an observed model
        ampdoctor.attach(model[0], trace=str(tmp_path / "d.db"))
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".db") == ["a.db"]
    first.close()
    _model2, _, _, _ = train(model, 3, trace=str(tmp_path / "e.db"))  # free again once the first is closed
    assert ampdoctor.load(tmp_path / "e.db").n_steps == 3


def test_log_metric_with_a_non_number_warns_once_and_collection_goes_on(trace_path):
    def metrics(i, model, doc):
        doc.log_metric("val/acc", "n/a" if i < 3 else 0.5 + i / 100)
        doc.log_metric("val/vec", torch.ones(3))
        assert doc.active

    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        train(mlp(width=16), 6, precision="fp32", trace=trace_path, on_step=metrics)
    msgs = [str(x.message) for x in w if "ampdoctor" in str(x.message)]
    assert len(msgs) == 2 and "log_metric('val/acc') skipped: the value 'n/a' is not a real number" in msgs[0]
    tr = ampdoctor.load(trace_path)
    assert tr.n_steps == 6 and tr.steps()["loss"].notna().all()
    m = tr.metrics()
    assert m["name"].tolist() == ["val/acc"] * 3 and m["step"].tolist() == [3, 4, 5]


def test_optimizer_of_another_model_warns_and_buffers_stay_bounded(trace_path, monkeypatch):
    """The optimizer given never steps this model: one clear warning, and a step's buffers stop growing."""
    from ampdoctor.collect import collector

    monkeypatch.setattr(collector, "MAX_STEP_ENTRIES", 200)  # the real bound is reached after ~12k micro-batches
    model = mlp(width=16)
    own = torch.optim.SGD(model.parameters(), lr=0.01)
    unrelated = torch.optim.SGD(mlp(width=8).parameters(), lr=0.01)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        with ampdoctor.attach(model, optimizer=unrelated, trace=trace_path) as doc:
            most = 0
            for x, y in batches(80, batch=4):
                loss = torch.nn.functional.mse_loss(model(x), y)
                own.zero_grad()
                loss.backward()
                own.step()
                doc.log_loss(loss)
                state = doc._collector.state  # (white box: the bound is internal)
                most = max(most, len(doc._collector.record.entries), len(state.losses))
    msgs = [str(x.message) for x in w if "ampdoctor" in str(x.message)]
    assert "3 optimizer steps went by without a step boundary" in msgs[0]
    assert "the optimizer given to attach() never ended a step: pass the one that updates this model" in msgs[0]
    assert any("observations of the unfinished step are dropped" in m for m in msgs) and len(msgs) == 2
    assert most <= 200 + 20 and 0 < len(doc._collector.state.losses) <= collector.MAX_STEP_LOSSES


def test_no_step_boundary_warns_with_the_fix(trace_path):
    """attach(model) with neither optimizer nor doctor.step(): the run said nothing and recorded 0 steps."""
    model = mlp(width=16)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with (
        pytest.warns(
            RuntimeWarning,
            match=r"3 optimizer steps went by without a step boundary.*"
            r"attach\(model, optimizer=opt\)\), or call doctor.step\(\)",
        ),
        ampdoctor.attach(model, trace=trace_path),
    ):
        for x, y in batches(5):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    with pytest.warns(RuntimeWarning, match="the whole run went by without a step boundary"):
        with ampdoctor.attach(model, trace=trace_path.replace(".db", "2.db")):
            model(torch.randn(2, 32)).sum().backward()


def test_lbfgs_closures_inside_one_step_are_not_missed_boundaries(trace_path):
    """LBFGS evaluates its closure (zero_grad, forward, backward) several times inside one optimizer.step(): those
    cleared gradients are the step's own, not steps that went by without a boundary. No warning, one step each."""
    model = mlp(width=16)
    opt = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ampdoctor.attach(model, optimizer=opt, trace=trace_path, live=False) as doc:
            for x, y in batches(12):

                def closure():
                    opt.zero_grad()
                    loss = torch.nn.functional.mse_loss(model(x), y)
                    loss.backward()
                    return loss

                doc.log_loss(opt.step(closure))
    assert [str(w.message) for w in caught if "ampdoctor" in str(w.message)] == []
    st = ampdoctor.load(trace_path).steps()
    assert st["step"].tolist() == list(range(12)) and (st["microbatches"] >= 2).all()


class _Wrapper(torch.nn.Module):
    """Holds the network but is never called itself, like a LightningModule whose training_step calls self.net."""

    def __init__(self):
        super().__init__()
        self.net = mlp(width=16)


def test_module_whose_forward_never_runs_warns_and_time_rules_stay_silent(trace_path):
    wrapper = _Wrapper()
    opt = torch.optim.SGD(wrapper.parameters(), lr=0.01)
    with (
        pytest.warns(
            RuntimeWarning,
            match=r"3 steps ended but _Wrapper.forward was never called.*"
            r"Attach the module whose forward runs",
        ),
        ampdoctor.attach(wrapper, optimizer=opt, trace=trace_path, live=False) as doc,
    ):
        for x, y in batches(12):
            time.sleep(0.002)  # "loading": a wait the observer could mistake for input time
            loss = torch.nn.functional.mse_loss(wrapper.net(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            doc.log_loss(loss)
    tr = ampdoctor.load(trace_path)
    st = tr.steps()
    assert len(st) == 12 and st["data_time"].isna().all() and st["samples"].isna().all()
    assert (st["step_time"] > 0).all() and tr.config["step_start"] is None
    assert tr.sites("act")["path"].tolist()[:1] == ["net.0"]  # the inner modules are still observed
    assert "input-pipeline-bound" not in [f.rule for f in ampdoctor.diagnose(trace_path)]


def test_autocast_entered_inside_forward_is_detected(trace_path):
    """Frameworks (accelerate) enter autocast inside forward, after the root pre-hook ran."""

    class AutocastInside(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mlp(width=16)

        def forward(self, x):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return self.net(x)

    model = AutocastInside()
    train(model, 2, precision="fp32", trace=trace_path)
    from ampdoctor.precision_label import describe_precision

    cfg = ampdoctor.load(trace_path).config
    assert cfg["autocast"] == {"device_type": "cpu", "enabled": True, "dtype": "bfloat16"}
    assert describe_precision(cfg) == "O1-style: autocast bfloat16, FP32 master weights"


def test_sentinel_figures_of_huge_and_non_finite_gradients():
    """The sentinel's norm and peak against float64 references: finite gradients whose squares overflow float32
    still give a finite norm, a NaN gives NaN; and nothing warns into the user's run."""
    import warnings as W

    from ampdoctor.collect.buffers import GradFigures

    params = [(f"p{i}", torch.nn.Parameter(torch.zeros(50))) for i in range(3)]
    for i, (_, p) in enumerate(params):
        p.grad = torch.linspace(-1, 1, 50) * 10.0 ** (10 * i + 10)  # up to 1e30: squares overflow float32
    ref = torch.cat([p.grad.double() for _, p in params])
    with W.catch_warnings():
        W.simplefilter("error")
        norm, peak = GradFigures()(params)
        assert norm == pytest.approx(float(ref.norm()), rel=1e-6) and peak == float(ref.abs().max())
        params[1][1].grad[3] = float("nan")
        norm, peak = GradFigures()(params)
    assert math.isnan(norm) and math.isnan(peak)


def test_a_gradient_hook_without_a_handle_sees_what_a_registered_one_sees():
    """hooks.grad_hook (the output gradients ampdoctor keeps every step) gets the gradient torch's register_hook
    gives, on a non-leaf and on a leaf, beside the loop's own hooks whether those came before or after, and a hook
    the loop registers afterwards can still be removed."""
    from ampdoctor.collect import hooks

    def run(before, after):
        torch.manual_seed(0)
        leaf = torch.randn(4, 3, requires_grad=True)
        mid = (leaf * 3).tanh()
        seen: dict[str, torch.Tensor] = {}
        if before:
            mid.register_hook(lambda g: seen.__setitem__("loop before", g.clone()))
        hooks.grad_hook(mid, lambda g: seen.__setitem__("ours", g.clone()))
        hooks.grad_hook(leaf, lambda g: seen.__setitem__("ours leaf", g.clone()))
        removed = None
        if after:
            mid.register_hook(lambda g: seen.__setitem__("loop after", g.clone()))
            removed = mid.register_hook(lambda g: seen.__setitem__("removed", g))
            removed.remove()
        ref = {}
        mid.register_hook(lambda g: ref.__setitem__("mid", g.clone()))
        (mid.square().sum()).backward()
        ref["leaf"] = leaf.grad
        return seen, ref

    for before in (False, True):
        for after in (False, True):
            seen, ref = run(before, after)
            assert torch.equal(seen["ours"], ref["mid"]) and torch.equal(seen["ours leaf"], ref["leaf"])
            assert "removed" not in seen
            if before:
                assert torch.equal(seen["loop before"], ref["mid"])
            if after:
                assert torch.equal(seen["loop after"], ref["mid"])


@pytest.mark.parametrize("case", ["fp16-scaler", "half-weights", "fp32-late-loss"])
def test_a_sentinel_steps_host_figures_give_the_rows_the_transfer_gives(tmp_path, monkeypatch, case):
    """On the CPU a sentinel step keeps its figures as they are (StepEnd._host_figures), where other steps assemble
    them into the step's one transfer. Both ways give the same rows and events, on runs that go through what a
    verdict reads: an FP16 run whose scaler skips steps (overflowing batches), a model whose weights are FP16 (the
    non-finite weights check), and an FP32 loop that logs its loss after ``optimizer.step()`` (a late loss)."""
    from ampdoctor.collect import boundary

    steps = 60

    factor = 30.0 if case == "fp32-late-loss" else 3e4  # a loss and gradient spike in FP32; an overflow in FP16

    def data():
        for i, (x, y) in enumerate(batches(steps)):
            yield (x * factor if i in (17, 41) else x), y

    def late_loss_loop(model, path):
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        with ampdoctor.attach(model, optimizer=opt, trace=path, live=False, replay=False) as doc:
            for x, y in data():
                opt.zero_grad(set_to_none=True)
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()
                opt.step()
                doc.log_loss(loss)  # after the step's boundary: joins the finished step

    def run(path, host):
        if host:
            monkeypatch.undo()
        else:
            monkeypatch.setattr(boundary.StepEnd, "_host_figures", lambda self, state: None)
        torch.manual_seed(0)
        model = mlp()
        kw = {"trace": str(path), "data": data(), "attach_options": {"live": False, "replay": False}}
        if case == "fp16-scaler":
            train(model, steps, precision="fp16", **kw)
        elif case == "half-weights":
            train(model.half(), steps, precision="fp32", scaler=False, input_dtype=torch.float16, **kw)
        else:
            late_loss_loop(model, str(path))
        tr = ampdoctor.load(str(path))
        cols = ["step", "loss", "loss_scale", "loss_scale_next", "skipped", "grad_norm", "grad_max", "nonfinite"]
        return tr.steps()[cols + ["level", "reason"]], tr.events()[["step", "kind", "message"]]

    steps_t, events_t = run(tmp_path / "transfer.db", host=False)
    steps_h, events_h = run(tmp_path / "host.db", host=True)
    assert (steps_h["level"] == -1).sum() >= 20  # (sentinel steps: the host path ran)
    pd_testing = pytest.importorskip("pandas.testing")
    pd_testing.assert_frame_equal(steps_h, steps_t)
    pd_testing.assert_frame_equal(events_h.reset_index(drop=True), events_t.reset_index(drop=True))
    if case == "fp16-scaler":
        assert steps_h["skipped"].sum() >= 2
    if case == "fp32-late-loss":
        assert steps_h["loss"].notna().all() and {"grad_spike", "loss_spike"} & set(events_h["kind"])
