"""The fix templates: code parts written for the configuration the run was recorded with (Setup: parameter dtype,
autocast, scaler, optimizer, device). Every code part runs when pasted whole into the training script: it uses only
the script's own names (``torch``, ``ampdoctor``, ``model``, ``optimizer``, ``scaler`` where the run has one,
``loss_fn``, ``x``, ``y``; a template that needs another says so in its text) and imports anything else itself.
Alternatives are separate parts. tests/rules/test_fix_templates.py runs each template for each configuration it can
be printed for."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .. import formats
from ..islands import code_line
from ..lossscale import TORCH_DEFAULTS
from ..trace.schema import ROOT
from .fix import Part, code, text
from .runview import RunView

# Headroom kept below the FP16 max when choosing a loss scale: gradients grow during training and one batch is
# not the worst batch; 2^3 leaves three binades before the next overflow.
SCALE_MARGIN = 8.0


# Hyper-parameters of the recorded optimizer that a re-created optimizer keeps (others are the class defaults).
HYPER = ("lr", "betas", "eps", "weight_decay", "momentum")


@dataclass(frozen=True)
class Setup:
    """The training configuration a run was recorded with: what a printed fix must fit."""

    device: str = "cpu"
    param_dtype: str = "float32"  # the dtype most trainable parameters are stored in
    autocast: str | None = None  # the autocast dtype; None: no autocast region
    scaler: bool = False  # a GradScaler is enabled
    optimizer: str | None = "SGD"  # the optimizer class; None: no optimizer seen
    hyper: dict[str, Any] = field(default_factory=dict)  # HYPER values of its first parameter group
    bf16_supported: bool = True
    capability: tuple[int, ...] | None = None
    module_dtypes: dict[str, str] = field(
        default_factory=dict
    )  # module path -> the dtype its own parameters are stored in

    @classmethod
    def of(cls, run: RunView) -> Setup:
        cfg = run.config
        counts = {k: v for k, v in (cfg.get("param_dtypes") or {}).items() if isinstance(v, (int, float))}
        ac = run.autocast
        opt = cfg.get("optimizer") or {}
        group = (opt.get("groups") or [{}])[0] or {}
        return cls(
            device=run.device,
            param_dtype=max(counts, key=lambda k: counts[k]) if counts else "float32",
            autocast=ac.get("dtype") if ac.get("enabled") and ac.get("dtype") in formats.REDUCED else None,
            scaler=run.scaler_on,
            optimizer=opt.get("class"),
            hyper={k: group[k] for k in HYPER if group.get(k) is not None},
            bf16_supported=run.bf16_supported,
            capability=run.capability,
            module_dtypes=dict(cfg.get("module_param_dtypes") or {}),
        )

    @property
    def half_params(self) -> bool:
        """Parameters stored in FP16/BF16 (``model.half()``): no GradScaler (it refuses FP16 gradients), and
        keep_fp32 needs autocast."""
        return self.param_dtype in formats.REDUCED

    @property
    def compute(self) -> str:
        """The reduced dtype the run computed in: autocast's, else the parameters'."""
        return self.autocast or (self.param_dtype if self.half_params else "float16")


def dev(run: RunView | Setup) -> str:
    return "cuda" if run.device == "cuda" else run.device


def suggest_scale(max_unscaled: float, fmt: formats.Format = formats.FP16, margin: float = SCALE_MARGIN) -> float:
    """Largest power of two s with max_unscaled * s * margin <= fmt.max (at least 1)."""
    if not (max_unscaled > 0 and math.isfinite(max_unscaled)):
        return TORCH_DEFAULTS["init_scale"]
    return 2.0 ** max(0, math.floor(math.log2(fmt.max / (margin * max_unscaled))))


def pow2(x: float) -> str:
    """512.0 -> '512.0', 2**20 -> '2.0**20' (readable scale values)."""
    if not math.isfinite(x):
        return repr(float(x))
    e = math.log2(x) if x > 0 else 0
    return f"{x:.1f}" if x < 2**17 or e != int(e) else f"2.0**{int(e)}"


def scaler_line(run: RunView, **settings: float) -> str:
    args = "".join(f", {k}={pow2(v) if k == 'init_scale' else v}" for k, v in settings.items())
    if run.config.get("fsdp"):  # FSDP: a GradScaler would judge this rank's shard alone (rules/fsdp.py)
        return (
            "from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler\n"
            f'scaler = ShardedGradScaler("{dev(run)}"{args})'
        )
    return f'scaler = torch.amp.GradScaler("{dev(run)}"{args})'


def autocast_block(run: RunView | Setup, dtype: str = "float16") -> str:
    return f'with torch.autocast(device_type="{dev(run)}", dtype=torch.{dtype}):\n    loss = loss_fn(model(x), y)'


def optimizer_line(setup: Setup) -> str:
    """The user's optimizer re-created over the (now FP32) parameters, with its recorded hyper-parameters."""
    args = []
    for key, v in setup.hyper.items():
        v = tuple(v) if isinstance(v, list) else v
        args.append(f"{key}={v!r}")
    cls = setup.optimizer or "SGD"
    if cls not in TORCH_OPTIMIZERS:
        return "optimizer = type(optimizer)(model.parameters(), **optimizer.defaults)  # re-created over FP32 params"
    return f"optimizer = torch.optim.{cls}(model.parameters(), {', '.join(args)})  # re-created over FP32 params"


