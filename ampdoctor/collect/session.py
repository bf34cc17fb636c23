"""The Doctor: what ``ampdoctor.attach`` returns. Hooks feed device-side statistics into one buffer per step;
at the step boundary the buffer crosses to the host in one transfer and goes to the writer thread."""
from __future__ import annotations

import functools
import logging
import math
import numbers
import os
import platform
import threading
import time
import warnings
import weakref

import numpy as np
import torch

from ..live import LiveDiagnosis, TrainingHalted, check_severity
from ..trace import schema
from ..trace.vectors import Entry
from ..trace.writer import StepPacket, Writer
from . import buffers as B
from . import cadence as C
from . import guards as G
from . import hooks as H
from . import probe as P
from . import stats as K

log = logging.getLogger("ampdoctor")
_now = time.perf_counter

# Full statistics cost ~2-3x a step on a 2-core CPU (benchmarks/overhead.py), so they are sampled (see cadence.py for
# the tiers: sentinel every step, sampled sites, calibration, the flight recorder after anomalies, debug mode).
DEFAULT_EVERY = C.DEFAULT_EVERY
DEFAULT_PEAK_EVERY = C.DEFAULT_PEAK_EVERY
DEFAULT_HIST_EVERY = 200    # histograms stored every 200th step: 500 sites x 10k steps stay well under 100 MB
DEFAULT_WEIGHT_EVERY = 200  # weights and updates change slowly, and an update needs a copy of the weights
WARN_AFTER_STEPS = 3        # steps (or cleared gradients) before a run that is not observed as it should be warns
# Observations held for one step: a step of 1,000 observed modules with 32 accumulated micro-batches holds ~64k
# (forward + backward). Beyond this the step boundary is taken to be missing (an optimizer of another model) and
# the step's observations so far are dropped, so that memory stays bounded.
MAX_STEP_ENTRIES = 200_000
MAX_STEP_LOSSES = 64        # micro-batch losses kept apart per step; beyond, they are summed into one


def _dist() -> dict:
    """rank, world size and local rank: torch.distributed's once initialised, else what torchrun put in the
    environment (a doctor attached before ``init_process_group`` still gets its own rank)."""
    env = os.environ
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        out = {"rank": torch.distributed.get_rank(), "world_size": torch.distributed.get_world_size(),
               "backend": str(torch.distributed.get_backend())}
    else:
        try:
            out = {"rank": int(env.get("RANK", 0)), "world_size": int(env.get("WORLD_SIZE", 1))}
        except ValueError:
            out = {"rank": 0, "world_size": 1}
    if out["world_size"] > 1:
        out["local_rank"] = int(env["LOCAL_RANK"]) if env.get("LOCAL_RANK", "").isdigit() else None
        out["run_id"] = env.get("TORCHELASTIC_RUN_ID")        # torchrun's id, shared by the ranks of one job
    return out


def _trace_path(trace) -> str:
    """The path this rank asks for: ``{rank}`` replaced; with several ranks and no ``{rank}``, ``.rank<N>`` added
    before the extension, so that ranks never share a file (``runs/exp.db`` -> ``runs/exp.rank1.db``)."""
    path = os.fspath(trace)
    d = _dist()
    if "{rank}" in path:
        return path.replace("{rank}", str(d["rank"]))
    if d["world_size"] <= 1:
        return path
    stem, ext = os.path.splitext(path)
    if d["rank"] == 0:
        warnings.warn(f"ampdoctor: {d['world_size']} ranks and no {{rank}} in trace={path!r}: each rank writes "
                      f"its own file, {stem}.rank<N>{ext}", RuntimeWarning, stacklevel=5)
    return f"{stem}.rank{d['rank']}{ext}"


def _check_positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"Argument {name} should be a positive int, but given {value!r}")


