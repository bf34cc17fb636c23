"""Which steps observe what. Every step gets the sentinel (loss, loss scale, skipped, gradient norm and peak, times:
no per-module work); some steps also observe the sites: sampled peaks and full statistics, the first steps of the
run (calibration), and the steps after an anomaly until the run is clean again (the flight recorder). In debug mode
every step observes every site in full."""

from __future__ import annotations

import math

MODES = ("default", "debug")

# Cadence defaults, from benchmarks/overhead.py and the trace's own observer_time (2-core CPU, FP32, 1 thread): a step
# with per-site peaks costs 0.4 ms on the small model (0.5 ms steps) and 3.1 ms on the reference one (35 ms steps),
# a full-statistics step 2.3 ms and 24 ms. Peaks every 10th step add ~1% to the reference model (7% to the small
# one) and full statistics every 100th <1% (5%); every other step pays only the sentinel (0.08 ms / 0.9 ms: reading
# every gradient twice, for the norm and the peak). Sparser peaks (every 20th) miss the late-training gradient
# trends the late-degradation rule reads in runs of a few hundred steps.
DEFAULT_PEAK_EVERY = 10
DEFAULT_EVERY = 100
# The first steps are where "NaN early" lives (an init scale too high, an overflowing layer): observed in full.
DEFAULT_CALIBRATION = 10
# After an anomaly every step is observed in full until this many clean steps in a row: a fault that recurs within
# them is localised to its module; a one-off anomaly leaves "origin unknown".
CLEAN_RUN = 5
# A gradient-norm spike: the norm above SPIKE_FACTOR times its running mean (an exponential average over ~1/ALPHA
# clean steps), once that mean has seen SPIKE_WARMUP steps. A healthy run's norm moves by a few x over hundreds of
# steps; a 10x jump from one step to the next is a blow-up in the making.
SPIKE_FACTOR = 10.0
SPIKE_ALPHA = 0.1
SPIKE_WARMUP = 5

# What a step observed of its sites ("n": none, the sentinel only; "p": peaks; "f": full statistics).
NONE, PEAK, FULL = "n", "p", "f"
# Why (the steps table's ``reason``).
REASONS = ("sentinel", "sampled", "calibration", "anomaly", "debug")


class Cadence:
    """The observation plan of a run: ``plan(step)`` says what step ``step`` observes and why; ``after()`` feeds
    the flight recorder with what the sentinel saw at the end of a step."""

    def __init__(
        self,
        mode: str = "default",
        *,
        every: int = DEFAULT_EVERY,
        peak_every: int = DEFAULT_PEAK_EVERY,
        hist_every: int = 200,
        calibration: int = DEFAULT_CALIBRATION,
        clean_run: int = CLEAN_RUN,
    ):
        self.mode = mode
        self.every, self.peak_every, self.hist_every = every, peak_every, hist_every
        self.calibration, self.clean_run = calibration, clean_run
        self._alarm = 0  # clean steps still to observe in full after the last anomaly
        self._norm_mean = None  # running mean of the gradient norm over clean steps
        self._norm_seen = 0

    def plan(self, step: int) -> tuple[str, str, bool]:
        """(what the step observes: NONE/PEAK/FULL, why, whether it stores histograms)."""
        if self.mode == "debug":
            return FULL, "debug", step % self.hist_every == 0
        if step < self.calibration:
            return FULL, "calibration", True
        if self._alarm:
            return FULL, "anomaly", True
        if step % self.every == 0 or step % self.hist_every == 0:
            return FULL, "sampled", step % self.hist_every == 0
        if step % self.peak_every == 0:
            return PEAK, "sampled", False
        return NONE, "sentinel", False

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

    def after(self, anomalous: bool) -> None:
        """A step ended: an anomaly (re)arms the flight recorder, a clean step counts down."""
        if anomalous:
            self._alarm = self.clean_run
        elif self._alarm:
            self._alarm -= 1

    @property
    def typical_norm(self) -> float | None:
        return self._norm_mean
