"""attach(budget=...): ampdoctor's measured share of the step time stays near the budget by stretching the sampled
tiers (never the sentinel, the calibration steps or the flight recorder); every change is recorded."""

import torch
from anomaly_models import classifier
from anomaly_models import train as train_classifier
from runs import mlp, train

import ampdoctor


def test_a_budget_stretches_the_sampled_tiers_and_records_each_change(trace_path):
    """Peaks every step and full statistics every 2nd cost a small model far more than 2% of its step: the budget
    doubles the intervals window after window, and says so in the trace."""
    train(
        mlp(width=16, depth=6),
        300,
        precision="fp32",
        trace=trace_path,
        attach_options={"peak_every": 1, "every": 2, "hist_every": 4, "budget": 0.02, "live": False},
    )
    tr = ampdoctor.load(trace_path)
    changes = tr.events("cadence")
    assert len(changes) >= 2
    stretch = [d["stretch"] for d in changes["data"]]
    assert stretch == sorted(stretch) and stretch[0] == 2  # (one-way here: the cost stays above the budget)
    first = int(changes["step"].iloc[0])
    st = tr.steps().set_index("step")
    before = st.loc[10:first, "reason"]
    after = st.loc[int(changes["step"].iloc[-1]) + 1 :, "reason"]
    assert (before == "sampled").mean() > 0.9  # every step observed sites before
    assert (after == "sentinel").mean() > 0.5  # most observe none after
    assert st["loss"].notna().all()  # the sentinel never stopped
    assert "budget of 2.0%" in changes["message"].iloc[0]
    # the weights and their updates are a sampled tier too: read every 200 steps at the defaults, then stretched
    last = changes["data"].iloc[-1]
    assert (
        last["weight_every"] == 200 * last["stretch"]
        and f"weights every {last['weight_every']}" in changes["message"].iloc[-1]
    )


def test_the_steps_a_cadence_leaves_to_the_sentinel_are_known_ahead():
    """Cadence.next_observed (the lane holds the steps before it) is the first step from the given one whose plan
    observes sites or reads the weights, for the default tiers and others, at every stretch the budget sets; the
    calibration steps, debug mode and the flight recorder's steps are never ahead."""
    from ampdoctor.collect.cadence import STRETCH_MAX, Cadence
    from ampdoctor.collect.options import Mode, Observe

    for tiers in ({}, {"every": 7, "peak_every": 3, "hist_every": 11, "weight_every": 5}, {"peak_every": 1}):
        cadence = Cadence(**tiers)
        for stretch in (1, 2, 8, STRETCH_MAX):
            cadence.stretch = stretch
            for step in [*range(0, 700), *range(12_700, 12_900)]:
                j = step
                while cadence.plan(j)[0] is Observe.NONE and not cadence.reads_weights(j):
                    j += 1
                assert cadence.next_observed(step) == j, (tiers, stretch, step)
    armed = Cadence()
    armed.after(True)  # (an anomaly: the flight recorder's plan depends on the streak, not on the step's number)
    assert armed.next_observed(500) == 500 and Cadence(Mode.DEBUG).next_observed(500) == 500


def test_under_a_budget_a_one_off_fault_is_still_replayed(trace_path):
    """The budget never stretches the sentinel or the replay: an outlier batch late in a stretched run is located."""
    torch.manual_seed(0)
    train_classifier(classifier(), 180, outlier={157: 28.0}, trace=trace_path, budget=0.005, live=False)
    tr = ampdoctor.load(trace_path)
    assert len(tr.events("cadence"))
    assert 157 in set(tr.events("replay")["step"])
    assert tr.events("operation").set_index("step").loc[157, "data"]["op"] == "aten::exp"


