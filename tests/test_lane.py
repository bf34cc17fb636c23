"""The clean step's short way (collect/lane.py) writes what the general path writes: real runs with the lane and
without it (core.LANE), compared row by row and event by event, through late and early losses, accumulated
micro-batches, dropout, a finite loss spike and a NaN the replay must localise."""

from __future__ import annotations

import sqlite3

import pytest
import torch
from runs import comparable

import ampdoctor
from ampdoctor.collect import compiled, core
from ampdoctor.collect import lane as lane_module


class Amplify(torch.autograd.Function):
    """Identity forward; its backward multiplies the gradient by 1e36 where its input held a value above 1e4: a
    batch with one large (finite) input overflows in the backward only, and a replay from the same inputs and the
    kept seed overflows there again."""

    @staticmethod
    def forward(ctx, x):
        ctx.large = bool(x.detach().abs().max() > 1e4)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * 1e36 if ctx.large else g


class Amplifier(torch.nn.Module):
    def forward(self, x):
        return Amplify.apply(x)


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.1),
        torch.nn.Linear(32, 32),
        Amplifier(),
        torch.nn.ReLU(),
        torch.nn.Linear(32, 1),
    )


def run(
    path,
    lane,
    monkeypatch,
    *,
    steps=60,
    late=True,
    accumulation=1,
    replay=True,
    spike=None,
    nan=None,
    bwd_nan=None,
    lbfgs=False,
    budget=None,
):
    """Train, attached; ``spike``: the step whose targets are 1000x (a finite loss spike), ``nan``: the step whose
    batch holds an Inf, ``bwd_nan``: the step whose batch holds 1e6 (finite; Amplify overflows its backward);
    ``lbfgs``: LBFGS, whose step runs the forward and backward in a closure; ``budget``: attach's. Returns the
    Doctor's lane (None without one)."""
    monkeypatch.setattr(core, "LANE", lane)
    m = model()
    opt = torch.optim.LBFGS(m.parameters(), lr=0.1, max_iter=2) if lbfgs else torch.optim.AdamW(m.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    with ampdoctor.attach(m, optimizer=opt, trace=path, live=False, replay=replay, budget=budget) as doc:
        for step in range(steps):
            if lbfgs:
                x, y = torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g)

                def closure():
                    opt.zero_grad()
                    loss = torch.nn.functional.mse_loss(m(x), y)
                    loss.backward()
                    return loss

                doc.log_loss(opt.step(closure))
                continue
            opt.zero_grad(set_to_none=True)
            for _ in range(accumulation):
                x, y = torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g)
                if step == spike:
                    y = y * 1000
                if step == nan:
                    x[0, 0] = float("inf")
                if step == bwd_nan:
                    x[0, 0] = 1e6
                loss = torch.nn.functional.mse_loss(m(x), y) / accumulation
                loss.backward()
                if not late:
                    doc.log_loss(loss)
            opt.step()
            if late:
                doc.log_loss(loss)
        return doc._core.lane


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"late": False},
        {"accumulation": 2},
        {"replay": False},
        {"spike": 40},
        {"late": False, "spike": 40},
        {"nan": 43},
        {"bwd_nan": 44},
        {"lbfgs": True},
        # (a budget no step can hold: the sampled tiers stretch at the end of every window, in both runs alike)
        {"budget": 1e-9, "steps": 170},
    ],
    ids=[
        "late-loss",
        "early-loss",
        "accumulation",
        "no-replay",
        "late-spike",
        "early-spike",
        "nan",
        "backward-nan",
        "lbfgs-closure",
        "budget",
    ],
)
def test_the_lane_writes_what_the_general_path_writes(tmp_path, monkeypatch, kwargs):
    compare(tmp_path, monkeypatch, kwargs)


