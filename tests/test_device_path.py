"""The accelerator path never waits for the device on a clean step: the step's figures are copied asynchronously and
read at a later step end; what depends on them (the verdict, the flight recorder, the anomaly replay) is decided
then. Run here on the CPU with host reads switched off (stats.HOST_READS = False), with the copies reporting
themselves unfinished for a step (transfer.EMULATED_LAG), and every host read of a tensor made by ampdoctor counted
(on an accelerator each would be a device sync)."""

import os
import sys

import numpy as np
import pytest
import torch
from anomaly_models import OUTLIER_STEP, classifier
from anomaly_models import train as train_classifier
from runs import mlp, train

import ampdoctor
from ampdoctor.collect import buffers, stats, transfer
from ampdoctor.collect.record import StepRecord

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from hostsync import HostReads  # (the counter benchmarks/device_check.py uses too)


@pytest.fixture
def device_path(monkeypatch):
    monkeypatch.setattr(stats, "HOST_READS", False)
    monkeypatch.setattr(transfer, "EMULATED_LAG", 1)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_no_host_read_on_a_clean_step(trace_path, device_path, precision):
    """Sentinel-only and sampled (peaks, full statistics, histograms) steps past calibration: zero reads of device
    values by ampdoctor. (The calibration steps and an anomaly may read: a late verdict checks the weights.)"""
    counter = HostReads()

    def on_step(step, model, doctor):
        counter.step = step + 1

    with counter:
        train(
            mlp(width=32, seed=2),
            30,
            precision=precision,
            trace=trace_path,
            attach_options={"calibration": 2, "peak_every": 3, "every": 7, "hist_every": 14, "live": False},
            on_step=on_step,
        )
    st = ampdoctor.load(trace_path).steps()
    bad = set(st.loc[st["skipped"] | st["nonfinite"].astype(bool), "step"])
    # a step during which an anomalous step's late verdict came in may read (the weights are checked then)
    clean = [s for s in range(3, 30) if not bad & set(range(s - 3, s + 1))]
    assert len(clean) > 15 and set(st.loc[clean, "reason"]) >= {"sentinel", "sampled"}
    assert {s: counter.by_step.get(s, 0) for s in clean} == dict.fromkeys(clean, 0)
    # nor a call that reads nothing on the host but waits for the device on CUDA (bincount, nonzero, a boolean index,
    # host data put on the device...): the full-statistics and histogram steps too
    assert {s: counter.on_cuda.by_step.get(s, 0) for s in clean} == dict.fromkeys(clean, 0)
    assert {st.loc[s, "level"] for s in clean} >= {-1, 0, 1, 2}  # sentinel, peaks, full statistics, histograms
    assert st["step"].tolist() == list(range(30))  # every step written, in order, all of them resolved


def test_the_step_transfer_puts_host_numbers_on_the_device_without_a_copy(device_path):
    """A step figure that is a Python number among device figures (a float loss beside a device one, a norm of no
    gradient values) joins the transfer by a fill on the device, not a copy of host memory (which CUDA follows with
    a stream synchronize); the values arrive exactly."""
    rec = StepRecord()
    for v in (torch.tensor(2.5, dtype=torch.float64), 0.1, 3, torch.tensor(-1.0)):
        rec.add_extra(v)
    counter = HostReads()
    with counter:
        copy = rec.start_transfer()
        loss = buffers.sum_losses([torch.tensor(0.5), 0.25])
    assert dict(counter.on_cuda.counts["ampdoctor"]) == {} and dict(counter.by_step) == {}
    values, _, bad = copy.result()
    assert values.tolist() == [2.5, 0.1, 3.0, -1.0] and not bad
    assert isinstance(loss, torch.Tensor) and loss.item() == 0.75


def test_the_counter_sees_the_calls_that_wait_on_cuda():
    """The CPU-side counter of calls that synchronize on CUDA without a host read: each kind is counted, and the
    fixed-size forms that do not wait are not."""
    x = torch.tensor([0.0, 1.0, 2.0, 0.0])
    mask, idx = x > 0, torch.tensor([1, 2])
    waits = [
        lambda: torch.bincount(idx),
        lambda: x.nonzero(),
        lambda: torch.where(mask),
        lambda: x[mask],
        lambda: x.__setitem__(mask, torch.tensor([5.0, 6.0])),
        lambda: x.masked_select(mask),
        lambda: torch.unique(x),
        lambda: torch.equal(x, x),
        lambda: torch.repeat_interleave(x, idx.repeat(2)),
        lambda: torch.histc(x, bins=4),
        lambda: torch.tensor([1.0], device=x.device),
    ]
    free = [
        lambda: torch.zeros(3, dtype=torch.int64).scatter_add_(0, idx, torch.ones_like(idx)),
        lambda: torch.where(mask, x, 0.0),
        lambda: x.masked_fill(mask, 1.0),
        lambda: x[idx],
        lambda: torch.repeat_interleave(x, idx.repeat(2), output_size=6),
        lambda: torch.histc(x, bins=4, min=0, max=4),
        lambda: torch.full((), 1.0, device=x.device),
        lambda: torch.bucketize(x, idx),
    ]
    for calls, expected in ((waits, 1), (free, 0)):
        for i, call in enumerate(calls):
            counter = HostReads()
            with counter:
                call()
            assert sum(counter.on_cuda.counts["loop"].values()) == expected, (expected, i)


def test_late_verdicts_record_what_the_host_path_records(tmp_path, device_path, monkeypatch):
    """The copies arrive a step late: the same skipped steps, non-finite events and replay as on the host path (the
    outlier step is skipped by the scaler, and so is nothing after it: the replay is still exact)."""
    paths = {}
    for host in (True, False):
        monkeypatch.setattr(stats, "HOST_READS", host)
        paths[host] = str(tmp_path / f"host_{host}.db")
        train_classifier(classifier(), 45, outlier={OUTLIER_STEP: 16.0}, trace=paths[host], live=False)
    a, b = ampdoctor.load(paths[True]), ampdoctor.load(paths[False])
    sa, sb = a.steps(), b.steps()
    for col in ("skipped", "nonfinite"):
        assert sa[col].tolist() == sb[col].tolist(), col
    assert sa.loc[OUTLIER_STEP, "reason"] == sb.loc[OUTLIER_STEP, "reason"] == "replay"
    # the flight recorder arms when the verdict comes in: one step later on the accelerator path
    after = [s for s in range(OUTLIER_STEP + 1, 45)]
    host_alarm = [s for s in after if sa.loc[s, "reason"] == "anomaly"]
    device_alarm = [s for s in after if sb.loc[s, "reason"] == "anomaly"]
    assert host_alarm and device_alarm == [s + 1 for s in host_alarm]
    assert np.allclose(sa["loss"].astype(float), sb["loss"].astype(float), equal_nan=True)
    ra = a.events("replay").set_index("step")["data"]
    rb = b.events("replay").set_index("step")["data"]
    assert list(ra.index) == list(rb.index) and OUTLIER_STEP in ra.index
    assert rb[OUTLIER_STEP]["exact"] and rb[OUTLIER_STEP]["reproduced"]
    oa, ob = a.events("operation"), b.events("operation")
    assert oa["message"].tolist() == ob["message"].tolist()
