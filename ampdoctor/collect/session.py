"""The Doctor: what ``ampdoctor.attach`` returns. Hooks feed device-side statistics into one record per step
(record.py); at the step boundary (boundary.py) the record crosses to the host in one transfer and goes to the
writer thread. This module holds the Doctor's life: arguments, installation, the per-step reset, the public calls,
failure and close. What it does when training calls it is in callbacks.py; every entry is guarded
(guards.guarded: never break training)."""

from __future__ import annotations

import functools
import itertools
import logging
import numbers
import os
import time
import warnings

import torch

from ..trace.writer import StepPacket, Writer
from . import buffers as B
from . import cadence as C
from . import guards as G
from . import hooks as H
from . import meta
from . import probe as P
from . import stats as K
from .boundary import StepBoundary
from .callbacks import Callbacks
from .live import LiveDiagnosis, check_severity
from .record import StepRecord
from .sites import Sites

log = logging.getLogger("ampdoctor")

# Full statistics cost ~2-3x a step on a 2-core CPU (benchmarks/overhead.py), so they are sampled (see cadence.py for
# the tiers: sentinel every step, sampled sites, calibration, the flight recorder after anomalies, debug mode).
DEFAULT_EVERY = C.DEFAULT_EVERY
DEFAULT_PEAK_EVERY = C.DEFAULT_PEAK_EVERY
DEFAULT_HIST_EVERY = 200  # histograms stored every 200th step: 500 sites x 10k steps stay well under 100 MB
DEFAULT_WEIGHT_EVERY = 200  # weights and updates change slowly, and an update needs a copy of the weights


def _check_positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"Argument {name} should be a positive int, but given {value!r}")


