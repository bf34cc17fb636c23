"""Which steps observe what. Every step gets the sentinel (loss, loss scale, skipped, gradient norm and peak, times:
no per-module work); some steps also observe the sites: sampled peaks and full statistics, the first steps of the
run (calibration), and the steps after an anomaly until the run is clean again (the flight recorder). In debug mode
every step observes every site in full."""

from __future__ import annotations

import math
from typing import Any

from .options import (
    DEFAULT_CALIBRATION,
    DEFAULT_EVERY,
    DEFAULT_HIST_EVERY,
    DEFAULT_PEAK_EVERY,
    DEFAULT_WEIGHT_EVERY,
    Mode,
    Observe,
)

# After an anomaly every step is observed in full until this many clean steps in a row: a fault that recurs within
# them is localised to its module (and a one-off one by the anomaly replay).
CLEAN_RUN = 5
# A lasting anomaly (weights gone NaN, a scaler that skips every step while its scale collapses): the first
# STREAK_FULL steps of it are observed in full, which localises it; from then on the steps at a power of two into
# it and every hist_every-th, the others as a clean step's plan has them. A dead run that goes on for hours does not
# pay debug mode's cost (3x a small model's step, 10x a wide one's) all that time.
STREAK_FULL = 16
# A gradient-norm spike: the norm above SPIKE_FACTOR times its running mean (an exponential average over ~1/ALPHA
# clean steps), once that mean has seen SPIKE_WARMUP steps. A healthy run's norm moves by a few x over hundreds of
# steps; a 10x jump from one step to the next is a blow-up in the making.
SPIKE_FACTOR = 10.0
SPIKE_ALPHA = 0.1
SPIKE_WARMUP = 5
# A loss spike: the loss above its running mean by LOSS_SPIKE_SIGMAS running standard deviations and by a factor
# LOSS_SPIKE_FACTOR (an exponential mean and variance over ~1/LOSS_ALPHA clean steps, after LOSS_WARMUP steps). A
# noisy loss moves by a few sigma from batch to batch; six sigma and 1.5x is the jump a spike makes in a
# practitioner's loss curve (a finite spike is where long runs start to go wrong).
LOSS_SPIKE_SIGMAS = 6.0
LOSS_SPIKE_FACTOR = 1.5
LOSS_ALPHA = 0.05
LOSS_WARMUP = 20

# The overhead budget (attach(budget=...)): ampdoctor's share of the step time, measured over windows of this many
# steps outside the flight recorder, stretches the sampled tiers (peaks, full statistics, histograms, the weights and
# their updates) by 2x while above the budget (at most STRETCH_MAX, peaks every 640 steps at the defaults) and relaxes
# them by 2x while below a third of it. The sentinel, the
# calibration steps and the flight recorder are never stretched: they are what catches a fault.
BUDGET_WINDOW = 50
STRETCH_MAX = 64

# Why a step observed what it did (the steps table's ``reason``).
REASONS = ("sentinel", "sampled", "calibration", "anomaly", "debug")


