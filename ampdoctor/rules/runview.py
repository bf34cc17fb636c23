"""What a rule reads: ``RunView``, the interface of the engine's Run (engine.py) as rules see it, and the evidence
objects the Run shares between rules (``Blowup``, ``Origins``). Rule modules cannot import the engine (it imports them
through the registry), so they annotate their ``run`` parameters with this protocol; the engine's Run satisfies it
(mypy checks that wherever the engine hands itself to a rule function)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypedDict

import numpy as np
import numpy.typing as npt
import pandas as pd

from ..trace import Trace
from ..trace.view import View

if TYPE_CHECKING:
    from ..lossscale import GradientPeaks, Suggestion

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]


@dataclass
class Blowup:
    """What the updates did to the weights before the first non-finite step: the evidence that tells an optimisation
    that left the range from a format too narrow for a healthy run (shared as ``Run.blowup``; divergence.py computes
    it)."""

    first_step: int  # the first non-finite or skipped step
    update_ratio: float | None = None  # largest update RMS / the weights' scale, at a recorded update step before
    update_param: str | None = None
    update_step: int | None = None
    jump: float | None = None  # largest one-step move of a module's output peak (binades; into non-finite: a bound)
    jump_site: str | None = None
    jump_step: int | None = None
    jump_from: float | None = None  # its peak on the step before
    loss_flat: bool | None = None  # the loss made no progress before the first non-finite step
    loss_start: float | None = None
    loss_best: float | None = None
    growth: float | None = None  # largest growth of a module's output peak before the first non-finite step
    growth_site: str | None = None
    growth_steps: list[int] = field(default_factory=list)
    decisive: list[str] = field(default_factory=list)  # sentences: evidence that decides for divergence
    partial: list[str] = field(default_factory=list)  # sentences: evidence that points that way but does not decide

    def evidence(self) -> dict[str, Any]:
        return {
            "update_to_weight_ratio": self.update_ratio,
            "update_param": self.update_param,
            "update_step": self.update_step,
            "one_step_jump_binades": self.jump,
            "jump_module": self.jump_site,
            "jump_step": self.jump_step,
            "loss_made_no_progress": self.loss_flat,
            "activation_growth_binades": self.growth,
            "growth_module": self.growth_site,
        }


@dataclass
class Origins:
    """The forward overflows of a run traced back to the module that produced the values (shared through
    ``Run.overflow_origins``; overflow.py computes it: loss-scale-collapse counts a tipping module's steps as its
    producer's)."""

    events: pd.DataFrame  # the forward non-finite events (phase "fwd"), less those of weights an update made NaN
    counts: pd.DataFrame  # per module: how many steps, first and last step (most steps first)
    culprit: str  # the producer behind the most overflowing steps
    tipped: list[str]  # modules that only tipped the culprit's near-limit values over
    operations: list[dict[str, Any]] | None = None  # the replays' operations (with their producers) on these steps


class WeightFault(TypedDict):
    """A weight matrix whose RMS at its first record is far off 1/sqrt(fan_in) (``Run.weight_faults``; weights.py
    computes it)."""

    rms: float
    fan_in_rms: float
    ratio: float  # rms / fan_in_rms
    module: str


class RunView(Protocol):
    """The engine's Run as the rules read it: a trace, cached views of it, and the evidence several rules share."""

    @property
    def trace(self) -> Trace: ...
    @property
    def view(self) -> View: ...
    @property
    def reference(self) -> RunView | None: ...
    @property
    def ranks(self) -> Mapping[int, RunView]: ...

    def threshold(self, rule_id: str, name: str) -> float: ...

    # -- shared evidence --
    @property
    def gradient_peaks(self) -> GradientPeaks: ...
    @property
    def suggestion(self) -> Suggestion | None: ...
    @property
    def weight_faults(self) -> dict[str, WeightFault]: ...
    @property
    def blowup(self) -> Blowup | None: ...
    @property
    def overflow_origins(self) -> Origins | None: ...
    @property
    def replays(self) -> list[dict[str, Any]]: ...
    @property
    def probes(self) -> pd.DataFrame: ...

    # -- tables --
    @property
    def steps(self) -> pd.DataFrame: ...
    @property
    def meta(self) -> dict[str, Any]: ...
    @property
    def config(self) -> dict[str, Any]: ...
    @property
    def info(self) -> dict[str, Any]: ...
    def sites(self, kind: str) -> pd.DataFrame: ...
    @property
    def stat_steps(self) -> IntArray: ...
    def stat(self, fld: str, kind: str) -> FloatArray: ...
    def records(self, fld: str, kind: str) -> FloatArray: ...
    def at(self, fld: str, kind: str, steps: Iterable[int] | npt.ArrayLike) -> FloatArray: ...
    @property
    def events(self) -> pd.DataFrame: ...
    @property
    def weight_events(self) -> pd.DataFrame: ...
    @property
    def metrics(self) -> pd.DataFrame: ...
    @property
    def full_steps(self) -> IntArray: ...

    # -- precision configuration and device --
    @property
    def n_steps(self) -> int: ...
    @property
    def autocast(self) -> dict[str, Any]: ...
    @property
    def scaler(self) -> dict[str, Any]: ...
    @property
    def scaler_on(self) -> bool: ...
    @property
    def compute_dtype(self) -> str | None: ...
    @property
    def fp16(self) -> bool: ...
    @property
    def module_types(self) -> dict[str, str]: ...
    @property
    def device(self) -> str: ...
    @property
    def bf16_supported(self) -> bool: ...
    @property
    def capability(self) -> tuple[int, ...] | None: ...

    def step_range(self, steps: Iterable[Any]) -> list[int]: ...
