"""FSDP's mixed precision (the ``fsdp`` entry of the precision configuration: FSDP casts the parameters itself, per
unit, and reduces the gradients in its own dtype):

- fsdp-reduce-dtype: gradients reduce-scattered across the ranks in BF16/FP16 (``reduce_dtype`` set to it, or left
  unset: FSDP then reduces in ``param_dtype``);
- fsdp-fp16-scaler: FSDP computes in FP16 without a loss scaler, or with a GradScaler that sees one shard only.
"""

from __future__ import annotations

from typing import Any

from .. import formats
from . import advice as A
from .fix import Part, code, text
from .result import Diagnosis, finding

Run = Any  # engine.Run (not imported: the engine imports the rules through the registry)
Unit = dict[str, Any]  # one unit's entry of config.fsdp.units

# A reduction over N ranks rounds each value up to N-1 times in the reduce dtype (a ring reduce-scatter adds one
# rank's piece per hop), on top of the rounding of each rank's gradient to it. With one rank nothing is reduced.
MIN_WORLD_SIZE = 2
SHARDED_SCALER = "ShardedGradScaler"


def _fsdp(run: Run) -> dict[str, Any]:
    cfg = run.config.get("fsdp")
    return cfg if isinstance(cfg, dict) and isinstance(cfg.get("units"), dict) else {}


def _torch(dtype: str | None) -> str:
    return f"torch.{dtype}" if dtype else "None"


def _policy_call(engine: str, unit: Unit, reduce_dtype: str | None) -> str:
    """The unit's policy as recorded, with ``reduce_dtype`` in place of its own: the constructor call to paste."""
    args = [f"param_dtype={_torch(unit.get('param_dtype'))}", f"reduce_dtype={_torch(reduce_dtype)}"]
    if engine == "fsdp1":
        if unit.get("buffer_dtype"):
            args.append(f"buffer_dtype={_torch(unit['buffer_dtype'])}")
        if unit.get("keep_low_precision_grads"):
            args.append("keep_low_precision_grads=True")
        if unit.get("cast_forward_inputs"):
            args.append("cast_forward_inputs=True")
        if unit.get("cast_root_forward_inputs") is False:
            args.append("cast_root_forward_inputs=False")
        return f"MixedPrecision({', '.join(args)})"
    if unit.get("output_dtype"):
        args.append(f"output_dtype={_torch(unit['output_dtype'])}")
    if unit.get("cast_forward_inputs") is False:
        args.append("cast_forward_inputs=False")
    return f"MixedPrecisionPolicy({', '.join(args)})"


def _policy_fix(engine: str, units: dict[str, Unit], fixed: list[str], reduce_dtype: str) -> list[Part]:
    """One policy per distinct policy of the units to fix (the units sharing it listed), each as printed code."""
    groups: dict[tuple[tuple[str, Any], ...], list[str]] = {}
    for path, u in units.items():
        key = tuple(sorted((k, v) for k, v in u.items() if k not in ("compute", "reduce", "params")))
        groups.setdefault(key, []).append(path)
    wanted = [paths for paths in groups.values() if any(p in fixed for p in paths)]
    cls = "MixedPrecision" if engine == "fsdp1" else "MixedPrecisionPolicy"
    var = "mixed_precision" if engine == "fsdp1" else "mp_policy"
    lines = ["import torch", f"from torch.distributed.fsdp import {cls}", ""]
    names = []
    for i, paths in enumerate(wanted):
        name = var if i == 0 else f"{var}_{i + 1}"
        names.append((name, paths))
        lines.append(f"{name} = {_policy_call(engine, units[paths[0]], reduce_dtype)}")
    if engine == "fsdp1":
        where = "; ".join(
            f"pass {name} as FullyShardedDataParallel(..., mixed_precision={name}) for {_units(paths)}"
            for name, paths in names
        )
    else:
        where = "; ".join(
            f"pass {name} to the fully_shard call of {_units(paths)}: fully_shard(module, mp_policy={name})"
            for name, paths in names
        )
    return [code(*lines), text(where[0].upper() + where[1:] + ".")]


def _units(paths: list[str]) -> str:
    shown = ", ".join(paths[:6]) + (f" and {len(paths) - 6} more" if len(paths) > 6 else "")
    return ("unit " if len(paths) == 1 else "units ") + shown


