"""Counting the host syncs of a training loop, per step and per party: ampdoctor's own, the GradScaler's (its found-inf
check in ``step()``), and the loop's (``loss.item()``, the optimizer, anything else). Used by
benchmarks/device_check.py and tests/test_device_path.py.

- ``HostReads`` (any device): every read of tensor values on the host (``item``, ``tolist``, ``numpy``, ``cpu``,
  ``float(t)``, ``bool(t)``, ...) through a ``TorchFunctionMode``. On the CPU such a read costs nothing; run with
  ``ampdoctor.collect.stats.HOST_READS = False`` (the accelerator path emulated) each read of ampdoctor's is one that
  would be a device sync on an accelerator.
- ``SyncWarnings`` (CUDA): ``torch.cuda.set_sync_debug_mode("warn")`` makes every synchronizing CUDA call (a
  device-to-host copy, ``item()``, a pageable host-to-device copy, a stream synchronize) warn; each warning is counted
  with the party whose code made the call.

A call is charged to the innermost frame that is ampdoctor's (its package), the GradScaler's (torch/amp/grad_scaler.py)
or the loop's (any other code outside torch); torch's own frames in between are passed over (an optimizer's step is
charged to the loop that called it, a hook ampdoctor installed to ampdoctor).
"""

from __future__ import annotations

import os
import sys
import warnings
from collections import defaultdict
from types import FrameType
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

import ampdoctor
from ampdoctor.collect import transfer

AMPDOCTOR, SCALER, LOOP = "ampdoctor", "GradScaler", "loop"
PARTIES = (AMPDOCTOR, SCALER, LOOP)
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_PACKAGE = os.path.dirname(os.path.abspath(ampdoctor.__file__)) + os.sep
_SCALER_FILE = os.path.join(_TORCH, "amp", "grad_scaler.py")
_PASSED = (os.path.abspath(__file__), os.path.abspath(warnings.__file__))
READS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.numpy,
    torch.Tensor.cpu,
    torch.Tensor.__float__,
    torch.Tensor.__int__,
    torch.Tensor.__bool__,
    torch.Tensor.__index__,
}
# Calls that read no value in Python but wait for the device on CUDA: an output whose size depends on the values
# (torch.bincount reads the input's min and max on the host, nonzero counts the non-zeros), a boolean index (a nonzero
# inside), a result Python receives as a bool, a tensor made from host data on the device (``torch.tensor(v,
# device=...)``: a copy from pageable memory, which CUDA follows with a stream synchronize).
CUDA_SYNCS = {
    torch.bincount,
    torch.Tensor.bincount,
    torch.nonzero,
    torch.Tensor.nonzero,
    torch.argwhere,
    torch.Tensor.argwhere,
    torch.masked_select,
    torch.Tensor.masked_select,
    torch.unique,
    torch.Tensor.unique,
    torch.unique_consecutive,
    torch.Tensor.unique_consecutive,
    torch.equal,
    torch.Tensor.equal,
    torch.allclose,
    torch.Tensor.allclose,
    torch.is_nonzero,
    torch.Tensor.is_nonzero,
}
# ... and these only with some arguments (see syncs_on_cuda)
_INDEXING = {torch.Tensor.__getitem__, torch.Tensor.__setitem__, torch.Tensor.index_put_, torch.Tensor.index_put}
_REPEAT = {torch.repeat_interleave, torch.Tensor.repeat_interleave}
_HISTC = {torch.histc, torch.Tensor.histc}
_FROM_HOST = {torch.tensor, torch.as_tensor}