class Doctor(Callbacks, StepBoundary):
    """Observes one model during training; use as a context manager or call ``close()``."""

    def __init__(
        self,
        model,
        optimizer=None,
        scaler=None,
        trace: str = "runs/ampdoctor.db",
        *,
        mode: str = "default",
        every: int | None = None,
        peak_every: int | None = None,
        hist_every: int | None = None,
        weight_every: int = DEFAULT_WEIGHT_EVERY,
        calibration: int = C.DEFAULT_CALIBRATION,
        include=None,
        exclude=None,
        live: bool = True,
        on_finding=None,
        halt_on: str | None = None,
        log_every: int | None = None,
        rules: dict | None = None,
        probe_every: int | None = None,
        export=None,  # issue 23: exporters (ampdoctor/export), started in _start, closed after the writer
        on_halt=None,  # issue 23: called with the finding at the step boundary instead of raising TrainingHalted
    ):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"Argument model should be of type torch.nn.Module, but given {type(model)}")
        if optimizer is not None:
            optimizer, wrapped_scaler = G.unwrap_optimizer(optimizer)
            if scaler is None and G.is_scaler(wrapped_scaler):  # accelerate's optimizer carries its GradScaler
                scaler = wrapped_scaler
        if scaler is not None and not G.is_scaler(scaler):
            raise TypeError(f"Argument scaler should be a torch.amp.GradScaler, but given {type(scaler)}")
        if mode not in C.MODES:
            raise ValueError(f"Argument mode should be one of {', '.join(map(repr, C.MODES))}, but given {mode!r}")
        debug = mode == "debug"  # every site, every step, full statistics and histograms
        every = (1 if debug else DEFAULT_EVERY) if every is None else every
        peak_every = (1 if debug else DEFAULT_PEAK_EVERY) if peak_every is None else peak_every
        hist_every = (1 if debug else DEFAULT_HIST_EVERY) if hist_every is None else hist_every
        for name, value in (
            ("every", every),
            ("peak_every", peak_every),
            ("hist_every", hist_every),
            ("weight_every", weight_every),
        ):
            _check_positive(name, value)
        if not isinstance(calibration, int) or isinstance(calibration, bool) or calibration < 0:
            raise ValueError(f"Argument calibration should be a non-negative int, but given {calibration!r}")
        if not isinstance(trace, (str, os.PathLike)):
            raise TypeError(f"Argument trace should be a path (str), but given {type(trace)}")
        if log_every is not None:
            _check_positive("log_every", log_every)
        if probe_every is not None:
            _check_positive("probe_every", probe_every)
        if on_finding is not None and not callable(on_finding):
            raise TypeError(f"Argument on_finding should be callable, but given {type(on_finding)}")
        check_severity("halt_on", halt_on)
        # -- issue 23 (export, on_halt): begin --
        if on_halt is not None and not callable(on_halt):
            raise TypeError(f"Argument on_halt should be callable, but given {type(on_halt)}")
        self._on_halt = on_halt
        self._export = None  # the LiveExport thread (ampdoctor.export.start)
        # -- issue 23: end --
        if rules is not None:
            from ..rules.engine import resolve_rules

            resolve_rules(rules)  # unknown ids or thresholds fail here, not in the live thread later

        self.model, self.optimizer, self.scaler = model, optimizer, scaler
        self.mode = mode
        self.every, self.peak_every, self.hist_every, self.weight_every = every, peak_every, hist_every, weight_every
        self._cadence = C.Cadence(
            mode, every=every, peak_every=peak_every, hist_every=hist_every, calibration=calibration
        )
        self._obs = 0.0  # host seconds spent inside ampdoctor on the training thread this step
        self._hooked = False  # the per-module hooks are installed (only for steps that observe sites)
        self._module_handles: list = []
        self.probe_every = probe_every
        self._include, self._exclude = include, exclude
        requested = self.path = meta.trace_path(trace)
        self._handles = H.Handles()
        self._off = False
        self._warned = False
        self._closed = False
        self._sites = Sites(model, self._put)
        self._params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self._step = 0
        self._rec = StepRecord()
        self._grad_plan: B.GradPlan | None = None
        self._grad_figures = B.GradFigures()
        self._reset_step()
        self._pending: StepPacket | None = None
        self._known_entries: list = []  # the entries of recent steps' distinct layouts, newest first
        self._bad_weights = 0
        self._half_params = any(p.dtype in (torch.float16, torch.bfloat16) for _, p in self._params)
        self._t_prev_end = time.perf_counter()
        self._config_written = False
        self._autocast: dict = {}
        self._loss_dtype = None
        self._snapshot = None
        self._live: LiveDiagnosis | None = None
        self._anchor = next(itertools.chain(model.parameters(), model.buffers()), None)
        self._device = self._device_now()
        self._halted = False
        self._external_batches = False  # begin_batch() marks the micro-batches (frameworks' callbacks)
        self._step_starts = 0  # micro-batch starts seen (root forwards or begin_batch calls)
        self._ac_probe = True  # look at the autocast state in the step's first observed forward
        self._grads_seen = False
        self._missed = 0  # gradients cleared by zero_grad() while no step boundary came
        self._warned_once: set = set()
        self._metric_warned: set = set()
        G.ATTACHED.claim(self, [*model.modules(), *(o for o in (optimizer, scaler) if o is not None)])

        try:
            self._writer = Writer(requested, free_name=True)  # never overwrites: an existing name gets -1, -2..
            self.path = self._writer.path
        except Exception as exc:  # a read-only or full directory: warn, observe nothing, let training run
            self._writer = None
            self._off = True
            G.ATTACHED.release(self)
            warnings.warn(
                f"ampdoctor: cannot write the trace {self.path} ({exc}); collection disabled, training continues",
                RuntimeWarning,
                stacklevel=4,
            )
            return
        try:
            self._start(live, on_finding, halt_on, log_every, rules)
            # -- issue 23 (export): begin; sinks are made here, so a missing package fails attach --
            if export is not None:
                from ..export import start as start_export

                self._export = start_export(export, self.path, findings=lambda: self.findings, rules=rules)
            # -- issue 23: end --
        except BaseException:
            self._abort()
            raise
        if self.path != requested:
            warnings.warn(
                f"ampdoctor: {requested} exists; writing this run's trace to {self.path}", RuntimeWarning, stacklevel=4
            )

    def _start(self, live, on_finding, halt_on, log_every, rules) -> None:
        """Everything attach() starts once the trace file exists; _abort() undoes it when any part raises."""
        self._writer.log_every = log_every
        self._writer.start()
        self._put(("meta", "run", meta.run_meta(self)))
        self._install()
        if live or on_finding is not None or halt_on is not None:
            self._live = LiveDiagnosis(self.path, on_finding=on_finding, halt_on=halt_on, rules=rules)
            self._live.start()
        if log_every is not None and not log.handlers and not logging.getLogger().handlers:
            _handler = logging.StreamHandler()  # the summary is asked for: make sure it is seen
            _handler.setFormatter(logging.Formatter("%(message)s"))
            log.addHandler(_handler)  # last: an attach that raised added no handler
            log.setLevel(logging.INFO)

    def _abort(self) -> None:
        """A failed attach leaves nothing behind: no hook, no wrapped method, no thread, no trace file."""
        self._closed = self._off = True
        self._handles.remove()
        if self._live is not None:
            self._live.stop()
        if self._export is not None:  # issue 23
            self._export.close()
        self._writer.close()
        for suffix in ("", "-wal", "-shm"):  # this Doctor's Writer created the file (it refuses an existing one)
            try:
                os.remove(self.path + suffix)
            except OSError:
                pass
        G.ATTACHED.release(self)

    # -- installation ------------------------------------------------------------------------------------------
    def _install(self) -> None:
        h = self._handles
        self._modules = H.select_modules(self.model, self._include, self._exclude)
        self._grad_hooks = {}
        self._fwd_hooks = []  # made once, registered only for steps that observe sites (_sync_hooks)
        # A compiled model keeps them (its graphs would change with every registration); they return at once on
        # steps that observe no site.
        self._keep_hooks = type(self.model).__name__ == "OptimizedModule"
        for path, mod in self._modules:
            self._grad_hooks[path] = H.eager(functools.partial(self._on_grad, path, mod))
            self._fwd_hooks.append((mod, H.eager(functools.partial(self._on_forward, path))))
        h.add(self.model.register_forward_pre_hook(H.eager(self._on_root_pre), with_kwargs=True))
        self._probe = P.StepProbe(self, self.probe_every) if self.probe_every else None
        if self._probe is not None:
            h.on_remove(self._probe.disarm)
        h.on_remove(self._unhook)
        self._sync_hooks()

        scaler_on = self.scaler is not None and self._scaler_enabled()
        if self.optimizer is not None:
            h.add(self.optimizer.register_step_pre_hook(self._on_opt_pre))
            h.add(self.optimizer.register_step_post_hook(self._on_opt_post))
        if self.scaler is not None:
            H.wrap_method(h, self.scaler, "scale", self._wrap_scale)
            H.wrap_method(h, self.scaler, "update", self._wrap_update)
        if scaler_on:
            self._boundary = "scaler"
        elif self.optimizer is not None:
            self._boundary = "optimizer"
        else:
            self._boundary = "manual"

    def _scaler_enabled(self) -> bool:
        fn = getattr(self.scaler, "is_enabled", None)
        return bool(fn()) if callable(fn) else True

    # -- per-step state ----------------------------------------------------------------------------------------
    def _reset_step(self) -> None:
        self._rec.clear()
        self._micro = 0
        self._samples = 0
        self._t_first = None
        self._losses: list = []
        self._scale_before = None
        self._opt_stepped = False
        self._grads_seen = False
        self._ac_probe = True
        self._bwd_probe = False
        self._cur_mode, self._reason, self._store_hist = self._cadence.plan(self._step)
        self._obs = 0.0
        self._sync_hooks()

    def _sync_hooks(self) -> None:
        """Per-module hooks exist only while a step observes sites: a sentinel step runs no Python per module call
        (registering ~25 hooks costs ~30 us, paid when the cadence switches, not every step)."""
        want = (self._cur_mode != C.NONE or self._keep_hooks) and not self._off
        if want == self._hooked or not hasattr(self, "_fwd_hooks"):
            return
        if want:
            self._module_handles = [mod.register_forward_hook(fn) for mod, fn in self._fwd_hooks]
        else:
            self._unhook()
        self._hooked = want

    def _unhook(self) -> None:
        for handle in self._module_handles:
            handle.remove()
        self._module_handles = []
        self._hooked = False

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned_once:
            self._warned_once.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=4)

    # -- public API ----------------------------------------------------------------------------------------------
    @G.guarded
    def log_loss(self, loss) -> None:
        """The training loss of this step (tensor or float); summed over the step's micro-batches."""
        self._log_loss(loss)

    def log_metric(self, name: str, value, step: int | None = None) -> None:
        """Any scalar, e.g. a validation metric; ``step`` defaults to the last completed step. A value that is not
        a number (``"n/a"``, a tensor of several values) is skipped with one warning per metric name."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"Argument name should be a non-empty str, but given {name!r}")
        if self._off:
            return
        number = G.as_number(value)
        if number is None or (
            step is not None and (not isinstance(step, numbers.Integral) or isinstance(step, bool) or step < 0)
        ):
            if name not in self._metric_warned:
                self._metric_warned.add(name)
                what = f"value {value!r:.60}" if number is None else f"step {step!r}"
                warnings.warn(
                    f"ampdoctor: log_metric({name!r}) skipped: the {what} is not "
                    f"{'a real number' if number is None else 'a non-negative int'}; collection continues",
                    RuntimeWarning,
                    stacklevel=2,
                )
            return
        self._record_metric(name, number, step)

    @G.guarded
    def _record_metric(self, name: str, number: float, step: int | None) -> None:
        if step is None:
            step = max(self._step - 1, 0)
        self._put(("metric", int(step), name, number, time.time()))

    @G.guarded
    def begin_batch(self, batch=None) -> None:
        """A training micro-batch starts, for loops where the attached module's own ``forward`` is not what runs
        (a LightningModule whose ``training_step`` calls an inner model); frameworks' callbacks call it. From the
        first call on, step timing and batch sizes come from these calls, not from the root forward."""
        self._external_batches = True
        if isinstance(batch, dict):
            t = H.first_tensor((), batch)
        else:
            t = H.first_tensor(batch if isinstance(batch, (list, tuple)) else (batch,))
        self._start_micro(t)

    def step(self) -> None:
        """Explicit step boundary, for loops that give attach() no optimizer (or a disabled scaler and none)."""
        if self._off:
            return
        if self._boundary != "manual":
            if not self._warned_step:
                self._warned_step = True
                warnings.warn(
                    f"ampdoctor: step() ignored: steps are taken from the {self._boundary} already",
                    RuntimeWarning,
                    stacklevel=2,
                )
            return
        self._end_step(skipped=False)

    _warned_step = False

    @property
    def steps(self) -> int:
        """Steps recorded so far."""
        return self._step

    @property
    def findings(self) -> list:
        """Findings the live diagnosis reported so far (worst first within each check)."""
        return list(self._live.findings) if getattr(self, "_live", None) is not None else []

    @property
    def active(self) -> bool:
        """False once collection stopped (after close() or an internal error)."""
        return not self._off and not self._closed

    # -- failure and shutdown ----------------------------------------------------------------------------------------
    def _put(self, item) -> None:
        if self._writer is not None:
            self._writer.put(item)

    def _fail(self, exc: BaseException) -> None:
        """Never break training: warn once, stop collecting, leave the user's objects as they were."""
        self._off = True
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"ampdoctor: collection stopped after an internal error ({type(exc).__name__}: {exc}); "
                "training continues",
                RuntimeWarning,
                stacklevel=3,
            )
        self._handles.remove()

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until the trace holds every step before the current one (the last finished step is written when the
        next one starts or at close(), so that a loss logged after ``optimizer.step()`` still joins it), committed
        and readable by other processes. False if that did not happen within ``timeout`` seconds."""
        if self._writer is None or self._closed:
            return False
        return self._writer.sync(timeout)

    def close(self) -> None:
        """Remove every hook, restore every wrapped method, flush and close the trace. Idempotent."""
        if self._closed:
            return
        if self._writer is not None and not self._off and self._step == 0 and (self._step_starts or self._rec.entries):
            self._warn_once("no-boundary", G.no_boundary(self._boundary, "the whole run"))
        self._closed = True
        self._off = True
        self._handles.remove()
        K.release_scratch()
        G.ATTACHED.release(self)
        if getattr(self, "_live", None) is not None:
            self._live.stop()
        if self._writer is not None:
            try:
                self._flush_pending()
            except Exception:
                pass
            try:
                self._put(("meta", "closed", {"steps": self._step, "time": time.time()}))
            except Exception:
                pass
            self._writer.close()
            # -- issue 23 (export): begin; after the writer closed, so the last steps are in the file --
            if self._export is not None:
                self._export.close()
            # -- issue 23: end --
            if self._writer.error is not None and not self._warned:
                self._warned = True
                warnings.warn(
                    f"ampdoctor: the trace {self.path} may be incomplete ({self._writer.error})",
                    RuntimeWarning,
                    stacklevel=2,
                )

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __del__(self):
        try:
            if not self._closed and getattr(self, "_writer", None) is not None:
                self.close()
        except Exception:
            pass


def attach(model, optimizer=None, scaler=None, trace: str = "runs/ampdoctor.db", **options) -> Doctor:
    """Start observing ``model``; returns a Doctor (a context manager). See Doctor for the options."""
    return Doctor(model, optimizer=optimizer, scaler=scaler, trace=trace, **options)
