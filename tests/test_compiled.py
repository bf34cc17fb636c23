"""The sentinel's C++ read (collect/compiled.py): it serves a real run once built, a run trains the same without it
(its build failed, or it is not there yet), a build is started once per machine and never twice at a time, and an
extension whose figures disagree with torch's is never used."""

import json
import math
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from runs import batches, mlp

from ampdoctor.collect import compiled

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A run that keeps, for every step, the gradient norm and peak torch computes in float64 before the optimizer's
# update, beside ampdoctor's figures of the same step; prints what read served and how the C++ read went.
SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    import ampdoctor
    from ampdoctor.collect import compiled
    from ampdoctor.trace.reader import Trace
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref = []
    def keep(o, a, k):
        flat = torch.cat([p.grad.double().reshape(-1) for p in model.parameters()])
        ref.append((flat.norm().item(), flat.abs().max().item()))
    opt.register_step_pre_hook(keep)
    doc = ampdoctor.attach(model, optimizer=opt, trace=sys.argv[1], live=False)
    for _ in range(12):
        x, y = torch.randn(8, 16), torch.randn(8, 1)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        doc.log_loss(loss)
    figures = doc._core.loop.end._grad_figures  # (which read served the last step)
    read = "C++" if callable(figures._compiled) else "numba or torch"
    doc.close()
    got = Trace(sys.argv[1]).query("SELECT grad_norm, grad_max FROM steps ORDER BY step")
    print(json.dumps({"read": read, "info": compiled.info, "ref": ref, "got": got}))
    """
)


def _run(tmp_path, name, **env):
    trace = str(tmp_path / f"{name}.db")
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, trace],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": ROOT, **env},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _same_figures(result, rel) -> None:
    """Every step's figures: the peak exact, the norm within ``rel`` (float64 sums in C++ and numba; the torch
    passes that serve before the numba kernels are loaded sum in float32)."""
    assert len(result["got"]) == len(result["ref"]) == 12
    for (norm, peak), (want_norm, want_peak) in zip(result["got"], result["ref"]):
        assert norm == pytest.approx(want_norm, rel=rel) and peak == want_peak


def test_a_run_reads_its_figures_in_cpp_once_the_extension_is_built(tmp_path):
    """make install builds the extension into the user's cache: a run loads it at attach and its figures come from
    the C++ read, equal to torch's float64 ones."""
    if compiled.wait() is None:
        pytest.fail(f"the C++ extension did not load: {compiled.info}")
    result = _run(tmp_path, "built")
    assert result["read"] == "C++" and "loaded" in result["info"]
    _same_figures(result, rel=1e-12)


def test_a_failed_build_leaves_the_run_to_the_numba_read_and_is_not_tried_again(tmp_path):
    """No working compiler (CXX=false): the first run starts the build in a process of its own and trains with
    the same figures meanwhile; the build's failure is written beside it, and the next run does not build again."""
    cache = tmp_path / "cache"
    env = {"AMPDOCTOR_BUILD_DIR": str(cache), "CXX": "false"}
    first = _run(tmp_path, "first", **env)
    assert first["read"] == "numba or torch"
    _same_figures(first, rel=1e-6)
    where = cache / compiled.tag()
    deadline = time.monotonic() + 50  # (the builder imports torch, then the compiler fails at once)
    while not (where / "error.txt").exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert (where / "error.txt").exists(), sorted(p.name for p in where.iterdir()) if where.exists() else None
    assert not (where / "building").exists()
    second = _run(tmp_path, "second", **env)
    assert second["read"] == "numba or torch" and "did not build" in second["info"]["error"]
    _same_figures(second, rel=1e-6)


