"""The FP32 recomputation behind the precision-loss probe: hooks that, for each observed module's forward, rerun it
in FP32 from the same inputs (upcast copies of inputs, parameters and buffers, the same RNG state, no grad, autocast
off) and keep the error of the half-precision output, per call; ``summarize`` turns the calls into rows.
probe.py runs it on probed steps (attach(probe_every=N)) and once (ampdoctor.probe)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .. import roundoff
from . import hooks, sharded

HALF = (torch.float16, torch.bfloat16)
# Modules whose output element depends on one input element (up to a few constants): no accumulation, k = 1.
_ELEMENTWISE = (
    "ReLU",
    "ReLU6",
    "LeakyReLU",
    "PReLU",
    "ELU",
    "SELU",
    "CELU",
    "GELU",
    "SiLU",
    "Mish",
    "Sigmoid",
    "Tanh",
    "Hardtanh",
    "Hardswish",
    "Hardsigmoid",
    "Softplus",
    "Softsign",
    "Tanhshrink",
    "Threshold",
    "Dropout",
    "Dropout1d",
    "Dropout2d",
    "Dropout3d",
    "AlphaDropout",
    "Identity",
    "Flatten",
    "Unflatten",
    "Embedding",
    "Upsample",
)


# Wrappers whose forward talks to other processes (buffer broadcasts, parameter gathers): never run twice.
_COMMUNICATING = ("DistributedDataParallel", "FullyShardedDataParallel", "DataParallel")
# torch.nn.RMSNorm where this torch has it (2.4+); typed Any: absent, it stands in as LayerNorm again
_RMS_NORM: Any = getattr(torch.nn, "RMSNorm", torch.nn.LayerNorm)
# (the CPU generator's state, the CUDA one's or None, the device)
RngState = tuple[torch.Tensor, "torch.Tensor | None", "torch.device | None"]


# -- the accumulation length k of a module's output ------------------------------------------------------------
def accumulation_length(module: torch.nn.Module, args: tuple[Any, ...]) -> int:
    """How many terms one output element sums (Linear: in_features; Conv: in_channels/groups x kernel; norms: the
    normalised size). Unknown modules get the last dimension of their first input (a reduction over it is the common
    case; an elementwise module gets a looser bound, never a tighter one)."""
    name = type(module).__name__
    if name in _ELEMENTWISE:
        return 1
    if isinstance(module, torch.nn.Linear):
        return module.in_features
    if isinstance(module, torch.nn.Bilinear):
        return module.in1_features * module.in2_features
    if isinstance(module, torch.nn.modules.conv._ConvNd):
        return (module.in_channels // module.groups) * math.prod(module.kernel_size)
    if isinstance(module, (torch.nn.LayerNorm, _RMS_NORM)):
        return math.prod(module.normalized_shape)
    x = hooks.first_tensor(args)
    if isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and x is not None and x.dim() > 1:
        return max(x.numel() // x.shape[1], 1) if module.training else 1
    if isinstance(module, torch.nn.GroupNorm) and x is not None and x.dim() > 1:
        return max(x.numel() // (x.shape[0] * module.num_groups), 1)
    if isinstance(module, torch.nn.MultiheadAttention):
        return int(module.embed_dim) + (
            x.shape[0 if not module.batch_first else 1] if x is not None and x.dim() > 1 else 1
        )
    if isinstance(module, (torch.nn.Softmax, torch.nn.LogSoftmax)) and x is not None and x.dim() > 0:
        return x.shape[module.dim if module.dim is not None else -1]
    return int(x.shape[-1]) if x is not None and x.dim() > 0 else 1


# -- RNG and upcasting -------------------------------------------------------------------------------------------
def rng_get(device: torch.device | None) -> RngState:
    cuda = torch.cuda.get_rng_state(device) if device is not None and device.type == "cuda" else None
    return torch.default_generator.get_state(), cuda, device  # (torch.get_rng_state() without its wrapper)


def rng_set(state: RngState) -> None:
    cpu, cuda, device = state
    torch.set_rng_state(cpu)
    if cuda is not None and device is not None:  # (a CUDA state is taken with its device)
        torch.cuda.set_rng_state(cuda, device)


def _up(x: Any) -> Any:
    """FP16/BF16 tensors (nested in tuples, lists, dicts) as float32 copies, detached; the rest detached as is."""
    if isinstance(x, torch.Tensor):
        return x.detach().float() if x.dtype in HALF else x.detach()
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return type(x)(*(_up(v) for v in x))
    if isinstance(x, (list, tuple)):
        return type(x)(_up(v) for v in x)
    if isinstance(x, dict):
        return type(x)((k, _up(v)) for k, v in x.items())
    return x


def _state_copies(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters (float32 copies of half ones, else the tensors themselves, detached) and buffers (always copies:
    a BatchNorm in training mode updates its running statistics in place)."""
    out = {n: (p.detach().float() if p.dtype in HALF else p.detach()) for n, p in module.named_parameters()}
    out.update({n: (b.float() if b.dtype in HALF else b.clone()) for n, b in module.named_buffers()})
    return out


