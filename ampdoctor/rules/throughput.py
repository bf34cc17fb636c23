"""input-pipeline-bound: the host waits for data for a large share of each step, so AMP cannot speed it up."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from . import advice as A
from .fix import code, text
from .result import Diagnosis, finding
from .runview import RunView

# A third of each step spent waiting for the next batch caps any compute speed-up (AMP's included) at 1.5x.
MIN_DATA_SHARE = 0.30
# Half of the step waiting: the accelerator idles more than it computes.
WARNING_SHARE = 0.50
WARMUP_STEPS = 2  # the first steps pay for worker start-up and allocation, not for the pipeline


def net_step_time(steps: pd.DataFrame) -> pd.Series:
    """Step times without ampdoctor's own host time (``observer_time``; traces without it: as recorded): what the
    training would have taken unobserved, which every time-based judgement uses."""
    own = steps["observer_time"].fillna(0.0) if "observer_time" in steps else 0.0
    return (steps["step_time"] - own).clip(lower=0.0)


def input_pipeline_bound(
    run: RunView, *, min_share: float = MIN_DATA_SHARE, warning_share: float = WARNING_SHARE, warmup: int = WARMUP_STEPS
) -> Diagnosis | None:
    if (run.config or {}).get("step_start", "forward") is None:
        return None  # no step start was seen (the attached module's forward never ran): no data wait known
    cols = ["step", "step_time", "data_time", "samples_per_s"] + (
        ["observer_time"] if "observer_time" in run.steps else []
    )
    st = run.steps[cols].iloc[warmup:]  # the columns this rule reads, not a copy of the whole table
    st = st.assign(net_time=net_step_time(st))  # the data wait holds no observer time; the step time does
    st = st[np.isfinite(st["data_time"]) & np.isfinite(st["net_time"]) & (st["net_time"] > 0)]
    if len(st) < 5:
        return None
    share = (st["data_time"] / st["net_time"]).clip(upper=1.0)
    med = float(np.median(share))
    if med < min_share:
        return None
    cuda = run.device == "cuda"
    data_s, step_s = float(st["data_time"].median()), float(st["net_time"].median())
    # Workers that each take data_s per batch keep up with a compute of (step_s - data_s) when there are
    # data_s / compute of them, plus one spare; more than the host's cores only helps I/O-bound loading.
    compute_s = max(step_s - data_s, 1e-6)
    workers = max(2, math.ceil(data_s / compute_s) + 1)
    cores = run.info.get("cpu_count")
    fix = [
        text("Load batches in parallel and ahead of the step (dataset and batch_size: yours):"),
        code(
            "loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=True,",
            f"    num_workers={workers}, persistent_workers=True, prefetch_factor=4"
            f"{', pin_memory=True' if cuda else ''})",
        ),
    ]
    if cores and workers > cores:
        fix.append(
            text(
                f"More workers than the host's {cores} cores: right for I/O-bound loading; CPU-bound "
                "decoding needs the steps below too."
            )
        )
    if cuda:
        fix += [
            text("With pin_memory the copy to the GPU overlaps compute:"),
            code('x = x.to("cuda", non_blocking=True)'),
            text(
                "Decode and augment images on the GPU (NVIDIA DALI, torchvision.io.decode_jpeg(device='cuda')) "
                "when the CPU cannot keep up."
            ),
        ]
    else:
        fix.append(
            text("Move decoding and augmentation out of __getitem__'s hot path (pre-process once, cache tensors).")
        )
    return finding(
        "warning" if med >= warning_share else "info",
        "Training is input-pipeline bound",
        f"The step waits for data {A.pct(med)} of its time (median {A.fmt_num(data_s)} s "
        f"of {A.fmt_num(step_s)} s, ampdoctor's own time taken out); a faster compute precision cannot shorten "
        "that part.",
        steps=[int(st["step"].iloc[0]), int(st["step"].iloc[-1])],
        evidence={
            "data_share_median": med,
            "data_time_median_s": data_s,
            "step_time_median_s": step_s,
            "recorded_step_time_median_s": float(st["step_time"].median()),
            "observer_time_median_s": float(st["observer_time"].median())
            if "observer_time" in st and st["observer_time"].notna().any()
            else None,
            "samples_per_s_median": float(np.nanmedian(st["samples_per_s"]))
            if st["samples_per_s"].notna().any()
            else None,
            "steps_measured": len(st),
        },
        fix=fix,
    )
