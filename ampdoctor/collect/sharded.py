"""Sharded parameters on the training side: FSDP2 (``fully_shard``: parameters and gradients are DTensors) and FSDP1
(``FullyShardedDataParallel``: each rank holds a padded 1-D piece of a flat parameter).

Every statistic of a sharded tensor is taken on this rank's own shard (a DTensor's local tensor; a flat parameter's
pieces without the padding), never by gathering it, and never with a collective on the training thread: a
collective that one rank's observer starts and the others do not hangs every rank. What each shard is (placements,
mesh, this rank's share) is written once into the trace (meta ``sharding``), from which the offline side
(trace/shards.py) combines the ranks' traces exactly. FSDP's mixed precision (its policy per unit: FSDP casts the
parameters itself, without autocast, and reduces the gradients in its own dtype) goes into the precision
configuration (``config``)."""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import Any

import torch

from .buffers import dtype_name


def _dtensor_type() -> type | None:
    """DTensor, once torch.distributed.tensor is imported (no DTensor exists before; importing it costs ~0.1 s)."""
    mod = sys.modules.get("torch.distributed.tensor")
    return getattr(mod, "DTensor", None) if mod is not None else None


def is_dtensor(t: object) -> bool:
    cls = _dtensor_type()
    return cls is not None and isinstance(t, cls)


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (no communication; no autograd node), any other tensor as it is."""
    if is_dtensor(t):
        inner = getattr(t, "_local_tensor", None)  # to_local() would add an autograd node per call
        out: torch.Tensor = inner if inner is not None else t.to_local()  # type: ignore[attr-defined]
        return out
    return t


def _is_flat(p: object) -> bool:
    return bool(getattr(p, "_is_flat_param", False)) and hasattr(p, "_shard_param_infos")


class LocalParam:
    """A sharded parameter as the observer sees it: its local shard, its gradient's local shard (read at every access:
    FSDP assigns a new gradient DTensor each backward). Offers what the collect code reads of a parameter."""

    __slots__ = ("param",)

    def __init__(self, param: torch.nn.Parameter):
        self.param = param

    def _view(self, t: torch.Tensor) -> torch.Tensor:
        return local(t)

    @property
    def grad(self) -> torch.Tensor | None:  # read every step by the sentinel: kept short
        g = self.param.grad
        if g is None:
            return None
        return getattr(g, "_local_tensor", g) if type(self) is LocalParam else self._view(g)

    def detach(self) -> torch.Tensor:
        return self._view(self.param).detach()

    @property
    def dtype(self) -> torch.dtype:
        return self.param.dtype

    @property
    def device(self) -> torch.device:
        return self.detach().device

    @property
    def shape(self) -> torch.Size:
        return self.detach().shape

    @property
    def requires_grad(self) -> bool:
        return self.param.requires_grad

    def numel(self) -> int:
        return self.detach().numel()

    @property
    def whole_shape(self) -> list[int]:
        """The shape of the whole (unsharded) tensor."""
        return list(self.param.shape)


class FlatPiece(LocalParam):
    """One original parameter's piece of an FSDP1 flat parameter's local shard (``use_orig_params=False``): a 1-D
    view of ``numel`` values at ``offset`` (empty where this rank holds none of it); the padding is in no piece."""

    __slots__ = ("numel_", "offset", "shape_")

    def __init__(self, flat: torch.nn.Parameter, offset: int, numel: int, shape: list[int]):
        super().__init__(flat)
        self.offset, self.numel_, self.shape_ = offset, numel, shape

    def _view(self, t: torch.Tensor) -> torch.Tensor:
        return t.reshape(-1)[self.offset : self.offset + self.numel_]

    def numel(self) -> int:
        return self.numel_

    @property
    def whole_shape(self) -> list[int]:
        return self.shape_


def _flat_pieces(name: str, flat: Any) -> list[tuple[str, FlatPiece]]:
    prefix = name[: -len("_flat_param")] if name.endswith("_flat_param") else ""
    out = []
    for fqn, shape, info in zip(flat._fqns, flat._shapes, flat._shard_param_infos):
        offset, n = (info.offset_in_shard, info.numel_in_shard) if info.in_shard else (0, 0)
        out.append((prefix + fqn, FlatPiece(flat, offset, n, list(shape))))
    return out


class OrigPiece(LocalParam):
    """An original parameter of an FSDP1 unit with ``use_orig_params=True``: already this rank's 1-D piece of it
    (FSDP keeps it as a view into the flat shard; empty where this rank holds none), with the whole shape known."""

    __slots__ = ("flat", "shape_")

    def __init__(self, param: torch.nn.Parameter, flat: Any, shape: list[int]):
        super().__init__(param)
        self.flat, self.shape_ = flat, shape

    @property
    def whole_shape(self) -> list[int]:
        return self.shape_


def _orig_pieces(model: torch.nn.Module) -> dict[str, tuple[Any, list[int]]]:
    """FSDP1 units with ``use_orig_params=True``: parameter name -> (its unit's flat parameter, its whole shape)."""
    out: dict[str, tuple[Any, list[int]]] = {}
    for path, m in model.named_modules():
        flat = getattr(m, "_flat_param", None)
        if flat is None or not getattr(m, "_use_orig_params", False) or not _is_flat(flat):
            continue
        prefix = (f"{path}." if path else "") + "_fsdp_wrapped_module."
        for fqn, shape in zip(flat._fqns, flat._shapes):
            out[prefix + fqn] = (flat, [int(v) for v in shape])
    return out


def local_params(model: torch.nn.Module, params: list[tuple[str, torch.nn.Parameter]]) -> list[tuple[str, Any]]:
    """The trainable parameters as the observer reads them: a sharded one as its local shard (LocalParam), an FSDP1
    flat parameter as its original parameters' pieces (FlatPiece); the list itself when nothing is sharded (or when
    FSDP's internals are not what this reads: then the first DTensor stops collection with one warning)."""
    try:
        return _local_params(model, params)
    except Exception:
        return params


def _local_params(model: torch.nn.Module, params: list[tuple[str, torch.nn.Parameter]]) -> list[tuple[str, Any]]:
    orig = _orig_pieces(model) if any(type(m).__name__ == "FullyShardedDataParallel" for m in model.modules()) else {}
    if not orig and not any(is_dtensor(p) or _is_flat(p) for _, p in params):
        return params
    out: list[tuple[str, Any]] = []
    for name, p in params:
        if _is_flat(p):
            out += _flat_pieces(name, p)
        elif is_dtensor(p):
            out.append((name, LocalParam(p)))
        elif name in orig:
            out.append((name, OrigPiece(p, *orig[name])))
        else:
            out.append((name, p))
    return out


# -- what the trace records ----------------------------------------------------------------------------------------
def _world() -> tuple[int, int]:
    d = torch.distributed
    if d.is_available() and d.is_initialized():
        return d.get_rank(), d.get_world_size()
    return 0, 1


def _dtensor_spec(p: Any) -> dict[str, Any]:
    """Placements, mesh and this rank's coordinate; ``shards``: how many distinct pieces the ranks hold; ``replica``:
    which copy of its piece this rank holds (0 counts when the ranks are combined: HSDP replicates the shards)."""
    mesh = p.device_mesh
    shape = list(mesh.shape)
    coord = mesh.get_coordinate() or [0] * len(shape)
    shards, replica = 1, 0
    for size, c, pl in zip(shape, coord, p.placements):
        if pl.is_shard():
            shards *= size
        elif pl.is_replicate():
            replica = replica * size + c
    return {
        "placements": [repr(pl) for pl in p.placements],
        "mesh": shape,
        "coordinate": list(coord),
        "shards": shards,
        "replica": replica,
    }


def _fsdp1_spec(model: torch.nn.Module, flat: Any) -> dict[str, Any]:
    unit = next((m for m in model.modules() if getattr(m, "_flat_param", None) is flat), None)
    pg = getattr(unit, "process_group", None)
    d = torch.distributed
    shards = d.get_world_size(pg) if pg is not None else _world()[1]
    inter = getattr(unit, "_inter_node_pg", None)  # HYBRID_SHARD: the shard is replicated across nodes
    replica = d.get_rank(inter) if inter is not None else 0
    strategy = getattr(getattr(unit, "sharding_strategy", None), "name", None)
    if strategy == "NO_SHARD":  # every rank holds all of it: one copy counts
        shards, replica = 1, _world()[0]
    return {"placements": [f"flat ({strategy})" if strategy else "flat"], "shards": shards, "replica": replica}


def describe(model: torch.nn.Module, params: list[tuple[str, Any]]) -> dict[str, Any] | None:
    """The ``sharding`` meta entry: which parameters are sharded and how, or None when none is (or it cannot be
    read: the ranks' traces are then read apart, never combined). ``params`` maps a name to [spec index, numel of
    this rank's shard, the whole tensor's shape]; specs are shared by the parameters sharded alike."""
    try:
        return _describe(model, params)
    except Exception:
        return None


def _describe(model: torch.nn.Module, params: list[tuple[str, Any]]) -> dict[str, Any] | None:
    named = [(n, p) for n, p in params if isinstance(p, LocalParam)]
    if not named:
        return None
    specs: list[dict[str, Any]] = []
    keys: dict[str, int] = {}
    table: dict[str, list[Any]] = {}
    engine = "fsdp1" if any(isinstance(p, (FlatPiece, OrigPiece)) for _, p in named) else "fsdp2"
    by_flat: dict[int, dict[str, Any]] = {}  # an FSDP1 unit's spec, once per flat parameter
    for n, p in named:
        flat = p.param if isinstance(p, FlatPiece) else p.flat if isinstance(p, OrigPiece) else None
        if flat is not None:
            spec = by_flat.get(id(flat))
            if spec is None:
                spec = by_flat[id(flat)] = _fsdp1_spec(model, flat)
        else:
            spec = _dtensor_spec(p.param)
        key = repr(sorted(spec.items()))
        if key not in keys:
            keys[key] = len(specs)
            specs.append(spec)
        table[n] = [keys[key], int(p.numel()), [int(v) for v in p.whole_shape]]
    rank, world = _world()
    replicas = {s["replica"] for s in specs}
    return {
        "engine": engine,
        "rank": rank,
        "world_size": world,
        "replica": replicas.pop() if len(replicas) == 1 else None,  # the rank's copy (None: it differs by spec)
        "specs": specs,
        "params": table,
    }


# -- FSDP's mixed precision ------------------------------------------------------------------------------------------
def _name(dtype: object) -> str | None:
    return dtype_name(dtype) if isinstance(dtype, torch.dtype) else None


def _unit_params(unit: Any, is_unit: Callable[[torch.nn.Module], bool]) -> list[torch.nn.Parameter]:
    """The parameters a unit manages: those of its subtree outside nested units."""
    out, stack = list(unit.parameters(recurse=False)), list(unit.children())
    while stack:
        m = stack.pop()
        if is_unit(m):
            continue
        out += list(m.parameters(recurse=False))
        stack += list(m.children())
    return out


def _effective(
    param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None, params: list[Any]
) -> tuple[str | None, str | None]:
    """(compute dtype, reduce dtype) as FSDP applies a policy: no param_dtype computes in the parameters' own dtype;
    no reduce_dtype reduces in the compute dtype."""
    orig = next((p.dtype for p in params if p.is_floating_point()), None)
    compute = param_dtype if param_dtype is not None and orig is not None else orig
    reduce = reduce_dtype if reduce_dtype is not None else compute
    return _name(compute), _name(reduce)


def _fsdp2_units(model: torch.nn.Module) -> dict[str, dict[str, Any]]:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return {}
    units = {}
    for path, m in model.named_modules():
        if not isinstance(m, FSDPModule):
            continue
        policy = getattr(m._get_fsdp_state(), "_mp_policy", None)
        if policy is None:
            continue
        params = _unit_params(m, lambda x: isinstance(x, FSDPModule))
        compute, reduce = _effective(policy.param_dtype, policy.reduce_dtype, params)
        units[path or "(model)"] = {
            "param_dtype": _name(policy.param_dtype),
            "reduce_dtype": _name(policy.reduce_dtype),
            "output_dtype": _name(policy.output_dtype),
            "cast_forward_inputs": bool(policy.cast_forward_inputs),
            "compute": compute,
            "reduce": reduce,
            "params": int(sum(p.numel() for p in params)),
        }
    return units


def _fsdp1_units(model: torch.nn.Module) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    except ImportError:
        return {}, {}
    units: dict[str, dict[str, Any]] = {}
    extra: dict[str, Any] = {}
    for path, m in model.named_modules():
        if not isinstance(m, FSDP):
            continue
        mp = m.mixed_precision
        flat = getattr(m, "_flat_param", None)
        orig = [flat] if flat is not None else []
        compute, reduce = _effective(mp.param_dtype, mp.reduce_dtype, orig)
        units[path or "(model)"] = {
            "param_dtype": _name(mp.param_dtype),
            "reduce_dtype": _name(mp.reduce_dtype),
            "buffer_dtype": _name(mp.buffer_dtype),
            "keep_low_precision_grads": bool(mp.keep_low_precision_grads),
            "cast_forward_inputs": bool(mp.cast_forward_inputs),
            "cast_root_forward_inputs": bool(mp.cast_root_forward_inputs),
            "compute": compute,
            "reduce": reduce,
            "params": int(sum(flat._numels)) if flat is not None else 0,
        }
        strategy = getattr(m, "sharding_strategy", None)
        if strategy is not None:
            extra["sharding_strategy"] = strategy.name
        extra["use_orig_params"] = bool(getattr(m, "_use_orig_params", False))
    return units, extra


def config(model: torch.nn.Module) -> dict[str, Any] | None:
    """FSDP's mixed-precision configuration (config ``fsdp``): per unit (the module given to ``fully_shard`` /
    ``FullyShardedDataParallel``), its policy as given and the dtypes FSDP computes and reduces in; None without
    FSDP. Read from FSDP's state (private attributes; a torch that moved them records nothing)."""
    try:
        extra: dict[str, Any] = {}
        units, engine = _fsdp2_units(model), "fsdp2"
        if not units:
            (units, extra), engine = _fsdp1_units(model), "fsdp1"
    except Exception:
        return None
    if not units:
        return None
    world = _world()[1]
    reduced = sorted({u["reduce"] for u in units.values() if u["reduce"]})
    computed = sorted({u["compute"] for u in units.values() if u["compute"]})
    return {
        "engine": engine,
        "world_size": world,
        "units": units,
        "compute_dtypes": computed,
        "reduce_dtypes": reduced,
        **extra,
    }


def is_unit(module: torch.nn.Module) -> bool:
    """An FSDP unit (``fully_shard``-ed module or FSDP1 wrapper): calling its forward again gathers its parameters
    from the other ranks, so the probe never recomputes it."""
    return type(module).__name__ == "FullyShardedDataParallel" or hasattr(module, "_get_fsdp_state")


def param_count(model: torch.nn.Module) -> int:
    """The model's parameter count, sharded parameters counted whole (an FSDP1 rank holds pieces of flat ones)."""
    orig = _orig_pieces(model) if any(type(m).__name__ == "FullyShardedDataParallel" for m in model.modules()) else {}
    total = 0
    for name, p in model.named_parameters():
        if _is_flat(p):
            total += int(sum(p._numels))  # type: ignore[attr-defined]
        elif name in orig:
            total += math.prod(orig[name][1])
        else:
            total += p.numel()  # (a DTensor's numel is the whole tensor's)
    return int(total)