# torch.optim classes a re-created optimizer can name (others are re-created from the user's own object).
TORCH_OPTIMIZERS = (
    "SGD",
    "Adam",
    "AdamW",
    "Adamax",
    "NAdam",
    "RAdam",
    "RMSprop",
    "Adagrad",
    "Adadelta",
    "ASGD",
    "Rprop",
    "LBFGS",
    "SparseAdam",
    "Adafactor",
)


def backward_lines(setup: Setup, scaler: bool) -> list[str]:
    """The end of the loop's step: through the GradScaler, or plain."""
    if scaler:
        return ["scaler.scale(loss).backward()", "scaler.step(optimizer)", "scaler.update()"]
    return ["loss.backward()", "optimizer.step()"]


def master_weights(setup: Setup, dtype: str | None = None, scaler: str | None = None) -> Part:
    """FP32 parameters, the optimizer re-created over them, autocast computing in ``dtype`` (default: the run's
    compute dtype), a GradScaler for FP16 (``scaler``: its line, e.g. the replay's); then one step of the loop, as it
    reads from now on."""
    dtype = dtype or setup.compute
    lines = ["model.float()", optimizer_line(setup)]
    if dtype == "float16":
        lines.append(scaler or f'scaler = torch.amp.GradScaler("{dev(setup)}")')
    lines += ["# and in the loop:", autocast_block(setup, dtype), *backward_lines(setup, dtype == "float16")]
    return code(*lines)


def keep_fp32(setup: Setup, paths: Sequence[str]) -> list[Part]:
    """Run ``paths`` in FP32 inside autocast; a run without autocast (half-precision parameters) first moves to FP32
    master weights with autocast, since keep_fp32 changes nothing outside an autocast region."""
    line = keep_fp32_line(paths)
    if setup.autocast is None and not setup.half_params:
        return [code(line, *_fp16_loop(setup))]  # an FP32 run: for when it trains in FP16 autocast
    if setup.autocast is None and setup.half_params:
        return [
            text(
                f"This run keeps its parameters in {setup.param_dtype} without autocast, where keep_fp32 changes "
                "nothing: keep FP32 parameters, let autocast compute in half precision, and keep these modules in "
                "FP32:"
            ),
            code(line, *master_weights(setup).text.splitlines()),
        ]
    return [code(line)]


def fp32_island(setup: Setup, paths: Sequence[str]) -> list[Part]:
    """Modules whose outputs are small (a normalisation) computed in FP32: inside autocast their parameters in FP32
    and keep_fp32; in a half-precision model without autocast their parameters in FP32 with their inputs cast up and
    their outputs cast back to the model's dtype (O2-style FP32 normalisation layers)."""
    mods = ", ".join(attr(p) for p in paths)
    if setup.autocast is None and setup.half_params:
        back = "half" if setup.param_dtype == "float16" else "bfloat16"
        return [
            code(
                "def inputs_to_fp32(m, args):",
                "    return tuple(a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args)",
                "",
                "",
                f"for m in ({mods},):",
                "    m.float()",
                "    m.register_forward_pre_hook(inputs_to_fp32)",
                f"    m.register_forward_hook(lambda m, args, out: out.{back}())",
            )
        ]
    # .float() converts parameters and buffers (a BatchNorm's running statistics); a no-op where they are FP32
    lines = [f"for m in ({mods},):", "    m.float()"] if len(paths) > 1 else [f"{attr(paths[0])}.float()"]
    loop = _fp16_loop(setup) if setup.autocast is None else []
    return [code(*lines, keep_fp32_line(paths), *loop)]


