"""The O0/O1/O2/O3-style label of a run, read from the configuration its trace recorded (CLI, dashboard, report)."""

from __future__ import annotations


def describe_precision(cfg: dict) -> str:
    """O0/O1/O2/O3-style label of a run from its observed configuration."""
    if not cfg:
        return "unknown: no step recorded yet"
    ac = cfg.get("autocast", {}) or {}
    params = cfg.get("param_dtypes", {}) or {}
    total = sum(params.values()) or 1
    half = sum(v for k, v in params.items() if k in ("float16", "bfloat16")) / total
    master = "FP32 master weights" if half < 0.5 else "half-precision weights"
    fsdp = cfg.get("fsdp") or {}
    cast = [d for d in fsdp.get("compute_dtypes", []) or [] if d in ("float16", "bfloat16")]
    if cast and not ac.get("enabled"):  # FSDP casts its sharded parameters for compute itself, without autocast
        reduce = "/".join(fsdp.get("reduce_dtypes") or []) or "?"
        return f"FSDP mixed precision: computes in {'/'.join(cast)}, {master}, gradients reduced in {reduce}"
    if ac.get("enabled"):
        return f"O1-style: autocast {ac.get('dtype')}, {master}"
    if half >= 0.99:
        return "O3-style: model in half precision, no autocast"
    if half > 0:
        return "O2-style: mostly half-precision weights (some FP32), no autocast"
    return "O0: FP32 throughout (no autocast, FP32 weights)"
