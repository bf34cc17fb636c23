"""The trace file: crash safety, concurrent readers, bad files, size, no leaks; the offline side has no torch."""
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import ampdoctor
from ampdoctor.trace import schema

HERE = os.path.dirname(__file__)
ROOT = os.path.dirname(HERE)


def run_py(code: str, *args, timeout=120, **kw):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env={**os.environ, "PYTHONPATH": HERE}, **kw)


@pytest.fixture(scope="module")
def good_trace(tmp_path_factory):
    from runs import mlp, train
    path = str(tmp_path_factory.mktemp("good") / "good.db")
    train(mlp(), 12, init_scale=2.0**24, trace=path, attach_options={"every": 4})
    return path


TRAIN_FOREVER = """
import sys, torch, ampdoctor
from runs import mlp, batches
model = mlp(width=32); opt = torch.optim.SGD(model.parameters(), lr=0.01)
doc = ampdoctor.attach(model, optimizer=opt, trace=sys.argv[1], every=5)
print("started", flush=True)
for x, y in batches(10**9):
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad(); loss.backward(); opt.step(); doc.log_loss(loss)
"""


def test_sigkill_leaves_a_readable_trace_and_readers_see_consistent_steps(tmp_path):
    path = str(tmp_path / "killed.db")
    proc = subprocess.Popen([sys.executable, "-c", TRAIN_FOREVER, path], cwd=ROOT, stdout=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": HERE})
    try:
        assert proc.stdout.readline().strip() == b"started"
        seen = 0
        deadline = time.time() + 60
        while seen < 200 and time.time() < deadline:       # a reader in this process while the run writes
            time.sleep(0.3)
            tr = ampdoctor.load(path)
            df = tr.steps()
            peaks = tr.records("peak", "act")
            assert df["step"].tolist() == list(range(len(df)))             # no gaps, no half-written step
            observed = df.index[df["level"] >= 0]                           # (a sentinel-only step stores none)
            assert len(observed) == 0 or not np.isnan(peaks[observed[-1]]).all()   # a listed step has its peaks
            assert len(df) >= seen
            seen = len(df)
            tr.close()
        assert seen >= 200
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    tr = ampdoctor.load(path)
    df = tr.steps()
    assert len(df) >= seen and df["step"].tolist() == list(range(len(df)))
    assert df["loss"].notna().all()
    assert "closed" not in tr.meta


def test_bad_files_raise_trace_error_with_one_line(tmp_path, good_trace):
    cases = {}
    cases["missing"] = (str(tmp_path / "nope.db"), "no such file")
    (tmp_path / "empty.db").write_bytes(b"")
    cases["empty"] = (str(tmp_path / "empty.db"), "empty file")
    (tmp_path / "text.db").write_text("step,loss\n0,1.0\n")
    cases["not sqlite"] = (str(tmp_path / "text.db"), "not a SQLite database")
    data = open(good_trace, "rb").read()
    (tmp_path / "trunc.db").write_bytes(data[: len(data) // 2 + 100])
    cases["truncated"] = (str(tmp_path / "trunc.db"), "truncated")
    foreign = sqlite3.connect(tmp_path / "foreign.db")
    foreign.execute("CREATE TABLE users (id INTEGER, name TEXT)")
    foreign.commit()
    foreign.close()
    cases["foreign"] = (str(tmp_path / "foreign.db"), "not an ampdoctor trace")
    shutil.copy(good_trace, tmp_path / "newer.db")
    c = sqlite3.connect(tmp_path / "newer.db")
    c.execute(f"PRAGMA user_version={schema.VERSION + 1}")
    c.commit()
    c.close()
    cases["newer"] = (str(tmp_path / "newer.db"), "newer than this ampdoctor reads")
    (tmp_path / "no-traces").mkdir()        # a directory is read as one run's ranks: here it holds none
    cases["directory"] = (str(tmp_path / "no-traces"), "no trace files")
    for name, (path, message) in cases.items():
        before = open(path, "rb").read() if os.path.isfile(path) else None
        with pytest.raises(ampdoctor.TraceError) as info:
            ampdoctor.load(path)
        text = str(info.value)
        assert message in text and "\n" not in text and path in text, name
        if before is not None:
            assert open(path, "rb").read() == before, name          # reading never changes the file


def test_truncated_pages_inside_are_reported(tmp_path, good_trace):
    data = bytearray(open(good_trace, "rb").read())
    page = int.from_bytes(data[16:18], "big")
    data[page * 2: page * 4] = b"\x00" * (page * 2)                 # zero two pages in the middle
    (tmp_path / "zeroed.db").write_bytes(bytes(data))
    with pytest.raises(ampdoctor.TraceError, match="corrupt"):
        tr = ampdoctor.load(tmp_path / "zeroed.db")
        tr.steps(), tr.records("peak", "act"), tr.records("absmax", "grad_out")


def test_full_disk_warns_and_training_finishes(tmp_path):
    """A file-size limit makes SQLite's writes fail as on a full disk; the training loop must not notice."""
    code = """
    import resource, signal, sys, warnings, torch, ampdoctor
    from runs import mlp, train
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (96 * 1024, 96 * 1024))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        _, _, _, losses = train(mlp(width=64), 150, precision="bf16", trace=sys.argv[1],
                                attach_options={"every": 1, "hist_every": 1})
    msgs = [str(x.message) for x in w if "ampdoctor" in str(x.message)]
    print(len(losses), len(msgs), msgs[0] if msgs else "")
    """
    out = run_py(code, str(tmp_path / "full.db"))
    assert out.returncode == 0, out.stderr[-2000:]
    n, n_warn, msg = out.stdout.strip().split(" ", 2)
    assert n == "150" and n_warn == "1" and "trace writer failed" in msg and "training continues" in msg


def test_offline_side_does_not_import_torch(good_trace):
    code = """
    import sys, ampdoctor
    from ampdoctor import cli
    tr = ampdoctor.load(sys.argv[1]); tr.steps(); tr.records("peak", "grad_out"); tr.hist(0)
    assert cli.main(["info", sys.argv[1]]) == 0
    print("torch" in sys.modules)
    """
    out = run_py(code, good_trace)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_memory_stays_flat_over_2000_steps(tmp_path):
    code = """
    import sys, torch, ampdoctor, gc
    from runs import mlp, batches
    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096 / 2**20
    model = mlp(width=32); opt = torch.optim.SGD(model.parameters(), lr=0.01)
    marks = {}
    with ampdoctor.attach(model, optimizer=opt, trace=sys.argv[1], every=20, hist_every=40) as doc:
        for i, (x, y) in enumerate(batches(2000, batch=16)):
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad(); loss.backward(); opt.step(); doc.log_loss(loss)
            if i in (499, 1999):
                gc.collect(); marks[i] = rss()
    print(marks[499], marks[1999])
    """
    out = run_py(code, str(tmp_path / "leak.db"), timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    at500, at2000 = map(float, out.stdout.split())
    # 1500 more steps: retained tensors or graphs would add MBs (one 16x32 activation set is ~20 kB a step)
    assert at2000 - at500 < 8.0, (at500, at2000)
    assert ampdoctor.load(tmp_path / "leak.db").n_steps == 2000


def test_nan_loss_is_recorded_as_nan_not_as_missing(tmp_path):
    import sqlite3 as sq

    import torch
    from runs import mlp
    path = str(tmp_path / "nan.db")
    model = mlp(width=16)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with ampdoctor.attach(model, optimizer=opt, trace=path) as doc:
        for loss_value in (1.0, float("nan"), float("inf")):
            loss = model(torch.randn(4, 32)).pow(2).sum() * loss_value
            opt.zero_grad()
            if loss_value == 1.0:       # no backward through a NaN/Inf: the weights stay finite for the next step
                loss.backward()
            opt.step()
            doc.log_loss(loss)
    rows = sq.connect(path).execute("SELECT loss, nonfinite FROM steps ORDER BY step").fetchall()
    assert rows[1] == ("nan", 1) and rows[2][0] == float("inf") and rows[2][1] == 1
    df = ampdoctor.load(path).steps()
    assert np.isnan(df["loss"][1]) and df["loss"][2] == np.inf and df["nonfinite"].tolist() == [False, True, True]


def test_is_trace_tells_traces_from_other_files(tmp_path, good_trace):
    from ampdoctor.trace import is_trace
    other = sqlite3.connect(tmp_path / "other.db")
    other.execute("CREATE TABLE t (x)")
    other.commit()
    other.close()
    (tmp_path / "notes.db").write_text("not a database")
    assert is_trace(good_trace)
    assert not is_trace(tmp_path / "other.db") and not is_trace(tmp_path / "notes.db")
    assert not is_trace(tmp_path / "missing.db")


def test_flush_makes_finished_steps_readable_while_training_goes_on(tmp_path):
    """flush(): every step before the current one is committed and readable from another connection (here before
    the writer's own once-a-second commit would come); the last finished step follows at the next step."""
    import torch
    from runs import batches, mlp
    path = str(tmp_path / "flushed.db")
    model = mlp(width=32)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with ampdoctor.attach(model, optimizer=opt, trace=path, live=False) as doc:
        for i, (x, y) in enumerate(batches(12)):
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            doc.log_loss(loss)            # after opt.step(): the reason the last step waits for the next one
            if i in (3, 9):
                assert doc.flush(timeout=10)
                steps = ampdoctor.load(path).steps()
                assert steps["step"].tolist() == list(range(i)) and steps["loss"].notna().all()
    assert len(ampdoctor.load(path).steps()) == 12
    assert not doc.flush()                # closed: nothing to wait for
