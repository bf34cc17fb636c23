"""Live diagnosis during training: findings logged once, on_finding, halt_on, and the log_every summary."""

import logging
import time

import pytest
import torch
from runs import batches, mlp

import ampdoctor


class Attention(torch.nn.Module):
    """Scores without the 1/sqrt(d) scale and large projections: FP16 overflows in the forward pass."""

    def __init__(self, d=32):
        super().__init__()
        self.q, self.k, self.out = torch.nn.Linear(d, d), torch.nn.Linear(d, d), torch.nn.Linear(d, d)
        with torch.no_grad():
            self.q.weight.mul_(200.0)
            self.k.weight.mul_(200.0)

    def forward(self, x):
        return self.out(torch.softmax(self.q(x) @ self.k(x).transpose(-1, -2), dim=-1) @ x)


def fp16_step(model, opt, scaler, x, y):
    """One FP16 autocast step with a GradScaler, the way a training loop writes it."""
    with torch.autocast("cpu", dtype=torch.float16):
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()


def overflowing_run(trace, budget_s=40.0, **options):
    """Train until TrainingHalted or the time budget; returns (steps done, the exception or None)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), Attention(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    x, y = torch.randn(4, 16, 32), torch.randn(4, 16, 1)
    steps, halted = 0, None
    t0 = time.time()
    with ampdoctor.attach(model, optimizer=opt, scaler=scaler, trace=trace, **options) as doctor:
        try:
            while time.time() - t0 < budget_s:
                fp16_step(model, opt, scaler, x, y)
                steps += 1
                time.sleep(0.005)
        except ampdoctor.TrainingHalted as exc:
            halted = exc
    return steps, halted, doctor


def test_halt_on_critical_stops_a_broken_run_early(trace_path, caplog):
    seen = []
    with caplog.at_level(logging.INFO, logger="ampdoctor"):
        steps, halted, doctor = overflowing_run(trace_path, halt_on="critical", on_finding=seen.append)
    assert halted is not None, f"not halted after {steps} steps"
    assert halted.finding.rule == "forward-overflow" and halted.finding.layers[0] == "1"
    assert "ampdoctor halted training: critical forward-overflow in 1" in str(halted)
    assert [f.rule for f in seen].count("forward-overflow") == 1  # reported once, however many checks
    lines = [r.getMessage() for r in caplog.records if " forward-overflow [" in r.getMessage()]
    assert lines == [lines[0]] and lines[0].startswith("ampdoctor: critical forward-overflow [1]:")
    assert "Fix: " in lines[0]
    assert doctor.findings and ampdoctor.load(trace_path).n_steps == steps + 1


def test_log_every_prints_a_health_line(trace_path, caplog):
    model = mlp(width=32)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20)
    with caplog.at_level(logging.INFO, logger="ampdoctor"):
        with ampdoctor.attach(model, optimizer=opt, scaler=scaler, trace=trace_path, log_every=5, live=False):
            for x, y in batches(10):
                fp16_step(model, opt, scaler, x, y)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("ampdoctor: step")]
    assert [ln.split(" |")[0] for ln in lines] == ["ampdoctor: step 4", "ampdoctor: step 9"]
    skipped = ampdoctor.load(trace_path).steps()["skipped"]
    assert f"skipped {int(skipped[:5].sum())} so far" in lines[0]
    assert "loss scale" in lines[0] and "worst FP16 headroom" in lines[0] and "binades below 65504" in lines[1]


def test_live_arguments_are_validated(trace_path):
    with pytest.raises(ValueError, match="Argument halt_on should be one of info, warning, critical or None"):
        ampdoctor.attach(mlp(), trace=trace_path, halt_on="fatal")
    with pytest.raises(TypeError, match="Argument on_finding should be callable"):
        ampdoctor.attach(mlp(), trace=trace_path, on_finding="print")


WRITER = """
import sys, time, torch, ampdoctor
from runs import mlp, batches
model = mlp(width=32); opt = torch.optim.SGD(model.parameters(), lr=0.01)
scaler = torch.amp.GradScaler("cpu", init_scale=2.0**30, growth_interval=3)
doc = ampdoctor.attach(model, optimizer=opt, scaler=scaler, trace=sys.argv[1], every=3, hist_every=3, live=False)
print("started", flush=True)
for x, y in batches(3000, batch=8):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
    opt.zero_grad(); scaler.scale(loss).backward(); scaler.step(opt); scaler.update()
    time.sleep(0.005)   # paced: with cheap sentinel steps an unpaced run grows the trace faster than it is read
