"""The operation behind a non-finite value, found on a replayed step: every aten operation the forward and backward
run passes through a dispatch mode, which checks its outputs. An operation whose output holds a NaN/Inf while its
inputs were finite made one; the values it made are followed (an operation fed a followed NaN/Inf that outputs
one passes it on), and the one that counts is the first whose NaN/Inf reached the step's results (the model's
outputs, the gradients). A NaN/Inf a model makes on purpose and then absorbs (T5's ``log(0)`` before a cast to
integers, an attention mask's ``-inf`` before a softmax) is therefore passed over. When the inputs of the operation
that counts were already within a binade of the format's max, the operation that produced those inputs made the
values and this one only tipped them over (the walk goes back while that holds). Each is named with the module it
ran in (the innermost module being executed, forward or backward), its dtype, its inputs' magnitudes and the line of
user code that called it.

Only replays run this (a check per operation costs a reduction, and on an accelerator a host read); the training
steps themselves never do."""

from __future__ import annotations

import math
import os
import traceback
import weakref
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.module_tracker import ModuleTracker

from ..formats import DTYPE_FORMATS
from ..formats import get as get_format
from ..trace.schema import ROOT

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_THIS_FILE = os.path.abspath(__file__)
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
# Operations that only move or view values: they cannot make a value, only pass one on.
_PASS_ON = {"view", "_unsafe_view", "reshape", "expand", "t", "transpose", "permute", "clone", "contiguous",
            "detach", "alias", "slice", "select", "squeeze", "unsqueeze", "as_strided", "split", "split_with_sizes",
            "cat", "stack", "copy_", "_to_copy", "to", "flatten", "unbind", "narrow", "index", "gather"}  # fmt: skip
# Operations that return memory they have not filled (empty_like, a resize): their outputs hold whatever was there.
_UNFILLED = ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "resize_", "empty_permuted")
KEPT_OPS = 200_000  # operations remembered for the walk back (metadata only, ~200 bytes each)
MAX_CANDIDATES = 64  # operations making a NaN/Inf from finite inputs, followed at once


@dataclass
class Operand:
    """One tensor operand of an operation: its dtype, shape and magnitudes."""

    dtype: str
    shape: list[Any]
    absmax: float  # largest finite |x| (0 when none)
    nonfinite: int  # NaN/Inf values
    zeros: int

    @classmethod
    def of(cls, t: torch.Tensor) -> Operand:
        d = t.detach()
        if not d.is_floating_point() or not d.numel():
            return cls(str(d.dtype).replace("torch.", ""), list(d.shape), 0.0, 0, 0)
        finite = torch.isfinite(d)
        absmax = float(torch.where(finite, d.abs(), torch.zeros((), dtype=d.dtype, device=d.device)).max())
        return cls(
            str(d.dtype).replace("torch.", ""),
            list(d.shape),
            absmax,
            int((~finite).sum()),
            int((d == 0).sum()),
        )