def _fp16_loop(setup: Setup) -> list[str]:
    """For an FP32 run (no autocast): the FP16 autocast step with a GradScaler that keep_fp32 takes effect in."""
    return [
        f'scaler = torch.amp.GradScaler("{dev(setup)}")',
        "# and in the loop:",
        autocast_block(setup, "float16"),
        *backward_lines(setup, True),
    ]


def loss_in_fp32(setup: Setup) -> Part:
    """The loss computed in FP32 from the model's output (outside autocast)."""
    if setup.autocast is not None:
        return code(
            f'with torch.autocast(device_type="{dev(setup)}", dtype=torch.{setup.autocast}):',
            "    out = model(x)",
            "loss = loss_fn(out.float(), y)  # the loss in FP32, outside autocast",
        )
    return code("loss = loss_fn(model(x).float(), y)  # the loss in FP32")


def clip_lines(setup: Setup, max_norm: float = 1.0) -> list[str]:
    """Gradient clipping as the run's configuration needs it: with a GradScaler, unscale first."""
    lines = ["scaler.unscale_(optimizer)  # clip the gradients the optimizer will apply, not the scaled ones"]
    return (lines if setup.scaler else []) + [
        f"torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm={float(max_norm)!r})"
    ]


def lower_lr(run: RunView | Setup, lr: float | None, new_lr: float | None, warmup: int, adaptive: bool) -> list[Part]:
    """A lower learning rate and a warm-up (and, for an optimizer whose step follows the gradient, clipping)."""
    setup = run if isinstance(run, Setup) else Setup.of(run)
    opt = setup.optimizer or "the optimizer"
    fix = [
        text(
            "Lower the learning rate and warm it up"
            + ("; a different loss scale or a wider format cannot help:" if setup.scaler else ":")
            + " (call scheduler.step() after every optimizer step)"
        ),
        code(
            "for group in optimizer.param_groups:  # (initial_lr: what a scheduler, yours or this one, starts from)",
            f'    group["lr"] = group["initial_lr"] = {new_lr:g}  # was {lr:.3g}'
            if new_lr
            else '    group["lr"] = group["initial_lr"] = group.get("initial_lr", group["lr"]) / 10',
            f"scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / {warmup}))",
        ),
    ]
    if adaptive:
        fix.append(
            text(
                f"Clipping the gradient norm does not help {opt}: it divides each update by the gradient's running "
                "RMS, so a smaller gradient does not make a smaller step."
            )
        )
    else:
        fix += [
            text(
                f"Also clip the gradient norm before optimizer.step() ({opt}'s step is proportional to the gradient):"
            ),
            code(*clip_lines(setup)),
        ]
    return fix


def bf16_note(run: RunView | Setup) -> list[Part]:
    """The BF16 alternative (fix parts), offered only where the recorded device supports it."""
    if not run.bf16_supported:
        return []
    setup = run if isinstance(run, Setup) else Setup.of(run)
    if setup.half_params:
        return [
            text(
                "Or train in BF16 with FP32 parameters (FP32's exponent range, no loss scaling; this device "
                "supports it):"
            ),
            master_weights(setup, "bfloat16"),
        ]
    return [
        text("Or switch to BF16 (FP32's exponent range, no loss scaling needed; this device supports it):"),
        code(autocast_block(run, "bfloat16"), "loss.backward()  # no GradScaler", "optimizer.step()"),
    ]


def tf32_note(run: RunView | Setup) -> list[Part]:
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


def keep_fp32_line(paths: Sequence[str]) -> str:
    return code_line(paths)


def fmt_num(v: float | None) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if v == 0:
        return "0"
    return f"{v:.3g}" if 1e-3 <= abs(v) < 1e5 else f"{v:.2e}"


def pct(share: float) -> str:
    return f"{100.0 * share:.1f}%"