time.sleep(600)         # still writing as far as the reader knows (killed by the test)
"""


def test_diagnose_while_another_process_writes(tmp_path):
    """Rules combine several tables; on a growing trace they must see one consistent state of it."""
    import os
    import signal
    import subprocess
    import sys

    path = str(tmp_path / "growing.db")
    here = os.path.dirname(__file__)
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, path], stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": here}
    )
    try:
        assert proc.stdout.readline().strip() == b"started"
        rules_seen, checks = set(), 0
        deadline = time.time() + 90
        # at least 12 checks, and on until the run has gone past its calibration (the first commits can hold only
        # skipped steps, and a dozen checks of a small trace fit between two commits)
        while (checks < 12 or "init-scale-too-high" not in rules_seen) and time.time() < deadline:
            try:
                found = ampdoctor.diagnose(path)
            except ampdoctor.TraceError as exc:  # before the first step is committed
                assert "no steps recorded" in str(exc)
                continue
            rules_seen.update(f.rule for f in found)
            checks += 1
        assert checks >= 12, f"only {checks} diagnoses in 90 s"
        assert "init-scale-too-high" in rules_seen, rules_seen
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


def test_live_checks_keep_their_cpu_share_however_costly_they_get():
    """The live thread's schedule (LiveDiagnosis.next_wait) over a long run whose checks grow costly (a wide model's
    trace: each check 10% dearer than the last, from 0.2 s to minutes of CPU): the checks' CPU time stays within
    MAX_SHARE of the run's time from the second check on (the first, on a trace of a few steps, has nothing to go
    by), and they never come more often than every MIN_INTERVAL_S."""
    from ampdoctor.collect import live as L

    lv = L.LiveDiagnosis("unused.db", diagnose=lambda trace, rules=None: [])
    t, cost, checks = lv.interval, 0.2, 0
    while t < 24 * 3600:
        lv.spent += cost  # a check at time t took this much CPU
        lv._last_cost = cost
        checks += 1
        if checks > 1:
            assert lv.spent <= L.MAX_SHARE * t * 1.0001, (checks, t, lv.spent)
        wait = lv.next_wait(t)
        assert wait >= L.MIN_INTERVAL_S
        t += wait
        cost *= 1.1
    assert checks > 20  # and it kept checking


def test_the_live_thread_imports_the_rules_as_it_starts_and_keeps_that_out_of_the_checks_share(trace_path):
    """attach(live=True) hands the live thread the rules' import, done as the thread starts (beside the first
    steps), not inside its first check seconds into training: the import's CPU time is the thread's load_cost, and a
    check's share counts only the checks."""
    import sys

    from ampdoctor.collect import live as L

    def costly_import():  # what importing the rules and pandas is on a fresh process: CPU-bound Python
        t0 = time.thread_time()
        while time.thread_time() - t0 < 0.05:
            pass

    seen = []
    lv = L.LiveDiagnosis(trace_path, diagnose=lambda trace, rules=None: seen.append(1) or [], load=costly_import)
    lv.start()
    try:
        assert lv.loaded.wait(30)
        assert lv.load_cost >= 0.05 and lv.spent == 0.0 and not seen  # no check yet: interval not reached
    finally:
        lv.stop()

    model = torch.nn.Linear(4, 2)
    with ampdoctor.attach(model, trace=trace_path + "2", live=True) as doctor:
        assert doctor.live is not None and doctor.live.loaded.wait(60)
        assert "ampdoctor.rules.engine" in sys.modules and doctor.live.spent == 0.0
