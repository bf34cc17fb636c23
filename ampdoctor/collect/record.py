"""What one step observed, waiting for the step end: the observations (Entry: which values belong to which site)
and the values they point at, in blocks concatenated at the step end into the step's one host transfer:
[min, max] pairs per (dtype, device) | full-statistics vectors | step figures (extras)."""

from __future__ import annotations

import weakref

import numpy as np
import torch

from ..trace.vectors import EXTRAS_BLOCK, FULL_BLOCK, Entry, peak_block
from . import buffers, sharded, stats
from .options import Observe
from .transfer import Ready, Transfer

_NUMBERS = {float, int}


class StepRecord:
    def __init__(self):
        self._bufs: dict = {}  # PeakList per dtype (or (dtype, device)): kept across steps, cleared
        self.clear()

    def clear(self) -> None:
        for buf in self._bufs.values():
            buf.clear()
        self.entries: list[Entry] = []
        self._fulls: list[torch.Tensor] = []
        self._full_len = 0
        self._extras: list = []  # floats, or 0-d tensors on an accelerator (read with the step's transfer)
        self._seen: dict[int, tuple] = {}
        self.act_seen: set[int] = set()  # sites whose forward was recorded this step (checkpointing recomputes)

    def drop_observations(self) -> None:
        """Forget what the step observed so far (its step figures stay): the step has no end in sight."""
        extras = self._extras
        self.clear()
        self._extras = extras

    def add_full(self, vec: torch.Tensor) -> int:
        off = self._full_len
        self._fulls.append(vec)
        self._full_len += stats.FULL_LEN
        return off

    def add_extra(self, v) -> int:
        """A step figure: a float, or a 0-d tensor (read now if it is on the CPU, where that costs no sync)."""
        if isinstance(v, torch.Tensor) and stats.on_host(v):
            v = v.item()
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
            ref = (self.add_full(stats.full(t)), FULL_BLOCK, n)
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

    def start_transfer(self, grad_buffers=()) -> HostCopy:
        """Everything the step computed, in one transfer: [peaks per buffer | full vectors | extras] as float64
        (``grad_buffers``: the parameter gradients' slots of a peaks step). On the CPU the values are read now; on an
        accelerator the copy is issued and read later (transfer.py)."""
        blocks, bases, n = [], {}, 0
        for buf in [*self._bufs.values(), *grad_buffers]:
            if buf.n:
                bases[buf.block_name] = n
                blocks.append(buf.block())
                n += buf.n
        bases[FULL_BLOCK] = n
        bases[EXTRAS_BLOCK] = n + self._full_len
        extras = self._extras
        n_fulls = len(self._fulls)
        if not blocks and not self._fulls and {type(e) for e in extras} <= _NUMBERS:
            return HostCopy(Ready(np.array(extras, dtype=np.float64)), bases, n, 0)  # a sentinel step on the CPU
        on_cpu = (
            all(stats.on_host(b) for b in blocks)
            and all(stats.on_host(f) for f in self._fulls)
            and not any(isinstance(e, torch.Tensor) for e in extras)
        )
        if on_cpu:  # already on the host: numpy copies, no torch op per block
            values = np.concatenate(
                [buffers.host_float64(b) for b in blocks]
                + [f.numpy() for f in self._fulls]
                + [np.array(extras, dtype=np.float64)]
            )
            return HostCopy(Ready(values), bases, n, n_fulls)
        dev = next(t.device for t in [*blocks, *self._fulls, *extras] if isinstance(t, torch.Tensor))
        parts = [b.to(dev, torch.float64) for b in blocks] + [f.to(dev) for f in self._fulls]
        if extras:
            parts.append(
                torch.stack(
                    [
                        e.to(dev, torch.float64).reshape(())
                        if isinstance(e, torch.Tensor)
                        else torch.tensor(float(e), dtype=torch.float64, device=dev)
                        for e in extras
                    ]
                )
            )
        return HostCopy(Transfer(torch.cat(parts)), bases, n, n_fulls)  # cat copies: the buffers are reused


class HostCopy:
    """A step's values on their way to the host, with where each block starts."""

    def __init__(self, copy: Transfer | Ready, bases: dict, n_peaks: int, n_fulls: int):
        self.copy = copy
        self.bases = bases
        self._n_peaks = n_peaks
        self._n_fulls = n_fulls

    def ready(self) -> bool:
        return self.copy.ready()

    def result(self) -> tuple[np.ndarray, dict, bool]:
        """(values, bases, whether any observed value was NaN/Inf: a NaN min/max, or a full vector's NaN/Inf
        count)."""
        values = self.copy.values()
        n = self._n_peaks
        bad = not np.isfinite(values[:n]).all()
        if self._n_fulls:
            fulls = values[n : self.bases[EXTRAS_BLOCK]].reshape(-1, stats.FULL_LEN)
            bad = bad or bool(fulls[:, stats.HEAD + stats.KEY_INF :].any())
        return values, self.bases, bad