class Doctor:
    """Observes one model during training; use as a context manager or call ``close()``."""

    def __init__(self, model, optimizer=None, scaler=None, trace: str = "runs/ampdoctor.db", *,
                 mode: str = "default", every: int | None = None, peak_every: int | None = None,
                 hist_every: int | None = None, weight_every: int = DEFAULT_WEIGHT_EVERY,
                 calibration: int = C.DEFAULT_CALIBRATION, include=None, exclude=None,
                 live: bool = True, on_finding=None, halt_on: str | None = None, log_every: int | None = None,
                 rules: dict | None = None, probe_every: int | None = None):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"Argument model should be of type torch.nn.Module, but given {type(model)}")
        if optimizer is not None:
            optimizer, wrapped_scaler = G.unwrap_optimizer(optimizer)
            if scaler is None and G.is_scaler(wrapped_scaler):    # accelerate's optimizer carries its GradScaler
                scaler = wrapped_scaler
        if scaler is not None and not G.is_scaler(scaler):
            raise TypeError(f"Argument scaler should be a torch.amp.GradScaler, but given {type(scaler)}")
        if mode not in C.MODES:
            raise ValueError(f"Argument mode should be one of {', '.join(map(repr, C.MODES))}, but given {mode!r}")
        debug = mode == "debug"            # every site, every step, full statistics and histograms
        every = (1 if debug else DEFAULT_EVERY) if every is None else every
        peak_every = (1 if debug else DEFAULT_PEAK_EVERY) if peak_every is None else peak_every
        hist_every = (1 if debug else DEFAULT_HIST_EVERY) if hist_every is None else hist_every
        for name, value in (("every", every), ("peak_every", peak_every), ("hist_every", hist_every),
                            ("weight_every", weight_every)):
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
        if rules is not None:
            from ..diagnose.engine import resolve_rules
            resolve_rules(rules)               # unknown ids or thresholds fail here, not in the live thread later

        self.model, self.optimizer, self.scaler = model, optimizer, scaler
        self.mode = mode
        self.every, self.peak_every, self.hist_every, self.weight_every = every, peak_every, hist_every, weight_every
        self._cadence = C.Cadence(mode, every=every, peak_every=peak_every, hist_every=hist_every,
                                  calibration=calibration)
        self._obs = 0.0                  # host seconds spent inside ampdoctor on the training thread this step
        self._hooked = False             # the per-module hooks are installed (only for steps that observe sites)
        self._module_handles: list = []
        self.probe_every = probe_every
        self._include, self._exclude = include, exclude
        requested = self.path = _trace_path(trace)
        self._handles = H.Handles()
        self._off = False
        self._warned = False
        self._closed = False
        self._sites: dict[tuple[str, str], int] = {}
        self._act_ids: dict[str, int] = {}       # the hooks' lookups by path alone: no tuple built per call
        self._grad_ids: dict[str, int] = {}
        self._lock = threading.Lock()
        self._params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self._owner = {(f"{m}." if m else "") + n: mod for m, mod in model.named_modules()
                       for n, _ in mod.named_parameters(recurse=False)}
        self._step = 0
        self._bufs: dict = {}
        self._grad_plan: B.GradPlan | None = None
        self._grad_figures = B.GradFigures()
        self._reset_step()
        self._pending: StepPacket | None = None
        self._prev_entries: list = []
        self._bad_weights = 0
        self._half_params = any(p.dtype in (torch.float16, torch.bfloat16) for _, p in self._params)
        self._t_prev_end = time.perf_counter()
        self._config_written = False
        self._autocast: dict = {}
        self._loss_dtype = None
        self._snapshot = None
        self._live: LiveDiagnosis | None = None
        self._device = _device_type(model)
        self._halted = False
        self._external_batches = False   # begin_batch() marks the micro-batches (frameworks' callbacks)
        self._step_starts = 0            # micro-batch starts seen (root forwards or begin_batch calls)
        self._ac_probe = True            # look at the autocast state in the step's first observed forward
        self._grads_seen = False
        self._missed = 0                 # gradients cleared by zero_grad() while no step boundary came
        self._warned_once: set = set()
        self._metric_warned: set = set()
        G.ATTACHED.claim(self, [*model.modules(), *(o for o in (optimizer, scaler) if o is not None)])

        try:
            self._writer = Writer(requested, free_name=True)    # never overwrites: an existing name gets -1, -2..
            self.path = self._writer.path
        except Exception as exc:  # a read-only or full directory: warn, observe nothing, let training run
            self._writer = None
            self._off = True
            G.ATTACHED.release(self)
            warnings.warn(f"ampdoctor: cannot write the trace {self.path} ({exc}); collection disabled, "
                          "training continues", RuntimeWarning, stacklevel=4)
            return
        try:
            self._start(live, on_finding, halt_on, log_every, rules)
        except BaseException:
            self._abort()
            raise
        if self.path != requested:
            warnings.warn(f"ampdoctor: {requested} exists; writing this run's trace to {self.path}",
                          RuntimeWarning, stacklevel=4)

    def _start(self, live, on_finding, halt_on, log_every, rules) -> None:
        """Everything attach() starts once the trace file exists; _abort() undoes it when any part raises."""
        self._writer.log_every = log_every
        self._writer.start()
        self._put(("meta", "run", self._run_meta()))
        self._install()
        if live or on_finding is not None or halt_on is not None:
            self._live = LiveDiagnosis(self.path, on_finding=on_finding, halt_on=halt_on, rules=rules)
            self._live.start()
        if log_every is not None and not log.handlers and not logging.getLogger().handlers:
            _handler = logging.StreamHandler()          # the summary is asked for: make sure it is seen
            _handler.setFormatter(logging.Formatter("%(message)s"))
            log.addHandler(_handler)                    # last: an attach that raised added no handler
            log.setLevel(logging.INFO)

    def _abort(self) -> None:
        """A failed attach leaves nothing behind: no hook, no wrapped method, no thread, no trace file."""
        self._closed = self._off = True
        self._handles.remove()
        if self._live is not None:
            self._live.stop()
        self._writer.close()
        for suffix in ("", "-wal", "-shm"):      # this Doctor's Writer created the file (it refuses an existing one)
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
        self._fwd_hooks = []             # made once, registered only for steps that observe sites (_sync_hooks)
        # A compiled model keeps them (its graphs would change with every registration); they return at once on
        # steps that observe no site.
        self._keep_hooks = type(self.model).__name__ == "OptimizedModule"
        for path, mod in self._modules:
            self._grad_hooks[path] = _eager(functools.partial(self._on_grad, path, mod))
            self._fwd_hooks.append((mod, _eager(functools.partial(self._on_forward, path))))
        h.add(self.model.register_forward_pre_hook(_eager(self._on_root_pre), with_kwargs=True))
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

    # -- per-step buffer ---------------------------------------------------------------------------------------
    def _reset_step(self) -> None:
        # Blocks concatenated at the step end into the step's one host transfer (see _to_host):
        #   peaks: [min, max] pairs per (dtype, device) (buffers.PeakList; the parameter gradients' in a GradPlan);
        #   fulls: FULL_LEN float64 vectors; extras: float64 step figures.
        for buf in self._bufs.values():
            buf.clear()
        self._fulls: list[torch.Tensor] = []
        self._full_len = 0
        self._extras: list = []          # floats, or 0-d tensors on an accelerator (read with the step's transfer)
        self._entries: list[Entry] = []
        self._seen: dict[int, tuple] = {}
        self._act_seen: set[int] = set()
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

    def _drop_observations(self) -> None:
        """The step has grown past MAX_STEP_ENTRIES: its boundary is missing. Drop what it observed so far (its
        timing, micro-batches and losses stay), warn once, keep collecting."""
        for buf in self._bufs.values():
            buf.clear()
        self._fulls, self._full_len, self._entries = [], 0, []
        self._seen, self._act_seen = {}, set()
        self._warn_once("bounded", G.no_boundary(self._boundary, f"{MAX_STEP_ENTRIES:,} observations") +
                        "; the observations of the unfinished step are dropped to bound memory")

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned_once:
            self._warned_once.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=4)

    def _add_full(self, vec: torch.Tensor) -> int:
        off = self._full_len
        self._fulls.append(vec)
        self._full_len += K.FULL_LEN
        return off

    def _add_extra(self, v) -> int:
        """A step figure: a float, or a 0-d tensor (read now if it is on the CPU, where that costs no sync)."""
        if isinstance(v, torch.Tensor) and K.on_host(v):
            v = v.item()
        self._extras.append(v)
        return len(self._extras) - 1

    def _buffer(self, t: torch.Tensor) -> B.PeakList:
        buf = self._bufs.get(t.dtype)
        if buf is None or buf.device != t.device:
            key = t.dtype if buf is None else (t.dtype, t.device)      # a second device: its own buffer
            buf = self._bufs.get(key)
            if buf is None:
                buf = self._bufs[key] = B.PeakList(t, "p" + B.dtype_name(t.dtype) +
                                                    ("" if key is t.dtype else f"@{t.device}"))
        return buf

    def _observe(self, t: torch.Tensor, want: str) -> tuple[int, str, int]:
        """Statistics of one tensor for this step ("p": peak, "f": full), computed once per tensor (a module's
        output is often the next module's input, and a container's output is its last child's)."""
        key = id(t)
        hit = self._seen.get(key)
        if hit is not None and hit[0]() is t and hit[1] == t._version and (hit[2][1] == "f" or want == "p"):
            return hit[2]
        n = t.numel()
        if want == "f":
            ref = (self._add_full(K.full(t)), "f", n)
        else:                      # PeakList.add inlined: two calls fewer per observed tensor
            d = t.detach()
            buf = self._bufs.get(d.dtype)
            if buf is None or buf.device != d.device:
                buf = self._buffer(d)
            off = buf.n
            buf.vals.extend(torch.aminmax(d if n else d.new_zeros(1)))
            buf.n = off + 2
            ref = (off, buf.mode, n)
        self._seen[key] = (weakref.ref(t), t._version, ref)
        return ref

    def _site(self, path: str, kind: str, module, t: torch.Tensor | None) -> int:
        sid = self._sites.get((path, kind))
        if sid is None:
            with self._lock:           # backward hooks of several devices run on autograd's per-device threads
                return self._new_site(path, kind, module, t)
        return sid

    def _new_site(self, path: str, kind: str, module, t: torch.Tensor | None) -> int:
        sid = self._sites.get((path, kind))
        if sid is None:
            sid = len(self._sites)
            self._sites[(path, kind)] = sid
            if kind in ("act", "grad_out"):
                mod_path, mtype = path, type(module).__name__
            else:
                mod_path, mtype = path.rpartition(".")[0] or H.ROOT, type(module).__name__ if module else None
            dtype = B.dtype_name(t.dtype) if t is not None else None
            shape = "x".join(map(str, t.shape)) if t is not None else None
            self._put(("site", sid, path, mod_path, kind, mtype, dtype, shape, self._step))
        return sid

    # -- hooks -------------------------------------------------------------------------------------------------
    def _on_root_pre(self, module, args, kwargs):
        if self._off or self._external_batches or not torch.is_grad_enabled() or H.graph_task_id() != -1:
            return None
        t0 = _now()
        try:
            first = self._t_first is None
            self._start_micro(H.first_tensor(args, kwargs))
            if first and self._probe is not None:
                self._probe.begin(self._step, args, kwargs)       # the step's first forward: its RNG state, inputs
        except Exception as exc:
            self._fail(exc)
        self._obs += _now() - t0
        return None

    def _start_micro(self, t: torch.Tensor | None) -> None:
        """A micro-batch's forward begins: the step's first one ends the data wait; ``t`` gives the batch size."""
        if self._t_first is None:
            self._t_first = time.perf_counter()
            self._flush_pending()
            self._device = _device_type(self.model)      # once a step: a model may be moved
            self._probe_autocast()
        self._step_starts += 1
        self._micro += 1
        if t is not None and t.dim() > 0:
            self._samples += int(t.shape[0])
        self._bwd_probe = True

    def _probe_autocast(self) -> None:
        """Record the autocast state at the step's first forward. Frameworks enter autocast inside ``forward``
        (accelerate wraps it), after the root pre-hook: the first observed forward inside looks again."""
        dev = self._device
        if dev is None or (self._autocast.get("enabled") and self._autocast.get("device_type") == dev):
            return
        enabled = torch.is_autocast_enabled(dev)
        if enabled or not self._autocast:
            self._autocast = {"device_type": dev, "enabled": enabled,
                              "dtype": B.dtype_name(torch.get_autocast_dtype(dev)) if enabled else None}

    def _check_missed_step(self) -> None:
        """At a micro-batch's first backward hook: gradients of an earlier backward of this step that are gone
        (``zero_grad()``) mean a step passed with no step boundary. Warn once after a few; the step's observations
        are bounded by MAX_STEP_ENTRIES meanwhile."""
        if not self._grads_seen or any(p.grad is not None for _, p in self._params):
            return          # (only asked after an earlier backward of this step: accumulated micro-batches)
        self._missed += 1
        if self._missed == WARN_AFTER_STEPS:
            self._warn_once("no-boundary", G.no_boundary(self._boundary, f"{self._missed} optimizer steps"))

    def _on_forward(self, path, module, args, output):
        if self._off or self._cur_mode == C.NONE or not torch.is_grad_enabled():
            return
        t0 = _now()
        try:
            if type(output) is torch.Tensor:          # the common case: one tensor out, one in
                if not output.is_floating_point():
                    return
                tensors = (output,)
            else:
                tensors = H.float_tensors(output)
                if not tensors:
                    return
            if self._ac_probe:
                self._ac_probe = False
                self._bwd_probe = True         # (also where no root forward marks the micro-batches)
                if self._device is None:
                    self._device = _device_type(self.model)
                self._probe_autocast()
            if len(self._entries) >= MAX_STEP_ENTRIES:
                self._drop_observations()
            sid = self._act_ids.get(path)
            if sid is None:
                sid = self._act_ids[path] = self._site(path, "act", module, tensors[0])
            if sid in self._act_seen and H.graph_task_id() != -1:
                return                 # checkpoint recomputation: the original forward was already recorded
            self._act_seen.add(sid)
            mode = self._cur_mode
            outs = [self._observe(tensors[0], mode)] if len(tensors) == 1 else [self._observe(t, mode) for t in tensors]
            a0 = args[0] if len(args) == 1 else None
            ins = [self._observe(a0, "p")] if type(a0) is torch.Tensor and a0.is_floating_point() \
                else [self._observe(t, "p") for t in H.float_tensors(args)]
            self._entries.append(Entry(sid, "fwd", outs, ins))
            for t in tensors:
                if t.requires_grad:
                    t.register_hook(self._grad_hooks[path])
        except Exception as exc:
            self._fail(exc)
        finally:
            self._obs += _now() - t0

    def _on_grad(self, path, module, grad):
        if self._off or grad is None:
            return
        t0 = _now()
        try:
            if self._bwd_probe:
                self._bwd_probe = False
                self._check_missed_step()
            self._grads_seen = True
            if len(self._entries) >= MAX_STEP_ENTRIES:
                self._drop_observations()
            sid = self._grad_ids.get(path)
            if sid is None:
                sid = self._grad_ids[path] = self._site(path, "grad_out", module, grad)
            self._entries.append(Entry(sid, "bwd", [self._observe(grad, self._cur_mode)]))
        except Exception as exc:
            self._fail(exc)
        self._obs += _now() - t0      # (on an accelerator autograd's thread: the training thread waits for it)

    def _on_opt_pre(self, optimizer, args, kwargs):
        if self._off:
            return
        t0 = _now()
        try:
            if self._step % self.weight_every == 0:
                self._snapshot = [p.detach().clone() for _, p in self._params]
        except Exception as exc:
            self._fail(exc)
        self._obs += _now() - t0

    def _on_opt_post(self, optimizer, args, kwargs):
        if self._off:
            return
        self._opt_stepped = True
        t0 = _now()
        try:
            if self._snapshot is not None:
                for (name, p), old in zip(self._params, self._snapshot):
                    sid = self._site(name, "update", self._owner.get(name), p)
                    self._entries.append(Entry(sid, "update", [(self._add_full(K.full(p.detach() - old)), "f",
                                                                p.numel())]))
                self._snapshot = None
        except Exception as exc:
            self._fail(exc)
        self._obs += _now() - t0
        if self._boundary == "optimizer":
            self._end_step(skipped=False)

    def _wrap_scale(self, original):
        @functools.wraps(original)
        def scale(outputs):
            result = original(outputs)
            if not self._off:
                t0 = _now()
                try:
                    t = outputs if isinstance(outputs, torch.Tensor) else H.first_tensor(outputs)
                    if t is not None:
                        self._log_loss(t)
                    if self._scale_before is None:
                        self._scale_before = self._read_scale()
                except Exception as exc:
                    self._fail(exc)
                self._obs += _now() - t0
            return result
        return scale

    def _wrap_update(self, original):
        @functools.wraps(original)
        def update(*args, **kwargs):
            if not self._off and self._scale_before is None:
                t0 = _now()
                try:
                    self._scale_before = self._read_scale()
                except Exception as exc:
                    self._fail(exc)
                self._obs += _now() - t0
            result = original(*args, **kwargs)
            if not self._off and self._boundary == "scaler":
                skipped = (not self._opt_stepped) if self.optimizer is not None else None
                self._end_step(skipped=skipped)
            return result
        return update

    def _read_scale(self):
        """The scale in force, as a device tensor when the scaler keeps one (no host sync)."""
        s = getattr(self.scaler, "_scale", None)
        if isinstance(s, torch.Tensor):
            if K.on_host(s):
                return s.item()
            return s.detach().clone().reshape(())     # update() changes it in place
        return float(self.scaler.get_scale())

    # -- public API ----------------------------------------------------------------------------------------------
    def log_loss(self, loss) -> None:
        """The training loss of this step (tensor or float); summed over the step's micro-batches."""
        if self._off:
            return
        t0 = _now()
        try:
            self._log_loss(loss)
        except Exception as exc:
            self._fail(exc)
        self._obs += _now() - t0

    def _log_loss(self, loss) -> None:
        if isinstance(loss, torch.Tensor):
            if self._loss_dtype is None:
                self._loss_dtype = B.dtype_name(loss.dtype)
            if not loss.numel():
                return
            # a CPU value is read now (no sync to wait for); an accelerator's joins the step's one transfer
            loss = loss.item() if loss.numel() == 1 and K.on_host(loss) else loss.detach().reshape(-1)[0]
        if loss is None:
            return
        if len(self._losses) >= MAX_STEP_LOSSES:      # a step without an end: keep one running sum
            self._losses = [B.sum_losses(self._losses)]
        if self._t_first is None and self._pending is not None and self._pending.loss is None:
            self._pending.late_loss = loss        # logged after the optimizer step ended the step
        else:
            self._losses.append(loss)

    def _flush_pending(self) -> None:
        p = self._pending
        if p is None:
            return
        self._pending = None
        if p.late_loss is not None:
            v = p.late_loss
            p.loss = float(v.item() if isinstance(v, torch.Tensor) else v)
            p.late_loss = None
        self._put(("step", p))

    def log_metric(self, name: str, value, step: int | None = None) -> None:
        """Any scalar, e.g. a validation metric; ``step`` defaults to the last completed step. A value that is not
        a number (``"n/a"``, a tensor of several values) is skipped with one warning per metric name."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"Argument name should be a non-empty str, but given {name!r}")
        if self._off:
            return
        number = G.as_number(value)
        if number is None or (step is not None and (not isinstance(step, numbers.Integral) or isinstance(step, bool)
                                                    or step < 0)):
            if name not in self._metric_warned:
                self._metric_warned.add(name)
                what = f"value {value!r:.60}" if number is None else f"step {step!r}"
                warnings.warn(f"ampdoctor: log_metric({name!r}) skipped: the {what} is not "
                              f"{'a real number' if number is None else 'a non-negative int'}; collection continues",
                              RuntimeWarning, stacklevel=2)
            return
        try:
            if step is None:
                step = max(self._step - 1, 0)
            self._put(("metric", int(step), name, number, time.time()))
        except Exception as exc:
            self._fail(exc)

    def begin_batch(self, batch=None) -> None:
        """A training micro-batch starts, for loops where the attached module's own ``forward`` is not what runs
        (a LightningModule whose ``training_step`` calls an inner model); frameworks' callbacks call it. From the
        first call on, step timing and batch sizes come from these calls, not from the root forward."""
        if self._off:
            return
        self._external_batches = True
        try:
            if isinstance(batch, dict):
                t = H.first_tensor((), batch)
            else:
                t = H.first_tensor(batch if isinstance(batch, (list, tuple)) else (batch,))
            self._start_micro(t)
        except Exception as exc:
            self._fail(exc)

    def step(self) -> None:
        """Explicit step boundary, for loops that give attach() no optimizer (or a disabled scaler and none)."""
        if self._off:
            return
        if self._boundary != "manual":
            if not self._warned_step:
                self._warned_step = True
                warnings.warn("ampdoctor: step() ignored: steps are taken from the "
                              f"{self._boundary} already", RuntimeWarning, stacklevel=2)
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

    # -- step boundary -------------------------------------------------------------------------------------------
    def _end_step(self, skipped) -> None:
        if self._off:
            return
        try:
            self._record_step(skipped)
        except Exception as exc:
            self._fail(exc)
        live = self._live
        if live is not None and live.halt is not None and not self._halted:
            self._halted = True        # raised once: a loop that catches it may go on
            raise TrainingHalted(live.halt)

    def _record_step(self, skipped) -> None:
        if self._writer.error is not None:
            raise RuntimeError(f"trace writer failed: {self._writer.error}")
        t0 = _now()
        step, mode, store_hist = self._step, self._cur_mode, self._store_hist
        entries = self._entries

        if mode != C.NONE:
            self._observe_param_grads(mode, entries)
        # The sentinel: global norm and largest unscaled gradient, fused over all gradients, every step.
        norm, gmax = self._grad_figures(self._params)
        norm_off = self._add_extra(norm) if norm is not None else None
        max_off = self._add_extra(gmax) if gmax is not None else None
        if step % self.weight_every == 0:
            for name, p in self._params:
                sid = self._site(name, "weight", self._owner.get(name), p)
                entries.append(Entry(sid, "weight", [self._observe(p.detach(), "f")]))
        loss_off = self._add_extra(B.sum_losses(self._losses)) if self._losses else None
        # Half-precision weights can turn NaN/Inf in an optimizer step from finite gradients (Adam's eps is 0 in
        # FP16): watched every step for them (one fused norm), on anomalous steps only for FP32 weights.
        bad_w_off = self._add_extra(B.count_nonfinite([p for _, p in self._params])) if self._half_params else None
        scaler_on = self.scaler is not None and self._scaler_enabled()
        scales = [self._scale_before, self._read_scale()] if scaler_on else [None, None]
        scale_offs = [self._add_extra(v) if isinstance(v, torch.Tensor) else v for v in scales]

        values, bases, bad = self._to_host()            # the step's one host transfer
        if self._probe is not None:
            self._probe.end(step)
        extra_base = bases["x"]
        if entries == self._prev_entries:               # same control flow as the last step: one shared Layout
            entries = self._prev_entries
        self._prev_entries = entries

        def pick(off):
            return None if off is None else float(values[extra_base + off])

        scale_vals = [pick(o) if isinstance(v, torch.Tensor) else v for o, v in zip(scale_offs, scales)]
        # No forward of the attached module and no begin_batch() this step: when the data arrived is unknown, so
        # the data wait is left empty (a wait of the whole step would make the time rules blame the input pipeline).
        started = self._t_first is not None
        if not started and self._step + 1 >= WARN_AFTER_STEPS and not self._step_starts:
            self._warn_once("no-forward", G.no_forward(type(self.model).__name__, self._step + 1))
        row = {
            "time": time.time(),
            "data_time": max(self._t_first - self._t_prev_end, 0.0) if started else None,
            "samples": (self._samples or None) if started else None,
            "lr": [float(g["lr"]) for g in self.optimizer.param_groups] if self.optimizer is not None else None,
            "microbatches": self._micro,
            "peak_mem": int(torch.cuda.max_memory_allocated()) if self._device == "cuda" else None,
            "level": _LEVELS[mode] if not store_hist else schema.LEVEL_HIST,
            "reason": self._reason,
            "grad_max": pick(max_off),
        }
        packet = StepPacket(step=step, row=row, values=values, bases=bases, entries=entries, loss=pick(loss_off),
                            scale=scale_vals[0], scale_next=scale_vals[1], grad_norm=pick(norm_off),
                            skipped=skipped, store_hist=store_hist)
        grads_bad = not all(v is None or math.isfinite(v) for v in (packet.grad_norm, row["grad_max"]))
        backoff = skipped is None and None not in scale_vals and scale_vals[1] < scale_vals[0]
        anomalous = (bool(skipped) or backoff or bad or grads_bad
                     or (packet.loss is not None and not math.isfinite(packet.loss)))
        if anomalous or (bad_w_off is not None and pick(bad_w_off)):
            self._check_weights(step)
        if not anomalous and self._cadence.spike(packet.grad_norm):
            anomalous = True           # observed in full from the next step on; the spike itself is an event
            self._put(("event", step, "grad_spike", None, None,
                       f"gradient norm {packet.grad_norm:.4g} jumped above {C.SPIKE_FACTOR:g}x its running mean "
                       f"{self._cadence.typical_norm:.4g}", {"grad_norm": packet.grad_norm,
                                                             "running_mean": self._cadence.typical_norm}))
        if not self._config_written:
            self._put(("meta", "config", self._config()))
            self._config_written = True
        self._flush_pending()
        self._pending = packet      # sent when the next step starts: a loss logged after opt.step() joins it
        # The flight recorder: an anomaly seen now gets every site in full from the next step on, until a run of
        # clean steps (the tensors of this one are gone; what it observed, or "origin unknown", is recorded).
        self._cadence.after(anomalous)
        obs = self._obs
        self._step += 1
        self._reset_step()
        # The step spans from the end of the previous step's boundary work to the end of this one's, so the steps'
        # times add up to the run's; observer_time is ampdoctor's share of it on the training thread.
        end = _now()
        row["step_time"] = end - self._t_prev_end
        row["observer_time"] = obs + (end - t0)
        self._t_prev_end = end

    def _grad_site(self, name: str, grad: torch.Tensor) -> int:
        return self._site(name, "param_grad", self._owner.get(name), grad)

    def _observe_param_grads(self, mode: str, entries: list) -> list[torch.Tensor]:
        """Peaks (or full statistics) of every parameter gradient, in parameter order; returns their sums of
        squares for the global norm."""
        if mode != "f":
            present = tuple([p.grad is not None for _, p in self._params])    # (no generator: one call)
            plan = self._grad_plan
            if plan is None or plan.key != present:
                plan = self._grad_plan = B.GradPlan(self._params, present, self._grad_site)
            try:
                squares = plan.run()
            except RuntimeError:         # parameters moved to another device or dtype since the plan was made
                plan = self._grad_plan = B.GradPlan(self._params, present, self._grad_site)
                squares = plan.run()
            entries.extend(plan.entries)
            return squares
        squares = []
        for name, p in self._params:
            g = p.grad
            if g is None:
                continue
            g = g.detach()
            sid = self._grad_site(name, g)
            if g.layout != torch.strided:                  # a sparse gradient: peaks of its stored values only
                v = B.dense_values(g)
                entries.append(Entry(sid, "param", [self._observe(v, "p")]))
                squares.append(B.sum_squares(v))
                continue
            vec = K.full(g)
            entries.append(Entry(sid, "param", [(self._add_full(vec), "f", g.numel())]))
            squares.append(vec[K.I_NORM].square())         # the l2 norm is part of the full vector
        return squares

    def _check_weights(self, step: int) -> None:
        """On an anomalous step only: are the weights themselves non-finite after the optimizer step? Then a later
        forward NaN comes from the update (e.g. Adam's eps lost in FP16), not from the forward computation."""
        if not self._params:
            return
        norms = torch.stack([n.to(torch.float32) for n in torch._foreach_norm(
            [p.detach() for _, p in self._params])]).cpu()
        bad = [name for (name, _), ok in zip(self._params, torch.isfinite(norms).tolist()) if not ok]
        if len(bad) != self._bad_weights:
            self._bad_weights = len(bad)
            if bad:
                self._put(("event", step, "nonfinite_weights", None, "update",
                           f"{len(bad)} parameter tensor(s) hold NaN/Inf after the optimizer step",
                           {"params": bad[:100], "count": len(bad)}))

    def _to_host(self) -> tuple[np.ndarray, dict, bool]:
        """Everything the step computed, in one transfer: [peaks per buffer | full vectors | extras] as float64.
        Also says whether any observed value was NaN/Inf (a NaN min/max, or a full vector's NaN/Inf count)."""
        blocks, bases, n = [], {}, 0
        plan = self._grad_plan
        for buf in [*self._bufs.values(), *(plan.buffers if plan is not None and self._cur_mode == C.PEAK else ())]:
            if buf.n:
                bases[buf.mode] = n
                blocks.append(buf.block())
                n += buf.n
        bases["f"] = n
        bases["x"] = n + self._full_len
        extras = self._extras
        if not blocks and not self._fulls and {type(e) for e in extras} <= _NUMBERS:
            return np.array(extras, dtype=np.float64), bases, False      # a sentinel step on the CPU: floats only
        on_cpu = (all(K.on_host(b) for b in blocks) and all(K.on_host(f) for f in self._fulls)
                  and not any(isinstance(e, torch.Tensor) for e in extras))
        if on_cpu:                 # already on the host: numpy copies, no torch op per block
            values = np.concatenate([B.host_float64(b) for b in blocks] + [f.numpy() for f in self._fulls]
                                    + [np.array(extras, dtype=np.float64)])
        else:
            dev = next(t.device for t in [*blocks, *self._fulls, *extras] if isinstance(t, torch.Tensor))
            parts = [b.to(dev, torch.float64) for b in blocks] + [f.to(dev) for f in self._fulls]
            if extras:
                parts.append(torch.stack([e.to(dev, torch.float64).reshape(()) if isinstance(e, torch.Tensor)
                                          else torch.tensor(float(e), dtype=torch.float64, device=dev)
                                          for e in extras]))
            values = torch.cat(parts).cpu().numpy()     # cat copies: the peak buffers are reused next step
        bad = not np.isfinite(values[:n]).all()
        if self._fulls:
            fulls = values[n:bases["x"]].reshape(-1, K.FULL_LEN)
            bad = bad or bool(fulls[:, K.HEAD + K.KEY_INF:].any())
        return values, bases, bad

    # -- metadata --------------------------------------------------------------------------------------------------
    def _run_meta(self) -> dict:
        import ampdoctor
        dev = _device_type(self.model) or "cpu"
        info = {"ampdoctor": ampdoctor.__version__, "torch": torch.__version__, "python": platform.python_version(),
                "host": platform.node(), "pid": os.getpid(), **_dist(), "started": time.time(),
                "model": type(self.model).__name__, "device": dev,
                "params": int(sum(p.numel() for p in self.model.parameters())),
                "cpu_count": os.cpu_count(), "threads": torch.get_num_threads(),
                "mode": self.mode, "every": self.every, "peak_every": self.peak_every, "hist_every": self.hist_every,
                "weight_every": self.weight_every, "calibration": self._cadence.calibration,
                "clean_run": self._cadence.clean_run, "probe_every": self.probe_every}
        if dev == "cuda":
            idx = next(self.model.parameters()).device.index or 0
            cap = torch.cuda.get_device_capability(idx)
            info.update(device_name=torch.cuda.get_device_name(idx), capability=list(cap),
                        bf16_supported=bool(torch.cuda.is_bf16_supported()))
        else:
            info.update(device_name=platform.processor() or platform.machine(), bf16_supported=True)
        return info

    def _config(self) -> dict:
        """The observed precision configuration, taken after the first step (autocast and dtypes are known)."""
        params: dict[str, int] = {}
        module_dtypes: dict[str, str] = {}
        for name, p in self.model.named_parameters():
            d = B.dtype_name(p.dtype)
            params[d] = params.get(d, 0) + p.numel()
            module_dtypes.setdefault(name.rpartition(".")[0] or H.ROOT, d)
        cfg = {"autocast": self._autocast or {"enabled": False}, "param_dtypes": params,
               "module_param_dtypes": module_dtypes, "loss_dtype": self._loss_dtype, "boundary": self._boundary,
               # where step timing comes from: the root forward, begin_batch() calls, or nowhere (no data wait)
               "step_start": "begin_batch" if self._external_batches else ("forward" if self._step_starts else None)}
        if self.optimizer is not None:
            groups = [{k: _plain(v) for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
            cfg["optimizer"] = {"class": type(self.optimizer).__name__, "groups": groups}
        if self.scaler is not None:
            s = self.scaler
            cfg["scaler"] = {"class": type(s).__name__, "enabled": self._scaler_enabled()}
            for key in ("init_scale", "growth_factor", "backoff_factor", "growth_interval"):
                getter = getattr(s, f"get_{key}", None)
                if callable(getter):
                    cfg["scaler"][key] = _plain(getter())
                elif key == "init_scale" and hasattr(s, "_init_scale"):   # GradScaler has no public getter
                    cfg["scaler"][key] = _plain(s._init_scale)
        return cfg

    # -- failure and shutdown ----------------------------------------------------------------------------------------
    def _put(self, item) -> None:
        if self._writer is not None:
            self._writer.put(item)

    def _fail(self, exc: BaseException) -> None:
        """Never break training: warn once, stop collecting, leave the user's objects as they were."""
        self._off = True
        if not self._warned:
            self._warned = True
            warnings.warn(f"ampdoctor: collection stopped after an internal error ({type(exc).__name__}: {exc}); "
                          "training continues", RuntimeWarning, stacklevel=3)
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
        if (self._writer is not None and not self._off and self._step == 0
                and (self._step_starts or self._entries)):
            self._warn_once("no-boundary", G.no_boundary(self._boundary, "the whole run"))
        self._closed = True
        self._off = True
        self._handles.remove()
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
            if self._writer.error is not None and not self._warned:
                self._warned = True
                warnings.warn(f"ampdoctor: the trace {self.path} may be incomplete ({self._writer.error})",
                              RuntimeWarning, stacklevel=2)

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


_NUMBERS = {float, int}
_LEVELS = {C.NONE: schema.LEVEL_SENTINEL, C.PEAK: schema.LEVEL_PEAK, C.FULL: schema.LEVEL_FULL}


def _eager(fn):
    """Hooks run eagerly under torch.compile: traced, their id()/weakref bookkeeping would make dynamo guard on
    tensor identities and recompile every step. The disabled copy is only entered while dynamo traces (its
    wrapper costs microseconds per call, which eager training would pay on every hook)."""
    compiler = getattr(torch, "compiler", None)
    if compiler is None or not hasattr(compiler, "disable") or not hasattr(compiler, "is_compiling"):
        return fn
    disabled = compiler.disable(fn)
    is_compiling = compiler.is_compiling

    @functools.wraps(fn)
    def hook(*args, **kwargs):
        if is_compiling():
            return disabled(*args, **kwargs)
        return fn(*args, **kwargs)
    return hook


def _device_type(model) -> str | None:
    for p in model.parameters():
        return p.device.type
    for b in model.buffers():
        return b.device.type
    return None


def _plain(v):
    if isinstance(v, torch.Tensor):
        return v.item() if v.numel() == 1 else v.tolist()
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return repr(v)


def attach(model, optimizer=None, scaler=None, trace: str = "runs/ampdoctor.db", **options) -> Doctor:
    """Start observing ``model``; returns a Doctor (a context manager). See Doctor for the options."""
    return Doctor(model, optimizer=optimizer, scaler=scaler, trace=trace, **options)
