"""Every fix template, for every recorded configuration it can be printed for, runs when pasted whole into that
configuration's training script and leaves a script that trains: no name the script does not have, no
"Attempting to unscale FP16 gradients", no dtype mismatch, no keep_fp32 that changes nothing.

A configuration is what a trace records (advice.Setup): parameter dtype, autocast, GradScaler, optimizer, device. The
script is the loop of tests/reported/script.py with that configuration's set-up, forward and backward parts; a
template's part is pasted where its text says it goes.
"""

import ast
import builtins
import math
import os
import sys
import warnings

import pytest
import torch

from ampdoctor.rules import advice as A
from ampdoctor.rules import division, lossfn
from ampdoctor.rules.fix import Part, code

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "reported"))
from script import PLAIN, SCALED, Script, run

SCRIPT_NAMES = {"torch", "ampdoctor", "math", "model", "optimizer", "scaler", "loss_fn", "x", "y", "loss"}

CONFIGS = {
    "fp16-amp-sgd": A.Setup(autocast="float16", scaler=True, optimizer="SGD", hyper={"lr": 0.05}),
    "fp16-amp-adam": A.Setup(
        autocast="float16", scaler=True, optimizer="Adam", hyper={"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8}
    ),
    "fp16-amp-noscaler": A.Setup(autocast="float16", optimizer="SGD", hyper={"lr": 0.05}),
    "bf16-amp-adamw": A.Setup(autocast="bfloat16", optimizer="AdamW", hyper={"lr": 1e-3, "weight_decay": 0.01}),
    "fp16-params-sgd": A.Setup(param_dtype="float16", optimizer="SGD", hyper={"lr": 0.05}),
    "fp16-params-adam": A.Setup(param_dtype="float16", optimizer="Adam", hyper={"lr": 1e-3, "eps": 1e-4}),
    "bf16-params-sgd": A.Setup(param_dtype="bfloat16", optimizer="SGD", hyper={"lr": 0.05}),
    "fp32-custom-optimizer": A.Setup(optimizer="MyOptimizer", hyper={"lr": 0.05}),
    "fp16-amp-cuda-v100": A.Setup(
        device="cuda", autocast="float16", scaler=True, optimizer="SGD", hyper={"lr": 0.05}, bf16_supported=False
    ),
}
NORM = "1"  # the LayerNorm of the test model
LAST = "3"  # its last Linear


def model_for(setup: A.Setup) -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    return m.to(getattr(torch, setup.param_dtype))


def script_for(setup: A.Setup) -> Script:
    """The training script this configuration was recorded from (its optimizer with its hyper-parameters)."""
    lines = []
    if setup.optimizer == "MyOptimizer":
        lines.append("MyOptimizer = type('MyOptimizer', (torch.optim.SGD,), {})  # the user's own class")
        cls = "MyOptimizer"
    else:
        cls = f"torch.optim.{setup.optimizer}"
    args = ", ".join(f"{k}={tuple(v) if isinstance(v, list) else v!r}" for k, v in setup.hyper.items())
    lines.append(f"optimizer = {cls}(model.parameters(), {args})")
    if setup.scaler:
        lines.append(f'scaler = torch.amp.GradScaler("{setup.device}")')
    if setup.autocast:
        fwd = f'with torch.autocast(device_type="{setup.device}", dtype=torch.{setup.autocast}):\n'
        fwd += "    loss = loss_fn(model(x), y)"
    else:
        fwd = "loss = loss_fn(model(x), y)"
    return Script("\n".join(lines), fwd, SCALED if setup.scaler else PLAIN)


def data(setup: A.Setup, n: int = 3):
    g = torch.Generator().manual_seed(1)
    dt = getattr(torch, setup.param_dtype)
    for _ in range(n):
        x = torch.randn(4, 8, generator=g)
        yield x.to(dt), x.sum(1, keepdim=True)


def mse(out, y):
    return torch.nn.functional.mse_loss(out.float(), y)


def free_names(code: str) -> set:
    """Names the code reads that it does not bind itself (nor Python's builtins)."""
    tree = ast.parse(code)
    bound, used = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (bound if isinstance(node.ctx, ast.Store) else used).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.Lambda)):
            args = node.args.args + node.args.kwonlyargs
            bound |= {a.arg for a in args}
            if isinstance(node, ast.FunctionDef):
                bound.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.comprehension):
            bound |= {n.id for n in ast.walk(node.target) if isinstance(n, ast.Name)}
    return used - bound - set(dir(builtins))


# -- the templates: name -> (configurations it is printed for, parts for a setup, where each part goes) -------------
def _parts(value) -> list:
    return value if isinstance(value, list) else [value]


