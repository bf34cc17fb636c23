"""The Doctor: what ``ampdoctor.attach`` returns, a thin facade over the training side's core (core.py: the parts
of one run, wired), the ``Writer`` thread (trace/writer.py), the live rules (live.py) and the exporters. It checks
attach()'s arguments, starts and stops the threads, owns the handles of every hook and wrapped method (one
``close()`` removes them all), and offers the public calls and read-only properties the integrations use. Every
entry from training runs under ``guards.guarded`` (never break training)."""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections.abc import Callable, Iterable
from typing import Any, Literal

import torch

from ..trace.messages import MetaMsg, MetricMsg
from ..trace.writer import Writer
from . import guards, hooks, meta, sharded, stats
from .core import Core
from .guards import Guard, guarded
from .live import MAX_SHARE, LiveDiagnosis
from .options import Boundary, Options

log = logging.getLogger("ampdoctor")

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
        load_rules: Callable[[], object] | None = None,
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
        self._boundary = _boundary(self._scaler_on, optimizer is not None)
        self.guard = Guard(self._stop_after_error)
        self._closed = self._warned = False
        self._handles = hooks.Handles()
        self._live: LiveDiagnosis | None = None
        self._export: Any = None  # the exporters' thread (ampdoctor.export), with export=
        self._lane: Any = None  # the clean steps' short way (lane.py), where the run allows it
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
            self._build(self._writer, diagnose, load_rules, exporter)
        except BaseException:
            self._abort()
            raise
        if self.path != requested:
            warnings.warn(
                f"ampdoctor: {requested} exists; writing this run's trace to {self.path}", RuntimeWarning, stacklevel=4
            )

    def _build(
        self,
        writer: Writer,
        diagnose: Callable[..., Any] | None,
        load_rules: Callable[[], object] | None,
        exporter: Callable[..., Any] | None,
    ) -> None:
        """The core, the hooks, the writer and live threads; _abort() undoes whatever part of it was done."""
        model, options = self.model, self.options
        if options.wants_live:
            assert diagnose is not None  # (checked in __init__)
            self._live = _live_rules(self.path, diagnose, load_rules, options)
        core = self._core = Core(
            self.guard,
            model,
            self.optimizer,
            self.scaler,
            options,
            writer,
            boundary=self._boundary,
            scaler_enabled=self._scaler_on,
            live=self._live,
        )
        self._collector = core.collector
        self._lane = core.lane
        writer.log_every = options.log_every
        writer.start()
        writer.put(MetaMsg("run", meta.run_meta(model, options, core.cadence)))
        sharding = sharded.describe(model, core.params)  # which parameters are shards, for trace/shards.py
        if sharding is not None:
            writer.put(MetaMsg("sharding", sharding))
        core.install(self._handles, model, self.optimizer, self.scaler)
        if self._live is not None:
            self._live.start()
        if options.export is not None:  # sinks made here: a bad spec or a missing package fails attach
            assert exporter is not None  # (checked in __init__)
            self._export = exporter(options.export, self.path, findings=lambda: self.findings, rules=options.rules)
        if options.log_every is not None:
            _show_summaries()  # last: an attach that raised added no handler

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

    # -- public API ---------------------------------------------------------------------------------------------------
    def log_loss(self, loss: Any) -> None:
        """The training loss of this step (tensor or float); summed over the step's micro-batches. Not needed with
        a GradScaler (``scaler.scale(loss)`` is read)."""
        lane = self._lane
        if lane is not None and lane.held and lane.log_loss(loss):  # (a held step's: guarded and timed there)
            return
        self._log_loss(loss)

    @guarded
    def _log_loss(self, loss: Any) -> None:
        self._collector.log_loss(loss, self._core.last_open())

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
        assert self._writer is not None  # (no writer: the guard is off)
        self._writer.put(MetricMsg(step, name, number, time.time()))

    @guarded
    def begin_batch(self, batch: Any = None) -> None:
        """A training micro-batch starts, for loops where the attached module's own ``forward`` is not what runs
        (a LightningModule whose ``training_step`` calls an inner model); frameworks' callbacks call it. From the
        first call on, step timing and batch sizes come from these calls, not from the root forward."""
        if self._lane is not None:
            self._lane.let_go()  # (the general path keeps the steps of a loop that marks its batches)
        self._core.facts.external_batches = True
        if isinstance(batch, dict):
            t = hooks.first_tensor((), batch)
        else:
            t = hooks.first_tensor(batch if isinstance(batch, (list, tuple)) else (batch,))
        self._collector.start_micro(t)

    @guarded
    def log_batch_ids(self, ids: Iterable[Any]) -> None:
        """The ids of the samples in this step's batch (ints or strings): a finding about an anomalous step names
        them. Kept until the step ends (written only when the step is replayed)."""
        replays = self._core.replays
        if replays is not None:
            replays.log_batch_ids(ids)

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
        self._core.loop.end_step(False)

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
        lane = self._core.lane
        if lane is not None and not self.guard.off:
            lane.flush(keep_open=True)
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
        writer = self._writer
        core = self._core if writer is not None else None  # (no writer: nothing was built)
        started = core is not None and (core.facts.step_starts or core.record.entries)
        if started and not self.guard.off and self.n_steps == 0:
            message = guards.no_boundary(self._boundary.value, "the whole run")
            self.guard.warn_once("no-boundary", message, stacklevel=3)
        self._closed = True
        self.guard.off = True
        self._handles.remove()
        if core is not None and core.replays is not None:
            core.replays.unheal()
        stats.release_scratch()
        guards.ATTACHED.release(self)
        if self._live is not None:
            self._live.stop()
        if writer is not None and core is not None:
            try:
                core.drain()
            except Exception:
                pass
            try:
                writer.put(MetaMsg("closed", {"steps": self.n_steps, "time": time.time()}))
            except Exception:
                pass
            writer.close()
            if self._export is not None:  # after the writer closed: the last steps are in the file
                self._export.close()
            if writer.error is not None and not self._warned:
                self._warned = True
                warnings.warn(
                    f"ampdoctor: the trace {self.path} may be incomplete ({writer.error})", RuntimeWarning, stacklevel=2
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


def _live_rules(
    path: str, diagnose: Callable[..., Any], load: Callable[[], object] | None, options: Options
) -> LiveDiagnosis:
    """The live rules' thread (not started). Under an overhead budget it gets a third of it (its CPU time, on another
    thread, holds the GIL that training's Python waits for); the training thread's share is the Budget's to keep."""
    share = options.budget / LIVE_PART_OF_BUDGET if options.budget is not None else MAX_SHARE
    return LiveDiagnosis(
        path,
        diagnose,
        on_finding=options.on_finding,
        halt_on=options.halt_on,
        rules=options.rules,
        share=share,
        load=load,
    )


def _show_summaries() -> None:
    """log_every= asks for a summary in the log: make sure it is seen where logging is not set up."""
    if not log.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)


def _boundary(scaler_enabled: bool, has_optimizer: bool) -> Boundary:
    """What ends a step: the scaler's update() (it tells whether the optimizer skipped the step), else the
    optimizer's step(), else doctor.step()."""
    if scaler_enabled:
        return Boundary.SCALER
    return Boundary.OPTIMIZER if has_optimizer else Boundary.MANUAL


def _enabled(scaler: Any) -> bool:
    fn = getattr(scaler, "is_enabled", None)
    return bool(fn()) if callable(fn) else True
