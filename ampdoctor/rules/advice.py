"""Code snippets for recommendations, written for the device the run was recorded on."""

from __future__ import annotations

import math

from .. import formats
from ..islands import code_line
from ..lossscale import TORCH_DEFAULTS
from ..trace.schema import ROOT
from .fix import code, text

# Headroom kept below the FP16 max when choosing a loss scale: gradients grow during training and one batch is
# not the worst batch; 2^3 leaves three binades before the next overflow.
SCALE_MARGIN = 8.0


def dev(run) -> str:
    return "cuda" if run.device == "cuda" else run.device


def suggest_scale(max_unscaled: float, fmt: formats.Format = formats.FP16, margin: float = SCALE_MARGIN) -> float:
    """Largest power of two s with max_unscaled * s * margin <= fmt.max (at least 1)."""
    if not (max_unscaled > 0 and math.isfinite(max_unscaled)):
        return TORCH_DEFAULTS["init_scale"]
    return 2.0 ** max(0, math.floor(math.log2(fmt.max / (margin * max_unscaled))))


def pow2(x: float) -> str:
    """512.0 -> '512.0', 2**20 -> '2.0**20' (readable scale values)."""
    e = math.log2(x) if x > 0 else 0
    return f"{x:.1f}" if x < 2**17 or e != int(e) else f"2.0**{int(e)}"


def scaler_line(run, **settings) -> str:
    args = "".join(f", {k}={pow2(v) if k == 'init_scale' else v}" for k, v in settings.items())
    if run.config.get("fsdp"):  # FSDP: a GradScaler would judge this rank's shard alone (rules/fsdp.py)
        return (
            "from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler\n"
            f'scaler = ShardedGradScaler("{dev(run)}"{args})'
        )
    return f'scaler = torch.amp.GradScaler("{dev(run)}"{args})'


def autocast_block(run, dtype: str = "float16") -> str:
    return f'with torch.autocast(device_type="{dev(run)}", dtype=torch.{dtype}):\n    loss = loss_fn(model(x), y)'


def bf16_note(run) -> list:
    """The BF16 alternative (fix parts), offered only where the recorded device supports it."""
    if not run.bf16_supported:
        return []
    return [
        text("Or switch to BF16 (FP32's exponent range, no loss scaling needed; this device supports it):"),
        code(autocast_block(run, "bfloat16"), "loss.backward()  # no GradScaler"),
    ]


def tf32_note(run) -> list:
    """TF32 matmuls on Ampere and newer (fix parts): FP32 speed-up without half-precision range issues."""
    cap = run.capability
    if run.device == "cuda" and cap and cap[0] >= 8:
        return [
            text("This GPU (compute capability {}.{}) also runs FP32 matmuls in TF32:".format(*cap)),
            code("torch.backends.cuda.matmul.allow_tf32 = True", "torch.backends.cudnn.allow_tf32 = True"),
        ]
    return []


def attr(path: str) -> str:
    """Module path to Python attribute access: blocks.0.ln -> model.blocks[0].ln, 4.weight -> model[4].weight."""
    out = ["model"]
    if path == ROOT:
        return "model"
    for part in path.split("."):
        if part.isdigit():
            out[-1] += f"[{part}]"
        else:
            out.append(part)
    return ".".join(out)


def keep_fp32_line(paths) -> str:
    return code_line(paths)


def fmt_num(v: float) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if v == 0:
        return "0"
    return f"{v:.3g}" if 1e-3 <= abs(v) < 1e5 else f"{v:.2e}"


def pct(share: float) -> str:
    return f"{100.0 * share:.1f}%"
