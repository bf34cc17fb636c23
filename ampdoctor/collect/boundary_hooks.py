"""Where a step's boundary is seen: the optimizer's step hooks and the scaler's wrapped ``scale()`` and ``update()``.
Before the optimizer applies a step, an anomaly the sentinel already knows is replayed (the weights are still the
step's own) and the weights are kept where the updates are recorded; after it, the update is counted and recorded.
``scale()`` gives the loss and the scale in force; the step ends at the boundary the run has (options.Boundary):
the optimizer's step, or the scaler's update (which tells whether the optimizer skipped it)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from . import hooks
from .boundary import StepEnd, read_scale
from .collector import Collector
from .flights import Flights
from .guards import Guard, guarded
from .options import Boundary
from .replays import Replays
from .state import RunFacts


class BoundaryHooks:
    """The hooks' side of the optimizer and the scaler (Doctor._install registers them). ``end_step(skipped)`` ends
    the step in progress (StepLoop.end_step)."""

    def __init__(
        self,
        guard: Guard,
        collector: Collector,
        end: StepEnd,
        flights: Flights,
        replays: Replays | None,
        facts: RunFacts,
        *,
        scaler: Any,
        boundary: Boundary,
        has_optimizer: bool,
        reads_weights: Callable[[int], bool],
        end_step: Callable[[bool | None], None],
    ) -> None:
        self.guard = guard
        self.collector = collector
        self.end = end
        self.flights = flights
        self.replays = replays
        self.facts = facts
        self.scaler = scaler
        self.boundary = boundary
        self.has_optimizer = has_optimizer
        self.reads_weights = reads_weights  # (Cadence.reads_weights: a sampled tier the budget stretches)
        self.end_step = end_step

    # -- the optimizer --------------------------------------------------------------------------------------------
    @guarded
    def on_opt_pre(self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        state = self.collector.state
        state.in_update = True
        replays = self.replays
        if replays is not None and state.replay is None and replays.wanted(replays.capture.calls):
            # Before the update the weights are still the step's own: a replay now is exact (at the step end an
            # applied step's weights have moved). Only when the sentinel's figures are on the host already.
            verdict = self.end.early_verdict(state)
            if verdict is not None and verdict.anomalous:
                capture = replays.capture
                replays.replay(state, verdict.kind, capture.calls, capture.batch_ids, moved=None)
        if self.reads_weights(state.index):
            self.collector.keep_weights()

    def on_opt_post(self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self.guard.off:
            return
        self.facts.updates += 1
        state = self.collector.state
        state.opt_stepped = True
        state.in_update = False
        if state.weights_before is not None:
            self.collector.record_updates()
        if self.boundary is Boundary.OPTIMIZER:
            self.end_step(False)

    # -- the scaler -----------------------------------------------------------------------------------------------
    def wrap_scale(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def scale(outputs: Any) -> Any:
            result = original(outputs)
            self._after_scale(outputs)
            return result

        return scale

    @guarded
    def _after_scale(self, outputs: Any) -> None:
        t = outputs if isinstance(outputs, torch.Tensor) else hooks.first_tensor(outputs)
        if t is not None:
            self.collector.log_loss(t, self.flights.last_open())
        state = self.collector.state
        if state.scale_before is None:
            state.scale_before = read_scale(self.scaler)

    def wrap_update(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def update(*args: Any, **kwargs: Any) -> Any:
            self._before_update()
            result = original(*args, **kwargs)
            if not self.guard.off and self.boundary is Boundary.SCALER:
                stepped = self.collector.state.opt_stepped
                self.end_step((not stepped) if self.has_optimizer else None)
            return result

        return update

    @guarded
    def _before_update(self) -> None:
        state = self.collector.state
        if state.scale_before is None:
            state.scale_before = read_scale(self.scaler)
