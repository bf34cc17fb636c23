"""How the code is kept: no module reads another's private names (attributes, imports, getattr strings), walked from
the source with ast as tests/test_imports.py walks imports. A private name may be used by the module that defines it;
the few private names of torch (and os._exit) that ampdoctor must read are listed with the reason, and nothing
else."""

import ast
import os

from source import parse

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDERS = ("ampdoctor", "dashboards")
# torch's private names ampdoctor reads, each because no public API gives it:
THIRD_PARTY = {
    "_version": "Tensor._version: the in-place counter (a tensor seen twice in a step, inputs changed in place)",
    "_foreach_norm": "torch._foreach_norm: one fused norm over a list of tensors (the sentinel, weight checks)",
    "_C": "torch._C._current_graph_task_id: whether a backward is running (checkpoint recomputation)",
    "_current_graph_task_id": "see _C",
    "_scale": "GradScaler._scale: the scale as its device tensor (get_scale() syncs the host)",
    "_init_scale": "GradScaler._init_scale: the init scale (no public getter)",
    "_ConvNd": "torch.nn.modules.conv._ConvNd: every convolution's base class (the probe's accumulation length)",
    "_BatchNorm": "torch.nn.modules.batchnorm._BatchNorm: every batch norm's base class",
    "_schema": "an OpOverload's schema: the operation's name in a dispatch mode",
    "_get_mod_name": "torch's ModuleTracker hook for naming modules (overridden to name them by site path)",
    "_forward_hooks": "a module's hooks: a replay runs with only ampdoctor's (no public way to skip others')",
    "_forward_hooks_with_kwargs": "see _forward_hooks",
    "_forward_hooks_always_called": "see _forward_hooks",
    "_backward_hooks": "see _forward_hooks; a tensor's hook dict, set as Tensor.register_hook does (hooks.grad_hook)",
    "_register_hook_dict": "Tensor.register_hook's own call to hook a node to a tensor's hook dict, made without its "
    "removable handle (hooks.grad_hook: a handle per step costs ~4x the rest inside a training loop)",
    "_backward_pre_hooks": "see _forward_hooks",
    "_optimizer_step_pre_hooks": "an optimizer's step hooks (telling a torch optimizer from a wrapper)",
    "_execution_engine": "torch.autograd.Variable._execution_engine.queue_callback (ModuleTracker's own use)",
    "_fields": "a namedtuple's field names (its documented API, underscore and all)",
    "_make": "a namedtuple made from an iterable (its documented API, as _fields)",
    "_fsdp_wrapped_module": "FSDP1's wrapped module (telling an FSDP1 model, which a replay must not run)",
    # FSDP's shards (collect/sharded.py): a rank's own piece of a parameter without a gather or a collective
    "_local_tensor": "DTensor._local_tensor: FSDP2's local shard (to_local() adds an autograd node per call)",
    "_is_flat_param": "FSDP1's FlatParameter marker (telling a flat parameter from a plain one)",
    "_flat_param": "an FSDP1 unit's FlatParameter (the shard it holds)",
    "_fqns": "FlatParameter._fqns: the names of the parameters flattened into it",
    "_shapes": "FlatParameter._shapes: their shapes",
    "_numels": "FlatParameter._numels: their sizes",
    "_shard_param_infos": "FlatParameter._shard_param_infos: which part of each parameter this rank's shard holds",
    "_use_orig_params": "an FSDP1 unit's use_orig_params (whether its parameters are views of the shard)",
    "_inter_node_pg": "an FSDP1 HYBRID_SHARD unit's replication group (one copy counts)",
    "_get_fsdp_state": "FSDP2's state of a module (fully_shard's module has no public getter)",
    "_mp_policy": "FSDP2's MixedPrecisionPolicy of a unit (recorded in the trace's config)",
    # Python's own
    "_exit": "os._exit: Python's documented exit without clean-up (a diagnosis process whose server is gone)",
}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _files():
    for folder in FOLDERS:
        for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
            for f in files:
                if f.endswith(".py"):
                    yield os.path.join(dirpath, f)


def _own(tree: ast.AST) -> set:
    """Private names the module defines: its functions, classes, assignments, the attributes it sets."""
    own = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            own.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            own.add(node.attr)  # (set by this module: on self, or on an object it marks, like a wrapper function)
        elif isinstance(node, ast.arg):
            own.add(node.arg)
    return own


def _violations(path: str) -> list:
    tree = parse(path)
    own = _own(tree)
    rel = os.path.relpath(path, ROOT)
    out = []
    for node in ast.walk(tree):
        name = None
        if isinstance(node, ast.Attribute) and _private(node.attr):
            base = node.value
            if isinstance(base, ast.Name) and base.id in ("self", "cls"):
                continue
            name = node.attr
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if _private(alias.name):
                    out.append(f"{rel}:{node.lineno} imports {alias.name}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _private(node.args[1].value)
        ):
            name = node.args[1].value
        if name is not None and name not in own and name not in THIRD_PARTY:
            out.append(f"{rel}:{node.lineno} reads {name}")
    return out


def test_the_walk_finds_a_private_read(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from x import _hidden\nimport m\nm.obj._secret\ngetattr(m, '_other')\nself._mine = 1\n")
    assert _violations(str(bad)) == [
        f"{os.path.relpath(str(bad), ROOT)}:1 imports _hidden",
        f"{os.path.relpath(str(bad), ROOT)}:3 reads _secret",
        f"{os.path.relpath(str(bad), ROOT)}:4 reads _other",
    ]


def test_no_module_reads_another_modules_private_names():
    found = [v for path in _files() for v in _violations(path)]
    assert found == []