def test_under_a_budget_the_live_checks_keep_a_third_of_it(trace_path):
    """The live rules run on another thread but hold the GIL that training's Python waits for: under budget=b their
    CPU time stays within b/3 of the run's time (their schedule over a long run whose checks grow costly), never
    more than without a budget."""
    from ampdoctor.collect import live as L

    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ampdoctor.attach(model, optimizer=opt, trace=trace_path, budget=0.03) as doc:
        assert doc.live is not None and doc.live.share == 0.01
    with ampdoctor.attach(model, optimizer=opt, trace=trace_path + ".2", budget=0.3) as doc:
        assert doc.live is not None and doc.live.share == L.MAX_SHARE
    lv = L.LiveDiagnosis("unused.db", diagnose=lambda trace, rules=None: [], share=0.01)
    t, cost, checks = lv.interval, 0.2, 0
    while t < 24 * 3600:
        lv.spent += cost
        lv._last_cost = cost
        checks += 1
        if checks > 1:
            assert lv.spent <= 0.01 * t * 1.0001, (checks, t, lv.spent)
        t += lv.next_wait(t)
        cost *= 1.1
    assert checks > 10


def test_a_step_that_waited_does_not_undo_the_stretch():
    """A window of steps where ampdoctor costs 10% of each, one of which waited 10 s (an evaluation, a checkpoint, a
    paused process): the budget still sees 10% and stretches; a window where it costs 0.5% relaxes again."""
    from ampdoctor.collect.cadence import BUDGET_WINDOW, Budget, Cadence

    cadence = Cadence()
    budget = Budget(0.03, cadence)
    changes = [budget.update(0.0001, 10.0 if k == 7 else 0.001, "sentinel") for k in range(BUDGET_WINDOW)]
    assert changes[:-1] == [None] * (BUDGET_WINDOW - 1) and changes[-1] is not None
    assert cadence.stretch == 2 and changes[-1]["peak_every"] == 20
    assert changes[-1]["share"] > 0.09
    for _ in range(BUDGET_WINDOW):
        change = budget.update(0.000005, 0.001, "sentinel")
    assert change is not None and cadence.stretch == 1


def test_a_budget_the_every_step_work_alone_exceeds_is_said_to_be_unheld(trace_path, capsys):
    """A budget below what the never-stretched work costs (the sentinel and the replay's capture on a small model):
    once the sampled tiers are stretched their most, the trace says once that it cannot be held, with the
    sentinel-only steps' own share, and ``info`` says so; a budget the run holds says nothing of the kind."""
    from ampdoctor import cli
    from ampdoctor.collect.cadence import BUDGET_WINDOW, STRETCH_MAX

    budget = 0.0005
    train(mlp(width=16, depth=2), 420, precision="fp32", trace=trace_path, attach_options={"budget": budget})
    tr = ampdoctor.load(trace_path)
    changes = tr.event_rows("cadence")
    unheld = [e for e in changes if e.data.get("held") is False]
    assert len(unheld) == 1 and unheld[0].data["stretch"] == STRETCH_MAX
    said = unheld[0]
    # the share said is the sentinel-only steps' own in the window that ended there (observer over step time)
    st = tr.steps().set_index("step").loc[: said.step]
    window = st[st["reason"].isin(["sentinel", "sampled"])].tail(BUDGET_WINDOW)
    sentinel = window[window["reason"] == "sentinel"]
    expected = (sentinel["observer_time"] / sentinel["step_time"]).clip(upper=1.0).mean()
    assert said.data["sentinel_share"] > budget and abs(said.data["sentinel_share"] - expected) < 1e-9
    assert "cannot be held" in said.message and st["loss"].notna().all()
    capsys.readouterr()
    assert cli.main(["info", trace_path]) == 0
    assert f"budget     not held from step {said.step}" in capsys.readouterr().out

    held = trace_path + ".held.db"
    train(mlp(width=16, depth=2), 420, precision="fp32", trace=held, attach_options={"budget": 0.9})
    assert not [e for e in ampdoctor.load(held).event_rows("cadence") if e.data.get("held") is False]
