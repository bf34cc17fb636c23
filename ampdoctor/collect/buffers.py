"""Where a step's figures wait for the step end: the [min, max] pairs of observed tensors, the plan that reduces
the parameter gradients, and the small reductions and conversions around the step's one host transfer."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..trace.vectors import Entry, Phase, peak_block
from . import compiled
from . import stats as K

SMALL_GRAD = 4096  # parameter gradients up to this size are stacked by size and reduced together
# The sentinel concatenates the gradients when they hold fewer values than this per gradient on average: copying a
# value costs ~0.3 ns on a CPU, a reduction's dispatch ~2.5 us, so below ~8,000 values each the copy is cheaper.
CAT_PER_GRAD = 8000


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


class PeakList:
    """[min, max] pairs of the tensors of one dtype and device observed this step, as the 0-d tensors aminmax
    returns; stacked once at the step end (``aminmax(out=...)`` into a preallocated buffer measured ~5 µs slower
    per call inside a training loop than one stack of them all). ``n`` counts the values."""

    def __init__(self, like: torch.Tensor, block: str) -> None:
        self.block_name = block
        self.device = like.device
        self.vals: list[torch.Tensor] = []
        self.n = 0

    def block(self) -> torch.Tensor:
        return torch.stack(self.vals)

    def clear(self) -> None:
        self.vals = []
        self.n = 0


class SlotBuffer:
    """Fixed [min, max] slots (one buffer per dtype and device) for tensors observed every step in the same order:
    the parameter gradients. Written in place by ``aminmax(out=...)``; lives as long as its plan."""

    def __init__(self, dtype: torch.dtype, device: torch.device, block: str, size: int) -> None:
        self.block_name = block
        self.device = device
        self.buf = torch.zeros(size, dtype=dtype, device=device)  # empty gradients keep [0, 0]
        self.slots = self.buf.unbind()  # 0-d views, made once: indexing per call would cost more
        self.n = 0

    def reserve(self, k: int) -> int:
        n = self.n
        self.n = n + k
        return n

    def block(self) -> torch.Tensor:
        return self.buf[: self.n]


class GradFigures:
    """(global L2 norm, largest |g|) over the parameter gradients: the sentinel's every-step figures. On the CPU, one
    native read of every gradient once the kernels are loaded (stats.native(); float32/bf16/fp16 gradients). Else
    one fused ``_foreach_norm`` for the norm; the peak by a fused inf-norm on an accelerator, and on the CPU (where
    an inf-norm is a scalar loop, ~40x slower) by one ``aminmax`` per gradient in a comprehension (no Python
    function call each), or, for many small gradients, one ``aminmax`` and one dot product of their concatenation.
    How to reduce is decided once per set of gradients (layout, device, sizes do not change between steps; a new
    count, dtype or device type of the first gradient plans again): reading a tensor attribute costs ~0.3 us, which per
    gradient and step would be most of a sentinel step on a CPU. The native read checks dtype, device and layout of
    every gradient itself, as it reads memory through their pointers."""

    def __init__(self) -> None:
        self._key: tuple[int, torch.dtype, bool] | None = None
        # The C++ read (compiled.py) of the parameters it was made for; False: their gradients are ones it does not
        # read (another device, sparse, float64), until they change
        self._compiled: Callable[[], tuple[float, float, int]] | bool | None = None
        self._compiled_for: list[Any] | None = None

    def _plan(self, grads: list[torch.Tensor], key: tuple[int, torch.dtype, bool]) -> None:
        self._key = key
        self.sparse = bool([g for g in grads if g.layout != torch.strided])
        self.host = K.on_host(grads[0]) and len({g.device for g in grads}) == 1
        self.cat = self.host and sum([dense_values(g).numel() for g in grads]) < CAT_PER_GRAD * len(grads)
        self.float32 = not self.sparse and all(g.dtype == torch.float32 for g in grads)
        # float32 results (float64 where a gradient is): an FP16 gradient's norm may exceed 65504 while its values do
        # not
        self.wide = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32

    def __call__(self, params: list[tuple[str, torch.nn.Parameter]]) -> tuple[Any, ...]:
        """Floats on the CPU, else 0-d device tensors that join the step's one transfer; (None, None) without
        gradients."""
        compiled_read = self._compiled
        if callable(compiled_read) and self._compiled_for is params:  # (the common call: one C++ read, no more)
            norm, peak, n = compiled_read()
            if n > 0:
                return norm, peak
        if self._compiled is not False:
            read = self._read_compiled(params)
            if read is not None:
                return read
        grads = [g for g in [p.grad for _, p in params] if g is not None]  # (.grad read once each)
        if not grads:
            return None, None
        key = (len(grads), grads[0].dtype, grads[0].is_cpu)  # (not .device: it makes a torch.device, ~1 us)
        if self._key != key:  # (model.to(), model.half())
            self._plan(grads, key)
            self._compiled = None  # (the C++ read may serve the new ones)
        if self.sparse:
            grads = [dense_values(g) for g in grads]
        if self.host:
            kernels = K.native()
            read = K.grad_norm_peak(kernels, grads) if kernels is not None else None
            if read is not None:
                return read
        wide = self.wide
        with torch.no_grad():
            if self.cat:  # one copy and three reductions beat ~2.5 us of dispatch per small gradient
                if self.float32:  # numpy concatenates the views ~10 us faster than torch.cat (no dispatch)
                    flat = np.concatenate([g.detach().numpy().reshape(-1) for g in grads])
                else:
                    flat = torch.cat([g.reshape(-1) for g in grads]).to(wide).numpy()
                return _norm_and_peak(flat)
            grads = [g for g in grads if g.numel()]
            if not grads:
                return 0.0, 0.0
            norms = torch._foreach_norm(grads, 2, dtype=wide)
            if self.host:  # (item() of each 0-d result: half the time of stacking them)
                ends = np.array([e.item() for g in grads for e in torch.aminmax(g)])
                v = np.array([n.item() for n in norms])
                return math.sqrt(float(np.dot(v, v))), float(max(-ends.min(), ends.max()))  # NaN propagates
            figures = norms + torch._foreach_norm(grads, math.inf, dtype=wide)
            dev = figures[0].device
            both = torch.stack([f if f.device == dev else f.to(dev) for f in figures]).to(torch.float64)
        k = len(grads)
        return both[:k].square().sum().sqrt(), both[k:].max()

    def _read_compiled(self, params: list[tuple[str, torch.nn.Parameter]]) -> tuple[Any, Any] | None:
        """The figures by one C++ call that reads every ``.grad`` itself (None: the extension is not loaded yet, or
        a gradient is one it does not read)."""
        read = self._compiled
        if read is None or self._compiled_for is not params:
            ext = compiled.get()
            if ext is None:
                return None
            tensors = [p for _, p in params]
            if not all([isinstance(p, torch.Tensor) for p in tensors]):  # (FSDP's local shards: sharded.LocalParam)
                self._compiled = False
                return None
            read = self._compiled = ext.Grads(tensors).figures
            self._compiled_for = params
        assert callable(read)
        norm, peak, n = read()
        if n < 0:
            self._compiled = False
            return None
        return (norm, peak) if n else (None, None)


def _norm_and_peak(flat: np.ndarray) -> tuple[float, float]:
    """(L2 norm, largest |x|) of float32 (or float64) values on the host; NaN propagates to both."""
    if not flat.size:
        return 0.0, 0.0
    mn, mx = float(flat.min()), float(flat.max())
    peak = max(-mn, mx) if mn == mn and mx == mx else math.nan
    with np.errstate(all="ignore"):  # (numpy would warn into the user's run)
        sq = float(np.dot(flat, flat))
        if sq == math.inf and math.isfinite(peak):  # finite values whose squares overflow float32
            sq = float(np.dot(flat.astype(np.float64), flat.astype(np.float64)))
    return math.sqrt(sq), peak


def count_nonfinite(tensors: list[torch.Tensor]) -> torch.Tensor:
    """How many of the tensors hold a NaN/Inf (their norm is then non-finite), without a host sync."""
    norms = torch.stack([n.to(torch.float32) for n in torch._foreach_norm([t.detach() for t in tensors])])
    return (~torch.isfinite(norms)).sum()


class GradPlan:
    """How the parameter gradients of a peaks step are reduced, built again only when the set of parameters with
    a gradient changes (a gradient has its parameter's dtype, device and shape). Each gradient gets fixed [min, max]
    slots in buffers of its own, so the step's entries for them are the same list every step. Small gradients of
    one size (biases, norm weights) are stacked and reduced together: on the CPU a reduction over 512 values costs
    its call overhead, not its arithmetic."""

    def __init__(
        self,
        params: list[tuple[str, torch.nn.Parameter]],
        present: tuple[bool, ...],
        site: Callable[[str, torch.Tensor], int],
    ) -> None:
        """params: (name, parameter) of every trainable parameter; present: which have a gradient this step;
        site(name, grad) -> the param_grad site id."""
        self.key = present
        params = [(name, p) for (name, p), has in zip(params, present) if has]
        by_size: dict[tuple[Any, ...], list[Any]] = {}
        for _, p in params:
            if 0 < p.numel() <= SMALL_GRAD and p.grad is not None and p.grad.layout == torch.strided:
                by_size.setdefault((p.dtype, p.device, p.numel()), []).append(p)
        grouped = {id(p) for g in by_size.values() if len(g) > 1 for p in g}
        slots: dict[tuple[Any, ...], int] = {}
        for _, p in params:
            slots[(p.dtype, p.device)] = slots.get((p.dtype, p.device), 0) + 2
        bufs = {
            (dtype, device): SlotBuffer(dtype, device, peak_block(dtype_name(dtype), str(device), grads=True), size)
            for (dtype, device), size in slots.items()
        }
        where: dict[int, int] = {}
        self.groups = []
        for (dtype, device, _n), group in by_size.items():
            if len(group) < 2:
                continue
            buf = bufs[(dtype, device)]
            base = buf.reserve(2 * len(group))
            self.groups.append(
                (
                    [p for p in group],
                    buf.buf[base : base + 2 * len(group) : 2],
                    buf.buf[base + 1 : base + 2 * len(group) : 2],
                )
            )
            for k, p in enumerate(group):
                where[id(p)] = base + 2 * k
        self.big = []
        for _, p in params:
            if id(p) in grouped:
                continue
            buf = bufs[(p.dtype, p.device)]
            off = where[id(p)] = buf.reserve(2)
            if p.numel():
                self.big.append((p, buf.slots[off], buf.slots[off + 1]))
        self.buffers = list(bufs.values())
        self.entries = []
        for name, p in params:
            assert p.grad is not None  # (params: the ones present)
            sid = site(name, p.grad)
            block = bufs[(p.dtype, p.device)].block_name
            self.entries.append(Entry(sid, Phase.PARAM, [(where[id(p)], block, p.numel())]))

    def run(self) -> None:
        """Write this step's [min, max] of every gradient into the slots."""
        with torch.no_grad():  # out= refuses inputs that require grad (create_graph=True)
            for p, lo, hi in self.big:
                assert p.grad is not None  # (the plan's key: present)
                g = dense_values(p.grad)
                if not g.numel():  # a sparse gradient that stores nothing this step
                    lo.zero_()
                    hi.zero_()
                    continue
                torch.aminmax(g, out=(lo, hi))
            for group, lo, hi in self.groups:
                rows = torch.stack([p.grad.reshape(-1) for p in group])
                torch.amin(rows, dim=1, out=lo)  # two single-purpose reductions beat aminmax(dim=1) 3x
                torch.amax(rows, dim=1, out=hi)


def dense_values(g: torch.Tensor) -> torch.Tensor:
    """A strided gradient as it is; a sparse one (``nn.Embedding(sparse=True)``) as its coalesced stored values,
    which hold its abs max and its sum of squares (the implicit zeros change neither)."""
    if g.layout == torch.strided:
        return g
    if g.layout == torch.sparse_coo:
        return g.coalesce().values()
    return g.values()  # compressed layouts store each element once


def sum_losses(losses: list[float | torch.Tensor]) -> float | torch.Tensor:
    """The step's loss, summed over micro-batches: a float when every part is on the CPU, else a device tensor."""
    if len(losses) == 1 and type(losses[0]) is float:  # (the common case: one micro-batch's, read on the host)
        return losses[0]
    if not any(isinstance(v, torch.Tensor) and not K.on_host(v) for v in losses):
        return sum(float(v) for v in losses)
    dev = next(v.device for v in losses if isinstance(v, torch.Tensor) and not K.on_host(v))
    parts = [
        v.to(dev, torch.float64)
        if isinstance(v, torch.Tensor)
        else torch.full((), float(v), dtype=torch.float64, device=dev)  # a fill: no host copy
        for v in losses
    ]
    return torch.stack(parts).sum()


def host_float64(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's values as a new float64 array (bf16, which numpy lacks, through its bits)."""
    if t.dtype == torch.bfloat16:
        bits = t.view(torch.int16).numpy().view(np.uint16).astype(np.uint32) << 16
        return bits.view(np.float32).astype(np.float64)
    return t.numpy().astype(np.float64)