def syncs_on_cuda(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether a call that reads no value on the host waits for the device on CUDA (see CUDA_SYNCS)."""
    if func in CUDA_SYNCS:
        return True
    if func in _INDEXING:
        index = args[1] if len(args) > 1 else kwargs.get("indices")
        parts = index if isinstance(index, (tuple, list)) else (index,)
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in parts)
    if func is torch.where:  # where(condition) is nonzero(condition, as_tuple=True)
        return len(args) + len(kwargs) == 1
    if func in _REPEAT:  # the output's size is the sum of the repeats, unless output_size gives it
        if func is torch.repeat_interleave and len(args) + len(kwargs) == 1:  # repeat_interleave(repeats)
            return True
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        given = args[3] if len(args) > 3 else kwargs.get("output_size")
        return isinstance(repeats, torch.Tensor) and given is None
    if func in _FROM_HOST:  # host data copied to a device: a pageable copy, then a stream synchronize, on CUDA
        data = args[0] if args else kwargs.get("data")
        return kwargs.get("device") is not None and not isinstance(data, torch.Tensor)
    if func in _HISTC:  # min == max (the default 0, 0): the range is read from the values
        lo = args[3] if len(args) > 3 else kwargs.get("min", 0)
        hi = args[4] if len(args) > 4 else kwargs.get("max", 0)
        return lo == hi
    return False


SYNC_WARNING = "synchronizing CUDA operation"  # c10::cuda::warn_or_error_on_sync's message


def whose(frame: FrameType) -> str | None:
    """The party one frame belongs to; None for torch's own frames and this module's."""
    path = frame.f_code.co_filename
    if path.startswith(_PACKAGE):
        return AMPDOCTOR
    if path == _SCALER_FILE:
        return SCALER
    if path.startswith(_TORCH) or path in _PASSED or path.startswith("<frozen"):
        return None
    return LOOP


def caller(frame: FrameType | None) -> tuple[str, FrameType | None]:
    """Whose code, from ``frame`` outwards, made the call (see the module docstring), and its frame."""
    while frame is not None:
        who = whose(frame)
        if who is not None:
            return who, frame
        frame = frame.f_back
    return LOOP, None


class Counts:
    """Calls per party and step; ``step`` is set by the loop before each step (-1: before the loop)."""

    def __init__(self) -> None:
        self.step = -1
        self.counts: dict[str, dict[int, int]] = {p: defaultdict(int) for p in PARTIES}
        self.where: dict[str, dict[str, int]] = {p: defaultdict(int) for p in PARTIES}  # "file:line" -> calls

    def add(self, frame: FrameType | None) -> None:
        who, f = caller(frame)
        self.counts[who][self.step] += 1
        if f is not None:
            self.where[who][f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno} in {f.f_code.co_name}"] += 1

    @property
    def by_step(self) -> dict[int, int]:
        """ampdoctor's calls per step."""
        return self.counts[AMPDOCTOR]


class HostReads(TorchFunctionMode, Counts):
    """Counts the reads of tensor values on the host, per party and step. A read of a finished transfer's host memory
    (``transfer.READING``) is no device read and is left out. Apart, in ``on_cuda``: the calls that read no value on
    the host but synchronize on CUDA (``syncs_on_cuda``: an output whose size depends on the values, ``bincount``,
    ``nonzero``, boolean indexing...), which a CPU run cannot see otherwise."""

    def __init__(self) -> None:
        TorchFunctionMode.__init__(self)
        Counts.__init__(self)
        self.on_cuda = Counts()

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func in READS:
            if not transfer.READING[0]:
                self.add(sys._getframe(1))
        elif syncs_on_cuda(func, args, kwargs or {}):
            self.on_cuda.step = self.step
            self.on_cuda.add(sys._getframe(1))
        return func(*args, **(kwargs or {}))


class SyncWarnings(Counts):
    """CUDA: ``torch.cuda.set_sync_debug_mode("warn")`` while inside, each synchronizing call counted per party and
    step (the warnings themselves are not shown); the mode and the warning filters are put back on exit."""

    def __enter__(self) -> SyncWarnings:
        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.filterwarnings("always", message=f".*{SYNC_WARNING}")
        # Shown warnings reach warnings._showwarnmsg_impl unless showwarning was replaced (logging.captureWarnings):
        # the sync warnings are taken there, every other warning goes where it went before.
        before_impl, before_show = warnings._showwarnmsg_impl, warnings.showwarning
        original = warnings._showwarning_orig

        def impl(msg: warnings.WarningMessage) -> None:
            if SYNC_WARNING in str(msg.message):
                self.add(sys._getframe(1))
            elif before_show is not original:
                before_show(msg.message, msg.category, msg.filename, msg.lineno, msg.file, msg.line)
            else:
                before_impl(msg)

        warnings.showwarning = original
        warnings._showwarnmsg_impl = impl
        self._mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc: object) -> None:
        torch.cuda.set_sync_debug_mode(self._mode)
        self._catch.__exit__(*exc)
