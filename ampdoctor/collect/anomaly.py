"""The anomaly replay: an anomalous step that observed no site in full (a NaN on a sentinel-only step, a loss or
gradient-norm spike) is run again, forward and backward, on the same inputs, with the same weights, RNG state and
autocast settings, observing every site in full and every operation (ops.py), so that nothing is lost in the
default tiers. Nothing in training changes: the backward runs through ``torch.autograd.grad`` (no ``.grad`` is
written), buffers (BatchNorm statistics) and the RNG are put back, the scaler is never called.

What a replay needs is kept during every step, by reference (no copy): the root module's call arguments and their
version counters, the RNG state when each micro-batch's forward started (a CPU generator's state is 5 KB; a CUDA
generator's 16 bytes), the autocast state, and the gradients that reached the root module's outputs (the seeds of
the backward: the loss's gradient, carrying the loss scale). All of it is dropped when the next step starts.

Where a precision change could fix the fault, the replay also tries it on a copy of the step (the module kept in
FP32, BF16 instead of FP16, a lower loss scale) and records whether the NaN/Inf is gone: a fix is printed only when
it worked on the failing step. With ``heal=True`` a module whose forward overflow two replays confirmed, and fixed, is
kept in FP32 from the next step on."""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, cast

import torch

from .. import islands
from ..trace.schema import ROOT, observed_ancestor
from . import hooks
from .ops import OpTracer
from .recompute import RngState, rng_get, rng_set

# Gradients reaching the root module's outputs are kept (by reference) up to this many values per tensor: a
# classifier's logits or a loss easily; a language model's logits when the loss is computed outside the model
# (batch x tokens x vocabulary) are not held on to: the replay of such a step is forward-only.
SEED_KEEP_MAX = 1 << 22
MAX_CALLS = 64  # micro-batches of one step kept for a replay
TYPICAL_KEPT = 64  # recent input peaks the "usual" magnitude of the batches is the median of
OUTLIER_FACTOR = 8.0  # a batch whose inputs are this many times the usual peak is an outlier batch
# A keep_fp32 fix grows by the modules that still overflow after it, up to this many modules in all.
ISLAND_GROWTH = 4
HASH_BYTES_MAX = 1 << 26  # inputs larger than this are fingerprinted by shape, dtype and magnitudes only