def fsdp_reduce_dtype(run: Run, *, min_world_size: int = MIN_WORLD_SIZE) -> Diagnosis | None:
    cfg = _fsdp(run)
    units = cfg.get("units", {})
    world = int(cfg.get("world_size") or run.info.get("world_size") or 1)
    if not units or world < min_world_size:
        return None
    half = {p: u for p, u in units.items() if u.get("reduce") in formats.REDUCED and u.get("params")}
    if not half:
        return None
    engine = str(cfg.get("engine") or "fsdp2")
    dtypes = sorted({u["reduce"] for u in half.values()})
    implicit = [p for p, u in half.items() if not u.get("reduce_dtype")]
    fmt = formats.get(dtypes[0]) if len(dtypes) == 1 else formats.FP16 if "float16" in dtypes else formats.BF16
    bits = fmt.mantissa_bits + 1
    n_params = sum(int(u.get("params") or 0) for u in half.values())
    total = sum(int(u.get("params") or 0) for u in units.values()) or n_params
    why = (
        f"reduce_dtype is not set, so FSDP reduces in param_dtype={half[implicit[0]].get('param_dtype')}"
        if implicit
        else f"reduce_dtype={'/'.join(dtypes)}"
    )
    fp16 = "float16" in dtypes
    harm = (
        f"{fmt.name.upper()} keeps {bits} significant bits (a relative rounding error up to 2^-{bits}): each rank's "
        f"gradient is rounded to it and every partial sum of the reduction again, up to {world - 1} time(s) per "
        f"value over {world} ranks, so the averaged gradient loses precision as ranks are added"
    )
    if fp16:
        harm += "; FP16 also flushes gradient values under 6e-8 to zero and overflows a sum above 65504"
    summary = (
        f"FSDP reduce-scatters the gradients of {_units(list(half))} ({n_params:,} of {total:,} parameters) in "
        f"{'/'.join(dtypes)} across {world} ranks: {why}. {harm}. Reducing in FP32 costs "
        "twice the gradient traffic; compute stays in the half-precision param_dtype."
    )
    fix = [
        text(
            "Reduce the gradients in FP32 (FSDP upcasts each rank's gradient before the reduce-scatter and hands the "
            "optimizer FP32 gradients, as before):"
        ),
        *_policy_fix(engine, units, list(half), "float32"),
    ]
    return finding(
        "warning" if implicit or fp16 else "info",
        f"FSDP reduces gradients in {'/'.join(dtypes)}",
        summary,
        layers=[p for p in half if p != "(model)"] + (["(model)"] if "(model)" in half else []),
        steps=[0, run.n_steps - 1],
        evidence={
            "engine": engine,
            "world_size": world,
            "reduce_dtype": dtypes,
            "reduce_dtype_unset_units": implicit,
            "units": {
                p: {k: u.get(k) for k in ("param_dtype", "reduce_dtype", "reduce", "params")} for p, u in half.items()
            },
            "parameters_reduced_in_half": n_params,
            "significant_bits": bits,
            "roundings_per_value": world - 1,
        },
        fix=fix,
    )


def fsdp_fp16_scaler(run: Run) -> Diagnosis | None:
    cfg = _fsdp(run)
    units = cfg.get("units", {})
    fp16 = {p: u for p, u in units.items() if u.get("compute") == "float16" and u.get("params")}
    if not fp16:
        return None
    sc = run.scaler
    cls = sc.get("class") if run.scaler_on else None
    if cls == SHARDED_SCALER:
        return None
    engine = str(cfg.get("engine") or "fsdp2")
    world = int(cfg.get("world_size") or run.info.get("world_size") or 1)
    dev = A.dev(run)
    settings = "".join(
        f", {k}={A.pow2(float(sc[k])) if k == 'init_scale' else sc[k]}"
        for k in ("init_scale", "growth_interval")
        if cls is not None and sc.get(k) is not None
    )
    skipped = int(run.steps["skipped"].sum()) if run.n_steps else 0
    nonfinite = int(run.steps["nonfinite"].sum()) if run.n_steps else 0
    if cls is None:
        severity, title = "critical", "FSDP computes in FP16 without a loss scaler"
        what = (
            f"FSDP casts the parameters of {_units(list(fp16))} to float16 (param_dtype) and no GradScaler scales "
            "the loss: gradients under FP16's smallest subnormal (6e-8) flush to zero in the backward pass and "
            "the updates they carry are lost"
        )
    else:
        severity, title = "warning", f"FSDP with a {cls}: each rank judges its own shard"
        what = (
            f"FSDP computes {_units(list(fp16))} in float16 with a {cls}, which checks only this rank's shard of the "
            f"gradients for Inf/NaN and does not agree with the other {world - 1} rank(s): ranks skip different "
            "steps and their shards of the model part ways"
        )
    fix = [
        text(
            "Scale the loss with ShardedGradScaler: it checks every rank's shard and all-reduces found_inf, so all "
            "ranks skip the same steps:"
        ),
        code(
            "from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler",
            "",
            f'scaler = ShardedGradScaler("{dev}"{settings})',
        ),
        text("and in the training step:"),
        code("scaler.scale(loss).backward()", "scaler.step(optimizer)", "scaler.update()"),
    ]
    if run.bf16_supported:
        fix += [
            text("Or compute in BF16 (FP32's range: no loss scaling needed; this device supports it):"),
            *_policy_fix(
                engine, {p: {**u, "param_dtype": "bfloat16"} for p, u in units.items()}, list(fp16), "float32"
            ),
        ]
    return finding(
        severity,
        title,
        f"{what} ({skipped} skipped and {nonfinite} non-finite step(s) on this rank).",
        layers=[p for p in fp16 if p != "(model)"] + (["(model)"] if "(model)" in fp16 else []),
        steps=[0, run.n_steps - 1],
        evidence={
            "engine": engine,
            "world_size": world,
            "units": {p: {k: u.get(k) for k in ("param_dtype", "compute", "params")} for p, u in fp16.items()},
            "scaler": cls,
            "skipped_steps": skipped,
            "nonfinite_steps": nonfinite,
        },
        fix=fix,
    )