def compare(tmp_path, monkeypatch, kwargs):
    fast = run(str(tmp_path / "lane.db"), True, monkeypatch, **kwargs)
    slow = run(str(tmp_path / "general.db"), False, monkeypatch, **kwargs)
    assert slow is None and fast is not None
    # where the C++ extension is loaded (make install builds it), the lane's HeldSteps records the held steps;
    # without it the general path takes every step
    loaded = compiled.get() is not None
    assert (fast.rec is not None) == loaded
    # the lane carried the clean sentinel steps: all but calibration, sampled and anomalous ones (and the last,
    # ended by close())
    sentinel = (comparable(str(tmp_path / "lane.db"))[0]["reason"] == "sentinel").sum()
    if kwargs.get("lbfgs") or not loaded:  # (LBFGS's forwards run inside optimizer.step(): every step is let go)
        assert sentinel > 20 and fast.carried == 0
    else:
        assert sentinel > 20 and fast.carried >= sentinel - 2
    (s1, e1), (s2, e2) = comparable(str(tmp_path / "lane.db")), comparable(str(tmp_path / "general.db"))
    assert s1.equals(s2), s1.compare(s2)
    for e in (e1, e2):  # (what a cadence change says it measured is each run's own timing; the change is compared)
        e["message"] = e["message"].str.replace(r"cost [0-9.]+%", "cost ...%", regex=True)
    assert e1.equals(e2), (e1, e2)
    if "spike" in kwargs:
        assert (e1["kind"] == "loss_spike").any()
    for key in ("nan", "bwd_nan"):
        if key in kwargs:
            assert s1.loc[s1["step"] == kwargs[key], "nonfinite"].item()
            assert (e1["step"] == kwargs[key]).any()  # the replay's localisation of the Inf, as without the lane
    if "budget" in kwargs:  # the cadence changed twice, the lane held steps under each
        assert (e1["kind"] == "cadence").sum() >= 2
    if "bwd_nan" in kwargs:  # found in the backward, which the replay ran from the seed the lane's hook kept
        assert (e1.loc[e1["step"] == kwargs["bwd_nan"], "phase"] == "bwd").any(), e1


def test_a_cadence_the_budget_changes_is_followed_both_ways(tmp_path, monkeypatch):
    """The overhead budget stretches the sampled tiers and relaxes them again (here at its first three windows' ends,
    alike in both runs: the budget's own measurement is tests/test_budget.py's): the lane holds the steps each new
    plan leaves to the sentinel and none it observes, and its windows end where the general path's do, so its trace
    is the general path's."""
    from ampdoctor.collect import cadence as cadence_module

    def close_window(self):
        self.windows = getattr(self, "windows", 0) + 1
        self._shares = self._floor_shares = 0.0
        self._steps = self._floor_steps = 0
        stretch = {1: 4, 2: 1, 3: 2}.get(self.windows)
        if stretch is None:
            return None
        c = self.cadence
        c.stretch = stretch
        every = {f: getattr(c, f) * stretch for f in ("peak_every", "every", "hist_every", "weight_every")}
        return {"share": 0.5, "budget": self.share, "stretch": stretch, **every, "sentinel_share": None, "held": True}

    monkeypatch.setattr(cadence_module.Budget, "close_window", close_window)
    compare(tmp_path, monkeypatch, {"budget": 0.5, "steps": 170})


