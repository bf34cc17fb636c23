"""The autocast op lists (ampdoctor.autocast_ops) against what torch's autocast really does: every op sample run
under real CPU autocast on this machine (FP16 and BF16) shows the rule the CPU lists give (on the lower-precision list:
the autocast dtype from FP32 inputs; on the float32 list: FP32 from half-precision inputs; on neither, e.g. exp,
softmax, log, pow, layer_norm: the inputs' dtype), and every op torch registers an autocast kernel for, on the CPU and
on CUDA, is on one of the lists. The CUDA rules are observed the same way on a GPU by benchmarks/device_check.py."""

import pytest
import torch

from ampdoctor import autocast_ops

DTYPES = ["bfloat16", "float16"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", sorted(autocast_ops.SAMPLES))
def test_each_sample_shows_the_cpu_rule_of_the_lists(op, dtype):
    assert autocast_ops.observe(op, "cpu", dtype) == autocast_ops.autocast_rule(op, "cpu")


def test_the_samples_cover_every_rule():
    """Enough samples of each list to catch a wrong list on either device."""
    for device in ("cpu", "cuda"):
        rules = [autocast_ops.autocast_rule(op, device) for op in autocast_ops.SAMPLES]
        counts = {r: rules.count(r) for r in ("lower", "float32", None)}
        assert min(counts.values()) >= 5, (device, counts)
    assert sum(autocast_ops.autocast_rule(op, "cuda") == "promote" for op in autocast_ops.SAMPLES) >= 5


@pytest.mark.parametrize("op", ["exp", "softmax", "log", "pow", "layer_norm", "sum"])
def test_ops_the_cpu_keeps_in_the_input_dtype_cuda_computes_in_float32(op):
    assert autocast_ops.observe(op, "cpu", "bfloat16") is None
    assert autocast_ops.computes_in_float32_on(f"aten::{op}.default", "cuda")  # (observed on a GPU: device_check)


def _registered(key: str) -> set[str]:
    get = getattr(torch._C, "_dispatch_get_registrations_for_dispatch_key", None)
    if get is None:
        pytest.skip("this torch cannot list its dispatcher registrations")
    return {autocast_ops.short_name(op) for op in get(key)}


@pytest.mark.parametrize("device,key", [("cpu", "AutocastCPU"), ("cuda", "AutocastCUDA")])
def test_every_op_torch_autocasts_is_on_a_list(device, key):
    """The installed torch's autocast kernels, per device (registered in CPU-only builds too): none is missing from
    the lists, whatever its policy (the policy is what the samples observe)."""
    listed = set().union(*autocast_ops.LISTS[device].values())
    banned = autocast_ops.CUDA_BANNED if device == "cuda" else set()
    registered = _registered(key)
    assert len(registered) > 50
    assert registered - listed - banned == set()


def test_the_lists_are_disjoint_per_device():
    for lists in autocast_ops.LISTS.values():
        names = [set(v) for v in lists.values()]
        assert not any(a & b for i, a in enumerate(names) for b in names[i + 1 :])


def test_the_module_imports_no_torch():
    """autocast_ops is on the offline side: torch is imported inside observe() only."""
    import subprocess
    import sys

    code = "import sys, ampdoctor.autocast_ops as a; a.check; assert 'torch' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
