"""The trace file: crash safety, concurrent readers, bad files, size, no leaks; the offline side has no torch."""

import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import textwrap
import time

import numpy as np
import pytest

import ampdoctor
from ampdoctor.trace import schema

HERE = os.path.dirname(__file__)
ROOT = os.path.dirname(HERE)


def run_py(code: str, *args, timeout=120, **kw):
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": HERE},
        **kw,
    )


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
    proc = subprocess.Popen(
        [sys.executable, "-c", TRAIN_FOREVER, path],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": HERE},
    )
    try:
        assert proc.stdout.readline().strip() == b"started"
        seen = 0
        deadline = time.time() + 60
        while seen < 200 and time.time() < deadline:  # a reader in this process while the run writes
            time.sleep(0.3)
            tr = ampdoctor.load(path)
            df = tr.steps()
            peaks = tr.records("peak", "act")
            assert df["step"].tolist() == list(range(len(df)))  # no gaps, no half-written step
            observed = df.index[df["level"] >= 0]  # (a sentinel-only step stores none)
            assert len(observed) == 0 or not np.isnan(peaks[observed[-1]]).all()  # a listed step has its peaks
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
    (tmp_path / "no-traces").mkdir()  # a directory is read as one run's ranks: here it holds none
    cases["directory"] = (str(tmp_path / "no-traces"), "no trace files")
    for name, (path, message) in cases.items():
        before = open(path, "rb").read() if os.path.isfile(path) else None
        with pytest.raises(ampdoctor.TraceError) as info:
            ampdoctor.load(path)
        text = str(info.value)
        assert message in text and "\n" not in text and path in text, name
        if before is not None:
            assert open(path, "rb").read() == before, name  # reading never changes the file


def test_truncated_pages_inside_are_reported(tmp_path, good_trace):
    data = bytearray(open(good_trace, "rb").read())
    page = int.from_bytes(data[16:18], "big")
    data[page * 2 : page * 4] = b"\x00" * (page * 2)  # zero two pages in the middle
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