def test_a_build_is_started_once_and_never_beside_a_running_one(tmp_path, monkeypatch):
    """A fresh marker of a build in progress (another process) means wait for it; a marker left by a build that
    died long ago is no reason to wait; one process starts at most one build."""
    monkeypatch.setenv("AMPDOCTOR_BUILD_DIR", str(tmp_path))
    monkeypatch.setattr(compiled, "_ext", None)
    monkeypatch.setattr(compiled, "_started", False)
    monkeypatch.setattr(compiled, "info", {})
    spawned = []
    monkeypatch.setattr(compiled, "_spawn_build", lambda: spawned.append(1))
    where = compiled.build_dir()
    where.mkdir(parents=True)
    (where / "building").write_text("")
    compiled._try_load()
    assert not spawned and compiled._ext is None
    old = time.time() - compiled.STALE_BUILD_S - 60
    os.utime(where / "building", (old, old))
    compiled._try_load()
    compiled._try_load()
    assert spawned == [1]


def test_an_extension_whose_figures_disagree_with_torch_is_never_used(tmp_path, monkeypatch):
    """The self-check after loading: figures that differ from torch's (here: a peak one ulp off, and a NaN lost)
    keep the extension out, with the reason in ``info``."""

    class Off:
        def __init__(self, params):
            self.grad = params[0].grad

        def figures(self):
            wide = self.grad.double()
            return float(wide.norm()), math.nextafter(float(wide.abs().max()), 0.0), 1

    class LosesNaN(Off):
        def figures(self):
            return 1.0, 1.0, 1

    for fake in (Off, LosesNaN):
        monkeypatch.setenv("AMPDOCTOR_BUILD_DIR", str(tmp_path / fake.__name__))
        monkeypatch.setattr(compiled, "_ext", None)
        monkeypatch.setattr(compiled, "info", {})
        monkeypatch.setattr(compiled, "_import", lambda library, fake=fake: type("Ext", (), {"Grads": fake}))
        where = compiled.build_dir()
        where.mkdir(parents=True)
        (where / (compiled.module_name() + ".so")).write_bytes(b"")
        compiled._try_load()
        error = compiled.info["error"]
        assert compiled._ext is None and ("disagree" in error or "loses a NaN" in error), error


def test_gradients_the_cpp_read_does_not_take_go_to_the_other_reads(monkeypatch):
    """float64 gradients, and a model whose gradients change dtype (``model.half()``) between steps: the C++ read
    steps aside for the first and takes the second up again; every step's figures equal torch's."""
    from ampdoctor.collect.buffers import GradFigures

    if compiled.wait() is None:
        pytest.fail(f"the C++ extension did not load: {compiled.info}")
    model = mlp(width=16, depth=2, d_in=8)
    params = list(model.named_parameters())
    figures = GradFigures()
    for dtype in (torch.float32, torch.float64, torch.float16, torch.float32):
        model.to(dtype)
        model.zero_grad()
        for x, y in batches(1, batch=4, d_in=8):
            torch.nn.functional.mse_loss(model(x.to(dtype)), y.to(dtype)).backward()
        flat = torch.cat([p.grad.double().reshape(-1) for _, p in params])
        norm, peak = figures(params)
        assert norm == pytest.approx(flat.norm().item(), rel=1e-6) and peak == flat.abs().max().item()
        assert callable(figures._compiled) == (dtype != torch.float64)


def test_whatever_keeps_the_extension_out_reaches_info_never_training(tmp_path, monkeypatch):
    """An install without the C++ source (a packaging slip) or a cache that cannot be written: ``get()`` answers
    None with the reason in ``info``, and a run attaches and trains with the other reads."""
    import ampdoctor

    monkeypatch.setattr(compiled, "_ext", None)
    monkeypatch.setattr(compiled, "info", {})
    monkeypatch.setattr(compiled, "_next_look", 0.0)
    monkeypatch.setattr(compiled, "SOURCE", tmp_path / "missing.cpp")
    assert compiled.get() is None and "missing.cpp" in compiled.info["error"]
    model = mlp(width=16, depth=2, d_in=8)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with ampdoctor.attach(model, optimizer=opt, trace=str(tmp_path / "t.db"), live=False) as doc:
        for x, y in batches(3, batch=4, d_in=8):
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            doc.log_loss(loss)
        assert not doc.guard.off
