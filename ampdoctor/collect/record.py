"""What one step observed, waiting for the step end: the observations (Entry: which values belong to which site)
and the values they point at, in blocks concatenated at the step end into the step's one host transfer:
[min, max] pairs per (dtype, device) | full-statistics vectors | step figures (extras)."""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from ..trace.vectors import EXTRAS_BLOCK, FULL_BLOCK, FULL_LEN, HEAD, KEY_INF, Entry, peak_block
from . import buffers, sharded, stats
from .options import Observe
from .transfer import Ready, Transfer


class StepRecord:
    def __init__(self) -> None:
        # PeakList per dtype (or (dtype, device)): kept across steps, cleared
        self._bufs: dict[torch.dtype | tuple[torch.dtype, torch.device], buffers.PeakList] = {}
        self._new_containers()
        self._device_fulls = False  # a full vector is a device tensor
        self._device_extras = False  # an extra is a device tensor (read with the step's transfer)

    def _new_containers(self) -> None:
        self.entries: list[Entry] = []
        self._fulls: list[torch.Tensor | np.ndarray] = []  # (numpy: the native kernel's, already on the host)
        self._full_len = 0
        # floats, or 0-d tensors on an accelerator (read with the step's transfer)
        self._extras: list[float | torch.Tensor] = []
        self._seen: dict[int, tuple[weakref.ref[torch.Tensor], int, tuple[int, str, int]]] = {}
        self.act_seen: set[int] = set()  # sites whose forward was recorded this step (checkpointing recomputes)

    def clear(self) -> None:
        """A new step. Its containers are new ones where the last step filled them (a flight keeps its entries),
        and kept where they are empty: a sentinel step records nothing, and makes nothing here."""
        for buf in self._bufs.values():
            buf.clear()
        if self.entries or self._fulls or self._extras or self._seen or self.act_seen:
            self._new_containers()
        self._device_fulls = self._device_extras = False

    def drop_observations(self) -> None:
        """Forget what the step observed so far (its step figures stay): the step has no end in sight."""
        extras, device_extras = self._extras, self._device_extras
        self.clear()
        self._extras, self._device_extras = extras, device_extras

    def add_full(self, vec: torch.Tensor | np.ndarray) -> int:
        off = self._full_len
        if not self._device_fulls and not isinstance(vec, np.ndarray) and not stats.on_host(vec):
            self._device_fulls = True
        self._fulls.append(vec)
        self._full_len += FULL_LEN
        return off

    def add_extra(self, v: float | torch.Tensor) -> int:
        """A step figure: a float, or a 0-d tensor (read now if it is on the CPU, where that costs no sync)."""
        if isinstance(v, torch.Tensor):
            if stats.on_host(v):
                v = v.item()
            else:
                self._device_extras = True
        self._extras.append(v)
        return len(self._extras) - 1

    def _buffer(self, t: torch.Tensor) -> buffers.PeakList:
        buf = self._bufs.get(t.dtype)
        if buf is None or buf.device != t.device:
            key = t.dtype if buf is None else (t.dtype, t.device)  # a second device: its own buffer
            buf = self._bufs.get(key)
            if buf is None:
                buf = self._bufs[key] = buffers.PeakList(
                    t, peak_block(buffers.dtype_name(t.dtype), None if key is t.dtype else str(t.device))
                )
        return buf

    def observe(self, t: torch.Tensor, want: Observe) -> tuple[int, str, int]:
        """Statistics of one tensor for this step (a peak, or full statistics), computed once per tensor (a module's
        output is often the next module's input, and a container's output is its last child's)."""
        if type(t) is not torch.Tensor and sharded.is_dtensor(t):  # its shard: never a collective (sharded.py)
            t = sharded.local(t)
        key = id(t)
        hit = self._seen.get(key)
        if (
            hit is not None
            and hit[0]() is t
            and hit[1] == t._version
            and (hit[2][1] == FULL_BLOCK or want is Observe.PEAK)
        ):
            return hit[2]
        n = t.numel()
        if want is Observe.FULL:
            vec = stats.full_host(t)
            ref = (self.add_full(vec if vec is not None else stats.full(t)), FULL_BLOCK, n)
        else:  # PeakList.add inlined: two calls fewer per observed tensor
            d = t.detach()
            buf = self._bufs.get(d.dtype)
            if buf is None or buf.device != d.device:
                buf = self._buffer(d)
            off = buf.n
            buf.vals.extend(torch.aminmax(d if n else d.new_zeros(1)))
            buf.n = off + 2
            ref = (off, buf.block_name, n)
        self._seen[key] = (weakref.ref(t), t._version, ref)
        return ref

    def start_transfer(self, grad_buffers: Iterable[buffers.SlotBuffer] = ()) -> HostCopy:
        """Everything the step computed, in one transfer: [peaks per buffer | full vectors | extras] as float64
        (``grad_buffers``: the parameter gradients' slots of a peaks step). On the CPU the values are read now; on an
        accelerator the copy is issued and read later (transfer.py)."""
        blocks: list[torch.Tensor] = []
        bases: dict[str, int] = {}
        n = 0
        for buf in self._bufs.values():
            if buf.n:
                bases[buf.block_name] = n
                blocks.append(buf.block())
                n += buf.n
        for slots in grad_buffers:
            if slots.n:
                bases[slots.block_name] = n
                blocks.append(slots.block())
                n += slots.n
        extras = self._extras
        bases[FULL_BLOCK] = n
        bases[EXTRAS_BLOCK] = n + self._full_len
        n_fulls = len(self._fulls)
        on_cpu = all([stats.on_host(b) for b in blocks]) and not self._device_fulls and not self._device_extras
        if on_cpu:  # already on the host: numpy copies, no torch op per block
            values = np.concatenate(
                [buffers.host_float64(b) for b in blocks]
                + [f if isinstance(f, np.ndarray) else f.numpy() for f in self._fulls]
                + [np.array(extras, dtype=np.float64)]
            )
            return HostCopy(Ready(values), bases, n, n_fulls)
        fulls = [torch.from_numpy(f) if isinstance(f, np.ndarray) else f for f in self._fulls]
        dev = next(t.device for t in [*blocks, *fulls, *extras] if isinstance(t, torch.Tensor))
        parts = [b.to(dev, torch.float64) for b in blocks] + [f.to(dev) for f in fulls]
        if extras:
            parts.append(
                torch.stack(
                    [
                        e.to(dev, torch.float64).reshape(())
                        if isinstance(e, torch.Tensor)
                        else torch.full((), float(e), dtype=torch.float64, device=dev)  # a fill: no host copy
                        for e in extras
                    ]
                )
            )
        return HostCopy(Transfer(torch.cat(parts)), bases, n, n_fulls)  # cat copies: the buffers are reused


class HostCopy:
    """A step's values on their way to the host, with where each block starts."""

    def __init__(self, copy: Transfer | Ready, bases: dict[str, Any], n_peaks: int, n_fulls: int) -> None:
        self.copy = copy
        self.bases = bases
        self._n_peaks = n_peaks
        self._n_fulls = n_fulls

    def ready(self) -> bool:
        return self.copy.ready()

    def result(self) -> tuple[np.ndarray, dict[str, Any], bool]:
        """(values, bases, whether any observed value was NaN/Inf: a NaN min/max, or a full vector's NaN/Inf
        count)."""
        values = self.copy.values()
        n = self._n_peaks
        bad = bool(n) and not np.isfinite(values[:n]).all()  # (a sentinel step has no peaks: no numpy call)
        if self._n_fulls:
            fulls = values[n : self.bases[EXTRAS_BLOCK]].reshape(-1, FULL_LEN)
            bad = bad or bool(fulls[:, HEAD + KEY_INF :].any())
        return values, self.bases, bad
