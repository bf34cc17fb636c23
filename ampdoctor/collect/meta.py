"""What the trace says about the run besides its steps: the rank and the file it writes, versions and settings at
attach, and the precision configuration observed after the first step."""

from __future__ import annotations

import os
import platform
import time
import warnings

import torch

from ..trace.schema import ROOT
from . import sharded
from .buffers import dtype_name
from .cadence import Cadence
from .options import Options
from .state import RunFacts


def dist() -> dict:
    """rank, world size and local rank: torch.distributed's once initialised, else what torchrun put in the
    environment (a doctor attached before ``init_process_group`` still gets its own rank)."""
    env = os.environ
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        out = {
            "rank": torch.distributed.get_rank(),
            "world_size": torch.distributed.get_world_size(),
            "backend": str(torch.distributed.get_backend()),
        }
    else:
        try:
            out = {"rank": int(env.get("RANK", 0)), "world_size": int(env.get("WORLD_SIZE", 1))}
        except ValueError:
            out = {"rank": 0, "world_size": 1}
    if out["world_size"] > 1:
        out["local_rank"] = int(env["LOCAL_RANK"]) if env.get("LOCAL_RANK", "").isdigit() else None
        out["run_id"] = env.get("TORCHELASTIC_RUN_ID")  # torchrun's id, shared by the ranks of one job
    return out


def trace_path(trace) -> str:
    """The path this rank asks for: ``{rank}`` replaced; with several ranks and no ``{rank}``, ``.rank<N>`` added
    before the extension, so that ranks never share a file (``runs/exp.db`` -> ``runs/exp.rank1.db``)."""
    path = os.fspath(trace)
    d = dist()
    if "{rank}" in path:
        return path.replace("{rank}", str(d["rank"]))
    if d["world_size"] <= 1:
        return path
    stem, ext = os.path.splitext(path)
    if d["rank"] == 0:
        warnings.warn(
            f"ampdoctor: {d['world_size']} ranks and no {{rank}} in trace={path!r}: each rank writes "
            f"its own file, {stem}.rank<N>{ext}",
            RuntimeWarning,
            stacklevel=5,
        )
    return f"{stem}.rank{d['rank']}{ext}"


def run_meta(model: torch.nn.Module, options: Options, cadence: Cadence) -> dict:
    """What the run is: versions, host, rank, model, device and the observation settings (written at attach)."""
    import ampdoctor

    dev = device_type(model) or "cpu"
    info = {
        "ampdoctor": ampdoctor.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "host": platform.node(),
        "pid": os.getpid(),
        **dist(),
        "started": time.time(),
        "model": type(model).__name__,
        "device": dev,
        "params": sharded.param_count(model),  # (FSDP: the whole model, not this rank's shards)
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "mode": options.mode.value,
        "every": options.every,
        "peak_every": options.peak_every,
        "hist_every": options.hist_every,
        "weight_every": options.weight_every,
        "calibration": cadence.calibration,
        "clean_run": cadence.clean_run,
        "probe_every": options.probe_every,
        "replay": options.replay,
        "heal": options.heal,
        "budget": options.budget,
    }
    if dev == "cuda":
        idx = next(model.parameters()).device.index or 0
        cap = torch.cuda.get_device_capability(idx)
        info.update(
            device_name=torch.cuda.get_device_name(idx),
            capability=list(cap),
            bf16_supported=bool(torch.cuda.is_bf16_supported()),
        )
    else:
        info.update(device_name=platform.processor() or platform.machine(), bf16_supported=True)
    return info


def config(model: torch.nn.Module, optimizer, scaler, scaler_enabled: bool, facts: RunFacts, boundary: str) -> dict:
    """The observed precision configuration, taken after the first step (autocast and dtypes are known)."""
    params: dict[str, int] = {}
    module_dtypes: dict[str, str] = {}
    for name, p in model.named_parameters():
        d = dtype_name(p.dtype)
        params[d] = params.get(d, 0) + p.numel()
        module_dtypes.setdefault(name.rpartition(".")[0] or ROOT, d)
    cfg = {
        "autocast": facts.autocast or {"enabled": False},
        "param_dtypes": params,
        "module_param_dtypes": module_dtypes,
        "loss_dtype": facts.loss_dtype,
        "boundary": boundary,
        # where step timing comes from: the root forward, begin_batch() calls, or nowhere (no data wait)
        "step_start": "begin_batch" if facts.external_batches else ("forward" if facts.step_starts else None),
    }
    fsdp = sharded.config(model)  # FSDP's mixed precision: its policy per unit, the dtypes it computes and reduces in
    if fsdp is not None:
        cfg["fsdp"] = fsdp
    if optimizer is not None:
        groups = [{k: plain(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        cfg["optimizer"] = {"class": type(optimizer).__name__, "groups": groups}
    if scaler is not None:
        cfg["scaler"] = {"class": type(scaler).__name__, "enabled": scaler_enabled}
        for key in ("init_scale", "growth_factor", "backoff_factor", "growth_interval") if scaler_enabled else ():
            getter = getattr(scaler, f"get_{key}", None)
            if callable(getter):
                cfg["scaler"][key] = plain(getter())
            elif key == "init_scale" and hasattr(scaler, "_init_scale"):  # GradScaler has no public getter
                cfg["scaler"][key] = plain(scaler._init_scale)
    return cfg


def device_type(model) -> str | None:
    for p in model.parameters():
        return p.device.type
    for b in model.buffers():
        return b.device.type
    return None


def plain(v):
    if isinstance(v, torch.Tensor):
        return v.item() if v.numel() == 1 else v.tolist()
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    if isinstance(v, (list, tuple)):
        return [plain(x) for x in v]
    return repr(v)
