"""Rank rules: what only the ranks of a distributed run read together show. Each runs once over ``run.ranks``
(every rank's Run; empty for a single trace, where these rules stay silent) and names the rank at fault.

- rank-nonfinite: NaN/Inf produced on some ranks only (a bad data shard or a faulty device);
- rank-scale-divergence: the ranks' loss scalers disagree (they skip different steps: replicas part ways);
- rank-straggler: one rank's step or data wait much longer than the others' (it sets everyone's pace).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypedDict

import numpy as np
import pandas as pd

from . import advice as A
from .fix import code, text
from .result import Diagnosis, finding
from .runview import RunView
from .throughput import net_step_time

# Steps with a non-finite forward or loss on some ranks only. One such step is already a fact worth reporting: a
# healthy run (the same model and numerics on every rank) has none after calibration, and a NaN in the forward
# pass does not depend on the loss scale, so calibration cannot explain it.
MIN_STEPS = 1
# The share of steps lost to it that makes it critical: above 5%, skipping alone slows training noticeably.
CRITICAL_SHARE = 0.05
WARMUP_STEPS = 2  # the first steps pay for start-up (process group, allocations, workers), not the pace
MIN_TIMED_STEPS = 5
# A rank waiting for data 20% of the step longer than the others costs every rank that much under DDP (the others
# wait in the gradient all-reduce); below that, noise and one slow batch dominate.
MIN_LAG_SHARE = 0.20
# A rank 30% slower per step than the median of the others (ranks that do not wait for each other show it in the
# step time itself): the same job on the same hardware differs by a few percent.
SLOW_RATIO = 1.3
# A rank's compute lag this many times the worst data lag names a compute straggler instead (see rank_straggler).
COMPUTE_OVER_DATA = 2.0


class Medians(TypedDict):
    """One rank's median step and data wait (seconds) after the warm-up (``_medians``): the step net of ampdoctor's
    own time and as recorded (``gross``)."""

    step: float
    gross: float
    data: float
    samples: float | None
    host: str | None
    n: int


def _rank_label(ranks: Iterable[int]) -> str:
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _local_nonfinite(run: RunView) -> dict[int, str | None]:
    """Steps whose forward pass or loss was non-finite on this rank (step -> module where it started, None for
    the loss): what the rank itself produced. A gradient made non-finite by the all-reduce is not counted."""
    out: dict[int, str | None] = {}
    ev = run.events
    for e in ev[ev["phase"] == "fwd"].itertuples():
        out.setdefault(int(e.step), e.path if isinstance(e.path, str) else None)
    st = run.steps
    loss = st["loss"].to_numpy(dtype=float)
    if np.isfinite(loss).any():  # a NaN loss reads as missing: count it only where the run logs losses
        for s in st["step"][~np.isfinite(loss)]:
            out.setdefault(int(s), None)
    return out


def rank_nonfinite(
    run: RunView, *, min_steps: int = MIN_STEPS, critical_share: float = CRITICAL_SHARE
) -> Diagnosis | None:
    if len(run.ranks) < 2:
        return None
    local = {r: _local_nonfinite(x) for r, x in run.ranks.items()}
    # Once some rank's weights hold NaN/Inf the replicas differ: later NaNs say nothing about data or devices.
    n_steps = min(
        [x.n_steps for x in run.ranks.values()]
        + [int(x.weight_events["step"].min()) + 1 for x in run.ranks.values() if len(x.weight_events)]
    )
    one_sided = {
        r: sorted(s for s in steps if s < n_steps and not all(s in local[o] for o in local))
        for r, steps in local.items()
    }
    culprits = [r for r, s in one_sided.items() if len(s) >= min_steps]
    if not culprits or len(culprits) == len(local):
        return None  # every rank produces its own NaN: a model problem the per-rank rules report
    steps = sorted({s for r in culprits for s in one_sided[r]})
    layers = [p for r in culprits for p in dict.fromkeys(local[r][s] for s in one_sided[r]) if p]
    skipped_all = all(
        bool(x.steps.set_index("step")["skipped"].get(s, True)) for x in run.ranks.values() for s in steps
    )
    share = len(steps) / max(n_steps, 1)
    who = _rank_label(culprits)
    spread = (
        "every rank skipped these steps: the all-reduce carried the Inf/NaN to the others' gradients"
        if skipped_all
        else "the other ranks went on"
    )
    at = f"step {steps[0]}" if len(steps) == 1 else f"steps {', '.join(map(str, steps[:8]))}"
    fix = [
        text(
            f"The inputs of {who} at {at} are the first suspects "
            "(a corrupt file in its shard). Find them: on that rank, log the samples of a step whose input or "
            "loss is not finite,"
        ),
        code(
            "if not (torch.isfinite(x).all() and torch.isfinite(loss)):",
            '    print(f"rank {dist.get_rank()} step {step}: non-finite, samples {batch_indices}")',
        ),
        text(
            "If the same rank goes bad again with the shards swapped (e.g. DistributedSampler(..., seed=1)), "
            "its device is at fault: run the vendor's diagnostic on it (nvidia-smi -q -d ECC, dcgmi diag -r 3) "
            "and train without it."
        ),
    ]
    return finding(
        "critical" if share >= critical_share else "warning",
        f"NaN/Inf produced on {who} only",
        f"{who.capitalize()} produced NaN/Inf in the forward pass or the loss at {len(steps)} step(s) "
        f"(of {n_steps} compared) where the other ranks computed finite values on their own data; {spread}.",
        layers=layers,
        steps=[steps[0], steps[-1]],
        ranks=culprits,
        evidence={
            "ranks": culprits,
            "steps_nonfinite_by_rank": {f"rank {r}": sum(s < n_steps for s in v) for r, v in local.items()},
            "one_rank_steps": steps[:20],
            "first_module": layers[0] if layers else "the loss",
            "skipped_on_every_rank": skipped_all,
            "steps_compared": n_steps,
        },
        fix=fix,
    )


def _scale_table(run: RunView) -> pd.DataFrame | None:
    """Per step (rows) and rank (columns): the loss scale after update(); None without a scaler on every rank."""
    cols = {}
    for r, x in sorted(run.ranks.items()):
        st = x.steps
        if not st["loss_scale_next"].notna().any():
            return None
        cols[r] = st.set_index("step")["loss_scale_next"]
    return pd.DataFrame(cols).dropna()


def rank_scale_divergence(run: RunView) -> Diagnosis | None:
    if len(run.ranks) < 2:
        return None
    table = _scale_table(run)
    if table is None or not len(table):
        return None
    differs = table.nunique(axis=1) > 1
    if not differs.any():
        return None
    step = int(differs.idxmax())
    ranks = sorted(run.ranks)
    before = {r: float(run.ranks[r].steps.set_index("step")["loss_scale"].get(step, np.nan)) for r in ranks}
    after = {r: float(table.at[step, r]) for r in ranks}
    skipped = {r: bool(run.ranks[r].steps.set_index("step")["skipped"].get(step, False)) for r in ranks}
    groups: dict[tuple[float, bool], list[int]] = {}
    for r in ranks:
        groups.setdefault((after[r], skipped[r]), []).append(r)
    ordered = sorted(groups.values(), key=len)
    odd = ordered[0] if len(ordered[0]) < len(ordered[-1]) else [r for r in ranks if skipped[r]] or ordered[0]
    own = "grad_norm_shard" if "grad_norm_shard" in run.steps else "grad_norm"  # FSDP: the rank's own shard's
    applied_bad = [
        r
        for r in ranks
        if not skipped[r] and not np.isfinite(float(run.ranks[r].steps.set_index("step")[own].get(step, 0.0)))
    ]
    others = [r for r in ranks if r not in odd]
    what = (
        f"{_rank_label(odd)} skipped step {step} and backed off while {_rank_label(others)} applied it"
        if all(skipped[r] for r in odd) and not any(skipped[r] for r in others)
        else f"{_rank_label(odd)} ended step {step} with another loss scale than {_rank_label(others)}"
    )
    if applied_bad:
        what += f"; {_rank_label(applied_bad)} applied it with non-finite gradients"
    fix = [
        text(
            "Every rank must make the same skip decision, so each scaler has to see the same gradients. Let "
            "DDP average them during backward() and call unscale_/step after it; when averaging by hand, do it "
            "before scaler.unscale_(opt):"
        ),
        code(
            "scaler.scale(loss).backward()",
            "for p in model.parameters():",
            "    dist.all_reduce(p.grad)",
            "    p.grad /= dist.get_world_size()",
            "scaler.unscale_(opt)   # found_inf is now the same on every rank",
            "scaler.step(opt)",
            "scaler.update()",
        ),
        text(
            "With FSDP or a sharded optimizer use torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler (it "
            "all-reduces found_inf); give every rank the same GradScaler(init_scale=...)."
        ),
    ]
    return finding(
        "critical",
        f"Loss scales diverge across ranks from step {step}",
        f"The ranks' loss scalers disagree: {what}. From there the replicas' weights are no longer the same "
        f"({int(differs.sum())} step(s) with different scales).",
        steps=[step, int(table.index[differs][-1])],
        ranks=odd,
        evidence={
            "first_step": step,
            "ranks": odd,
            "loss_scale_before": {f"rank {r}": before[r] for r in ranks},
            "loss_scale_after": {f"rank {r}": after[r] for r in ranks},
            "skipped": {f"rank {r}": skipped[r] for r in ranks},
            "applied_with_nonfinite_gradients": applied_bad,
            "steps_with_different_scales": int(differs.sum()),
        },
        fix=fix,
    )


def _medians(x: RunView, warmup: int) -> Medians | None:
    st = x.steps.iloc[warmup:]
    st = st.assign(gross=st["step_time"], step_time=net_step_time(st))  # ampdoctor's own time taken out
    st = st[np.isfinite(st["step_time"]) & (st["step_time"] > 0)]
    if len(st) < MIN_TIMED_STEPS:
        return None
    data = st["data_time"].where(np.isfinite(st["data_time"]), 0.0)
    return {
        "step": float(st["step_time"].median()),
        "gross": float(st["gross"].median()),
        "data": float(data.median()),
        "samples": float(st["samples"].median()) if st["samples"].notna().any() else None,
        "host": x.info.get("host"),
        "n": len(st),
    }


def rank_straggler(
    run: RunView, *, min_lag_share: float = MIN_LAG_SHARE, slow_ratio: float = SLOW_RATIO, warmup: int = WARMUP_STEPS
) -> Diagnosis | None:
    if len(run.ranks) < 2:
        return None
    med = {r: m for r, x in sorted(run.ranks.items()) if (m := _medians(x, warmup)) is not None}
    if len(med) < 2:
        return None
    step_all = float(np.median([m["step"] for m in med.values()]))
    data_lag: dict[int, float] = {}
    step_ratio: dict[int, float] = {}
    compute_lag: dict[int, float] = {}
    for r, m in med.items():
        others = [o for q, o in med.items() if q != r]
        data_lag[r] = m["data"] - float(np.median([o["data"] for o in others]))
        # slower with ampdoctor's own time and without it: ranks that wait for each other every step have one
        # period, and the time one rank's observer takes (a replay, the flight recorder) is a wait in the others'
        # steps that taking it out of that rank alone would show as their compute
        step_ratio[r] = min(m[k] / max(float(np.median([o[k] for o in others])), 1e-9) for k in ("step", "gross"))
        compute_lag[r] = (m["step"] - m["data"]) - float(np.median([o["step"] - o["data"] for o in others]))
    # the rank that holds the others back the most: a late input pipeline, unless a rank's own compute lags at least
    # COMPUTE_OVER_DATA times as much (under DDP the ranks that wait for a late one show its lag as compute, about
    # once: that is its wait, not theirs)
    worst = max(data_lag, key=data_lag.__getitem__)
    kind, lag = "data", data_lag[worst]
    if lag < min_lag_share * step_all or max(compute_lag.values()) >= COMPUTE_OVER_DATA * lag:
        worst = max(step_ratio, key=step_ratio.__getitem__)
        kind, lag = "compute", step_ratio[worst] - 1
        if step_ratio[worst] < slow_ratio:
            return None
    m = med[worst]
    ev = {
        "rank": worst,
        "step_time_median_s": {f"rank {r}": v["step"] for r, v in med.items()},
        "data_time_median_s": {f"rank {r}": v["data"] for r, v in med.items()},
        "samples_per_step": {f"rank {r}": v["samples"] for r, v in med.items()},
        "steps_measured": min(v["n"] for v in med.values()),
    }
    hosts = {v["host"] for v in med.values()}
    if len(hosts) > 1:
        ev["host_by_rank"] = {f"rank {r}": v["host"] for r, v in med.items()}
    if kind == "data":
        summary = (
            f"Rank {worst} waits {A.fmt_num(m['data'])} s per step for its data, {A.fmt_num(lag)} s more than "
            f"the others ({A.pct(lag / step_all)} of the {A.fmt_num(step_all)} s step); under DDP every "
            f"rank waits for it in the gradient all-reduce, so the whole run goes at its pace."
        )
        fix = [
            text(
                f"Speed up rank {worst}'s input pipeline: more DataLoader workers and prefetching on that "
                "rank's host, its data on local or faster storage, and equal shards (a DistributedSampler gives "
                "every rank the same number of samples; dataset and batch_size: yours):"
            ),
            code(
                "sampler = torch.utils.data.distributed.DistributedSampler(dataset)",
                "loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, sampler=sampler,",
                "    num_workers=4, persistent_workers=True, prefetch_factor=4)",
            ),
        ]
        title = f"Rank {worst} is a straggler: its input pipeline holds every rank back"
    else:
        summary = (
            f"Rank {worst} takes {A.fmt_num(m['step'])} s per step, {A.pct(lag)} more than the median of "
            f"the others; ranks that wait for each other all go at its pace."
        )
        fix = [
            text(
                f"Check rank {worst}'s device and host: other processes on it, clocks and thermal throttling "
                "(nvidia-smi -q -d PERFORMANCE), a slower device model, and that its batches are the same size "
                "as the others' (samples per step in the evidence)."
            )
        ]
        title = f"Rank {worst} is a straggler: its steps take longer than the other ranks'"
    st = run.ranks[worst].steps
    return finding(
        "warning",
        title,
        summary,
        steps=[int(st["step"].iloc[warmup]), int(st["step"].iloc[-1])],
        ranks=[worst],
        evidence=ev,
        fix=fix,
    )