def test_each_kept_call_has_the_generator_state_it_started_with(tmp_path):
    """A held step's calls keep the CPU generator's state at each call: read again after anything moved it (dropout,
    a torch.rand, a manual_seed), the same tensor while nothing did; compared with torch.get_rng_state() taken at
    each call."""

    if compiled.get() is None:
        pytest.skip("the C++ extension is not loaded here (make install builds it): no step is held")
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    with ampdoctor.attach(m, optimizer=opt, trace=str(tmp_path / "t.db"), live=False) as doc:
        lane, x = doc._core.lane, torch.randn(4, 16)
        for _ in range(25):  # (past the calibration, to a step the lane holds)
            m(x).sum().backward()
            opt.step()
            opt.zero_grad()
        assert lane.held
        expected = []
        m.eval()  # (no dropout: the generator moves only where the loop moves it)
        for move in (None, None, "rand", None, "seed", None):
            if move == "rand":
                torch.rand(3)
            elif move == "seed":
                torch.manual_seed(7)
            expected.append(torch.get_rng_state())
            m(x).sum().backward()
        m.train()
        expected.append(torch.get_rng_state())
        m(x).sum().backward()  # (dropout: moves it during the call, after its state was kept)
        expected.append(torch.get_rng_state())
        m(x).sum().backward()
        lane.let_go()
        calls = doc._core.replays.capture.calls
        assert len(calls) == len(expected) <= lane_module.MAX_CALLS
        for call, state in zip(calls, expected):
            assert torch.equal(call.rng[0], state)
        assert calls[0].rng[0] is calls[1].rng[0] and calls[2].rng[0] is not calls[1].rng[0]