TEMPLATES = {
    "master_weights fp16": (
        ["fp16-params-sgd", "fp16-params-adam", "bf16-params-sgd", "fp32-custom-optimizer"],
        lambda s: [A.master_weights(s, "float16")],
        "setup+step",
    ),
    "master_weights bf16": (
        ["fp16-params-sgd", "fp16-params-adam", "bf16-params-sgd"],
        lambda s: [A.master_weights(s, "bfloat16")],
        "setup+step",
    ),
    "keep_fp32": (list(CONFIGS), lambda s: A.keep_fp32(s, [LAST]), "auto"),
    "fp32_island": (list(CONFIGS), lambda s: A.fp32_island(s, [NORM]), "auto"),
    "loss_in_fp32": (list(CONFIGS), lambda s: [A.loss_in_fp32(s)], "forward"),
    "bf16_note": ([c for c, s in CONFIGS.items() if s.bf16_supported], lambda s: A.bf16_note(s), "auto"),
    "lower_lr sgd": (list(CONFIGS), lambda s: A.lower_lr(s, 0.5, 0.05, 100, adaptive=False), "lr"),
    "lower_lr adaptive": (list(CONFIGS), lambda s: A.lower_lr(s, 0.5, None, 100, adaptive=True), "lr"),
    "cross_entropy": (list(CONFIGS), lambda s: [lossfn._cross_entropy(s)], "forward"),
}


def _role(part: str, role: str, setup: A.Setup) -> str:
    if role != "auto":
        return role
    if "# and in the loop:" in part:
        return "setup+step"
    if "loss.backward()" in part:
        return "step"
    return "setup"


CASES = [(t, c) for t, (configs, _, _) in TEMPLATES.items() for c in configs]


@pytest.mark.parametrize("template, config", CASES, ids=[f"{t}-{c}" for t, c in CASES])
def test_template_runs_in_every_configuration_it_is_printed_for(template, config):
    _, make, role = TEMPLATES[template]
    setup = CONFIGS[config]
    parts = [p for p in make(setup) if isinstance(p, Part)]
    code = [p.text for p in parts if p.kind == "code"]
    assert code, template
    for block in code:
        compile(block, template, "exec")  # pasted whole: no fragment, no stray indentation
        assert free_names(block) <= SCRIPT_NAMES, (template, free_names(block))
        if config == "fp16-amp-cuda-v100":
            assert '"cpu"' not in block and "bfloat16" not in block  # the recorded device, no BF16 on a V100
    script = script_for(setup)
    for block in code:
        if role == "lr":  # the learning-rate part before the loop; clipping (if printed) between backward and step
            if "clip_grad_norm_" in block:
                back = script.backward.split("\n")
                script = Script(script.setup, script.forward, "\n".join(back[:1] + [block] + back[1:]), script.after)
            else:
                script = script.with_fix(block, "setup")
                script = Script(script.setup, script.forward, script.backward, "scheduler.step()")
        else:
            script = script.with_fix(block, _role(block, role, setup))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a CUDA recording executed on this CPU: torch warns and disables
        res = run(script, model_for(setup), data(setup), 3, loss_fn=mse, attach=None)
    assert all(math.isfinite(v) for v in res.losses), (template, config, res.losses)
    ns = res.ns
    if "handle" in ns:  # a keep_fp32 that is active where it runs: inside autocast
        assert ns["handle"].active
        assert "torch.autocast" in script.forward or "torch.autocast" in script.setup, (template, config)
    scaler = ns.get("scaler")
    if scaler is not None and scaler.is_enabled():
        assert all(p.dtype == torch.float32 for p in ns["model"].parameters()), "a GradScaler on half parameters"


@pytest.mark.parametrize("config", list(CONFIGS))
def test_clip_lines_and_the_unscale_block_fit(config):
    setup = CONFIGS[config]
    clip = "\n".join(A.clip_lines(setup))
    assert ("scaler.unscale_(optimizer)" in clip) == setup.scaler  # never clip scaled gradients
    assert free_names(clip) <= SCRIPT_NAMES
    if setup.scaler:
        step = code(
            "scaler.scale(loss).backward()",
            "scaler.unscale_(optimizer)",
            "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)",
            "scaler.step(optimizer)",
            "scaler.update()",
        ).text
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a CUDA recording executed on this CPU: torch warns and disables
            res = run(script_for(setup).with_fix(step, "backward"), model_for(setup), data(setup), 3, loss_fn=mse)
        assert all(math.isfinite(v) for v in res.losses)


def test_torch_normalisation_eps_line_runs():
    m = model_for(CONFIGS["fp16-amp-sgd"])
    exec(f"{A.attr(NORM)}.eps = {division.VARIANCE_EPS!r}", {"model": m})
    assert m[1].eps == 1e-5


def test_free_names_sees_what_a_block_needs():
    assert free_names("scores = (q / math.sqrt(q.shape[-1])) @ k.transpose(-2, -1)") == {"q", "k", "math"}
    assert free_names("def f(m, args):\n    return tuple(a for a in args)\n\nh = f(model, ())") == {"model"}