@dataclass
class OpRecord:
    """One operation of a replay, as the findings show it."""

    op: str  # e.g. "aten::exp"
    module: str  # the innermost module running it (a site path), ROOT outside any
    phase: str  # "fwd" or "bwd"
    dtype: str  # of its (first) output
    inputs: list[Any] = field(default_factory=list)  # Operand per tensor input
    output: dict[str, Any] = field(default_factory=dict)  # Operand of the first output
    line: str | None = None  # "file.py:42 in forward: code" of the user's code that called it
    index: int = 0  # its position among the replay's operations

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def user_line() -> str | None:
    """The innermost frame of the user's code inside the model's forward (or backward): outside torch, and below
    ampdoctor's replay, which called the model. None where only torch's own modules ran (an nn.Sequential): the
    line that called the replay (``optimizer.step()``) did not make the value."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        path = os.path.abspath(frame.filename)
        if path == _THIS_FILE or path.startswith(_TORCH_DIR) or "<frozen" in path:
            continue  # the tracer itself, torch's modules and dispatch
        if path.startswith(_PACKAGE_DIR):
            return None
        code = (frame.line or "").strip()
        return f"{os.path.basename(path)}:{frame.lineno} in {frame.name}: {code}"[:300]
    return None


def _limit(dtype: torch.dtype) -> float:
    name = str(dtype).replace("torch.", "")
    return get_format(name).max if name in DTYPE_FORMATS else math.inf


# Operations whose outputs reach this magnitude are remembered for the walk back: half the FP16 max, the smallest
# limit among the half-precision formats (BF16 and FP32 overflow far above it, so their producers are kept too).
REMEMBER_ABOVE = 65504.0 / 2


def _peak(t: torch.Tensor) -> float:
    """max |x| of a tensor: NaN when it holds a NaN, inf when an Inf (one reduction)."""
    if not t.numel():
        return 0.0
    return float(t.detach().abs().amax())


class OpTracer(TorchDispatchMode):  # type: ignore[no-untyped-call]  # (unannotated in torch)
    """A dispatch mode that finds the operation making the NaN/Inf that reached the step's results (``first``, once
    ``reached`` was told the results) and the chain of operations that produced the values it overflowed (``chain``:
    producer first). ``paused`` lets ampdoctor's own observation hooks run their reductions unseen."""

    def __init__(self, paths: dict[int, str]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # (unannotated in torch)
        self.paused = False
        self.count = 0
        # operations that made a NaN/Inf from finite inputs, in order, each with its chain (producer first)
        self.candidates: list[tuple[OpRecord, list[OpRecord]]] = []
        self._reached: set[int] = set()  # candidates whose NaN/Inf reached a result
        # id(non-finite output) -> (weakref to it, the candidate it descends from): the NaN/Inf followed
        self._taint: dict[int, tuple[Any, ...]] = {}
        self._tracker = _PathTracker(paths)
        # id(output) -> (weakref to it, what made it): only outputs of at least REMEMBER_ABOVE (rare in a healthy
        # net), held weakly: the replay keeps alive nothing the training step would not.
        self._made: dict[int, tuple[Any, ...]] = {}

    def __enter__(self) -> OpTracer:
        self._tracker.__enter__()  # type: ignore[no-untyped-call]  # (unannotated in torch)
        mode: OpTracer = super().__enter__()  # type: ignore[no-untyped-call]  # (unannotated in torch)
        return mode

    def __exit__(self, *exc: Any) -> Any:
        try:
            return super().__exit__(*exc)  # type: ignore[no-untyped-call]  # (unannotated in torch)
        finally:
            self._tracker.__exit__(*exc)  # type: ignore[no-untyped-call]  # (unannotated in torch)

    @property
    def first(self) -> OpRecord | None:
        """The operation that counts: the first whose NaN/Inf reached a result; where none was seen reaching one (a
        result outside what ``reached`` was told), the first that made one."""
        counted = self._counted()
        return counted[0] if counted else None

    @property
    def chain(self) -> list[OpRecord]:
        counted = self._counted()
        return counted[1] if counted else []

    def _counted(self) -> tuple[OpRecord, list[OpRecord]] | None:
        if not self.candidates:
            return None
        return self.candidates[min(self._reached) if self._reached else 0]

    def reached(self, tensors: Iterable[object]) -> None:
        """``tensors`` are results of the step (the model's outputs, the parameters' gradients): the candidates whose
        NaN/Inf they carry count."""
        for t in tensors:
            hit = self._taint.get(id(t)) if isinstance(t, torch.Tensor) else None
            if hit is not None and hit[0]() is t:
                self._reached.add(hit[1])

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.paused or len(self.candidates) >= MAX_CANDIDATES:
            return out
        try:
            self._look(func, args, kwargs or {}, out)
        except Exception:  # an operand the checks cannot read (a sparse or quantized tensor): not this one
            pass
        return out

    def _look(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        index = self.count
        self.count += 1
        outs = [t for t in _tensors(out) if t.is_floating_point()]
        if not outs:
            return
        peaks = [_peak(t) for t in outs]
        top = max(peaks)
        if math.isfinite(top) and top < REMEMBER_ABOVE:
            return  # the common case: one reduction per output, nothing kept
        name = func._schema.name if hasattr(func, "_schema") else str(func)
        if name.rsplit("::", 1)[-1] in _UNFILLED:
            return
        ins = [t for t in _tensors((args, kwargs)) if t.is_floating_point()]
        module, phase = self._tracker.where()
        if not math.isfinite(top):
            bad = [t for t in outs if not math.isfinite(_peak(t))]
            followed = [hit[1] for t in ins if (hit := self._taint.get(id(t))) is not None and hit[0]() is t]
            if followed:  # a NaN/Inf passed on (its own input may be the output, in place)
                self._follow(bad, min(followed))
            elif all(math.isfinite(_peak(t)) for t in ins):
                record = _record(name, module, phase, outs[0], ins, index)
                record.line = user_line()
                self.candidates.append((record, self._walk_back(ins, _limit(outs[0].dtype)) + [record]))
                self._follow(bad, len(self.candidates) - 1)
            return
        if len(self._made) < KEPT_OPS:
            # What made this output, resolved now while its inputs are alive (a view's source is often freed at
            # once): an operation that only moves values stands for the one that made its large input.
            parents = [self._made[id(t)][1] for t in ins if id(t) in self._made and self._made[id(t)][0]() is t]
            short = name.rsplit("::", 1)[-1].split(".")[0]
            if short in _PASS_ON and len(parents) == 1:
                made = parents[0]
            else:
                record = _record(name, module, phase, outs[0], ins, index)
                record.line = user_line() if short not in _PASS_ON else None
                made = _Made(record, top, parents, short in _PASS_ON)
            for t in outs:
                self._made[id(t)] = (weakref.ref(t), made)

    def _follow(self, tensors: list[torch.Tensor], candidate: int) -> None:
        for t in tensors:
            self._taint[id(t)] = (weakref.ref(t), candidate)

    def _walk_back(self, ins: list[torch.Tensor], limit: float) -> list[OpRecord]:
        """The operations that made the inputs of the bad one, while those inputs ran within a binade of ``limit``
        (producer first). Operations that only move values (views, copies, casts) are passed through."""
        chain: list[OpRecord] = []
        frontier = [hit[1] for t in ins if (hit := self._made.get(id(t))) is not None and hit[0]() is t]
        seen: set[int] = set()
        while frontier and len(chain) < 32:
            made = frontier.pop(0)
            if id(made) in seen or made.peak < limit / 2:
                continue
            seen.add(id(made))
            if not made.passes_on:
                chain.insert(0, made.record)
            frontier += made.parents
        return chain


@dataclass
class _Made:
    """What made a large output: the operation, the output's peak, and what made its own large inputs."""

    record: OpRecord
    peak: float
    parents: list[Any]
    passes_on: bool


def _record(name: str, module: str, phase: str, out: torch.Tensor, ins: list[Any], index: int) -> OpRecord:
    return OpRecord(
        op=name,
        module=module,
        phase=phase,
        dtype=str(out.dtype).replace("torch.", ""),
        inputs=[asdict(Operand.of(t)) for t in ins[:8]],
        output=asdict(Operand.of(out)),
        index=index,
    )


def _tensors(obj: object, depth: int = 0) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if depth > 3:
        return []
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o, depth + 1)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o, depth + 1)]
    return []


class _PathTracker(ModuleTracker):
    """torch's ModuleTracker (which modules are running, forward or backward), with modules named by their site paths
    (``paths``: id(module) -> path) instead of class names."""

    def __init__(self, paths: dict[int, str]) -> None:
        super().__init__()
        self._paths = paths
        self._names = set(paths.values())

    def _get_mod_name(self, mod: torch.nn.Module) -> str:
        return self._paths.get(id(mod), type(mod).__name__)

    def where(self) -> tuple[str, str]:
        """(the innermost module running, "fwd" or "bwd")."""
        known = [p for p in self.parents if p in self._names]
        if not known:
            return ROOT, "bwd" if self.is_bw else "fwd"
        inner = max(known, key=lambda p: (0 if p == ROOT else p.count(".") + 1, len(p)))
        return inner, "bwd" if self.is_bw else "fwd"