@dataclass(slots=True)
class Call:
    """One micro-batch's root call, as the replay needs it."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    versions: list[tuple[torch.Tensor, int]]  # (tensor, its version counter at the call)
    rng: RngState
    autocast: tuple[str, torch.dtype] | None  # (device_type, dtype) when autocast was on at the call
    seeds: dict[int, torch.Tensor] = field(default_factory=dict)  # output index -> gradient that reached it
    held: dict[int, Any] | None = None  # output index -> its gradient held by a C++ hook (the lane's): take_held()

    def take_held(self) -> None:
        """The gradients C++ hooks held join ``seeds`` (before a replay reads them)."""
        held, self.held = self.held, None
        for i, seed in (held or {}).items():
            grad = seed.get()
            if grad is not None:
                self.seeds[i] = grad


class Capture:
    """The per-step memory of the replay: filled by the root module's hooks, emptied at every step start."""

    def __init__(self, device: Callable[[], torch.device | None]) -> None:
        self.device = device
        self.calls: list[Call] = []
        self.batch_ids: list[Any] = []
        self._peaks: torch.Tensor | None = None  # recent batches' input peaks (sampled steps): one ring tensor
        self._next_peak = 0
        self.paused = False  # a replay is running

    def clear(self) -> None:
        self.calls = []
        self.batch_ids = []

    def take(self) -> tuple[list[Call], list[Any]]:
        """The finished step's calls and batch ids (kept by its InFlight until its verdict), and a fresh start."""
        taken = (self.calls, self.batch_ids)
        self.calls = []
        if self.batch_ids:  # (log_batch_ids replaces the list, never appends: an empty one is shared)
            self.batch_ids = []
        return taken

    def on_call(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        measure: bool,
        device_type: str | None,
        autocast: tuple[str, torch.dtype] | None,
    ) -> None:
        """The root's forward starts (training, grad enabled), on the model's ``device_type``, with ``autocast``
        as the collector read it at this call. ``measure``: also keep the batch's input peak for the run's usual
        magnitude (on steps that observe sites)."""
        if self.paused or len(self.calls) >= MAX_CALLS:
            return
        a0 = args[0] if len(args) == 1 and not kwargs else None
        if type(a0) is torch.Tensor:  # the common case, without walking the arguments: one tensor
            tensors = [a0] if a0.layout == torch.strided or not a0.is_floating_point() else []
        else:
            tensors = hooks.float_tensors((args, kwargs)) + int_tensors((args, kwargs))
        dev = self.device() if device_type != "cpu" else None  # (the CPU generator's state is always kept)
        self.keep(args, kwargs, [(t, t._version) for t in tensors], rng_get(dev), autocast)
        if measure:
            peaks = [t.detach().abs().amax().float() for t in hooks.float_tensors((args, kwargs)) if t.numel()]
            if peaks:
                peak = torch.stack(peaks).amax() if len(peaks) > 1 else peaks[0]
                if self._peaks is None or self._peaks.device != peak.device:
                    self._peaks = torch.full((TYPICAL_KEPT,), math.nan, device=peak.device)
                self._peaks[self._next_peak % TYPICAL_KEPT] = peak  # (on the device: no host read)
                self._next_peak += 1

    def keep(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        versions: list[tuple[torch.Tensor, int]],
        rng: RngState,
        autocast: tuple[str, torch.dtype] | None,
    ) -> None:
        """A root call, its tensors' versions and RNG state read already (on_call, or the lane's one C++ call)."""
        if not self.paused and len(self.calls) < MAX_CALLS:
            self.calls.append(Call(args, kwargs, versions, rng, autocast))

    def on_output(self, module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
        """The root's forward ended: hook the gradients that will reach its outputs (the backward's seeds)."""
        if self.paused or not self.calls:
            return
        seeds = self.calls[-1].seeds
        # (an output that requires grad is a float one, made with grad enabled: the common case, one tensor, asks
        # nothing else)
        if type(output) is torch.Tensor:
            if output.requires_grad and output.numel() <= SEED_KEEP_MAX and output.layout == torch.strided:
                hooks.grad_hook(output, _keep_seed(seeds, 0))
            return
        for i, t in enumerate(hooks.float_tensors(output)):
            if t.requires_grad and t.numel() <= SEED_KEEP_MAX:
                hooks.grad_hook(t, _keep_seed(seeds, i))

    def typical_peak(self) -> float | None:
        """The median input peak of recent sampled batches (one host read, on a replay only)."""
        if self._peaks is None:
            return None
        values = self._peaks.to("cpu").double()
        values = values[torch.isfinite(values)]
        return float(values.median()) if values.numel() else None


# Hooks others registered on the modules that run after a forward or in the backward (activation recorders, loggers):
# a replay must not feed them a step twice. Forward pre-hooks stay: some compute what the forward needs
# (torch.nn.utils.weight_norm, spectral_norm).
_OTHERS_HOOKS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_backward_hooks",
    "_backward_pre_hooks",
)


@contextlib.contextmanager
def others_hooks_off(model: torch.nn.Module, ours: set[int]) -> Iterator[None]:
    """Run ``model`` with only ampdoctor's forward and backward hooks (``ours``: their handle ids). torch offers no
    public way to run a module without the hooks others registered on it, so the module's hook dicts are swapped
    for filtered copies and put back, every one, whatever happens."""
    saved = []
    try:
        for m in model.modules():
            for name in _OTHERS_HOOKS:
                hooks_of = getattr(m, name, None)
                if hooks_of and any(k not in ours for k in hooks_of):
                    saved.append((m, name, hooks_of))
                    setattr(m, name, OrderedDict((k, v) for k, v in hooks_of.items() if k in ours))
        yield
    finally:
        for m, name, hooks_of in saved:
            setattr(m, name, hooks_of)


def _keep_seed(seeds: dict[int, torch.Tensor], i: int) -> Callable[[torch.Tensor], None]:
    def keep(grad: torch.Tensor) -> None:
        seeds[i] = grad if i not in seeds else seeds[i] + grad  # (an output used twice gets both gradients)

    return keep


