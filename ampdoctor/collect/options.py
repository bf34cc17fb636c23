"""What ``attach`` takes, checked once: the observation mode and cadence, the live rules, halting, the probe, the
anomaly replay. A frozen dataclass (the Doctor cannot change its mind mid-run) and the enums of the training side."""

from __future__ import annotations

import numbers
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from ..severity import SEVERITIES


class Mode(str, Enum):
    """How much a run observes: the tiers (cheap enough to leave on), or everything every step."""

    DEFAULT = "default"
    DEBUG = "debug"


class Observe(str, Enum):
    """What one step observes of its sites (the values are the step vector's block kinds, see trace/vectors.py)."""

    NONE = "n"  # the sentinel only: no per-module work
    PEAK = "p"  # max |x| of every observed tensor
    FULL = "f"  # full statistics (and histograms on histogram steps)


class Boundary(str, Enum):
    """What ends a step: the scaler's ``update()``, the optimizer's ``step()``, or the user's ``doctor.step()``."""

    SCALER = "scaler"
    OPTIMIZER = "optimizer"
    MANUAL = "manual"


# Cadence defaults, from benchmarks/overhead.py and the trace's own observer_time (2-core CPU, FP32): a step with
# per-site peaks costs 0.4 ms on the small model (0.5 ms steps) and 3.1 ms on the reference one (35 ms steps), a
# full-statistics step 2.3 ms and 24 ms. Peaks every 10th step add ~1% to the reference model and full statistics
# every 100th <1%; every other step pays only the sentinel. Sparser peaks (every 20th) miss the late-training
# gradient trends the late-degradation rule reads in runs of a few hundred steps.
DEFAULT_PEAK_EVERY = 10
DEFAULT_EVERY = 100
DEFAULT_HIST_EVERY = 200  # histograms every 200th step: 500 sites x 10k steps stay well under 100 MB
DEFAULT_WEIGHT_EVERY = 200  # weights and updates change slowly, and an update needs a copy of the weights
# The first steps are where "NaN early" lives (an init scale too high, an overflowing layer): observed in full.
DEFAULT_CALIBRATION = 10


def _positive_int(name: str, value: Any) -> int:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
        raise ValueError(f"Argument {name} should be a positive int, but given {value!r}")
    return int(value)


def _callable_or_none(name: str, value: Any) -> None:
    if value is not None and not callable(value):
        raise TypeError(f"Argument {name} should be callable, but given {type(value)}")


def check_severity(name: str, value: Any) -> None:
    if value is not None and value not in SEVERITIES:
        raise ValueError(f"Argument {name} should be one of {', '.join(SEVERITIES)} or None, but given {value!r}")


@dataclass(frozen=True)
class Options:
    """Everything ``ampdoctor.attach`` takes besides the model, optimizer, scaler and trace (see its Args)."""

    mode: Mode = Mode.DEFAULT
    every: int | None = None
    peak_every: int | None = None
    hist_every: int | None = None
    weight_every: int = DEFAULT_WEIGHT_EVERY
    calibration: int = DEFAULT_CALIBRATION
    include: Any = None
    exclude: Any = None
    live: bool = True
    on_finding: Callable | None = None
    halt_on: str | None = None
    on_halt: Callable | None = None
    log_every: int | None = None
    rules: dict | None = None
    probe_every: int | None = None
    replay: bool = True
    heal: bool = False
    budget: float | None = None
    export: Any = None

    def __post_init__(self) -> None:
        try:
            mode = Mode(self.mode)
        except ValueError:
            modes = ", ".join(repr(m.value) for m in Mode)
            raise ValueError(f"Argument mode should be one of {modes}, but given {self.mode!r}") from None
        debug = mode is Mode.DEBUG  # every site, every step, full statistics and histograms
        cadence = {
            "every": DEFAULT_EVERY,
            "peak_every": DEFAULT_PEAK_EVERY,
            "hist_every": DEFAULT_HIST_EVERY,
        }
        set_ = object.__setattr__
        set_(self, "mode", mode)
        for name, default in cadence.items():
            value = getattr(self, name)
            set_(self, name, _positive_int(name, (1 if debug else default) if value is None else value))
        set_(self, "weight_every", _positive_int("weight_every", self.weight_every))
        calibration = self.calibration
        if not isinstance(calibration, numbers.Integral) or isinstance(calibration, bool) or calibration < 0:
            raise ValueError(f"Argument calibration should be a non-negative int, but given {calibration!r}")
        for name in ("log_every", "probe_every"):
            if getattr(self, name) is not None:
                set_(self, name, _positive_int(name, getattr(self, name)))
        for name in ("on_finding", "on_halt"):
            _callable_or_none(name, getattr(self, name))
        check_severity("halt_on", self.halt_on)
        if self.rules is not None and not isinstance(self.rules, dict):
            raise TypeError(f"Argument rules should be of type dict, but given {type(self.rules)}")
        for name in ("live", "replay", "heal"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"Argument {name} should be of type bool, but given {type(getattr(self, name))}")
        budget = self.budget
        if budget is not None and (
            not isinstance(budget, numbers.Real) or isinstance(budget, bool) or not 0 < float(budget) < 1
        ):
            raise ValueError(f"Argument budget should be a share of the step time in (0, 1), but given {budget!r}")

    @property
    def wants_live(self) -> bool:
        """The rules run while training: asked for, or needed by on_finding / halt_on."""
        return self.live or self.on_finding is not None or self.halt_on is not None
