"""The clean step's short way. Most steps of a healthy run observe no site and are clean: the sentinel reads its
figures, finds nothing, and the step's row goes to the trace. Inside a training loop each distinct call ampdoctor
makes on such a step pays its cache misses again (benchmarks/step_costs.py), and so does each Python object it
touches: the general path (the collector's and the boundary's hooks, the step end, the flights' verdicts and packets,
one packet a step to the writer) spent ~150-180 us of a small CPU model's ~1 ms step on it.

The lane holds a step from its start when the step can only be a clean host step or stop being one: it observes no
site (the cadence's plan), its figures are on the host (a CPU model, no scaler, no half-precision weights), the
flight recorder is off and the optimizer's step ends it. A held step is recorded by the C++ extension's HeldSteps
(csrc/step_record.cpp, loaded by compiled.py): its counts, its root calls kept for the replay, the backward's seed,
the gradients' figures and the sentinel's verdict, its row, and the next step, which it holds too while the plan
allows. The hooks below are thin: each hands its call to HeldSteps and returns. Between two let-gos no Python object
of the general path is touched but the step's StepState index; the cadence's running means, the run's counts and the
step's fields are HeldSteps' own until the general path takes a step back (``let_go``: a NaN/Inf, a spike, a loss on
a device, a model moved, a closure, another kind of call, a writer that failed, a step the cadence observes), when
they are written where the general path reads them and the step's kept calls become the replay's Calls. The verdict
is HeldSteps' repetition of the general path's (StepEnd.early_verdict and Cadence.spike/loss_spike, compiled without
fused multiply-adds: bit for bit); tests/test_lane.py compares whole traces of both. Without the extension the
general path takes every step.

A clean step's row waits in HeldSteps while a loss logged after ``optimizer.step()`` may still join it; the rows go
to the writer together, as one queue item, at most ROWS_MAX steps or FLUSH_S seconds after the oldest, and always
before any packet of the general path (the trace stays in step order)."""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any

import torch

from ..trace import schema
from ..trace.messages import StepBatch, StepPacket
from . import cadence as cadence_module
from . import compiled, hooks, stats
from .anomaly import MAX_CALLS, SEED_KEEP_MAX, Call, int_tensors
from .boundary import NO_VALUES, SENTINEL_BASES
from .collector import MAX_STEP_LOSSES
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

# HeldSteps' answers (csrc/step_record.cpp, HeldSteps::Code)
_LET_GO, _START, _AUTOCAST, _NEXT, _SPIKE, _OTHER, _PENDING, _WINDOW, _BUDGET = 1, 2, 4, 8, 32, 64, 128, 256, 512

now = time.perf_counter