def test_memory_stays_flat_over_many_steps(tmp_path):
    """Nothing is retained per step. Measured precisely instead of over thousands of steps: the live tensors
    (exact count), the Python and numpy memory allocated since a warm-up (tracemalloc) and the resident size,
    three times around step 80 and three times around step 180 with the trace flushed (the least of each three:
    the live diagnosis thread may be holding a DataFrame at one of them); every-step, full-statistics and histogram
    steps all recur in between. One retained activation set (~20 kB) or graph per step would add megabytes; the
    bound on traced memory is 640 bytes per step."""
    code = """
    import sys, tracemalloc, torch, ampdoctor
    from ampdoctor.collect import stats
    from runs import mlp, batches, live_tensors
    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096 / 2**20
    def mark(doc):
        doc.flush()
        tensors = len(live_tensors())        # (after a collection, as the traced memory below)
        return tracemalloc.get_traced_memory()[0], tensors, rss()
    model = mlp(width=32); opt = torch.optim.SGD(model.parameters(), lr=0.01)
    marks = []
    # (live=False: the live diagnosis reads the whole trace anew, its memory follows the file's content by design)
    with ampdoctor.attach(model, optimizer=opt, trace=sys.argv[1], every=10, hist_every=20, live=False) as doc:
        for i, (x, y) in enumerate(batches(200, batch=16)):
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad(); loss.backward(); opt.step(); doc.log_loss(loss)
            if i == 29:
                stats.native(wait=True)  # the kernels' one-time load (compiled in the background) is not a leak
                tracemalloc.start()
            if i in (59, 79, 99, 159, 179, 199):
                marks.append(mark(doc))
    early, late = marks[:3], marks[3:]
    print(min(m[0] for m in early), max(m[1] for m in early), min(m[2] for m in early),
          min(m[0] for m in late), max(m[1] for m in late), min(m[2] for m in late))
    """
    out = run_py(code, str(tmp_path / "leak.db"), timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    traced1, tensors1, rss1, traced2, tensors2, rss2 = map(float, out.stdout.split())
    assert tensors2 == tensors1, (tensors1, tensors2)
    assert traced2 - traced1 < 64 * 1000, (traced1, traced2)
    # resident size is coarse (allocator arenas, SQLite's page caches grow with the file): native leaks of size only
    assert rss2 - rss1 < 12.0, (rss1, rss2)
    assert ampdoctor.load(tmp_path / "leak.db").n_steps == 200


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
            if loss_value == 1.0:  # no backward through a NaN/Inf: the weights stay finite for the next step
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
            doc.log_loss(loss)  # after opt.step(): the reason the last step waits for the next one
            if i in (3, 9):
                assert doc.flush(timeout=10)
                steps = ampdoctor.load(path).steps()
                assert steps["step"].tolist() == list(range(i)) and steps["loss"].notna().all()
    assert len(ampdoctor.load(path).steps()) == 12
    assert not doc.flush()  # closed: nothing to wait for


# -- hostile names and files -------------------------------------------------------------------------------------------
def test_file_uri_is_quoted_so_every_name_opens_that_very_file(tmp_path, good_trace):
    """A trace named %2E%2E%2Foutside.db opens that file, not ../outside.db (SQLite decodes %XX in a file: URI);
    'lr%201e-3.db' and names with '?', '#', spaces open too."""
    served = tmp_path / "served"
    served.mkdir()
    outside = tmp_path / "outside.db"
    shutil.copy(good_trace, outside)
    c = sqlite3.connect(outside)
    c.execute("UPDATE meta SET value = json_set(value, '$.model', 'Outside') WHERE key = 'run'")
    c.commit()
    c.close()
    for name in ("%2E%2E%2Foutside.db", "lr%201e-3.db", "lr 1e-3?x=1#frag.db", "100%.db"):
        shutil.copy(good_trace, served / name)
        tr = ampdoctor.load(served / name)
        assert tr.meta["run"]["model"] == "Sequential", name
        assert tr.n_steps == 12, name
        tr.close()
    assert ampdoctor.load(outside).meta["run"]["model"] == "Outside"


@pytest.mark.timeout(60)
def test_non_regular_files_are_refused_not_opened(tmp_path, good_trace):
    """A FIFO would block open() forever (a served directory, a reader): refused from its stat, as is a trace whose
    -wal is a FIFO (SQLite would open that)."""
    from ampdoctor.trace import is_trace

    fifo = tmp_path / "pipe.db"
    os.mkfifo(fifo)
    with pytest.raises(ampdoctor.TraceError, match="not a regular file") as info:
        ampdoctor.load(fifo)
    assert "\n" not in str(info.value)
    assert not is_trace(fifo)
    shutil.copy(good_trace, tmp_path / "t.db")
    os.mkfifo(tmp_path / "t.db-wal")
    with pytest.raises(ampdoctor.TraceError, match="t.db-wal next to it is not a regular file"):
        ampdoctor.load(tmp_path / "t.db")
    from ampdoctor.dashboards.catalog import discover_runs

    shutil.copy(good_trace, tmp_path / "ok.db")
    runs = discover_runs(str(tmp_path))  # a served directory with FIFOs in it: scanned, not blocked
    assert "ok.db" in runs and "pipe.db" not in runs


def _read_unprivileged(path: str) -> str:
    """'steps N' (or the error) reading ``path`` as a user who cannot write its directory: this process when not
    root, else a forked child that drops to nobody (root ignores directory permissions)."""

    def read():
        try:
            tr = ampdoctor.load(path)
            return f"steps {len(tr.steps())} {tr.n_steps} {int(np.isfinite(tr.records('peak', 'act')).any())}"
        except Exception as exc:  # the report names it; the test compares the text
            return f"error {exc}"

    if os.geteuid() != 0:
        return read()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: everything it needs is imported already
        try:
            os.close(r)
            os.setgid(65534)
            os.setuid(65534)
            os.write(w, read().encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        out = f.read()
    os.waitpid(pid, 0)
    return out


def test_a_killed_runs_trace_reads_from_a_read_only_directory(tmp_path):
    """SIGKILL leaves the last steps in the -wal file. Copied to a directory the reader cannot write (with the -shm,
    and without it, where SQLite cannot build its WAL index), every committed step still reads, and nothing is
    created next to the trace."""
    path = str(tmp_path / "killed.db")
    proc = subprocess.Popen(
        [sys.executable, "-c", TRAIN_FOREVER, path],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": HERE},
    )
    try:
        assert proc.stdout.readline().strip() == b"started"
        deadline = time.time() + 60
        while time.time() < deadline and (not os.path.exists(path) or ampdoctor.load(path).n_steps < 20):
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert os.path.getsize(path + "-wal") > 0
    n = ampdoctor.load(path).n_steps
    assert n >= 20
    _read_unprivileged(path)  # warms every lazy import before the child needs them
    base = tempfile.mkdtemp()  # outside pytest's root-only tmp tree: nobody can reach it
    try:
        os.chmod(base, 0o755)
        for with_shm in (True, False):
            ro = os.path.join(base, f"ro-{with_shm}")
            os.mkdir(ro)
            for side in ("", "-wal") + (("-shm",) if with_shm else ()):
                shutil.copyfile(path + side, os.path.join(ro, "killed.db" + side))
                os.chmod(os.path.join(ro, "killed.db" + side), 0o444)
            before = sorted(os.listdir(ro))
            os.chmod(ro, 0o555)
            assert _read_unprivileged(os.path.join(ro, "killed.db")) == f"steps {n} {n} 1", with_shm
            assert sorted(os.listdir(ro)) == before
    finally:
        for d in os.listdir(base):
            os.chmod(os.path.join(base, d), 0o755)
        shutil.rmtree(base)
