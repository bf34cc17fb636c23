"""The clean step's short way. Most steps of a healthy run observe no site and are clean: the sentinel reads its
figures, finds nothing, and the step's row goes to the trace. Inside a training loop each distinct call ampdoctor
makes on such a step pays its cache misses again (benchmarks/step_costs.py): the general path (the collector's and
the boundary's hooks, the step end, the flights' verdicts and packets, one packet a step to the writer) spent
~150-180 us of a small CPU model's ~1 ms step on it; the short way ~85, of which ~17 read the gradients' memory.

The lane holds a step from its start when the step can only be a clean host step or stop being one: it observes no
site (the cadence's plan), its figures are on the host (a CPU model, no scaler, no half-precision weights) and the
optimizer's step ends it. It works on the general path's own state (the step's StepState, the replay's Capture) and
decides with the same functions (the sentinel's figures, the running means of the spikes). The one thing it keeps
its own way is the step's root calls: as read, made into the replay's Calls only if the general path takes the step
(a clean step's are let go unmade). Where the step turns out not to be clean (a NaN/Inf, a spike, a loss on a
device, a model moved, a closure, a writer that failed), the lane lets it go at once and the general path carries on
from there: the replay finds the step's calls where it always does. Where the C++ extension is loaded
(compiled.py), a root call's state is read by one call and the backward's seed is kept by a C++ hook (the backward
runs no Python for it).

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
from .anomaly import MAX_CALLS, SEED_KEEP_MAX, Call
from .boundary import NO_VALUES, SENTINEL_BASES
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
        # the held step's root calls, kept as read ([args, kwargs, versions, rng, autocast, seed]) and made into the
        # replay's Calls only when the general path takes the step (settle): a clean step's are let go unmade
        self.raw: list[list[Any]] = []
        self._autocast_seen: Any = False  # the last autocast state given to Collector.record_autocast

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
    # On a held step each hook does its work in its own body, under the run's guard as guards.guarded does it (timed;
    # an error stops collection, never training): inside a training loop every further Python call a step makes pays
    # its cache misses again (benchmarks/sentinel_pieces.py), so a held step makes few. Where the lane lets a call go,
    # the general path's own hook takes it and times itself; the step's calls are settled first.
    def root_pre(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Collector.on_root_pre and start_micro for the common call of a held step: one plain tensor, read by one
        C++ call (compiled.py). Another call, no extension, a moved model: the general path takes the call."""
        guard = self.guard
        if self.held and not guard.off:
            t0 = now()
            try:
                a0 = args[0] if len(args) == 1 and not kwargs else None
                call_state = self._call_state
                if call_state is not None and type(a0) is torch.Tensor:
                    if self._root_call(a0, args, kwargs, call_state, t0):
                        return
                    self.held = False
            except Exception as exc:
                guard.fail(exc)
                return
            finally:
                guard.observer_time += now() - t0
            self.settle()
        self.collector.on_root_pre(module, args, kwargs)

    def _root_call(
        self, a0: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any], call_state: Any, t0: float
    ) -> bool:
        """root_pre's work on a held step's common call. False: the step is let go (the model moved)."""
        training, dtype, rows, version, rng = call_state(a0, self.capture is not None)
        if not training:
            return True  # (an evaluation forward, a checkpoint's recomputation)
        autocast = ("cpu", dtype) if dtype is not None else None
        collector = self.collector
        state = collector.state
        if state.t_first is None:
            if not self._anchor.is_cpu:  # the model moved: the general path reads its new device
                return False
            state.t_first = t0
            self.open = None  # (step_start: no loss joins the last clean step any more)
            if (self.rows and (len(self.rows) >= ROWS_MAX or t0 - self._oldest >= FLUSH_S)) or self.flights.queue:
                self.step_start()
            if autocast != self._autocast_seen:  # (recording the same state again changes nothing)
                collector.record_autocast(autocast)
                self._autocast_seen = autocast
        collector.autocast_now = autocast
        self.facts.step_starts += 1
        state.micro += 1
        if rows > 0:
            state.samples += rows
        state.first_backward = True
        capture = self.capture
        if capture is not None and not capture.paused and len(capture.calls) + len(self.raw) < MAX_CALLS:
            self.raw.append([args, kwargs, [(a0, version)] if version >= 0 else [], (rng, None, None), autocast, None])
        return True

    def root_out(self, module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
        """The root's forward hook (registered with the replay): the backward's seed. On a held step a single output
        tensor's is kept by a hook in C++ (the backward runs no Python for it); else Replays.on_root_output."""
        guard, keep_seed = self.guard, self._keep_seed
        if self.held and keep_seed is not None and type(output) is torch.Tensor:
            if guard.off:
                return
            t0 = now()
            try:
                capture = self.capture
                assert capture is not None  # (registered only with the replay)
                # (None: no gradient will reach it, e.g. an evaluation forward inside the step, which is no call: the
                # last call's seed stays, as Capture.on_output leaves it)
                held = keep_seed(output, SEED_KEEP_MAX)
                if held is not None and self.raw:
                    self.raw[-1][5] = held
                elif held is not None and capture.calls and not capture.paused:  # (a call the general path took)
                    capture.calls[-1].held = held
            except Exception as exc:
                guard.fail(exc)
            finally:
                guard.observer_time += now() - t0
            return
        assert self.replays is not None  # (registered only with the replay)
        self.settle()
        self.replays.on_root_output(module, args, output)

    def opt_pre(self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """The sentinel's verdict on a held step before the update (StepEnd.early_verdict). Not clean, or a closure
        (which runs forwards inside the step): the general path takes the step."""
        guard = self.guard
        # (``args`` holds the optimizer itself)
        if self.held and len(args) <= 1 and not kwargs and not guard.off:
            t0 = now()
            try:
                if self._verdict(self.collector.state):
                    return
            except Exception as exc:
                guard.fail(exc)
                return
            finally:
                guard.observer_time += now() - t0
        self.let_go()
        self.boundary_hooks.on_opt_pre(optimizer, args, kwargs)  # (an anomaly known now is replayed there)

    def opt_post(self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        guard = self.guard
        if self.held and not guard.off:
            t0 = now()
            try:
                ended = self._end(t0)
            except Exception as exc:
                guard.fail(exc)
                return
            if ended:
                live = self.loop.live
                if live is not None and live.halt is not None:
                    self.loop.after_step()  # (as StepLoop.end_step after its _finish; raised into training)
                return
        self.let_go()
        self.boundary_hooks.on_opt_post(optimizer, args, kwargs)

    # -- the general path takes the step -------------------------------------------------------------------------------
    def let_go(self) -> None:
        self.held = False
        self.settle()

    def settle(self) -> None:
        """The held step's root calls into the replay's Capture, as Capture.keep would have kept them: the general
        path finds them where it always does."""
        raw = self.raw
        if raw:
            capture = self.capture
            assert capture is not None  # (raw calls are kept only with the replay)
            for args, kwargs, versions, rng, autocast, held in raw:
                capture.calls.append(Call(args, kwargs, versions, rng, autocast, held=held))
            self.raw = []

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
    def _verdict(self, state: StepState) -> bool:
        """The sentinel's verdict on a held step, where StepEnd.early_verdict and _judge reach it: its figures and
        losses on the host and finite, no spike. False: the step is let go (the general path reaches the same verdict
        from the same cached figures and judged spikes)."""
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

    def _end(self, t0: float) -> bool:
        """BoundaryHooks.on_opt_post and StepLoop._finish for a clean held step: its row, the next step. False: the
        step is let go at its end (the general path closes it). Its observer_time ends with its row."""
        collector, end, loop, cadence = self.collector, self.end, self.loop, self.cadence
        state = collector.state
        if (
            state.t_first is None  # no forward this step: the general path knows what to warn
            or loop.writer.error is not None
            or self.flights.queue  # (the general path's finished steps go to the writer before this one)
            or state.grad_spike is None  # (not judged before the update: an optimizer hook of ours came after)
        ):
            return False
        self.facts.updates += 1
        state.opt_stepped = True
        norm, gmax = state.figures  # type: ignore[misc]  # (judged clean: floats)
        losses = state.losses
        t_prev = end.t_prev_end
        groups = self.groups
        row = [
            state.index,
            time.time(),
            max(state.t_first - t_prev, 0.0),
            state.samples or None,
            [float(groups[0]["lr"])] if len(groups) == 1 else [float(g["lr"]) for g in groups],
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
        self.raw = []  # (a clean step's calls are let go: Capture.take)
        capture = self.capture
        if capture is not None and (capture.calls or capture.batch_ids):
            capture.take()
        cadence.after(False)
        if self.replays is not None and not cadence.alarmed:
            self.replays.clean_again()
        loop.begin_step(state.index + 1)  # (its on_begin: take)
        t_end = now()  # (StepEnd.stamp)
        end.t_prev_end = t_end
        if len(rows) == 1:
            self._oldest = t_end
        row[_STEP_TIME] = step_time = t_end - t_prev
        row[_OBSERVER_TIME] = observer_time = self.guard.take_time() + (t_end - t0)
        if loop.budget is not None:
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
