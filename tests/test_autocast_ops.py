"""The autocast op lists (ampdoctor.autocast_ops) against what torch's CPU autocast really does on this machine: an op
on the lower-precision list computes in the autocast dtype from FP32 inputs, one on the float32 list in FP32 from
half-precision inputs, and one on neither list (exp, softmax, log, pow, layer_norm on the CPU) in its inputs' dtype.
The CUDA lists are checked the same way on a GPU by benchmarks/device_check.py."""

import pytest
import torch
import torch.nn.functional as F

from ampdoctor import autocast_ops

x32 = torch.randn(4, 8)
w32 = torch.randn(8, 8)
LOWER = {
    "mm": lambda x: torch.mm(x, x.t()),
    "bmm": lambda x: torch.bmm(x[None], x.t()[None]),
    "addmm": lambda x: torch.addmm(torch.zeros(4, 4, dtype=x.dtype), x, x.t()),
    "matmul": lambda x: torch.matmul(x, x.t()),
    "linear": lambda x: F.linear(x, w32.to(x.dtype)),
    "conv1d": lambda x: F.conv1d(x[None], torch.randn(2, 4, 3, dtype=x.dtype)),
    "baddbmm": lambda x: torch.baddbmm(torch.zeros(1, 4, 4, dtype=x.dtype), x[None], x.t()[None]),
}
FLOAT32 = {
    "mse_loss": lambda x: F.mse_loss(x, x * 0.5),
    "l1_loss": lambda x: F.l1_loss(x, x * 0.5),
    "nll_loss": lambda x: F.nll_loss(x, torch.zeros(4, dtype=torch.long)),
    "kl_div": lambda x: F.kl_div(x, x.abs(), reduction="batchmean"),
    "cdist": lambda x: torch.cdist(x, x),
    "prod": lambda x: torch.prod(x, dim=1),
    "binary_cross_entropy_with_logits": lambda x: F.binary_cross_entropy_with_logits(x, x.sigmoid()),
}
NEITHER = {
    "exp": torch.exp,
    "softmax": lambda x: torch.softmax(x, -1),
    "log": lambda x: torch.log(x.abs() + 1),
    "pow": lambda x: torch.pow(x, 2),
    "layer_norm": lambda x: F.layer_norm(x, (8,)),
    "sum": lambda x: x.sum(-1),
}


@pytest.mark.parametrize("op", sorted(LOWER))
def test_cpu_lower_precision_ops_compute_in_the_autocast_dtype(op):
    assert autocast_ops.autocast_rule(f"aten::{op}", "cpu") == "lower"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert LOWER[op](x32).dtype == torch.bfloat16


@pytest.mark.parametrize("op", sorted(FLOAT32))
def test_cpu_float32_ops_compute_in_float32(op):
    assert autocast_ops.computes_in_float32_on(f"aten::{op}", "cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert FLOAT32[op](x32.bfloat16()).dtype == torch.float32


@pytest.mark.parametrize("op", sorted(NEITHER))
def test_ops_on_no_cpu_list_keep_their_inputs_dtype_on_the_cpu_and_cuda_computes_them_in_float32(op):
    assert autocast_ops.autocast_rule(f"aten::{op}", "cpu") is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert NEITHER[op](x32.bfloat16()).dtype == torch.bfloat16
    assert autocast_ops.computes_in_float32_on(f"aten::{op}.default", "cuda")  # (the CUDA list; on a GPU: device_check)


def test_the_lists_are_disjoint_per_device():
    for lists in autocast_ops.LISTS.values():
        names = [set(v) for v in lists.values()]
        assert not any(a & b for i, a in enumerate(names) for b in names[i + 1 :])
