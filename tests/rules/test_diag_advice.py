"""Recommendations follow the recorded device: BF16 only where supported, TF32 on Ampere+, CUDA-only options."""

import pytest

import ampdoctor
from ampdoctor.rules import advice as A
from ampdoctor.rules.engine import Run

V100 = {"device": "cuda", "device_name": "Tesla V100", "capability": [7, 0], "bf16_supported": False}
A100 = {"device": "cuda", "device_name": "A100", "capability": [8, 0], "bf16_supported": True}


@pytest.mark.parametrize("g, scale", [(0.2, 32768.0), (1.8e-5, 2.0**28), (5.49, 1024.0), (1e5, 1.0)])
def test_suggest_scale(g, scale):
    assert A.suggest_scale(g) == scale
    if scale > 1:
        assert g * scale * A.SCALE_MARGIN <= 65504 < g * 2 * scale * A.SCALE_MARGIN


def test_pow2_is_paste_able():
    for v in (512.0, 2.0**16, 2.0**28, 0.5):
        assert eval(A.pow2(v)) == v


@pytest.fixture(scope="module")
def overflow_trace(tmp_path_factory):
    import test_scen_faults as S

    path = str(tmp_path_factory.mktemp("adv") / "attn.db")
    S.attention_without_sqrt_d(path)
    return path


def _with_device(monkeypatch, info):
    monkeypatch.setattr(Run, "info", property(lambda self: info))


def test_cpu_recording(overflow_trace):
    d = {x.rule: x for x in ampdoctor.diagnose(overflow_trace)}["forward-overflow"]
    assert 'device_type="cpu"' in d.recommendation and "bfloat16" in d.recommendation
    assert "allow_tf32" not in d.recommendation


def test_gpu_without_bf16_gets_no_bf16_advice(overflow_trace, monkeypatch):
    _with_device(monkeypatch, V100)
    d = {x.rule: x for x in ampdoctor.diagnose(overflow_trace)}["forward-overflow"]
    assert 'device_type="cpu"' not in d.recommendation and '"cpu"' not in d.recommendation
    assert "bfloat16" not in d.recommendation
    # a set-up block for this recording names its device (the master-weights move of a half-parameter run)
    from ampdoctor.rules.advice import Setup, master_weights

    block = master_weights(Setup(device="cuda", param_dtype="float16", optimizer="SGD", bf16_supported=False)).text
    assert 'torch.amp.GradScaler("cuda")' in block and 'device_type="cuda"' in block


@pytest.fixture(scope="module")
def slow_trace(tmp_path_factory):
    import test_scen_faults as S

    path = str(tmp_path_factory.mktemp("adv") / "slow.db")
    S.slow_dataset(path)
    return path


def test_ampere_gets_tf32_and_pinned_memory(tmp_path, monkeypatch, slow_trace):
    import test_scen_faults as S

    inactive = str(tmp_path / "inactive.db")
    S.scaler_without_autocast(inactive)
    _with_device(monkeypatch, A100)
    d = ampdoctor.diagnose(inactive)[0]
    assert "torch.backends.cuda.matmul.allow_tf32 = True" in d.recommendation
    assert "torch.amp.GradScaler" not in d.recommendation or '"cuda"' in d.recommendation
    d = ampdoctor.diagnose(slow_trace)[0]
    assert "pin_memory=True" in d.recommendation and "non_blocking=True" in d.recommendation


@pytest.mark.filterwarnings("ignore:This DataLoader will create")  # more workers than this host's cores
@pytest.mark.parametrize("info", [None, A100], ids=["cpu", "a100"])
def test_input_pipeline_fix_runs_as_printed(slow_trace, monkeypatch, info):
    """The input-pipeline fix's code parts compile, and its DataLoader runs as printed given the two names the text
    says are the user's (dataset, batch_size): workers, prefetching and, on CUDA only, pinned memory."""
    import torch

    if info is not None:
        _with_device(monkeypatch, info)
    d = {x.rule: x for x in ampdoctor.diagnose(slow_trace)}["input-pipeline-bound"]
    parts = [p.text for p in d.fix if p.kind == "code"]
    assert len(parts) == (2 if info else 1) and "dataset and batch_size" in d.fix[0].text
    for part in parts:
        compile(part, d.rule, "exec")
    ns = {"torch": torch, "dataset": torch.utils.data.TensorDataset(torch.zeros(8, 2)), "batch_size": 4}
    exec(parts[0], ns)
    loader = ns["loader"]
    assert loader.batch_size == 4 and loader.num_workers >= 2 and loader.persistent_workers
    assert loader.prefetch_factor == 4 and loader.pin_memory == (info is not None)
