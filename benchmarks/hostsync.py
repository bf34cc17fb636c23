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
# Calls whose output size depends on the values: on CUDA they wait for the device (torch.bincount reads the input's
# min and max on the host), though no value reaches Python.
CUDA_SYNCS = {
    torch.bincount,
    torch.Tensor.bincount,
    torch.nonzero,
    torch.Tensor.nonzero,
    torch.masked_select,
    torch.Tensor.masked_select,
    torch.unique,
    torch.Tensor.unique,
    torch.repeat_interleave,
}
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
    the host but synchronize on CUDA (an output whose size depends on the values: ``bincount``, ``nonzero``, boolean
    indexing...), which a CPU run cannot see otherwise."""

    def __init__(self) -> None:
        TorchFunctionMode.__init__(self)
        Counts.__init__(self)
        self.on_cuda = Counts()

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func in READS:
            if not transfer.READING[0]:
                self.add(sys._getframe(1))
        elif func in CUDA_SYNCS or (func is torch.Tensor.__getitem__ and _boolean_index(args)):
            self.on_cuda.step = self.step
            self.on_cuda.add(sys._getframe(1))
        return func(*args, **(kwargs or {}))


def _boolean_index(args: tuple) -> bool:
    index = args[1] if len(args) > 1 else None
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in parts)


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
