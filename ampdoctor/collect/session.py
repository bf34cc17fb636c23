"""The Doctor: what ``ampdoctor.attach`` returns, a thin facade over the training side's core.

- ``Collector`` (collector.py): from hooks to the step's record.
- ``StepEnd`` (boundary.py): from the record to the writer's packet and the sentinel's verdict.
- ``Cadence`` (cadence.py): what each step observes; the flight recorder.
- the ``Writer`` thread (trace/writer.py) and the live rules (live.py).

The Doctor wires them (each is given what it needs explicitly), owns the torch hooks and wrapped methods, decides at
each step end what comes next, and offers the public calls and read-only properties the integrations use. Every
entry from training runs under ``guards.guarded`` (never break training)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import os
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Literal

import torch

from ..trace.messages import EventKind, EventMsg, MetaMsg, MetricMsg
from ..trace.vectors import FULL_BLOCK, Entry, Phase
from ..trace.writer import Writer
from . import guards, hooks, meta, sharded, stats
from .anomaly import Call, Capture, Replay, Replayer
from .boundary import InFlight, StepEnd, read_scale
from .cadence import Budget, Cadence
from .collector import Collector
from .guards import Guard, guarded
from .live import MAX_SHARE, LiveDiagnosis, TrainingHalted
from .options import Boundary, Observe, Options
from .probe import StepProbe
from .record import StepRecord
from .sites import Sites
from .state import RunFacts, StepState

log = logging.getLogger("ampdoctor")

# Finished steps whose values may still be on their way from an accelerator before the oldest is waited for: the
# verdict (and the flight recorder, the replay) comes at most this many steps late.
MAX_IN_FLIGHT = 2
LIVE_PART_OF_BUDGET = 3  # attach(budget=b): the live checks' CPU share is at most b / 3 (and MAX_SHARE)


class Doctor:
    """Observes one model during training; use as a context manager or call ``close()``. Made by
    ``ampdoctor.attach`` (see its arguments)."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: Any = None,
        scaler: Any = None,
        trace: str | os.PathLike[str] = "runs/ampdoctor.db",
        options: Options | None = None,
        *,
        diagnose: Callable[..., Any] | None = None,
        exporter: Callable[..., Any] | None = None,
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"Argument model should be of type torch.nn.Module, but given {type(model)}")
        if optimizer is not None:
            optimizer, wrapped_scaler = guards.unwrap_optimizer(optimizer)
            if scaler is None and guards.is_scaler(wrapped_scaler):  # accelerate's optimizer carries its GradScaler
                scaler = wrapped_scaler
        if scaler is not None and not guards.is_scaler(scaler):
            raise TypeError(f"Argument scaler should be a torch.amp.GradScaler, but given {type(scaler)}")
        if not isinstance(trace, (str, os.PathLike)):
            raise TypeError(f"Argument trace should be a path (str), but given {type(trace)}")
        options = options if options is not None else Options()
        if options.wants_live and diagnose is None:
            raise ValueError("Argument diagnose should be the rules' entry point when the rules run live")
        if options.export is not None and exporter is None:
            raise ValueError("Argument exporter should start ampdoctor.export's thread when export= is given")

        self.model, self.optimizer, self.scaler = model, optimizer, scaler
        self.options = options
        self._scaler_on = scaler is not None and _enabled(scaler)
        if self._scaler_on:
            self._boundary = Boundary.SCALER
        elif optimizer is not None:
            self._boundary = Boundary.OPTIMIZER
        else:
            self._boundary = Boundary.MANUAL
        self.guard = Guard(self._stop_after_error)
        self._closed = False
        self._warned = False
        self._halted = False
        self._handles = hooks.Handles()
        self._inflight: deque[InFlight] = deque()  # finished steps not yet sent to the writer, oldest first
        self._updates = 0  # optimizer updates applied so far
        self._replay_target: StepState | None = None
        self._capture: Capture | None = None
        self._replayer: Replayer | None = None
        self._live: LiveDiagnosis | None = None
        self._export: Any = None  # the exporters' thread (ampdoctor.export), with export=
        self._config_written = False
        every, peak_every, hist_every = options.every, options.peak_every, options.hist_every
        assert every is not None and peak_every is not None and hist_every is not None  # (Options fills them in)
        self._cadence = Cadence(
            options.mode,
            every=every,
            peak_every=peak_every,
            hist_every=hist_every,
            calibration=options.calibration,
        )
        self._budget = Budget(options.budget, self._cadence) if options.budget is not None else None
        requested = self.path = meta.trace_path(trace)
        guards.ATTACHED.claim(self, [*model.modules(), *(o for o in (optimizer, scaler) if o is not None)])
        try:
            self._writer: Writer | None = Writer(requested, free_name=True)  # never overwrites: a taken name gets -1..
            self.path = self._writer.path
        except Exception as exc:  # a read-only or full directory: warn, observe nothing, let training run
            self._writer = None
            self.guard.off = True
            guards.ATTACHED.release(self)
            warnings.warn(
                f"ampdoctor: cannot write the trace {self.path} ({exc}); collection disabled, training continues",
                RuntimeWarning,
                stacklevel=4,
            )
            return
        try:
            self._build(diagnose, exporter)
        except BaseException:
            self._abort()
            raise
        if self.path != requested:
            warnings.warn(
                f"ampdoctor: {requested} exists; writing this run's trace to {self.path}", RuntimeWarning, stacklevel=4
            )

    def _build(self, diagnose: Callable[..., Any] | None, exporter: Callable[..., Any] | None) -> None:
        """The core, the hooks, the writer and live threads; _abort() undoes whatever part of it was done."""
        model, options = self.model, self.options
        put = self._put
        stats.native()  # the native kernels start loading now, beside the first (calibration) steps
        # FSDP: a sharded parameter is read as this rank's shard (collect/sharded.py), never gathered
        self._first_param = next(iter(model.parameters()), None)
        self._params = sharded.local_params(model, [(n, p) for n, p in model.named_parameters() if p.requires_grad])
        self._record = StepRecord()
        self._sites = Sites(model, put)
        self._facts = RunFacts()
        self._modules = hooks.select_modules(model, options.include, options.exclude)
        self._collector = Collector(
            self.guard,
            model,
            self._modules,
            self._sites,
            self._record,
            self._facts,
            self._params,
            boundary_name=self._boundary.value,
            on_step_start=self._on_step_start,
            keep_hooks=type(model).__name__ == "OptimizedModule",
        )
        self._end = StepEnd(
            self.guard,
            self._record,
            self._sites,
            self._params,
            self._cadence,
            put,
            optimizer=self.optimizer,
            scaler=self.scaler,
            scaler_enabled=self._scaler_on,
            weight_every=options.weight_every,
            model_name=type(model).__name__,
        )
        self._probe: StepProbe | None = None
        if options.probe_every:
            self._probe = StepProbe(self._modules, self._sites, put, self.guard.fail, options.probe_every)
            self._collector.probe = self._probe
        if options.replay:
            self._capture = Capture(self._device)
            self._replayer = Replayer(
                model,
                self._modules,
                self._params,
                self._capture,
                self._observing,
                self._pause,
                self._collector.hook_ids,
                heal=options.heal,
            )
            self._collector.on_root_call = self._capture.on_call
        self._begin(0)

        writer = self._writer
        assert writer is not None  # (_build runs once the writer is made)
        writer.log_every = options.log_every
        writer.start()
        put(MetaMsg("run", meta.run_meta(model, options, self._cadence)))
        sharding = sharded.describe(model, self._params)  # which parameters are shards, for trace/shards.py
        if sharding is not None:
            put(MetaMsg("sharding", sharding))
        self._install()
        if options.wants_live:
            assert diagnose is not None  # (checked in __init__)
            # Under an overhead budget the live checks get a third of it (their CPU time, on another thread, holds the
            # GIL that training's Python waits for); the training thread's share is the Budget's to keep.
            share = options.budget / LIVE_PART_OF_BUDGET if options.budget is not None else MAX_SHARE
            self._live = LiveDiagnosis(
                self.path,
                diagnose,
                on_finding=options.on_finding,
                halt_on=options.halt_on,
                rules=options.rules,
                share=share,
            )
            self._live.start()
        if options.export is not None:  # sinks made here: a bad spec or a missing package fails attach
            assert exporter is not None  # (checked in __init__)
            self._export = exporter(options.export, self.path, findings=lambda: self.findings, rules=options.rules)
        if options.log_every is not None and not log.handlers and not logging.getLogger().handlers:
            handler = logging.StreamHandler()  # the summary is asked for: make sure it is seen
            handler.setFormatter(logging.Formatter("%(message)s"))
            log.addHandler(handler)  # last: an attach that raised added no handler
            log.setLevel(logging.INFO)

    def _install(self) -> None:
        h = self._handles
        collector = self._collector
        h.add(self.model.register_forward_pre_hook(hooks.eager(collector.on_root_pre), with_kwargs=True))
        if self._capture is not None:
            h.add(self.model.register_forward_hook(hooks.eager(self._on_root_output)))
        if self._probe is not None:
            h.on_remove(self._probe.disarm)
        h.on_remove(collector.unhook)
        if self.optimizer is not None:
            h.add(self.optimizer.register_step_pre_hook(self._on_opt_pre))
            h.add(self.optimizer.register_step_post_hook(self._on_opt_post))
        if self.scaler is not None:
            hooks.wrap_method(h, self.scaler, "scale", self._wrap_scale)
            hooks.wrap_method(h, self.scaler, "update", self._wrap_update)

    def _abort(self) -> None:
        """A failed attach leaves nothing behind: no hook, no wrapped method, no thread, no trace file."""
        self._closed = self.guard.off = True
        self._handles.remove()
        if self._live is not None:
            self._live.stop()
        if self._export is not None:
            self._export.close()
        assert self._writer is not None  # (_build runs once the writer is made)
        self._writer.close()
        for suffix in ("", "-wal", "-shm"):  # this Doctor's Writer created the file (it refuses an existing one)
            try:
                os.remove(self.path + suffix)
            except OSError:
                pass
        guards.ATTACHED.release(self)

    # -- the step boundary ---------------------------------------------------------------------------------------
    def _begin(self, index: int) -> None:
        """Step ``index`` starts: a new state as the cadence plans it."""
        observe, reason, store_hist = self._cadence.plan(index)
        self._collector.begin(StepState(index, observe, reason, store_hist, updates=self._updates))

    def _on_step_start(self) -> None:
        """The next step's first forward: no loss can join the finished steps any more; send those resolved."""
        for flight in self._inflight:
            flight.closed = True
        self._resolve(wait=False)
        self._send()

    @guarded
    def _on_opt_pre(self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        state = self._collector.state
        capture, replayer = self._capture, self._replayer  # (made together)
        if replayer is not None and capture is not None and state.replay is None and replayer.wanted(capture.calls):
            # Before the update the weights are still the step's own: a replay now is exact (at the step end an
            # applied step's weights have moved). Only when the sentinel's figures are on the host already.
            verdict = self._end.early_verdict(state)
            if verdict is not None and verdict.anomalous:
                self._replay(state, verdict.kind, capture.calls, capture.batch_ids, moved=None)
        if state.index % self.options.weight_every == 0:
            self._collector.keep_weights()

    def _on_opt_post(self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self.guard.off:
            return
        self._updates += 1
        state = self._collector.state
        state.opt_stepped = True
        if state.weights_before is not None:
            self._collector.record_updates()
        if self._boundary is Boundary.OPTIMIZER:
            self._end_step(skipped=False)

    def _wrap_scale(self, original: Callable[..., Any]) -> Callable[..., Any]:
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
            self._collector.log_loss(t, self._last_flight())
        state = self._collector.state
        if state.scale_before is None:
            state.scale_before = read_scale(self.scaler)

    def _wrap_update(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def update(*args: Any, **kwargs: Any) -> Any:
            self._before_update()
            result = original(*args, **kwargs)
            if not self.guard.off and self._boundary is Boundary.SCALER:
                stepped = self._collector.state.opt_stepped
                self._end_step(skipped=(not stepped) if self.optimizer is not None else None)
            return result

        return update

    @guarded
    def _before_update(self) -> None:
        state = self._collector.state
        if state.scale_before is None:
            state.scale_before = read_scale(self.scaler)

    def _end_step(self, skipped: bool | None) -> None:
        if self.guard.off:
            return
        self._finish_step(skipped)
        live = self._live
        if live is not None and live.halt is not None and not self._halted:
            self._halted = True  # asked once: a loop that catches TrainingHalted may go on
            if self.options.on_halt is None:
                raise TrainingHalted(live.halt)
            try:
                self.options.on_halt(live.halt)
            except Exception as exc:
                warnings.warn(
                    f"ampdoctor: on_halt callback raised {type(exc).__name__}: {exc}", RuntimeWarning, stacklevel=3
                )

    @guarded(timed=False)  # timed inside: the step's observer_time ends with its row
    def _finish_step(self, skipped: bool | None) -> None:
        writer = self._writer
        assert writer is not None  # (no writer: the guard is off, and no step ends)
        if writer.error is not None:
            raise RuntimeError(f"trace writer failed: {writer.error}")
        t0 = time.perf_counter()
        state, facts = self._collector.state, self._facts
        flight = self._end.close(state, skipped, facts.step_starts, facts.device)
        if self._capture is not None:
            flight.calls, flight.batch_ids = self._capture.take()
        flight.updates = state.updates
        self._inflight.append(flight)
        # On the CPU the values are here: the verdict now. On an accelerator, whatever finished copying; more than
        # MAX_IN_FLIGHT steps behind, the oldest is waited for (memory and lateness stay bounded).
        self._resolve(wait=len(self._inflight) > MAX_IN_FLIGHT)
        if self._probe is not None:
            self._probe.end(state.index)
        if not self._config_written:
            config = meta.config(self.model, self.optimizer, self.scaler, self._scaler_on, facts, self._boundary.value)
            self._put(MetaMsg("config", config))
            self._config_written = True
        self._begin(state.index + 1)
        self._end.stamp(flight.row, self.guard.take_time() + (time.perf_counter() - t0))
        if self._budget is not None:
            row = flight.row
            change = self._budget.update(row["observer_time"], row["step_time"], row["reason"])
            if change is not None:
                message = (
                    f"ampdoctor cost {change['share']:.1%} of the steps against a budget of {change['budget']:.1%}: "
                    f"peaks every {change['peak_every']}, full statistics every {change['every']} steps from now on"
                )
                self._put(EventMsg(state.index, EventKind.CADENCE, None, None, message, change))

    def _last_flight(self) -> InFlight | None:
        """The finished step a loss logged now belongs to (after ``optimizer.step()``, before the next forward)."""
        return self._inflight[-1] if self._inflight and not self._inflight[-1].closed else None

    def _resolve(self, wait: bool) -> None:
        """Verdicts for the finished steps whose values reached the host, in step order (``wait``: the oldest is
        waited for). A verdict arms the flight recorder and may replay its step."""
        for flight in self._inflight:
            if flight.packet is not None:
                continue
            if not flight.copy.ready() and not wait:
                break
            wait = False
            flight.packet, flight.verdict = self._end.resolve(flight)
            self._after_verdict(flight)

    def _after_verdict(self, flight: InFlight) -> None:
        state, verdict, packet, calls = flight.state, flight.verdict, flight.packet, flight.calls
        assert verdict is not None and packet is not None  # (resolved just before)
        replayer = self._replayer
        if (
            verdict.anomalous
            and state.replay is None
            and replayer is not None
            and replayer.wanted(calls)
            and calls is not None  # (wanted: some calls)
        ):
            if self._updates != flight.updates:
                moved = "the optimizer had applied an update since the step started when its anomaly was known"
            elif self._boundary is Boundary.MANUAL:
                moved = "the step ended after the loop's own optimizer step (doctor.step())"
            else:
                moved = None  # the scaler skipped it, and every step since: the weights are the step's own
            self._replay(state, verdict.kind, calls, flight.batch_ids, moved=moved)
        if state.replay_record is not None:
            self._end.rebuild(packet, state.replay_record, "replay")
            state.replay_record = None
        flight.calls = None  # (its batch, RNG states and output gradients are let go)
        # The flight recorder: an anomaly seen now gets every site in full from the next step it can still plan,
        # until a run of clean steps.
        self._cadence.after(verdict.anomalous)
        if self._replayer is not None and not self._cadence.alarmed:
            self._replayer.clean_again()

    def _drain(self) -> None:
        """Every finished step to the writer, waiting for what is still on its way (close())."""
        for flight in self._inflight:
            flight.closed = True
        while any(f.packet is None for f in self._inflight):
            self._resolve(wait=True)
        self._send(final=True)

    def _send(self, final: bool = False) -> None:
        """Finished steps to the writer, in order: resolved, closed to late losses, their late loss on the host."""
        while self._inflight:
            flight = self._inflight[0]
            if flight.packet is None or not flight.closed or not (final or flight.late_loss_ready()):
                break
            self._inflight.popleft()
            packet = flight.packet
            late = flight.take_late_loss()
            if late is not None:
                packet.loss = late
                packet.nonfinite = packet.nonfinite or not math.isfinite(late)
            self._put(packet)

    # -- the anomaly replay -------------------------------------------------------------------------------------------
    @guarded
    def _on_root_output(self, module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
        capture = self._capture  # (this hook is installed with a capture)
        if capture is not None and not self._collector.paused and not self._facts.external_batches:
            capture.on_output(module, args, output)

    def _device(self) -> torch.device | None:
        """The model's device, read from its first parameter at each root call: walking the modules to find it
        costs microseconds every step. A moved model keeps its Parameter objects (``.to()`` swaps their data)."""
        anchor = self._first_param
        return anchor.device if anchor is not None else None

    def _pause(self, on: bool) -> None:
        self._collector.paused = on
        if self._capture is not None:  # (the replayer pauses: made with a capture)
            self._capture.paused = on

    @contextlib.contextmanager
    def _observing(self, full: bool) -> Iterator[None]:
        """During a replay pass: every site observed in full (``full``) into a record of the replay's own, or
        nothing. The collector's current step is set aside meanwhile and put back, whatever happens."""
        collector = self._collector
        saved = (collector.state, collector.record)
        target = self._replay_target
        assert target is not None  # (set by _replay around the replay's passes)
        record = StepRecord()
        observe = Observe.FULL if full else Observe.NONE
        collector.state = dataclasses.replace(
            target, observe=observe, reason="replay", store_hist=True, first_backward=False, look_at_autocast=False
        )
        collector.record = record
        collector.sync_hooks()
        try:
            yield
            if full:
                target.replay_record = record
        finally:
            collector.state, collector.record = saved
            collector.sync_hooks()

    def _replay(
        self, state: StepState, why: str, calls: list[Call], batch_ids: list[Any], *, moved: str | None
    ) -> Replay | None:
        """Replay the step, record what it found; a replay that fails is recorded as such and training goes on."""
        scale = state.scale_before
        scale = float(scale) if scale is not None else None  # (a device value: read on an anomalous step only)
        full = state.observe is Observe.FULL  # it observed its sites itself
        replayer = self._replayer
        assert replayer is not None  # (replays are asked for only with a replayer)
        self._replay_target = state
        try:
            result = replayer.run(
                state.index,
                why,
                calls,
                batch_ids=batch_ids,
                weights_changed=moved,
                scale=scale,
                observe_sites=not full,
            )
        except Exception as exc:
            state.replay_record = None
            message = f"the replay of step {state.index} failed ({type(exc).__name__}: {exc})"
            self._put(EventMsg(state.index, EventKind.REPLAY, None, None, message, {"failed": str(exc)[:500]}))
            return None
        finally:
            self._replay_target = None
        state.replay = result
        if state.replay_record is not None:
            self._observe_replay_grads(state, state.replay_record, scale)
        self._put(EventMsg(state.index, EventKind.REPLAY, None, None, _replay_line(result), result.to_dict()))
        op = result.operation
        if op is not None:
            site = self._sites.act.get(op["module"]) if op["phase"] == "fwd" else self._sites.grad.get(op["module"])
            data = {**op, "producers": result.producers}
            self._put(EventMsg(state.index, EventKind.OPERATION, site, op["phase"], _op_line(result), data))
        for path in replayer.heal_now():
            message = f"{path} kept in FP32 from step {state.index + 1} on (heal=True): two replays confirmed it"
            self._put(
                EventMsg(state.index, EventKind.HEAL, self._sites.act.get(path), "fwd", message, {"module": path})
            )
        return result

    def _observe_replay_grads(self, state: StepState, record: StepRecord, scale: float | None) -> None:
        """The replayed parameter gradients into the replay's record, unscaled as the step's .grad was."""
        inv = 1.0 / scale if self._scaler_on and scale else 1.0
        assert self._replayer is not None  # (called from _replay)
        for (name, _), g in zip(self._params, self._replayer.grads):
            if g is None:
                continue
            g = g * inv if inv != 1.0 else g
            sid = self._sites.param(name, "param_grad", g, state.index)
            record.entries.append(Entry(sid, Phase.PARAM, [(record.add_full(stats.full(g)), FULL_BLOCK, g.numel())]))

    # -- public API ---------------------------------------------------------------------------------------------------
    @guarded
    def log_loss(self, loss: Any) -> None:
        """The training loss of this step (tensor or float); summed over the step's micro-batches. Not needed with
        a GradScaler (``scaler.scale(loss)`` is read)."""
        self._collector.log_loss(loss, self._last_flight())

    def log_metric(self, name: str, value: Any, step: int | None = None) -> None:
        """Any scalar, e.g. a validation metric; ``step`` defaults to the last completed step. A value that is not
        a number (``"n/a"``, a tensor of several values) or a step that is not one is skipped with one warning per
        metric name; nothing about the value reaches training."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"Argument name should be a non-empty str, but given {name!r}")
        if self.guard.off:
            return
        number = guards.as_number(value)
        at = guards.as_step(step) if step is not None else None
        if number is None or (step is not None and at is None):
            what = f"value {value!r:.60}" if number is None else f"step {step!r:.40}"
            need = "a real number" if number is None else "a non-negative int below 2**63"
            message = f"ampdoctor: log_metric({name!r:.80}) skipped: the {what} is not {need}; collection continues"
            self.guard.warn_once(f"metric:{name}", message, stacklevel=3)
            return
        self._record_metric(guards.text(name), number, at)

    @guarded
    def _record_metric(self, name: str, number: float, step: int | None) -> None:
        if step is None:
            step = max(self._collector.state.index - 1, 0)
        self._put(MetricMsg(step, name, number, time.time()))

    @guarded
    def begin_batch(self, batch: Any = None) -> None:
        """A training micro-batch starts, for loops where the attached module's own ``forward`` is not what runs
        (a LightningModule whose ``training_step`` calls an inner model); frameworks' callbacks call it. From the
        first call on, step timing and batch sizes come from these calls, not from the root forward."""
        self._facts.external_batches = True
        if isinstance(batch, dict):
            t = hooks.first_tensor((), batch)
        else:
            t = hooks.first_tensor(batch if isinstance(batch, (list, tuple)) else (batch,))
        self._collector.start_micro(t)

    @guarded
    def log_batch_ids(self, ids: Iterable[Any]) -> None:
        """The ids of the samples in this step's batch (ints or strings): a finding about an anomalous step names
        them. Kept until the step ends (written only when the step is replayed)."""
        if self._capture is None:
            return
        self._capture.batch_ids = [_plain_id(i) for i in list(ids)[:1024]]

    def step(self) -> None:
        """Explicit step boundary, for loops that give attach() no optimizer (or a disabled scaler and none)."""
        if self.guard.off:
            return
        if self._boundary is not Boundary.MANUAL:
            self.guard.warn_once(
                "step-ignored",
                f"ampdoctor: step() ignored: steps are taken from the {self._boundary.value} already",
                stacklevel=2,
            )
            return
        self._end_step(skipped=False)

    def fail(self, exc: BaseException) -> None:
        """Stop collecting after an error in code that observes on the Doctor's behalf (a framework callback's own
        hook): one warning, every hook removed, training goes on."""
        self.guard.fail(exc)

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until the trace holds every step before the current one (the last finished step is written when the
        next one starts or at close(), so that a loss logged after ``optimizer.step()`` still joins it), committed
        and readable by other processes. False if that did not happen within ``timeout`` seconds."""
        if self._writer is None or self._closed:
            return False
        return self._writer.sync(timeout)

    # -- what the integrations and tools read -------------------------------------------------------------------------
    @property
    def n_steps(self) -> int:
        """Steps recorded so far (the index of the step in progress)."""
        return self._collector.state.index if self._writer is not None else 0

    @property
    def boundary(self) -> Boundary:
        """What ends a step: the scaler's update(), the optimizer's step(), or doctor.step()."""
        return self._boundary

    @property
    def scaler_enabled(self) -> bool:
        """A GradScaler was given and is enabled (it scales the loss; the loss is read in ``scale()``)."""
        return self._scaler_on

    @property
    def mode(self) -> str:
        return self.options.mode.value

    @property
    def findings(self) -> list[Any]:
        """Findings the live diagnosis reported so far (worst first within each check)."""
        return list(self._live.findings) if self._live is not None else []

    @property
    def live(self) -> LiveDiagnosis | None:
        """The thread that runs the rules while training (None with live=False)."""
        return self._live

    @property
    def active(self) -> bool:
        """False once collection stopped (after close() or an internal error)."""
        return not self.guard.off and not self._closed

    # -- failure and shutdown -----------------------------------------------------------------------------------------
    def _put(self, item: Any) -> None:
        if self._writer is not None:
            self._writer.put(item)

    def _stop_after_error(self, exc: BaseException) -> None:
        """Never break training: warn once, stop collecting, leave the user's objects as they were."""
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"ampdoctor: collection stopped after an internal error ({type(exc).__name__}: {exc}); "
                "training continues",
                RuntimeWarning,
                stacklevel=3,
            )
        self._handles.remove()

    def close(self) -> None:
        """Remove every hook, restore every wrapped method, flush and close the trace. Idempotent."""
        if self._closed:
            return
        started = self._writer is not None and (self._facts.step_starts or self._record.entries)
        if started and not self.guard.off and self.n_steps == 0:
            message = guards.no_boundary(self._boundary.value, "the whole run")
            self.guard.warn_once("no-boundary", message, stacklevel=3)
        self._closed = True
        self.guard.off = True
        self._handles.remove()
        if self._replayer is not None:
            self._replayer.unheal()
        stats.release_scratch()
        guards.ATTACHED.release(self)
        if self._live is not None:
            self._live.stop()
        if self._writer is not None:
            try:
                self._drain()
            except Exception:
                pass
            try:
                self._put(MetaMsg("closed", {"steps": self.n_steps, "time": time.time()}))
            except Exception:
                pass
            self._writer.close()
            if self._export is not None:  # after the writer closed: the last steps are in the file
                self._export.close()
            if self._writer.error is not None and not self._warned:
                self._warned = True
                warnings.warn(
                    f"ampdoctor: the trace {self.path} may be incomplete ({self._writer.error})",
                    RuntimeWarning,
                    stacklevel=2,
                )

    def __enter__(self) -> Doctor:
        return self

    def __exit__(self, *exc: object) -> Literal[False]:
        self.close()
        return False

    def __del__(self) -> None:
        try:
            if not self._closed and getattr(self, "_writer", None) is not None:
                self.close()
        except Exception:
            pass


def _replay_line(r: Replay) -> str:
    how = "exactly" if r.exact else "not exactly (" + "; ".join(r.not_exact) + ")"
    found = {True: "reproduced the anomaly", False: "did not reproduce the anomaly", None: "observed every site"}
    return f"step {r.step} ({r.why}) replayed {how}: {found[r.reproduced]}"


def _op_line(r: Replay) -> str:
    op = r.operation
    assert op is not None  # (called for a replay that found the operation)
    made = r.producers[0] if r.producers else None
    where = f" ({op['line']})" if op.get("line") else ""
    text = f"{op['op']} in {op['module']} ({op['phase']}, {op['dtype']}) produced a non-finite value from finite inputs"
    if made is not None:
        text += f"; the values it overflowed were made by {made['op']} in {made['module']}"
        where = f" ({made['line']})" if made.get("line") else where
    return text + where


def _plain_id(i: Any) -> Any:
    if isinstance(i, (bool, int, str)):
        return i if not isinstance(i, str) else guards.text(i[:200])
    if isinstance(i, torch.Tensor) and i.numel() == 1:
        return i.item()
    try:
        return int(i)
    except Exception:
        return guards.text(str(i)[:200])


def _enabled(scaler: Any) -> bool:
    fn = getattr(scaler, "is_enabled", None)
    return bool(fn()) if callable(fn) else True
