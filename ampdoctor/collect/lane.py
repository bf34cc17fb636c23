"""The clean step's short way. Most steps of a healthy run observe no site and are clean: the sentinel reads its
figures, finds nothing, and the step's row goes to the trace. Inside a training loop each distinct call ampdoctor
makes on such a step pays its cache misses again (benchmarks/step_costs.py): the general path (the collector's and
the boundary's hooks, the step end, the flights' verdicts and packets, one packet a step to the writer) spent
~150-180 us of a small CPU model's ~1 ms step on it; the short way ~85, of which ~17 read the gradients' memory.

The lane holds a step from its start when the step can only be a clean host step or stop being one: it observes no
site (the cadence's plan), its figures are on the host (a CPU model, no scaler, no half-precision weights) and the
optimizer's step ends it. It works on the general path's own state (the step's StepState, the replay's Capture and
its Calls) and decides with the same functions (the sentinel's figures, the running means of the spikes). Where the
step turns out not to be clean (a NaN/Inf, a spike, a loss on a device, a model moved, a closure, a writer that
failed), the lane lets it go at once and the general path carries on from there: nothing is converted, the replay
finds the step's calls where it always does. Where the C++ extension is loaded (compiled.py), a root call's state is
read by one call and the backward's seed is kept by a C++ hook (the backward runs no Python for it).

A clean step's row waits in the lane while a loss logged after ``optimizer.step()`` may still join it; the rows go
to the writer together, as one queue item, at most ROWS_MAX steps or FLUSH_S seconds after the oldest, and always
before any packet of the general path (the trace stays in step order)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ..trace import schema
from ..trace.messages import StepBatch, StepPacket
from . import buffers, compiled, stats
from .anomaly import SEED_KEEP_MAX
from .boundary import NO_VALUES, SENTINEL_BASES
from .guards import guarded
from .options import Observe

if TYPE_CHECKING:
    from .anomaly import Capture
    from .boundary import StepEnd
    from .boundary_hooks import BoundaryHooks
    from .cadence import Cadence
    from .collector import Collector
    from .flights import Flights
    from .guards import Guard
    from .replays import Replays
    from .state import RunFacts, StepState
    from .steploop import StepLoop

ROWS_MAX = 256  # clean steps sent to the writer together: one queue item (StepBatch), one write of them all
FLUSH_S = 0.25  # ... or once the oldest waited this long: a live reader sees a slow run's steps within a commit

now = time.perf_counter


class Lane:
    """The hooks of a run whose clean steps can take the short way (core.Core makes it where the run's configuration
    allows: a model on the CPU, the optimizer as the step boundary, no enabled scaler, no probe, no half-precision
    weights, an eager model, not debug mode). Each hook passes the call to the general path's own hook whenever the
    lane does not hold the step."""

    def __init__(
        self,
        guard: Guard,
        collector: Collector,
        end: StepEnd,
        flights: Flights,
        loop: StepLoop,
        boundary_hooks: BoundaryHooks,
        replays: Replays | None,
        facts: RunFacts,
        cadence: Cadence,
        optimizer: torch.optim.Optimizer,
        *,
        weight_every: int,
    ) -> None:
        self.guard = guard
        self.collector = collector
        self.end = end
        self.flights = flights
        self.loop = loop
        self.boundary_hooks = boundary_hooks
        self.replays = replays
        self.capture: Capture | None = replays.capture if replays is not None else None
        self.facts = facts
        self.cadence = cadence
        self.groups = optimizer.param_groups
        self.weight_every = weight_every
        self.put = loop.put
        self.held = False  # the step in progress is the lane's
        self.carried = 0  # steps the lane carried to their end
        self.rows: list[list[Any]] = []  # clean steps' rows not sent yet, oldest first (fields by position: _end)
        self.open: StepState | None = None  # the newest of them while a late loss may join it (its step's state)
        self._oldest = 0.0  # when the oldest row's step ended (perf_counter)
        anchor = collector.anchor
        assert anchor is not None  # (Core makes a lane only for a model with one)
        self._anchor = anchor
        # the C++ read of a root call and the C++ seed hook, once the extension is loaded
        self._call_state: Callable[..., tuple[Any, ...]] | None = None
        self._keep_seed: Callable[..., Any] | None = None

    # -- which steps ---------------------------------------------------------------------------------------------------
    def take(self, state: StepState) -> None:
        """A step begins: the lane holds it when it can only be a clean host step or stop being one."""
        facts = self.facts
        self.held = (
            state.observe is Observe.NONE
            and state.index % self.weight_every != 0
            and facts.device == "cpu"
            and stats.HOST_READS  # (False: the accelerator's path, emulated on the CPU by the tests)
            and not facts.external_batches
            and self.loop.configured
            and not self.guard.off
        )
        if self._call_state is None and self.held:
            ext = compiled.get()  # (looks again every few seconds while the extension builds elsewhere)
            self._call_state = getattr(ext, "call_state", None)
            self._keep_seed = getattr(ext, "keep_seed", None)

    # -- training's hooks ----------------------------------------------------------------------------------------------
    # Each hook runs its held-step part under the run's guard (guards.guarded: timed, an error stops collection); a
    # part that answers False lets the call go to the general path's own hook, which times itself.
    def root_pre(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not self.held or self._root_pre(args, kwargs) is False:
            self.collector.on_root_pre(module, args, kwargs)

    @guarded
    def _root_pre(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Collector.on_root_pre and start_micro for the common call of a held step, one plain tensor, read by one C++
        call (compiled.py). False: the general path takes the call (another call, no extension, a moved model)."""
        a0 = args[0] if len(args) == 1 and not kwargs else None
        call_state, capture = self._call_state, self.capture
        if call_state is None or type(a0) is not torch.Tensor:
            return False
        training, dtype, rows, version, rng = call_state(a0, capture is not None)
        if not training:
            return True  # (an evaluation forward, a checkpoint's recomputation)
        autocast = ("cpu", dtype) if dtype is not None else None
        collector, state, facts = self.collector, self.collector.state, self.facts
        if state.t_first is None:
            if not self._anchor.is_cpu:  # the model moved: the general path reads its new device
                self.held = False
                return False
            state.t_first = now()
            self.step_start()
            collector.record_autocast(autocast)
        collector.autocast_now = autocast
        facts.step_starts += 1
        state.micro += 1
        if rows > 0:
            state.samples += rows
        state.first_backward = True
        if capture is not None:
            capture.keep(args, kwargs, [(a0, version)] if version >= 0 else [], (rng, None, None), autocast)
        return True

    def root_out(self, module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
        """The root's forward hook (registered with the replay): the backward's seed. On a held step a single output
        tensor's is kept by a hook in C++ (the backward runs no Python for it); else Replays.on_root_output."""
        if self.held and self._keep_seed is not None and type(output) is torch.Tensor:
            self._seed(output)
        else:
            assert self.replays is not None  # (registered only with the replay)
            self.replays.on_root_output(module, args, output)

    @guarded
    def _seed(self, output: torch.Tensor) -> None:
        capture, keep_seed = self.capture, self._keep_seed
        assert capture is not None and keep_seed is not None  # (root_out)
        if capture.calls and not capture.paused:
            capture.calls[-1].held = keep_seed(output, SEED_KEEP_MAX)

    def opt_pre(self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        # (``args`` holds the optimizer itself; a closure, which runs forwards inside the step: the general path)
        if self.held and len(args) <= 1 and not kwargs and self._clean(self.collector.state) is not False:
            return
        self.held = False
        self.boundary_hooks.on_opt_pre(optimizer, args, kwargs)  # (an anomaly known now is replayed there)

    def opt_post(self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not self.held or self._end() is False:
            self.boundary_hooks.on_opt_post(optimizer, args, kwargs)
        else:
            self.loop.after_step()  # (as StepLoop.end_step after its _finish)

    # -- a loss logged after the step ----------------------------------------------------------------------------------
    # While its row waits (``open``), the last clean step stands for the general path's finished step
    # (Core.last_open): a loss logged after ``optimizer.step()`` joins it through Collector.log_loss as it would join
    # an InFlight.
    @property
    def has_loss(self) -> bool:
        return self.rows[-1][_LOSS] is not None

    def add_late_loss(self, loss: float | torch.Tensor) -> None:
        """The loss joins the open row, judged for a spike as Flights.send judges a late loss."""
        value = float(loss)  # (a host value: the lane holds only host steps)
        row = self.rows[-1]
        row[_LOSS] = value
        if not math.isfinite(value):
            row[_NONFINITE] = True
        assert self.open is not None  # (last_open)
        self.end.late_loss(self.open, value)

    # -- the step's verdict and end ------------------------------------------------------------------------------------
    @guarded
    def _clean(self, state: StepState) -> bool:
        return self._verdict(state)

    def _verdict(self, state: StepState) -> bool:
        """The sentinel's verdict on a held step, where StepEnd.early_verdict and _judge reach it: its figures and
        losses on the host and finite, no spike. False: the step is let go (the general path reaches the same verdict
        from the same cached figures and judged spikes). Asked again at the step end: the figures and the spikes
        judged so far are cached, a loss logged since is judged then."""
        norm, gmax = self.end.figures(state)
        losses = state.losses
        if type(norm) is not float or type(gmax) is not float or not math.isfinite(norm + gmax):
            return False  # (on the device, absent, or a NaN/Inf)
        loss = None
        if losses:
            total = buffers.sum_losses(losses)
            if type(total) is not float or not math.isfinite(total):
                return False
            loss = total
        grad_spike, loss_spike = self.end.spikes(state, norm, loss)
        return not (grad_spike or loss_spike)

    @guarded(timed=False)  # timed inside: the step's observer_time ends with its row (as StepLoop._finish)
    def _end(self) -> bool:
        """BoundaryHooks.on_opt_post and StepLoop._finish for a clean held step: its row, the next step. False: the
        step is let go at its end (the general path closes it)."""
        t0 = now()
        collector, end, loop = self.collector, self.end, self.loop
        state = collector.state
        if (
            state.t_first is None  # no forward this step: the general path knows what to warn
            or loop.writer.error is not None
            or self.flights.queue  # (the general path's finished steps go to the writer before this one)
            or not self._verdict(state)
        ):
            self.held = False
            return False
        self.facts.updates += 1
        state.opt_stepped = True
        norm, gmax = state.figures  # type: ignore[misc]  # (judged clean: floats)
        losses = state.losses
        t_prev = end.t_prev_end
        row = [
            state.index,
            time.time(),
            max(state.t_first - t_prev, 0.0),
            state.samples or None,
            [float(g["lr"]) for g in self.groups],
            state.micro,
            gmax,
            norm,
            buffers.sum_losses(losses) if losses else None,
            False,  # non-finite (a late loss may be)
            0.0,  # step time, observer time: below
            0.0,
            state.reason,
        ]
        rows = self.rows
        rows.append(row)
        self.open = state
        if self.capture is not None:
            self.capture.take()  # (a clean step's calls are let go)
        self.cadence.after(False)
        if self.replays is not None and not self.cadence.alarmed:
            self.replays.clean_again()
        loop.begin_step(state.index + 1)
        t_end = now()  # (StepEnd.stamp)
        end.t_prev_end = t_end
        if len(rows) == 1:
            self._oldest = t_end
        row[_STEP_TIME] = step_time = t_end - t_prev
        row[_OBSERVER_TIME] = observer_time = self.guard.take_time() + (t_end - t0)
        loop.budget_step(state.index, observer_time, step_time, state.reason)
        self.carried += 1
        return True

    # -- to the writer -------------------------------------------------------------------------------------------------
    def step_start(self) -> None:
        """A step's first micro-batch: no loss joins the last clean step any more; the rows go to the writer when
        enough wait, and the general path's finished steps (Flights.on_step_start) when it has some."""
        self.open = None
        rows = self.rows
        if rows and (len(rows) >= ROWS_MAX or now() - self._oldest >= FLUSH_S):
            self.flush()
        if self.flights.queue:
            self.flush()
            self.flights.on_step_start()

    def flush(self, keep_open: bool = False) -> None:
        """The clean steps' rows to the writer (before any later step's packet), each as the packet the general path
        would have made (StepEnd._row and _judge). ``keep_open``: the newest stays while a late loss may join it
        (``doctor.flush()``: the general path too sends a step once the next one starts)."""
        rows = self.rows
        if keep_open and self.open is not None:
            rows, self.rows = rows[:-1], rows[-1:]
        else:
            self.rows = []
            self.open = None
        if self.rows:
            self._oldest = now()
        if not rows:
            return
        entries, level, packets = self.end.no_entries, schema.LEVEL_SENTINEL, []
        for step, wall, data_time, samples, lr, micro, gmax, norm, loss, bad, step_time, spent, reason in rows:
            row = {
                "time": wall,
                "data_time": data_time,
                "samples": samples,
                "lr": lr,
                "microbatches": micro,
                "peak_mem": None,
                "level": level,
                "reason": reason,
                "grad_max": gmax,
                "step_time": step_time,
                "observer_time": spent,
            }
            packets.append(
                StepPacket(step, row, NO_VALUES, SENTINEL_BASES, entries, loss, None, None, norm, False, bad, False)
            )
        self.put(StepBatch(packets))


# a row's fields (Lane._end), by position
_LOSS, _NONFINITE, _STEP_TIME, _OBSERVER_TIME = 8, 9, 10, 11
