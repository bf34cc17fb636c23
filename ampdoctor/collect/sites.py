"""The sites of a run: one id per (path, kind), announced to the writer the first time it is observed."""

from __future__ import annotations

import threading

import torch

from ..trace.messages import SiteMsg
from ..trace.schema import ROOT
from .buffers import dtype_name
from .guards import text


class Sites:
    """Site ids by (path, kind). ``act`` and ``grad`` map a module path alone to its id: the hooks' lookups build
    no tuple per call."""

    def __init__(self, model: torch.nn.Module, put):
        self.ids: dict[tuple[str, str], int] = {}
        self.act: dict[str, int] = {}
        self.grad: dict[str, int] = {}
        self._put = put
        self._lock = threading.Lock()
        # the module owning each parameter, by the parameter's full name
        self.owner = {
            (f"{m}." if m else "") + n: mod
            for m, mod in model.named_modules()
            for n, _ in mod.named_parameters(recurse=False)
        }

    def get(self, path: str, kind: str, module, t: torch.Tensor | None, step: int) -> int:
        sid = self.ids.get((path, kind))
        if sid is None:
            with self._lock:  # backward hooks of several devices run on autograd's per-device threads
                return self._new(path, kind, module, t, step)
        return sid

    def param(self, name: str, kind: str, t: torch.Tensor, step: int) -> int:
        """The site of a parameter's gradient, weight or update (its module: the parameter's owner)."""
        return self.get(name, kind, self.owner.get(name), t, step)

    def _new(self, path: str, kind: str, module, t: torch.Tensor | None, step: int) -> int:
        sid = self.ids.get((path, kind))
        if sid is None:
            sid = len(self.ids)
            self.ids[(path, kind)] = sid
            if kind in ("act", "grad_out"):
                mod_path, mtype = path, type(module).__name__
            else:
                mod_path, mtype = path.rpartition(".")[0] or ROOT, type(module).__name__ if module else None
            dtype = dtype_name(t.dtype) if t is not None else None
            shape = "x".join(map(str, t.shape)) if t is not None else None
            self._put(SiteMsg(sid, text(path), text(mod_path), kind, mtype and text(mtype), dtype, shape, step))
        return sid
