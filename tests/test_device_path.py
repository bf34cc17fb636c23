"""The accelerator path never waits for the device on a clean step: the step's figures are copied asynchronously and
read at a later step end; what depends on them (the verdict, the flight recorder, the anomaly replay) is decided
then. Run here on the CPU with host reads switched off (stats.HOST_READS = False), with the copies reporting
themselves unfinished for a step (transfer.EMULATED_LAG), and every host read of a tensor made by ampdoctor counted
(on an accelerator each would be a device sync)."""

import os
import traceback

import numpy as np
import pytest
import torch
from anomaly_models import OUTLIER_STEP, classifier
from anomaly_models import train as train_classifier
from runs import mlp, train
from torch.overrides import TorchFunctionMode

import ampdoctor
from ampdoctor.collect import stats, transfer

_PACKAGE = os.path.dirname(ampdoctor.__file__)
_TORCH = os.path.dirname(torch.__file__)
_READS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.numpy,
    torch.Tensor.cpu,
    torch.Tensor.__float__,
    torch.Tensor.__int__,
    torch.Tensor.__bool__,
    torch.Tensor.__index__,
}


class HostReads(TorchFunctionMode):
    """Counts the reads of tensor values on the host that ampdoctor's own code makes (torch's, e.g. GradScaler's
    found-inf check, and the training loop's are not ampdoctor's), per step."""

    def __init__(self):
        super().__init__()
        self.by_step: dict[int, int] = {}
        self.step = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _READS and not transfer.READING[0] and self._from_ampdoctor():
            self.by_step[self.step] = self.by_step.get(self.step, 0) + 1
        return func(*args, **(kwargs or {}))

    @staticmethod
    def _from_ampdoctor() -> bool:
        for frame in reversed(traceback.extract_stack()[:-2]):
            if frame.filename.startswith(_TORCH):
                continue
            return frame.filename.startswith(_PACKAGE)
        return False


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
    assert st["step"].tolist() == list(range(30))  # every step written, in order, all of them resolved


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