def stopped_at(tmp_path, at, fault, match):
    """model() trained 40 steps without ampdoctor, then attached with ``fault(doc)`` done before step ``at``: one
    warning that matches ``match`` says collection stopped, and the weights are the bare run's. Returns the closed
    Doctor."""

    def train(attach):
        m = model()
        opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
        g = torch.Generator().manual_seed(1)
        doc = ampdoctor.attach(m, optimizer=opt, trace=str(tmp_path / "t.db"), live=False) if attach else None
        for step in range(40):
            if step == at and doc is not None:
                fault(doc)
            x, y = torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g)
            loss = torch.nn.functional.mse_loss(m(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if doc is not None:
                doc.log_loss(loss)
        if doc is not None:
            doc.close()  # (said once: the warning that stopped collection)
        return m, doc

    bare, _ = train(False)
    with pytest.warns(RuntimeWarning, match="collection stopped after an internal error.*" + match):
        observed, doc = train(True)
    assert not doc.active
    for a, b in zip(bare.parameters(), observed.parameters()):
        assert torch.equal(a, b)
    return doc


def test_a_writer_that_failed_while_steps_are_held_stops_collection_never_training(tmp_path):
    """The trace's writer fails (a full disk) while the lane holds the steps: the step is let go, the general path
    stops collection with one warning that names the writer's error, and training goes on as without ampdoctor."""

    def full_disk(doc):
        assert doc._core.lane.held or compiled.get() is None
        doc._core.loop.writer.error = OSError("No space left on device")

    stopped_at(tmp_path, 24, full_disk, "No space left on device")


def test_the_lane_without_the_cpp_extension(tmp_path, monkeypatch):
    """Where the extension is not built (no compiler), the lane holds no step: the general path writes the trace,
    through a NaN the replay localises."""
    monkeypatch.setattr(lane_module.compiled, "get", lambda: None)
    compare(tmp_path, monkeypatch, {"nan": 43})


@pytest.mark.parametrize(
    "setting",
    ["scaler", "debug", "probe", "half weights"],
)
def test_runs_the_lane_does_not_serve_take_the_general_path(tmp_path, setting):
    """A GradScaler's scale (read before and after its update), debug mode (every step observed), the probe and
    half-precision weights (checked every step) need the general path: no lane is made for them."""
    m = model()
    if setting == "half weights":
        m = m.bfloat16()
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    options = {"mode": "debug"} if setting == "debug" else {"probe_every": 5} if setting == "probe" else {}
    scaler = torch.amp.GradScaler("cpu") if setting == "scaler" else None
    with ampdoctor.attach(m, optimizer=opt, scaler=scaler, trace=str(tmp_path / "t.db"), live=False, **options) as doc:
        assert doc._core.lane is None


def test_flush_writes_every_finished_clean_step(tmp_path, monkeypatch):
    """``doctor.flush()`` makes every step before the last finished one readable, lane or not (the last finished
    step waits for a late loss either way)."""
    for lane in (True, False):
        path = str(tmp_path / f"{lane}.db")
        monkeypatch.setattr(core, "LANE", lane)
        m = model()
        opt = torch.optim.SGD(m.parameters(), lr=1e-3)
        doc = ampdoctor.attach(m, optimizer=opt, trace=path, live=False)
        try:
            for _ in range(50):
                loss = m(torch.randn(4, 16)).square().mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                doc.log_loss(loss)
            assert doc.flush()
            steps = [r[0] for r in sqlite3.connect(path).execute("SELECT step FROM steps ORDER BY step")]
            assert steps == list(range(49)), lane
        finally:
            doc.close()


def same_traces(train, tmp_path):
    """``train(path, lane)`` run with the lane and without it (it returns the Doctor's lane, None without one): the
    steps tables and events are equal. Returns the lane, and the lane run's steps and events."""
    lane = train(str(tmp_path / "lane.db"), True)
    assert train(str(tmp_path / "general.db"), False) is None
    (s1, e1), (s2, e2) = comparable(str(tmp_path / "lane.db")), comparable(str(tmp_path / "general.db"))
    assert s1.equals(s2), s1.compare(s2)
    assert e1.equals(e2), (e1, e2)
    return lane, s1, e1


def test_evaluation_forwards_a_schedule_and_an_interrupted_step(tmp_path, monkeypatch):
    """An evaluation forward under no_grad every few steps (not a micro-batch), two parameter groups (one with a
    tensor learning rate) under StepLR, two forwards in one step, and a run stopped by an error between a step's
    backward and its optimizer step: the lane's trace is the general path's."""

    def train(path, lane):
        monkeypatch.setattr(core, "LANE", lane)
        m = model()
        params = list(m.parameters())
        groups = [{"params": params[:2], "lr": 0.01}, {"params": params[2:], "lr": torch.tensor(0.02)}]
        opt = torch.optim.SGD(groups, lr=0.01, momentum=0.9)
        schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.5)
        g = torch.Generator().manual_seed(1)
        with pytest.raises(RuntimeError, match="stopped"):
            with ampdoctor.attach(m, optimizer=opt, trace=path, live=False) as doc:
                for step in range(60):
                    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g)
                    if step % 5 == 0:
                        m.eval()
                        with torch.no_grad():
                            m(x)
                        m.train()
                    loss = torch.nn.functional.mse_loss(m(x), y)
                    if step % 4 == 1:
                        loss = loss + torch.nn.functional.mse_loss(m(x * 0.5), y)
                    opt.zero_grad()
                    loss.backward()
                    if step == 45:
                        raise RuntimeError("stopped")
                    opt.step()
                    schedule.step()
                    doc.log_loss(loss)
        return doc._core.lane

    lane, s1, _ = same_traces(train, tmp_path)
    assert lane.carried >= 20 and len(s1) == 45
    assert s1["lr"].nunique() > 3 and set(s1["microbatches"]) == {1, 2}


class Keyworded(torch.nn.Module):
    """model() behind a forward that also takes its batch by keyword (a call the lane passes to the general path)."""

    def __init__(self):
        super().__init__()
        self.net = model()

    def forward(self, x=None, *, batch=None):
        return self.net(x if x is not None else batch)