def int_tensors(obj: object) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for t in _flat(obj):
        if isinstance(t, torch.Tensor) and not t.is_floating_point():
            out.append(t)
    return out[:16]


def _flat(obj: object, depth: int = 0) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth < 4 and isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _flat(o, depth + 1)
    elif depth < 4 and isinstance(obj, dict):
        for o in obj.values():
            yield from _flat(o, depth + 1)


@dataclass
class Replay:
    """What a replay found (the REPLAY event's data)."""

    step: int
    why: str  # the anomaly: "nonfinite", "skipped", "grad_spike", "loss_spike"
    exact: bool
    not_exact: list[str] = field(default_factory=list)  # the reasons it could not be exact
    backward: bool = True  # the backward was replayed too
    observed: bool = True  # the replay observed every site (False: the step had, itself)
    outputs_finite: bool | None = None  # the model's outputs were finite
    seeds_finite: bool | None = None  # the gradients reaching the model's outputs were finite
    loss_made_it: bool = False  # finite outputs, non-finite gradients at them: the loss (outside the model) made it
    reproduced: bool | None = None  # the replay showed the anomaly again
    grad_norm: float | None = None  # of the replayed (scaled) gradients
    operation: dict[str, Any] | None = None  # the first operation that made a NaN/Inf from finite inputs (ops.OpRecord)
    producers: list[dict[str, Any]] = field(default_factory=list)  # the operations that made the values it overflowed
    # fingerprint: per input shape, dtype, hash, peak; outlier factor
    batch: dict[str, Any] = field(default_factory=dict)
    # precision changes tried on the step: {"fix", "finite", ...}
    checks: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Replayer:
    """Runs one step's replay (when one runs, and where what it observes goes: replays.py). ``observe(full)``: a
    context in which the passes observe every site in full (into the replay's own record) or nothing; ``pause(on)``:
    the root module's calls are not the step's micro-batches meanwhile; ``paths``: id(module) -> site path."""

    def __init__(
        self,
        model: torch.nn.Module,
        modules: list[tuple[str, torch.nn.Module]],
        params: list[tuple[str, torch.nn.Parameter]],
        capture: Capture,
        observe: Callable[[bool], contextlib.AbstractContextManager[Any]],
        pause: Callable[[bool], None],
        ours: Callable[[], set[int]],
        *,
        heal: bool = False,
    ) -> None:
        self.model = _runnable(model)
        self.modules = modules
        self.params = params
        self.capture = capture
        self.observe = observe
        self.pause = pause
        self.ours = ours  # the handle ids of ampdoctor's own module hooks (others' are off during a replay)
        self.heal = heal
        self.paths = {id(m): p for p, m in modules}
        # the last observed replay's parameter gradients (scaled), aligned with params
        self.grads: list[torch.Tensor | None] = []
        self.healed: dict[str, islands.KeptFP32] = {}  # path -> islands handle
        self._confirmed: dict[str, set[Any]] = {}  # path -> steps whose replay confirmed keep_fp32(path) fixes it

    @property
    def _model(self) -> torch.nn.Module:
        """The model a replay runs (one runs only when there is one: ``run`` returns early otherwise)."""
        assert self.model is not None
        return self.model

    # -- the replay ---------------------------------------------------------------------------------------------------
    def run(
        self,
        step: int,
        why: str,
        calls: list[Call],
        *,
        batch_ids: list[Any],
        weights_changed: str | None,
        scale: float | None,
        observe_sites: bool = True,
    ) -> Replay:
        """Replay the step's micro-batches. ``weights_changed``: why the weights may differ from the step's (None:
        they are the same); ``observe_sites``: the step observed its sites in full itself (False) or not."""
        import time

        t0 = time.perf_counter()
        result = Replay(step=step, why=why, exact=True)
        if self.model is None:
            result.exact, result.backward = False, False
            result.not_exact.append("the model communicates with other ranks in its forward (FSDP): not replayed")
            return result
        if weights_changed:
            result.not_exact.append(weights_changed)
        changed = [t for c in calls for t, v in c.versions if t._version != v]
        if changed:
            result.not_exact.append(f"{len(changed)} input tensor(s) were changed in place after the forward")
        seeded = [c for c in calls if c.seeds]
        result.backward = len(seeded) == len(calls)
        if seeded:
            result.seeds_finite = all(_finite(g) for c in seeded for g in c.seeds.values())
        if not result.backward:
            result.not_exact.append(
                "the gradients reaching the model's outputs were not kept (larger than "
                f"{SEED_KEEP_MAX:,} values, or no backward ran): forward replayed only"
            )
        result.batch = self._fingerprint(calls, batch_ids)
        # Two passes: one under the operation tracer, one observing every site in full (the observation's own
        # reductions would otherwise pass through the tracer).
        tracer = OpTracer(self.paths)
        with self._isolated(), self.observe(False), others_hooks_off(self._model, self.ours()):
            self._pass(calls, tracer=tracer)
        result.observed = observe_sites
        with self._isolated(), self.observe(observe_sites), others_hooks_off(self._model, self.ours()):
            outputs_finite, finite, norm = self._pass(calls, keep_grads=observe_sites)
        result.exact = not result.not_exact
        result.grad_norm = norm
        result.outputs_finite = outputs_finite
        result.loss_made_it = bool(outputs_finite and result.seeds_finite is False)
        if tracer.first is not None:
            result.operation = tracer.first.to_dict()
            result.producers = [r.to_dict() for r in tracer.chain[:-1]]
        if why in ("nonfinite", "skipped"):
            result.reproduced = not finite
        elif why == "grad_spike":
            result.reproduced = None  # judged offline against the recorded norm and scale
        if not finite:
            result.checks = self._checks(calls, result, scale)
        result.seconds = time.perf_counter() - t0
        return result

    def _pass(
        self, calls: list[Call], *, tracer: OpTracer | None = None, scale_by: float = 1.0, keep_grads: bool = False
    ) -> tuple[bool, bool, float]:
        """Forward (and backward where seeds were kept) of every call: (the outputs finite, everything finite, norm
        of the gradients). ``keep_grads``: the parameters' gradients, summed over the calls, are left in
        ``self.grads`` (as the step's .grad would hold them, still scaled)."""
        finite = outputs_finite = True
        leaves = [p for _, p in self.params]
        # the step's gradients, summed over its micro-batches as .grad would be
        acc: list[torch.Tensor | None] = [None] * len(leaves)
        for call in calls:
            rng_set(call.rng)
            ac = torch.autocast(call.autocast[0], dtype=call.autocast[1]) if call.autocast else contextlib.nullcontext()
            with torch.enable_grad(), ac, tracer if tracer is not None else contextlib.nullcontext():
                out = self._model(*call.args, **call.kwargs)
                outs = hooks.float_tensors(out)
                if tracer is not None:
                    tracer.reached(outs)
                finite = finite and all(_finite(t) for t in outs)
                outputs_finite = finite
                pairs = [(outs[i], g) for i, g in sorted(call.seeds.items()) if i < len(outs) and outs[i].requires_grad]
                scalars = [(t, g) for t, g in pairs if t.dim() == 0]
                pairs = scalars or pairs  # a model that returns its loss: the backward starts there
                if pairs and leaves:
                    grads = torch.autograd.grad(
                        [t for t, _ in pairs],
                        leaves,
                        [g * scale_by if scale_by != 1.0 else g for _, g in pairs],
                        allow_unused=True,
                    )
                    if tracer is not None:
                        tracer.reached(grads)
                    acc = [
                        a if g is None else (g.detach() if a is None else a + g.detach()) for a, g in zip(acc, grads)
                    ]
        sq = sum(float(a.double().square().sum()) for a in acc if a is not None and a.numel())
        norm = math.sqrt(sq) if sq == sq and sq != math.inf else sq
        if keep_grads:
            self.grads = acc
        return outputs_finite, finite and math.isfinite(norm), norm

    @contextlib.contextmanager
    def _isolated(self) -> Iterator[None]:
        """Training is left as it was: the RNG, the buffers (BatchNorm's running statistics), grad mode; the root
        module's own hooks do not record the replay as a micro-batch."""
        device = self.capture.device()
        rng = rng_get(device)
        buffers = [(b, b.detach().clone()) for b in self._model.buffers()]
        self.pause(True)
        try:
            yield
        finally:
            self.pause(False)
            with torch.no_grad():
                for b, saved in buffers:
                    b.copy_(saved)
            rng_set(rng)

    # -- fixes tried on the step --------------------------------------------------------------------------------------
    def _checks(self, calls: list[Call], result: Replay, scale: float | None) -> list[dict[str, Any]]:
        """The precision changes a finding could print, each tried on the replayed step (no observation). Where the
        step's own output gradients are non-finite (its forward was), a check's backward starts from their finite
        part (the true gradient of a loss computed outside the model, on the fixed outputs, is not known here)."""
        checks = []
        origin = _origin_module(result)
        fwd = result.operation is not None and result.operation.get("phase") == "fwd"
        if origin is not None and fwd and origin != ROOT:
            for path in dict.fromkeys([origin, *_outer(origin, self.paths.values())]):
                check = self._island(calls, scale, path)
                checks.append(check)
                if check["finite"]:
                    for kept in check["modules"]:
                        self._confirm(kept, result.step)
                    break
        ac = next((c.autocast for c in calls if c.autocast), None)
        if ac is not None and ac[1] == torch.float16 and _bf16_ok(ac[0]):
            checks.append({"fix": "bf16", **self._try_scaled(calls, scale, dtype=torch.bfloat16)})
        if not fwd and result.backward and result.seeds_finite and scale:
            for k in (4, 8, 12, 16):  # the scale divided by 2^k
                check = {"fix": "loss_scale", "scale": scale * 2.0**-k, **self._try(calls, scale_by=2.0**-k)}
                checks.append(check)
                if check["finite"]:
                    break
        return checks

    def _island(self, calls: list[Call], scale: float | None, path: str) -> dict[str, Any]:
        """keep_fp32 of ``path`` tried on the step; where the forward still makes a NaN/Inf, in a module after it
        (values beyond FP16 that the next module casts back), the island grows by the module that made it, up to
        ISLAND_GROWTH modules: the fix printed is the island that removed the NaN/Inf on the step."""
        island = [path]
        while True:
            check = {"fix": "keep_fp32", "modules": list(island), **self._try_scaled(calls, scale, keep=island)}
            if check["finite"] or check.get("forward_finite") is not False or len(island) >= ISLAND_GROWTH:
                return check
            tracer = OpTracer(self.paths)
            with self._isolated(), self.observe(False), others_hooks_off(self._model, self.ours()):
                handle = islands.keep_fp32(self._model, *island)
                try:
                    self._pass(calls, tracer=tracer)
                except Exception:
                    return check
                finally:
                    handle.remove()
            made = tracer.first
            nxt = observed_ancestor(made.module, set(self.paths.values())) if made is not None else ROOT
            if made is None or made.phase != "fwd" or nxt == ROOT or any(_within(nxt, p) for p in island):
                return check  # nothing new to keep in FP32: the island cannot help
            island.append(nxt)

    def _try_scaled(self, calls: list[Call], scale: float | None, **change: Any) -> dict[str, Any]:
        """A forward fix tried on the step: where its forward is finite but its backward overflows at the step's loss
        scale, the scale the GradScaler backs off to (a few skipped steps, as with any fix) is tried too; the check
        passes there and says at which scale."""
        check = self._try(calls, **change)
        if check.get("forward_finite") and check.get("backward_finite") is False and scale:
            for k in (1, 4, 8, 12, 16):
                lower = self._try(calls, scale_by=2.0**-k, **change)
                if lower["finite"]:
                    return {**lower, "at_scale": scale * 2.0**-k}
        return check

    def _try(
        self, calls: list[Call], *, keep: Sequence[str] = (), dtype: torch.dtype | None = None, scale_by: float = 1.0
    ) -> dict[str, Any]:
        """One variant of the step, on the same inputs: its forward finite, its backward finite?"""
        seeds = "original"
        if any(not _finite(g) for c in calls for g in c.seeds.values()):
            seeds = "finite part of the original"
        calls = [
            Call(
                c.args,
                c.kwargs,
                c.versions,
                c.rng,
                (c.autocast[0], dtype) if c.autocast and dtype is not None else c.autocast,
                {i: torch.nan_to_num(g, nan=0.0, posinf=0.0, neginf=0.0) for i, g in c.seeds.items()},
            )
            for c in calls
        ]
        with self._isolated(), self.observe(False), others_hooks_off(self._model, self.ours()):
            handle = islands.keep_fp32(self._model, *keep) if keep else None
            try:
                forward, finite, _ = self._pass(calls, scale_by=scale_by)
            except Exception as exc:
                return {"finite": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
            finally:
                if handle is not None:
                    handle.remove()
        backward = None if not any(c.seeds for c in calls) else finite
        return {"finite": finite, "forward_finite": forward, "backward_finite": backward, "seeds": seeds}

    def _confirm(self, path: str, step: int) -> None:
        steps = self._confirmed.setdefault(path, set())
        steps.add(step)

    def heal_now(self) -> list[str]:
        """With heal=True: the modules two replays confirmed keep_fp32 fixes, kept in FP32 from now on."""
        if not self.heal:
            return []
        done = []
        for path, steps in self._confirmed.items():
            if len(steps) >= 2 and path not in self.healed:
                self.healed[path] = islands.keep_fp32(self._model, path)
                done.append(path)
        return done

    def unheal(self) -> None:
        for handle in self.healed.values():
            try:
                handle.remove()
            except Exception:
                pass
        self.healed = {}

    # -- the batch ----------------------------------------------------------------------------------------------------
    def _fingerprint(self, calls: list[Call], batch_ids: list[Any]) -> dict[str, Any]:
        """Shape, dtype, content hash and peak of each input; the batch's peak against the run's usual one."""
        inputs = []
        top = 0.0
        for c in calls:
            for t in [*hooks.float_tensors((c.args, c.kwargs)), *int_tensors((c.args, c.kwargs))]:
                d = t.detach()
                entry: dict[str, Any] = {"shape": list(d.shape), "dtype": str(d.dtype).replace("torch.", "")}
                if d.numel() and d.is_floating_point():
                    finite = torch.isfinite(d)
                    entry["nonfinite"] = int((~finite).sum())
                    peak = float(d.abs().where(finite, torch.zeros((), dtype=d.dtype, device=d.device)).amax())
                    entry["peak"] = peak
                    top = max(top, peak)
                if d.numel() * d.element_size() <= HASH_BYTES_MAX:
                    raw = d.contiguous().cpu()
                    data = raw.view(torch.uint8) if raw.dtype != torch.bool else raw.to(torch.uint8)
                    entry["sha1"] = hashlib.sha1(data.numpy().tobytes()).hexdigest()[:16]
                inputs.append(entry)
        out: dict[str, Any] = {"inputs": inputs[:32], "micro_batches": len(calls)}
        usual = self.capture.typical_peak()
        if usual and top:
            out.update(peak=top, usual_peak=usual, factor=top / usual, outlier=top / usual >= OUTLIER_FACTOR)
        if batch_ids:
            out["ids"] = batch_ids[:256]
        return out


def _origin_module(result: Replay) -> str | None:
    chain = [*result.producers, result.operation] if result.operation else []
    return chain[0]["module"] if chain else None


def _within(path: str, outer: str) -> bool:
    return path == outer or path.startswith(outer + ".") or outer == ROOT


def _outer(path: str, paths: Iterable[str]) -> list[str]:
    """The modules enclosing ``path`` (innermost first), among the observed ones."""
    known = set(paths)
    parts = path.split(".")
    return [p for p in (".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)) if p in known]


def _finite(t: torch.Tensor) -> bool:
    return not t.numel() or bool(torch.isfinite(t.detach()).all())


def _bf16_ok(device_type: str) -> bool:
    if device_type == "cuda":
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    return device_type == "cpu"


def _runnable(model: torch.nn.Module) -> torch.nn.Module | None:
    """The module a replay can call without talking to other processes: DDP's inner module; None for FSDP."""
    name = type(model).__name__
    if name in ("DistributedDataParallel", "DataParallel"):
        return cast(torch.nn.Module, model.module)  # (torch types a submodule attribute as Tensor | Module)
    if "FullyShardedDataParallel" in name or hasattr(model, "_fsdp_wrapped_module") or _fsdp2(model):
        return None
    return model


def _fsdp2(model: torch.nn.Module) -> bool:
    return any(type(m).__name__.startswith("FSDP") for m in model.modules())