class Cadence:
    """The observation plan of a run: ``plan(step)`` says what step ``step`` observes and why; ``after()`` feeds
    the flight recorder with what the sentinel saw at the end of a step."""

    def __init__(
        self,
        mode: Mode = Mode.DEFAULT,
        *,
        every: int = DEFAULT_EVERY,
        peak_every: int = DEFAULT_PEAK_EVERY,
        hist_every: int = DEFAULT_HIST_EVERY,
        calibration: int = DEFAULT_CALIBRATION,
        clean_run: int = CLEAN_RUN,
        weight_every: int = DEFAULT_WEIGHT_EVERY,
    ) -> None:
        self.mode = mode
        self.every, self.peak_every, self.hist_every = every, peak_every, hist_every
        self.weight_every = weight_every
        self.calibration, self.clean_run = calibration, clean_run
        self._alarm = 0  # clean steps still to observe in full after the last anomaly
        self.streak = 0  # anomalous steps in a row, up to the last verdict
        self._norm_mean: float | None = None  # running mean of the gradient norm over clean steps
        self._norm_seen = 0
        self.stretch = 1  # the sampled tiers' intervals are multiplied by this (the overhead budget)
        self._loss_mean: float | None = None  # running mean and variance of the loss over clean steps
        self._loss_var = 0.0
        self._loss_seen = 0

    def plan(self, step: int) -> tuple[Observe, str, bool]:
        """(what the step observes: NONE/PEAK/FULL, why, whether it stores histograms)."""
        if self.mode is Mode.DEBUG:
            return Observe.FULL, "debug", step % self.hist_every == 0
        if step < self.calibration:
            return Observe.FULL, "calibration", True
        if self._alarm and self._in_full(self.streak):
            return Observe.FULL, "anomaly", True
        k = self.stretch
        every, hist_every = self.every * k, self.hist_every * k
        if step % every == 0 or step % hist_every == 0:
            return Observe.FULL, "sampled", step % hist_every == 0
        if step % (self.peak_every * k) == 0:
            return Observe.PEAK, "sampled", False
        return Observe.NONE, "sentinel", False

    def next_observed(self, step: int) -> int:
        """The first step from ``step`` on that observes sites or reads the weights, while the cadence stays as it is
        (the steps before it are the sentinel's alone: the lane holds them). ``step`` itself where the plan depends
        on more than the step's number: debug mode, calibration, the flight recorder on."""
        if self.mode is Mode.DEBUG or step < self.calibration or self._alarm:
            return step
        k = self.stretch
        return min(
            -(-step // (n * k)) * n * k for n in (self.every, self.hist_every, self.peak_every, self.weight_every)
        )

    def reads_weights(self, step: int) -> bool:
        """Whether step ``step`` reads the weights and their update (a sampled tier: the budget stretches it too)."""
        return step % (self.weight_every * self.stretch) == 0

    def spike(self, grad_norm: float | None) -> bool:
        """Whether this (finite) gradient norm jumps far above its running mean; updates the mean otherwise."""
        if grad_norm is None or not math.isfinite(grad_norm):
            return False
        mean = self._norm_mean
        if mean is not None and self._norm_seen >= SPIKE_WARMUP and grad_norm > SPIKE_FACTOR * mean > 0:
            return True
        self._norm_mean = grad_norm if mean is None else mean + SPIKE_ALPHA * (grad_norm - mean)
        self._norm_seen += 1
        return False

    def loss_spike(self, loss: float | None) -> bool:
        """Whether this (finite, positive-trending) loss jumps far above its running mean; updates it otherwise."""
        if loss is None or not math.isfinite(loss):
            return False
        mean, var = self._loss_mean, self._loss_var
        if (
            mean is not None
            and self._loss_seen >= LOSS_WARMUP
            and loss - mean > LOSS_SPIKE_SIGMAS * math.sqrt(var)
            and loss > LOSS_SPIKE_FACTOR * mean > 0
        ):
            return True
        if mean is None:
            self._loss_mean = loss
        else:
            delta = loss - mean
            self._loss_mean = mean + LOSS_ALPHA * delta
            self._loss_var = (1 - LOSS_ALPHA) * (var + LOSS_ALPHA * delta * delta)
        self._loss_seen += 1
        return False

    def spike_state(self) -> tuple[float | None, int, float | None, float, int]:
        """The running means ``spike`` and ``loss_spike`` judge against, as one value (the lane's held steps keep
        them in C++ from one let-go to the next: lane.py)."""
        return self._norm_mean, self._norm_seen, self._loss_mean, self._loss_var, self._loss_seen

    def set_spike_state(self, state: tuple[float | None, int, float | None, float, int]) -> None:
        self._norm_mean, self._norm_seen, self._loss_mean, self._loss_var, self._loss_seen = state

    @property
    def typical_loss(self) -> float | None:
        return self._loss_mean

    @property
    def alarmed(self) -> bool:
        """The flight recorder is on: the run has not been clean for CLEAN_RUN steps since the last anomaly."""
        return self._alarm > 0

    def _in_full(self, streak: int) -> bool:
        """Whether the next step of an anomaly that has lasted ``streak`` steps is observed in full."""
        return streak <= STREAK_FULL or streak & (streak - 1) == 0 or streak % self.hist_every == 0

    def after(self, anomalous: bool) -> bool:
        """A step ended: an anomaly (re)arms the flight recorder, a clean step counts down. True when the anomaly
        has just lasted long enough that its steps are no longer all observed in full."""
        if anomalous:
            self._alarm = self.clean_run
            self.streak += 1
            return self.streak == STREAK_FULL + 1
        self.streak = 0
        if self._alarm:
            self._alarm -= 1
        return False

    @property
    def typical_norm(self) -> float | None:
        return self._norm_mean


class Budget:
    """Keeps ampdoctor's measured share of the step time under ``share`` by stretching the cadence's sampled tiers;
    ``update`` says when it changed them. The share of a window is the mean of its steps' shares (observer_time over
    step_time): a step that waited (an evaluation, a checkpoint, a stalled loader, a paused process) counts as one
    step, not as its length, which would make ampdoctor's cost look negligible and undo the stretch."""

    def __init__(self, share: float, cadence: Cadence) -> None:
        self.share = share
        self.cadence = cadence
        self._shares = 0.0
        self._steps = 0
        self._floor_shares = 0.0  # the window's sentinel-only steps: what no stretch can lower
        self._floor_steps = 0
        self.floor_said = False  # the run was told once that its every-step work alone is above the budget

    def update(self, observer_time: float, step_time: float, reason: str) -> dict[str, Any] | None:
        """One finished step's times; at the end of a window, the new cadence (a dict for the trace) or None. The
        dict also says whether the budget is held (``held``): False where the sampled tiers are stretched their most and
        the window's sentinel-only steps alone (the sentinel and the replay's capture, never stretched) still cost
        more than the budget; said once per run."""
        if reason in ("anomaly", "calibration", "replay", "debug") or step_time <= 0:
            return None  # never stretched, so not what the budget steers
        share = min(observer_time / step_time, 1.0)
        self._shares += share
        self._steps += 1
        if reason == "sentinel":
            self._floor_shares += share
            self._floor_steps += 1
        if self._steps < BUDGET_WINDOW:
            return None
        return self.close_window()

    def state(self) -> tuple[float, int, float, int, int]:
        """The window so far (its shares and steps, its sentinel-only ones) and its length: the lane's held steps
        add theirs in C++ as ``update`` adds them, and hand the window back to close it (lane.py)."""
        return self._shares, self._steps, self._floor_shares, self._floor_steps, BUDGET_WINDOW

    def set_state(self, state: tuple[float, int, float, int, int]) -> None:
        self._shares, self._steps, self._floor_shares, self._floor_steps, _ = state

    def close_window(self) -> dict[str, Any] | None:
        """A window's end: the cadence stretched or relaxed (``update``'s answer)."""
        measured = self._shares / self._steps
        floor = self._floor_shares / self._floor_steps if self._floor_steps >= BUDGET_WINDOW // 2 else None
        self._shares = self._floor_shares = 0.0
        self._steps = self._floor_steps = 0
        c = self.cadence
        before = c.stretch
        if measured > self.share and c.stretch < STRETCH_MAX:
            c.stretch *= 2
        elif measured < self.share / 3 and c.stretch > 1:
            c.stretch //= 2
        # (said once the stretch is at its most: a window early in the run, the kernels still loading, is no verdict)
        held = floor is None or floor <= self.share or c.stretch < STRETCH_MAX
        if c.stretch == before and (held or self.floor_said):
            return None
        if not held:
            self.floor_said = True
        return {
            "share": measured,
            "budget": self.share,
            "stretch": c.stretch,
            "peak_every": c.peak_every * c.stretch,
            "every": c.every * c.stretch,
            "hist_every": c.hist_every * c.stretch,
            "weight_every": c.weight_every * c.stretch,
            "sentinel_share": floor,
            "held": held,
        }