def test_a_step_of_lane_kept_and_general_calls_replays_both(tmp_path, monkeypatch):
    """Two micro-batches a step, the first a plain call the lane keeps as read, the second by keyword, which the
    general path takes: the calls reach the replay in their order. An Inf in a later step's second batch is
    localised by the replay as on the general path, and the traces are equal."""

    def train(path, lane):
        monkeypatch.setattr(core, "LANE", lane)
        m = Keyworded()
        opt = torch.optim.SGD(m.parameters(), lr=0.01)
        g = torch.Generator().manual_seed(1)
        with ampdoctor.attach(m, optimizer=opt, trace=path, live=False) as doc:
            for step in range(40):
                x1, x2, y = (torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g), torch.randn(8, 1))
                if step == 33:
                    x2[3, 5] = float("inf")
                opt.zero_grad()
                loss1 = torch.nn.functional.mse_loss(m(x1), y)
                loss1.backward()
                loss2 = torch.nn.functional.mse_loss(m(batch=x2), y)
                loss2.backward()
                opt.step()
                doc.log_loss(loss1.detach() + loss2.detach())
        return doc._core.lane

    lane, _, e1 = same_traces(train, tmp_path)
    assert lane.carried >= 15
    at = e1[e1["step"] == 33]
    assert "replayed exactly: reproduced" in " ".join(at.loc[at["kind"] == "replay", "message"]), at.to_dict("records")
    nonfinite = at[at["kind"] == "nonfinite"]  # (the batch itself holds the Inf: the root's forward meets it)
    assert list(nonfinite["path"]) == ["(model)"] and list(nonfinite["phase"]) == ["fwd"], at.to_dict("records")
    assert lane.rec.kept == 0  # (nothing kept as read after the run)


def test_an_evaluation_forward_inside_a_step_keeps_the_training_calls_seed(tmp_path, monkeypatch):
    """An evaluation forward under no_grad between a step's forward and its backward (a probe of the model mid-step)
    is no micro-batch and has no gradient to keep: the seed kept for the step's training call stays, and a replay of
    an overflow in the backward only reproduces it from that seed, as on the general path."""

    def train(path, lane):
        monkeypatch.setattr(core, "LANE", lane)
        m = model()
        opt = torch.optim.SGD(m.parameters(), lr=0.01)
        g = torch.Generator().manual_seed(1)
        with ampdoctor.attach(m, optimizer=opt, trace=path, live=False) as doc:
            for step in range(36):
                x, y = torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g)
                if step == 31:
                    x[2, 3] = 1e6  # (finite: Amplify overflows the backward only)
                loss = torch.nn.functional.mse_loss(m(x), y)
                m.eval()
                with torch.no_grad():
                    m(x[:2])
                m.train()
                opt.zero_grad()
                loss.backward()
                opt.step()
                doc.log_loss(loss)
        return doc._core.lane

    lane, _, e1 = same_traces(train, tmp_path)
    assert lane.carried >= 15
    at = e1[e1["step"] == 31]
    assert "reproduced" in " ".join(at.loc[at["kind"] == "replay", "message"]), at.to_dict("records")


def _raise(*args, **kwargs):
    raise RuntimeError("broken on purpose")


class Broken:
    """A HeldSteps whose method ``name`` raises."""

    def __init__(self, rec, name):
        self._rec, self._name = rec, name

    def __getattr__(self, attr):
        return _raise if attr == self._name else getattr(self._rec, attr)


@pytest.mark.parametrize("part", ["call", "seed", "verdict", "end", "loss"])
def test_an_error_in_a_held_steps_part_stops_collection_never_training(tmp_path, part):
    """Each part of a held step (HeldSteps: the root call, the seed's hook, the gradients' read and the verdict, the
    step end, a loss) that raises stops collection with one warning; training goes on, its weights those of the same
    run without ampdoctor, and the trace keeps the steps before."""
    if compiled.get() is None:
        pytest.skip("the C++ extension is not loaded here (make install builds it): no step is held")

    def break_part(doc):
        lane = doc._core.lane
        assert lane is not None and lane.held
        lane.rec = Broken(lane.rec, part)

    stopped_at(tmp_path, 25, break_part, "broken on purpose")
    with sqlite3.connect(str(tmp_path / "t.db")) as conn:
        steps = [s for (s,) in conn.execute("SELECT step FROM steps ORDER BY step")]
    assert steps[:25] == list(range(25)) and max(steps) <= 25
