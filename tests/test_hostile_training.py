"""The training side against hostile values (issue: trust, third pass): nothing a user passes to the public API raises
into the training loop, and nothing stops collection that should only be skipped or delayed."""

import math
import sqlite3
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest
import torch
from runs import batches, mlp

import ampdoctor


class FloatRaises:
    def __float__(self):
        raise RuntimeError("no float for you")


HOSTILE_METRICS = [
    ("meta tensor", "m/meta", torch.empty((), device="meta"), None),
    ("__float__ raises", "m/float", FloatRaises(), None),
    ("step 2**63", "m/big", 1.0, 2**63),
    ("numpy uint64 step", "m/u64", 1.0, np.uint64(2**64 - 1)),
    ("negative step", "m/neg", 1.0, -1),
    ("float step", "m/fstep", 1.0, 1.5),
    ("lone surrogate in the name", "a\ud800", 2.0, None),
    ("huge int value", "m/hugeint", 10**400, None),
    ("complex tensor", "m/complex", torch.tensor(1 + 2j), None),
]


def _loop(model, opt, doc, n, on_step=None):
    for i, (x, y) in enumerate(batches(n, d_in=32)):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        doc.log_loss(loss)
        if on_step is not None:
            on_step(i)


def test_log_metric_never_raises_and_never_stops_collection(trace_path):
    model = mlp(width=16)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def hostile(i):
        if i < len(HOSTILE_METRICS):
            _, name, value, step = HOSTILE_METRICS[i]
            doc.log_metric(name, value, step=step)
        doc.log_metric("ok", float(i))

    with warnings.catch_warnings(record=True), ampdoctor.attach(model, optimizer=opt, trace=trace_path) as doc:
        warnings.simplefilter("always")
        _loop(model, opt, doc, 30, hostile)
        assert doc.active
    tr = ampdoctor.load(trace_path)
    assert tr.n_steps == 30  # every step kept: the writer never died
    m = tr.metrics()
    assert m[m["name"] == "ok"]["value"].tolist() == [float(i) for i in range(30)]
    # the surrogate name is kept as its escape; values and steps that are not numbers are skipped (10**400 does
    # not fit a float: skipped too)
    assert set(m["name"]) == {"ok", "a\\ud800"}
    assert m[m["name"] == "a\\ud800"]["value"].tolist() == [2.0]


@pytest.mark.parametrize("name", ["blk\ud800", "(model)"])
def test_odd_module_names_keep_every_step_and_their_own_sites(trace_path, name):
    """A module name SQLite cannot store as UTF-8, and a submodule named like the root's site."""
    model = mlp(width=16)
    model.add_module(name, torch.nn.Identity())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with ampdoctor.attach(model, optimizer=opt, trace=trace_path, mode="debug") as doc:
        _loop(model, opt, doc, 30)
    tr = ampdoctor.load(trace_path)
    assert tr.n_steps == 30
    acts = tr.sites("act")
    root = acts[acts["path"] == "(model)"]
    assert len(root) == 1 and root["module_type"].iloc[0] == "Sequential"  # the root keeps its own site
    assert len(acts) == len(list(model.modules()))  # and the odd one has a site of its own
    assert acts["path"].is_unique


LOCKER = """
import sqlite3, sys, time
conn = sqlite3.connect(sys.argv[1], isolation_level=None, timeout=30)
conn.execute("BEGIN IMMEDIATE")          # the write lock: ampdoctor's writer cannot write meanwhile
print("locked", flush=True)
time.sleep(float(sys.argv[2]))
conn.execute("ROLLBACK")
"""


def test_a_busy_trace_delays_writing_and_loses_nothing(trace_path):
    """Another process holds the trace's write lock for 8 s in the middle of the run."""
    model = mlp(width=16)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    locker = None
    with ampdoctor.attach(model, optimizer=opt, trace=trace_path, live=False) as doc:

        def lock_once(i):
            nonlocal locker
            if i == 20:
                assert doc.flush()
                locker = subprocess.Popen([sys.executable, "-c", LOCKER, trace_path, "8"], stdout=subprocess.PIPE)
                assert locker.stdout.readline().strip() == b"locked"
            if i > 20:
                time.sleep(0.02)  # a slow loop: the lock outlives many commits the writer wants to make

        _loop(model, opt, doc, 500, lock_once)
        assert doc.active
    locker.wait(timeout=30)
    tr = ampdoctor.load(trace_path)
    assert tr.n_steps == 500
    assert math.isfinite(tr.steps()["loss"].iloc[-1])
    with sqlite3.connect(trace_path) as c:
        assert c.execute("SELECT count(*) FROM steps").fetchone()[0] == 500
