"""The GradScaler model: PyTorch's dynamic loss-scale update rule, stepped over the evidence of a trace.

The scaler (``torch._amp_update_scale_``): on a step with an inf/NaN gradient the scale is multiplied by
``backoff_factor`` and the growth tracker resets; otherwise the tracker counts up and, on reaching
``growth_interval``, the scale is multiplied by ``growth_factor`` (unless that would make the FP32 scale infinite)
and the tracker resets. The scale is an FP32 tensor: products are taken in double and rounded to FP32, as torch does.
Whether a step overflows at a given scale is the evidence's answer (evidence.py, the overflow model).

Underflow at the simulated scale, from the exponent histograms of the gradients computed in FP16 (evidence.py): the
share of the non-zero elements that a cast to FP16 would round below the smallest normal (2^-14: subnormal,
precision lost) and to zero (|x| <= 2^-25, half the smallest subnormal 2^-24: values between 2^-25 and 2^-24 round
up to 2^-24 and are not lost). One bin per binade resolves the flush threshold (a binade edge) up to exact ties and
counts the binade below 2^-14 wholly as subnormal (docs/trace-format.md, hists).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from .. import formats
from ..trace.checks import scaler_setting_problem
from .defaults import TORCH_DEFAULTS, Settings
from .evidence import BoolArray, Evidence, FloatArray, Histogram, IntArray
from .machine import Machine

_LOG2_NORMAL = formats.FP16.normal_exp  # -14: below this an FP16 value is subnormal (but a 2^-11 sliver)
_LOG2_FLUSH = math.log2(formats.FP16.flush_at)  # -25: at or below this it rounds to zero (binade -25 rounds up)
_SEARCH_CELLS = 2**22  # settings x histogram steps lost_many holds at once (32 MiB of shares)


@dataclass(eq=False)
class Replay:
    """Per-step result of simulating a dynamic loss scaler over a trace (arrays indexed like ``trace.steps()``)."""

    settings: Settings  # init_scale, growth_factor, backoff_factor, growth_interval
    steps: IntArray  # step numbers
    scales: FloatArray  # scale in force at each step (as trace.steps()["loss_scale"])
    skipped: BoolArray  # the step overflowed and the optimizer step was skipped
    underflow: FloatArray  # share of non-zero FP16 gradient elements below 2^-14; NaN without a histogram
    flushed: FloatArray  # share rounded to zero (<= 2^-25); NaN without a histogram
    estimated: BoolArray  # the skip decision rests on neighbouring steps (evidence.py)
    final_scale: float  # scale after the last step's update
    assumed_fp16: bool = False  # the run computed no gradient in FP16: every gradient was treated as FP16
    growth_tracker: int = 0  # tracker value the simulation started from

    @property
    def n_skipped(self) -> int:
        return int(self.skipped.sum())

    @property
    def mean_underflow(self) -> float:
        """Mean underflow share over the steps with a histogram whose update was applied (NaN if none)."""
        return nanmean(self.underflow[~self.skipped])

    @property
    def mean_flushed(self) -> float:
        return nanmean(self.flushed[~self.skipped])

    @property
    def lost(self) -> float:
        """Share of gradient information lost: a skipped step loses all of it, an applied step its underflow share.

        The --suggest objective: (skipped + sum over applied steps of underflow) / steps, the mean underflow standing
        in for applied steps without a histogram.
        """
        return lost_share(len(self.steps), self.n_skipped, self.mean_underflow)

    def summary(self) -> dict[str, float]:
        return {
            "steps": len(self.steps),
            "skipped": self.n_skipped,
            "skipped_share": self.n_skipped / len(self.steps) if len(self.steps) else math.nan,
            "min_scale": float(np.min(self.scales)) if len(self.scales) else math.nan,
            "max_scale": float(np.max(self.scales)) if len(self.scales) else math.nan,
            "final_scale": self.final_scale,
            "mean_underflow": self.mean_underflow,
            "mean_flushed": self.mean_flushed,
            "lost": self.lost,
            "estimated": int(self.estimated.sum()),
        }

    def _repr_html_(self) -> str:  # notebooks: settings and outcome (ampdoctor/notebook.py)
        from ..notebook import replay_html

        return replay_html(self)


def lost_share(n: int, n_skipped: int, mean_underflow: float) -> float:
    """``Replay.lost`` from its three numbers (``lost_many`` has no Replay to ask)."""
    if not n:
        return math.nan
    u = 0.0 if math.isnan(mean_underflow) else mean_underflow
    return (n_skipped + (n - n_skipped) * u) / n


def gradscaler_code(settings: Settings, device: str = "cuda") -> str:
    """The GradScaler line to paste (arguments left at torch's defaults are omitted, init_scale always shown)."""
    args = [f'"{device}"', f"init_scale={float(settings['init_scale'])!r}"]
    for key in ("growth_factor", "backoff_factor", "growth_interval"):
        if settings[key] != TORCH_DEFAULTS[key]:
            args.append(f"{key}={settings[key]!r}")
    return f"torch.amp.GradScaler({', '.join(args)})"


# -- settings ------------------------------------------------------------------------------------------------------
def _check_settings(s: Settings) -> None:
    """ValueError naming the first setting GradScaler cannot run with (checks.scaler_setting_problem)."""
    for key in ("init_scale", "growth_factor", "backoff_factor", "growth_interval"):
        problem = scaler_setting_problem(key, s[key])
        if problem is not None:
            raise ValueError(f"Argument {key} should be {problem}, but given {s[key]!r}")


def resolve(
    ev: Evidence,
    init_scale: float | None,
    growth_factor: float | None,
    backoff_factor: float | None,
    growth_interval: int | None,
) -> Settings:
    """The settings to simulate: the run's own, each one given (not None) replacing it; checked and typed.

    A given setting GradScaler cannot run with is a ValueError; one of the run's own (a crafted or damaged trace:
    a recorded first scale of 0 or inf) is replaced by torch's default, as an unknown setting is."""
    s = dict(ev.run_settings)
    for key in s:
        if key in TORCH_DEFAULTS and scaler_setting_problem(key, s[key]) is not None:
            s[key] = TORCH_DEFAULTS[key]
    for key, value in (
        ("init_scale", init_scale),
        ("growth_factor", growth_factor),
        ("backoff_factor", backoff_factor),
        ("growth_interval", growth_interval),
    ):
        if value is not None:
            s[key] = value
    _check_settings(s)
    s["init_scale"] = float(s["init_scale"])
    s["growth_factor"], s["backoff_factor"] = float(s["growth_factor"]), float(s["backoff_factor"])
    s["growth_interval"] = int(s["growth_interval"])
    return s


def initial_tracker(ev: Evidence) -> int:
    """Consecutive unskipped steps the scaler had counted when the trace began (0 for a fresh GradScaler): read off
    the first growth when it comes before any skip."""
    if not ev.has_scaler or not len(ev.steps):
        return 0
    gi = int(ev.run_settings["growth_interval"])
    with np.errstate(invalid="ignore"):
        event = np.asarray(ev.rec_over, bool) | (np.asarray(ev.rec_next) > np.asarray(ev.rec_scale))
    if not event.any():
        return 0
    t = int(event.argmax())
    return 0 if ev.rec_over[t] else max(gi - (t + 1), 0)


# -- the simulation (machine.py steps it) --------------------------------------------------------------------------
def simulate(ev: Evidence, settings: Settings, tracker: int = 0) -> Replay:
    """GradScaler over the evidence, step by step, from ``settings`` and a growth tracker at ``tracker``."""
    n = len(ev.steps)
    m = Machine(ev, [settings], [tracker], record=True)
    m.run()
    under = np.full(n, np.nan)
    flushed = np.full(n, np.nan)
    cache: dict[tuple[int, float], tuple[float, float]] = {}
    for j, t in enumerate(m.hsteps.tolist()):
        key = (t, float(m.h_scale[0, j]))
        if key not in cache:
            cache[key] = shares(ev.hist[t], key[1])
        under[t], flushed[t] = cache[key]
    return Replay(
        settings=dict(settings),
        steps=ev.steps.copy(),
        scales=m.scales[0],
        skipped=m.skipped[0],
        underflow=under,
        flushed=flushed,
        estimated=m.estimated[0],
        final_scale=float(m.scale[0]),
        assumed_fp16=ev.assumed_fp16,
    )


def lost_many(
    ev: Evidence,
    settings: Sequence[Settings],
    advance: Callable[[int], object] | None = None,
    bound: float = math.inf,
) -> list[float]:
    """``simulate(ev, s).lost`` for each of ``settings`` (each from a fresh tracker): the same decisions, FP32
    roundings and shares, so the very same numbers, for the whole grid in one pass over the steps (machine.py).
    A setting whose skipped steps alone lose more than ``bound`` cannot be the best: it comes back as inf (and is not
    stepped to the end). ``advance(k)`` is told as k more settings are done."""
    n = len(ev.steps)
    hist_steps = [t for t in sorted(ev.hist) if 0 <= t < n]
    group = max(1, _SEARCH_CELLS // max(len(hist_steps), 1))  # settings x histogram steps held at once
    out: list[float] = []
    for i in range(0, len(settings), group):
        part = settings[i : i + group]
        m = Machine(ev, part, [0] * len(part), bound=bound)
        m.run(advance, shares)
        m.finish()
        bound = m.bound  # tightened by the settings that finished
        under = np.full(m.h_scale.shape, np.nan)
        for j, t in enumerate(m.hsteps.tolist()):
            col = m.h_scale[:, j]
            for value in np.unique(col[~np.isnan(col)]):
                under[col == value, j] = shares(ev.hist[t], float(value))[0]
        for c in range(len(part)):
            out.append(math.inf if m.pruned[c] else lost_share(n, int(m.sk[c]), nanmean(under[c][~m.h_skip[c]])))
    return out


def shares(hist: Histogram, scale: float) -> tuple[float, float]:
    """(share below 2^-14, share rounded to zero) of the elements at ``scale``: whole binades below 2^-14 and at or
    below 2^-25 (edges of binades at power-of-two scales); at other scales a binade straddling a limit counts the
    fraction below it, values taken as log-uniform inside it."""
    lo, c = hist
    total = c.sum()
    if total <= 0 or scale <= 0:
        return (math.nan, math.nan) if total <= 0 else (1.0, 1.0)
    lo = lo + math.log2(scale)
    return (
        float((c * np.clip(_LOG2_NORMAL - lo, 0.0, 1.0)).sum() / total),
        float((c * np.clip(_LOG2_FLUSH - lo, 0.0, 1.0)).sum() / total),
    )


def nanmean(a: FloatArray) -> float:
    a = a[~np.isnan(a)]
    return float(a.mean()) if len(a) else math.nan