def _versions(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[tuple[torch.Tensor, int]]:
    return [(t, t._version) for t in hooks.float_tensors((args, kwargs))]


def _state_versions(module: torch.nn.Module) -> StateVersions:
    """Tensors a module (or a child) holds as plain attributes, not parameters or buffers (a counter, a cache):
    functional_call cannot swap them for copies, so a module whose forward updates or replaces one must not run a
    second time. (path of the attribute) -> (tensor, version)."""
    return {
        (id(m), name): (t, t._version)
        for m in module.modules()
        for name, t in vars(m).items()
        if isinstance(t, torch.Tensor)
    }


def _changed_state(before: StateVersions, module: torch.nn.Module) -> str | None:
    """The first plain tensor attribute the forward updated in place, replaced or added since ``before``."""
    for key, (t, v) in _state_versions(module).items():
        old = before.get(key)
        if old is None or old[0] is not t or old[1] != v:
            return key[1]
    return None


# (id of the module, attribute name) -> (the tensor, its version)
StateVersions = dict[tuple[int, str], tuple[torch.Tensor, int]]


@dataclass
class _Frame:
    """One module call in progress: where its forward started."""

    path: str
    rng: RngState
    versions: list[tuple[torch.Tensor, int]]
    state: StateVersions
    child_k: int = 0


@dataclass
class Call:
    """The comparison of one module call: device tensors [sum err^2, sum ref^2, max |err|, max |ref|] (or None
    when skipped), with what the rule needs besides."""

    path: str
    module_type: str
    dtype: str | None
    k: int
    numel: int
    figures: torch.Tensor | None
    skipped: str | None = None


class Recorder:
    """Arms probe hooks on ``modules`` for one step, compares each call, and disarms (removing every hook)."""

    def __init__(
        self,
        modules: list[tuple[str, torch.nn.Module]],
        *,
        need_grad: bool = True,
        keep_root: bool = False,
        on_error: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.modules = modules
        self.on_error = on_error  # training: a failure here must stop the probe, never the forward
        self.need_grad = need_grad  # training: only forwards that build a graph (not evaluation)
        self.keep_root = keep_root  # the one-off probe keeps the root's FP32 output for the loss
        self.root_ref: torch.Tensor | None = None
        self.calls: list[Call] = []
        self._stack: list[_Frame] = []
        self._handles = hooks.Handles()
        self._inside = False

    # -- arming ----------------------------------------------------------------------------------------------------
    def arm(self, root_args: tuple[Any, ...] | None = None, root_kwargs: dict[str, Any] | None = None) -> None:
        """Install the hooks; when called from inside the root's pre-hook, also open the root's frame (a hook
        added during the root's pre-hooks is not run for that call)."""
        for path, mod in self.modules:
            self._handles.add(mod.register_forward_pre_hook(self._pre(path), with_kwargs=True))
            self._handles.add(mod.register_forward_hook(self._post(path, mod), with_kwargs=True))
        if root_args is not None:
            self._open(self.modules[0][0], self.modules[0][1], root_args, root_kwargs or {})

    def disarm(self) -> list[Call]:
        self._handles.remove()
        self._stack.clear()
        calls, self.calls = self.calls, []
        return calls

    def _active(self) -> bool:
        return (
            not self._inside and (torch.is_grad_enabled() or not self.need_grad) and hooks.graph_task_id() == -1
        )  # a checkpoint recomputation is not a new call

    def _open(self, path: str, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        x = hooks.first_tensor(args, kwargs)
        self._stack.append(
            _Frame(path, rng_get(x.device if x is not None else None), _versions(args, kwargs), _state_versions(module))
        )

    def _guarded(self, fn: Callable[..., None]) -> Callable[..., None]:
        def hook(*args: Any) -> None:
            try:
                fn(*args)
            except Exception as exc:
                if self.on_error is None:
                    raise
                self.on_error(exc)
            return None  # a forward hook that returned something would replace the output

        return hook

    def _pre(self, path: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if self._active():
                self._open(path, module, args, kwargs)

        return self._guarded(hook)

    def _post(self, path: str, module: torch.nn.Module) -> Callable[..., None]:
        def hook(_module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            if not self._active() or not self._stack or self._stack[-1].path != path:
                return
            frame = self._stack.pop()
            k = frame.child_k or accumulation_length(module, args)
            if self._stack:
                self._stack[-1].child_k += k
            self.calls.append(self._compare(path, module, args, kwargs, output, frame, k))

        return self._guarded(hook)

    # -- one comparison --------------------------------------------------------------------------------------------
    def _compare(
        self,
        path: str,
        module: torch.nn.Module,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        output: Any,
        frame: _Frame,
        k: int,
    ) -> Call:
        outs = hooks.float_tensors(output)
        mtype = type(module).__name__
        dtype = str(outs[0].dtype).replace("torch.", "") if outs else None
        numel = sum(t.numel() for t in outs)
        call = Call(path, mtype, dtype, k, numel, None)
        if not outs:
            call.skipped = "no floating-point output"
        elif any(t._version != v for t, v in frame.versions):
            call.skipped = "modifies its input in place (the inputs it started from are gone)"
        elif (changed := _changed_state(frame.state, module)) is not None:
            call.skipped = f"keeps state in its tensor attribute {changed!r} (a second run would change it)"
        elif mtype in _COMMUNICATING or sharded.is_unit(module):
            call.skipped = "distributed wrapper (its forward communicates with the other ranks)"
        elif any(isinstance(t.grad_fn, torch.autograd.function.BackwardCFunction) for t in outs):
            call.skipped = "custom autograd Function (its forward may assume the half-precision dtype)"
        if call.skipped:
            return call
        try:
            refs = hooks.float_tensors(self._recompute(module, args, kwargs, frame.rng))
        except Exception as exc:  # a module that cannot run in FP32
            call.skipped = f"FP32 recomputation failed ({type(exc).__name__}: {str(exc)[:120]})"
            return call
        if len(refs) != len(outs) or any(r.shape != o.shape for r, o in zip(refs, outs)):
            call.skipped = "FP32 recomputation returned a different output structure"
            return call
        call.figures = _errors(outs, refs)
        if self.keep_root and path == self.modules[0][0]:
            self.root_ref = refs[0]  # the model output the one-off probe computes the FP32 loss from
        return call

    def _recompute(
        self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], start_rng: RngState
    ) -> Any:
        after = rng_get(start_rng[2])
        self._inside = True
        try:
            rng_set(start_rng)  # the same dropout mask as the half-precision forward drew
            device = start_rng[2].type if start_rng[2] is not None else "cpu"
            with torch.no_grad(), torch.autocast(device, enabled=False):
                return torch.func.functional_call(module, _state_copies(module), _up(args), _up(kwargs))
        finally:
            rng_set(after)  # training's RNG stream goes on as if nothing ran
            self._inside = False


def _errors(outs: list[torch.Tensor], refs: list[torch.Tensor]) -> torch.Tensor:
    """[sum of squared errors, sum of squared reference values, max |error|, max |reference|] in float64. The
    difference and the norms are taken in float32 (their own rounding, ~2^-24 relative, is far below any
    half-precision error)."""
    rows = []
    for o, r in zip(outs, refs):
        # float() then a same-dtype subtraction, and abs().amax(): on the CPU a mixed-dtype sub and an inf-norm
        # are ~1000x slower kernels (measured on 256x512: 30 ms and 12 ms against 0.02 ms)
        r = r.float()
        d = o.detach().float() - r
        if not d.numel():
            rows.append(torch.zeros(4, dtype=torch.float64, device=d.device))
            continue
        n = torch.stack(
            (torch.linalg.vector_norm(d), torch.linalg.vector_norm(r), d.abs().amax(), r.abs().amax())
        ).double()
        rows.append(torch.cat((n[:2].square(), n[2:])))
    if len(rows) == 1:
        return rows[0]
    s = torch.stack(rows)
    return torch.stack((s[:, 0].sum(), s[:, 1].sum(), s[:, 2].max(), s[:, 3].max()))


def summarize(calls: list[Call]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Per module path (calls merged: sums add, maxima max): the figures as host floats, in one transfer; and the
    skipped modules with their reasons."""
    measured = [c for c in calls if c.figures is not None]
    figures = [c.figures for c in calls if c.figures is not None]  # (measured's)
    skipped = {c.path: c.skipped for c in calls if c.skipped}
    if not measured:
        return [], skipped
    host = torch.stack([f.to(figures[0].device) for f in figures]).cpu().tolist()
    rows: dict[str, dict[str, Any]] = {}
    for c, (e2, r2, emax, rmax) in zip(measured, host):
        row = rows.get(c.path)
        if row is None:
            rows[c.path] = {
                "path": c.path,
                "module_type": c.module_type,
                "dtype": c.dtype,
                "k": c.k,
                "numel": c.numel,
                "calls": 1,
                "e2": e2,
                "r2": r2,
                "emax": emax,
                "rmax": rmax,
            }
        else:
            row.update(
                numel=row["numel"] + c.numel,
                calls=row["calls"] + 1,
                e2=row["e2"] + e2,
                r2=row["r2"] + r2,
                emax=max(row["emax"], emax),
                rmax=max(row["rmax"], rmax),
                k=max(row["k"], c.k),
            )
    out = []
    for r in rows.values():
        r["rel_err"] = roundoff.relative(math.sqrt(r.pop("e2")), math.sqrt(r["r2"]))
        r["ref_norm"] = math.sqrt(r.pop("r2"))
        r["max_err"] = roundoff.relative(r["emax"], r["rmax"])
        r["ref_absmax"] = r.pop("rmax")
        r.pop("emax")
        out.append(r)
    for path in skipped:
        skipped[path] = skipped[path] if path not in rows else skipped[path] + " (in some calls)"
    return out, skipped


# -- inside attach(): one probed step every N ---------------------------------------------------------------------