class Lane:
    """The hooks of a run whose clean steps can take the short way (core.Core makes it where the run's configuration
    allows: a model on the CPU, the optimizer as the step boundary, no enabled scaler, no probe, no half-precision
    weights, parameters that are not shards, an eager model, not debug mode; it holds steps once the C++ extension is
    loaded). Each hook passes the call to the general path's own hook whenever the lane does not hold the step."""

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
        self.put = loop.put
        self.held = False  # the step in progress is the lane's (HeldSteps records it)
        anchor = collector.anchor
        assert anchor is not None  # (Core makes a lane only for a model with one)
        self._anchor = anchor
        self.rec: Any = None  # the extension's HeldSteps, once the extension is loaded
        self._unmade = False  # HeldSteps refused this run's parameters or groups

    @property
    def carried(self) -> int:
        """Steps the lane carried to their end."""
        return self.rec.carried if self.rec is not None else 0

    # -- which steps ---------------------------------------------------------------------------------------------------
    def take(self, state: StepState) -> None:
        """A step begins (StepLoop.begin_step): the lane holds it when it can only be a clean host step or stop being
        one, and HeldSteps holds the steps after it while the plan allows."""
        facts, cadence = self.facts, self.cadence
        held = (
            state.observe is Observe.NONE
            and not cadence.reads_weights(state.index)
            and facts.device == "cpu"
            and stats.HOST_READS  # (False: the accelerator's path, emulated on the CPU by the tests)
            and not facts.external_batches
            and self.loop.configured
            and not self.guard.off
            and not cadence.alarmed  # (the flight recorder's steps end as the general path ends them)
        )
        rec = self.rec
        if held and rec is None and not self._unmade:
            rec = self.rec = self._make()  # (None until the extension is loaded: looked for again every few seconds)
        if held and rec is not None:
            capture = self.capture
            room = 0 if capture is None or capture.paused else MAX_CALLS - len(capture.calls)
            start = bool(self.flights.queue)  # (the general path's finished steps go out at this step's start)
            rec.begin(
                state,
                state.index,
                cadence.next_observed(state.index + 1),
                self.end.t_prev_end,
                cadence.spike_state(),
                room,
                start,
                self.loop.budget is not None,
            )
            self.held = True
        else:
            self.held = False

    def _make(self) -> Any:
        ext = compiled.get()
        if ext is None or not hasattr(ext, "HeldSteps"):
            return None
        limits = {
            "seed_max": SEED_KEEP_MAX,
            "calls_max": MAX_CALLS,
            "rows_max": ROWS_MAX,
            "losses_max": MAX_STEP_LOSSES,
            "flush_s": FLUSH_S,
            "spike_warmup": cadence_module.SPIKE_WARMUP,
            "loss_warmup": cadence_module.LOSS_WARMUP,
            "spike_factor": cadence_module.SPIKE_FACTOR,
            "spike_alpha": cadence_module.SPIKE_ALPHA,
            "loss_sigmas": cadence_module.LOSS_SPIKE_SIGMAS,
            "loss_factor": cadence_module.LOSS_SPIKE_FACTOR,
            "loss_alpha": cadence_module.LOSS_ALPHA,
            "compensated_sum": sys.version_info >= (3, 12),  # (Python's sum() of floats, as buffers.sum_losses sums)
        }
        # (HeldSteps reads CLOCK_MONOTONIC: the offset puts its times on perf_counter's, where they differ)
        offset = time.perf_counter() - time.clock_gettime(time.CLOCK_MONOTONIC)
        params = [p for _, p in self.end.params]
        try:
            return ext.HeldSteps(params, self._anchor, self.groups, limits, offset)
        except Exception:  # (parameters or groups it does not take: the general path takes every step)
            self._unmade = True
            return None

    # -- training's hooks ----------------------------------------------------------------------------------------------
    # On a held step each hook hands its call to HeldSteps (which times itself) under the run's guard, as
    # guards.guarded does it: an error stops collection, never training. Where the lane lets a step go, the general
    # path's own hook takes the call.
    def root_pre(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Collector.on_root_pre and the replay's capture (Capture.on_call) for a held step's call. A moved model: the
        general path takes the step."""
        guard = self.guard
        if self.held and not guard.off:
            try:
                code = self.rec.call(args, kwargs)
                if code & _OTHER:  # (keywords, several arguments: its tensors found as the general path finds them)
                    code = self._other_call(args, kwargs)
                if code == 0:
                    return
                if not code & _LET_GO:
                    self._call_extras(code)
                    return
            except Exception as exc:
                guard.fail(exc)
                return
            self.let_go()
        self.collector.on_root_pre(module, args, kwargs)

    def _other_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
        t0 = now()
        tensors = hooks.float_tensors((args, kwargs)) + int_tensors((args, kwargs))
        first = hooks.first_tensor(args, kwargs)
        versions = [(t, t._version) for t in tensors]
        self.guard.observer_time += now() - t0  # (HeldSteps times its own part)
        return int(self.rec.call_with(args, kwargs, first, versions))

    def _call_extras(self, code: int) -> None:
        """A held step's first call: the rows (and the general path's finished steps) to the writer, a new autocast
        state to the run's facts."""
        t0 = now()
        rec = self.rec
        if code & _BUDGET:
            rec.set_budget(self.loop.budget.state())  # type: ignore[union-attr]  # (asked only with a budget)
        if code & _AUTOCAST:
            self.collector.record_autocast(rec.autocast_now)
        if code & _START:
            self.flush()
            if self.flights.queue:
                # (a replay the finished steps ask for runs the root's forward: the general path's hooks, paused
                # meanwhile, take it)
                self.held = False
                try:
                    self.flights.on_step_start()
                finally:
                    self.held = True
                rec.set_means(self.cadence.spike_state())  # (their verdicts judged late losses)
                if self.cadence.alarmed:  # (an anomaly among them: the flight recorder's steps are the general path's)
                    self.let_go()
        self.guard.observer_time += now() - t0

    def root_out(self, module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
        """The root's forward hook (registered with the replay): the backward's seeds, kept by hooks in C++ (the
        backward runs no Python for them); else Replays.on_root_output."""
        if self.held:
            guard = self.guard
            if guard.off:
                return
            try:
                rec = self.rec
                # (not one plain tensor: its floating tensors, found as Capture.on_output finds them)
                if not rec.seed(output):
                    t0 = now()
                    for i, t in enumerate(hooks.float_tensors(output)):
                        rec.seed_at(i, t)
                    guard.observer_time += now() - t0
            except Exception as exc:
                guard.fail(exc)
            return
        assert self.replays is not None  # (registered only with the replay)
        self.replays.on_root_output(module, args, output)

    def opt_pre(self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """The sentinel's verdict on a held step before the update (StepEnd.early_verdict). Not clean, or a closure
        (which runs forwards inside the step): the general path takes the step."""
        guard = self.guard
        # (``args`` holds the optimizer itself)
        if self.held and len(args) <= 1 and not kwargs and not guard.off:
            try:
                if self.rec.verdict():
                    return
            except Exception as exc:
                guard.fail(exc)
                return
        self.let_go()
        self.boundary_hooks.on_opt_pre(optimizer, args, kwargs)  # (an anomaly known now is replayed there)

    def opt_post(self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """BoundaryHooks.on_opt_post and StepLoop._finish for a clean held step: its row, the next step."""
        guard = self.guard
        if self.held and not guard.off:
            loop = self.loop
            code = _LET_GO
            try:
                if loop.writer.error is None:  # (else the general path stops collection, and says why)
                    capture = self.capture
                    if capture is not None and capture.batch_ids:
                        capture.take()  # (a clean step's batch ids are let go)
                    extra, guard.observer_time = guard.observer_time, 0.0
                    code = self.rec.end(extra)
                    if code & _LET_GO:
                        guard.observer_time += extra
                    else:
                        if code:
                            self._after_end(code)
                        code = -1
            except Exception as exc:
                guard.fail(exc)
                return
            if code == -1:
                live = loop.live
                if live is not None and live.halt is not None:
                    loop.after_step()  # (as StepLoop.end_step after its _finish; raised into training)
                return
        self.let_go()
        self.boundary_hooks.on_opt_post(optimizer, args, kwargs)

    def _after_end(self, code: int) -> None:
        """After a held step's end: the next step's own start where the lane does not hold it, the overhead budget's
        window closed where it is full (StepLoop._finish's order: the next step begins with the cadence the budget
        then changes)."""
        t0 = now()
        rec, loop = self.rec, self.loop
        index = rec.index  # (the next step)
        budget = loop.budget
        if code & _NEXT:
            self.held = False
            self._sync()
            loop.begin_step(index)  # (its on_begin: take)
        if code & _WINDOW and budget is not None:
            if self.held:
                budget.set_state(rec.budget())
            stretch = self.cadence.stretch
            loop.budget_change(index - 1, budget.close_window())
            if self.held:
                rec.set_budget(budget.state())
                if self.cadence.stretch != stretch:
                    rec.until = self.cadence.next_observed(index + 1)
        self.guard.observer_time += now() - t0

    # -- the general path takes the step -------------------------------------------------------------------------------
    def let_go(self) -> None:
        """The held step to the general path: its fields into its StepState, the run's counts and the running means
        where the general path reads them, its kept calls into the replay's Capture."""
        if not self.held:
            return
        self.held = False
        try:
            self._release()
        except Exception as exc:
            self.guard.fail(exc)

    def _release(self) -> None:
        t0 = now()
        t_first, micro, samples, losses, figures, called, autocast, calls, spent = self.rec.release()
        self._sync()
        collector = self.collector
        state = collector.state
        state.t_first, state.micro, state.samples, state.losses = t_first, micro, samples, losses
        state.first_backward = micro > 0
        state.updates = self.facts.updates
        if figures is not None:
            state.figures = figures
        if called:
            collector.autocast_now = autocast
        if calls:
            capture = self.capture
            assert capture is not None  # (calls are kept only with the replay)
            for args, kwargs, versions, rng, call_autocast, seeds in calls:
                capture.calls.append(Call(args, kwargs, versions, rng, call_autocast, held=seeds))
        self.guard.observer_time += spent + (now() - t0)

    def _sync(self) -> None:
        """The run's counts, the cadence's running means and the last step end's time, from HeldSteps (the clean
        steps it ended since the last sync leave the flight recorder and the replay's incident as a clean step
        leaves them)."""
        rec = self.rec
        step_starts, updates, ended, t_prev_end, means = rec.sync()
        budget, window = self.loop.budget, rec.budget()
        if budget is not None and window is not None:  # (None: no held step reached its first call)
            budget.set_state(window)
        facts = self.facts
        facts.step_starts += step_starts
        facts.updates += updates
        self.cadence.set_spike_state(means)
        if ended:
            self.end.t_prev_end = t_prev_end
            self.cadence.after(False)
            if self.replays is not None and not self.cadence.alarmed:
                self.replays.clean_again()

    # -- a loss -----------------------------------------------------------------------------------------------------
    def log_loss(self, loss: Any) -> bool:
        """Doctor.log_loss while the lane holds the step, under the guard: the step's loss, or the last clean step's
        late loss, judged in HeldSteps. False: the general path takes the loss: the late loss of its own last step,
        or one HeldSteps does not take (on a device, of several values, of another type), the step let go first."""
        guard = self.guard
        if guard.off:
            return True
        t0 = now()
        try:
            if type(loss) is torch.Tensor:
                if loss.numel() != 1 or not loss.is_cpu or self.facts.loss_dtype is None:
                    self.let_go()
                    return False
                value = loss.item()
            elif type(loss) is float or type(loss) is int:
                value = float(loss)
            else:
                self.let_go()
                return False
            rec = self.rec
            code = rec.loss(value)
            if code & _PENDING:  # (before the step's first call, no clean step open: Collector.log_loss's rule)
                pending = self.flights.last_open()
                if pending is not None and not pending.has_loss:
                    return False  # (the general path's finished step's late loss)
                code = rec.add_loss(value)
            if code & _SPIKE:
                self.end.loss_spike_event(rec.late_step, value, rec.late_mean)
            return True
        except Exception as exc:
            guard.fail(exc)
            return True
        finally:
            guard.observer_time += now() - t0

    # While its row waits (``open``), the last clean step stands for the general path's finished step
    # (Core.last_open): a loss the general path is given after ``optimizer.step()`` joins it through
    # Collector.log_loss as it would join an InFlight.
    @property
    def open(self) -> bool:
        return self.rec is not None and self.rec.open

    @property
    def has_loss(self) -> bool:
        return bool(self.rec.open_has_loss)

    def add_late_loss(self, loss: float | torch.Tensor) -> None:
        """The loss joins the open row, judged for a spike as StepEnd.late_loss judges one (the general path's step
        is in progress: the running means are the cadence's)."""
        value = float(loss)  # (a host value: the lane holds only host steps)
        step = self.rec.late_loss(value)
        if self.cadence.loss_spike(value):
            self.end.loss_spike_event(step, value)

    # -- to the writer -------------------------------------------------------------------------------------------------
    def step_start(self) -> None:
        """A general path's step's first micro-batch (Collector.on_step_start): no loss joins the last clean step any
        more; the rows go to the writer when enough wait, and the general path's finished steps
        (Flights.on_step_start) when it has some."""
        rec = self.rec
        if rec is not None:
            rec.close_open()
            if rec.rows_due:
                self.flush()
        if self.flights.queue:
            self.flush()
            self.flights.on_step_start()

    def flush(self, keep_open: bool = False) -> None:
        """The clean steps' rows to the writer (before any later step's packet), each as the packet the general path
        would have made (StepEnd._row and _judge). ``keep_open``: the newest stays while a late loss may join it
        (``doctor.flush()``: the general path too sends a step once the next one starts)."""
        if self.rec is None:
            return
        rows = self.rec.rows(keep_open)
        if not rows:
            return
        entries, level, packets = self.end.no_entries, schema.LEVEL_SENTINEL, []
        for step, wall, data_time, samples, lr, micro, gmax, norm, loss, bad, step_time, spent in rows:
            row = {
                "time": wall,
                "data_time": data_time,
                "samples": samples,
                "lr": lr,
                "microbatches": micro,
                "peak_mem": None,
                "level": level,
                "reason": "sentinel",  # (the plan of every step the lane holds)
                "grad_max": gmax,
                "step_time": step_time,
                "observer_time": spent,
            }
            packets.append(
                StepPacket(step, row, NO_VALUES, SENTINEL_BASES, entries, loss, None, None, norm, False, bad, False)
            )
        self.put(StepBatch(packets))
