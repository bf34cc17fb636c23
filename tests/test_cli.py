"""The CLI: exact output on a known run, one-line errors with exit code 2, every command documented."""

import json
import os
import re
import sqlite3
import subprocess
import sys

import pytest

import ampdoctor
from ampdoctor import cli

ROOT = os.path.dirname(os.path.dirname(__file__))


@pytest.fixture(scope="module")
def skipping_trace(tmp_path_factory):
    """FP16 + GradScaler with init scale 2^24 on a 64-wide MLP: the first steps overflow and are skipped."""
    from runs import mlp, train

    path = str(tmp_path_factory.mktemp("cli") / "skips.db")
    train(mlp(width=64), 20, init_scale=2.0**24, trace=path, attach_options={"every": 5, "hist_every": 5})
    return path


def run(*args):
    return subprocess.run(
        [sys.executable, "-m", "ampdoctor", *args], capture_output=True, text=True, cwd=ROOT, timeout=120
    )


def test_info(skipping_trace, capsys):
    assert cli.main(["info", skipping_trace]) == 0
    out = capsys.readouterr().out.splitlines()
    lines = {line[:10].strip(): line for line in out}
    # full statistics: steps 0-9 (calibration, all skipped), 10-14 (the flight recorder after the skips), 15 (every 5)
    assert lines["steps"] == "steps      20 recorded, full statistics at 16"
    assert lines["precision"] == "precision  O1-style: autocast float16, FP32 master weights"
    assert lines["scaler"] == (
        "scaler     GradScaler (enabled; growth_factor 2.0, backoff_factor 0.5, growth_interval 2000)"
    )
    assert lines["loss scale"] == (
        "loss scale 1.67772e+07 at step 0, last 16384 at step 19, range 16384 .. "
        "1.67772e+07; 16384 after the last update"
    )
    assert lines["skipped"] == "skipped    10 step(s): 0-9"
    assert lines["non-finite"].startswith("non-finite 10 step(s); first at step 0: 6 (grad_out), bwd phase, inf")
    assert lines["sites"] == "sites      act 8, grad_out 8, param_grad 8, weight 8"
    assert lines["observed"] == (
        "observed   mode default (peaks every 10, full every 5, first 10 in full); "
        "full statistics + histograms 16, sentinel only 4; why: calibration 10, anomaly 5, "
        "sampled 1"
    )
    st = ampdoctor.load(skipping_trace).steps()
    share = st["observer_time"].sum() / st["step_time"].sum()
    assert 0 < share < 1
    assert lines["overhead"].startswith(f"overhead   ampdoctor cost {100 * share:.1f}% of this run (")


def test_layers_table(skipping_trace, capsys):
    assert cli.main(["layers", skipping_trace, "--step", "10", "--kind", "act", "--sort", "absmax"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "act at step 10, sorted by absmax"
    assert out[1].split()[:4] == ["layer", "type", "dtype", "abs"]
    rows = [line.split() for line in out[2:]]
    assert len(rows) == 8 and {r[0] for r in rows} == {"0", "1", "2", "3", "4", "5", "6", "(model)"}
    absmax = [float(r[3]) for r in rows]
    assert absmax == sorted(absmax, reverse=True)
    assert all(r[2] == "float16" for r in rows)
    assert cli.main(["layers", skipping_trace, "--kind", "grad_out"]) == 0
    assert "grad_out at step 15 (values scaled by the loss scale 16384)" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args,message",
    [
        (["info", "/no/such/trace.db"], "ampdoctor: /no/such/trace.db: no such file"),
        (["layers", "{trace}", "--step", "17"], "step 17 has no full statistics; nearest full step: 15"),
        (["layers", "{trace}", "--kind", "gradient"], "argument --kind: invalid choice: 'gradient'"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        (["info"], "the following arguments are required: trace"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(skipping_trace, args, message):
    out = run(*[a.format(trace=skipping_trace) for a in args])
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and message in out.stderr and "Traceback" not in out.stderr
    assert out.stdout == ""


def test_help_and_module_entry_point():
    out = run("--help")
    assert out.returncode == 0 and "info" in out.stdout and "layers" in out.stdout
    script = os.path.join(os.path.dirname(sys.executable), "ampdoctor")
    if os.path.exists(script):
        assert subprocess.run([script, "--version"], capture_output=True, text=True).stdout.startswith("ampdoctor ")


def test_every_command_is_listed_importable_and_documented():
    """Each command of the table: in --help, its module imports (add_arguments, run), and the documentation
    (docs/cli.md) shows it."""
    readme = open(os.path.join(ROOT, "docs", "cli.md")).read()
    helped = run("--help")
    assert helped.returncode == 0 and set(cli.COMMANDS) == {
        "info",
        "layers",
        "diagnose",
        "replay",
        "serve",
        "report",
        "export",
    }
    for name in cli.COMMANDS:
        assert re.search(rf"^    {name} +\S", helped.stdout, re.M), f"{name} is not in --help"
        mod = cli.command_module(name)
        assert callable(mod.add_arguments) and callable(mod.run), name
        assert re.search(rf"`ampdoctor {name}\b", readme), f"ampdoctor {name} is not in docs/cli.md"


def test_help_and_version_load_only_the_command_line():
    """--help and --version import no command, no pandas, no rules: the table alone (they start in milliseconds)."""
    code = (
        "import sys; from ampdoctor.cli import main\n"
        "try: main(['--version'])\nexcept SystemExit: pass\n"
        "try: main(['--help'])\nexcept SystemExit: pass\n"
        "print(sorted(m for m in sys.modules if m.startswith('ampdoctor.') or m in ('pandas', 'numpy', 'torch')))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "['ampdoctor.cli', 'ampdoctor.commands', 'ampdoctor.commands.common']"


def _ranks_of(path: str, folder) -> str:
    """Two ranks of one run: copies of a trace with rank 0 / 1 of world size 2 in their run metadata."""
    import shutil

    for rank in (0, 1):
        copy = str(folder / f"rank{rank}.db")
        shutil.copyfile(path, copy)
        with sqlite3.connect(copy) as conn:
            run = json.loads(conn.execute("SELECT value FROM meta WHERE key = 'run'").fetchone()[0])
            run.update(rank=rank, world_size=2, run_id="job")
            conn.execute("UPDATE meta SET value = ? WHERE key = 'run'", (json.dumps(run),))
        conn.close()
    return str(folder)


def test_info_starts_without_pandas_or_torch(skipping_trace, tmp_path):
    """`ampdoctor info` in a fresh interpreter imports neither pandas (~0.4-0.7 s of a start) nor torch: on a trace
    with skips and non-finite events, a trace of format 1 (its steps read from the rows) and one run's ranks; what it
    prints is the full summary all the same."""
    import shutil

    v1 = str(tmp_path / "v1.db")
    shutil.copyfile(os.path.join(ROOT, "tests", "data", "v1-fp16-run.db"), v1)
    (tmp_path / "ranks").mkdir()
    ranks = _ranks_of(skipping_trace, tmp_path / "ranks")
    code = (
        "import sys; from ampdoctor.cli import main\n"
        f"for spec in {[skipping_trace, v1, ranks]!r}:\n"
        "    assert main(['info', spec]) == 0\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'pandas', 'pyarrow', 'torch'}))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 0, r.stderr
    out = r.stdout.splitlines()
    assert out[-1] == "[]"
    assert "skipped    10 step(s): 0-9" in out and "sites      act 8, grad_out 8, param_grad 8, weight 8" in out
    assert any(line.startswith("non-finite 10 step(s); first at step 0: 6 (grad_out), bwd phase, inf") for line in out)
    assert sum(line.startswith("steps      40 recorded") for line in out) == 1  # the v1 trace
    rows = [line.split() for line in out if re.match(r" +[01] +20 ", line)]  # rank, steps, skipped, non-finite, ...
    assert [row[:4] for row in rows] == [["0", "20", "10", "10"], ["1", "20", "10", "10"]]


def test_a_command_that_fails_to_import_fails_loudly():
    """A broken command module is a traceback naming it, never a command quietly missing from --help."""
    code = (
        "import sys, ampdoctor.commands\n"
        "sys.modules['ampdoctor.commands.layers'] = None   # what a failing import leaves behind\n"
        "from ampdoctor.cli import main\nmain(['layers', 'x.db'])"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 1 and "ampdoctor.commands.layers" in r.stderr and "Traceback" in r.stderr


def test_info_says_when_the_loss_was_never_finite(tmp_path, capsys):
    """Every step's loss NaN (inputs that overflow FP16 in the first layer): info says so instead of no loss line."""
    from runs import batches, mlp, train

    path = str(tmp_path / "nan.db")
    data = ((x * 1e5, y) for x, y in batches(6))
    train(mlp(width=32), 6, trace=path, data=data)
    assert cli.main(["info", path]) == 0
    lines = {line[:10].strip(): line for line in capsys.readouterr().out.splitlines()}
    assert lines["loss"] == "loss       not finite at any of the 6 step(s)"


# -- issue 21, items 1 and 8: nothing the user had is overwritten; arguments out of range are one line -------------
def _files(d) -> dict:
    """Every file under ``d``: relative path -> its bytes (symbolic links: where they point); the -wal/-shm files
    SQLite makes next to the rank traces a reader opened aside."""
    out = {}
    for root, _, names in os.walk(d):
        for n in names:
            p = os.path.join(root, n)
            if os.path.basename(root) == "ranks" and n.endswith(("-wal", "-shm")):
                continue
            out[os.path.relpath(p, d)] = ("->", os.readlink(p)) if os.path.islink(p) else open(p, "rb").read()
    return out


@pytest.fixture
def inputs(tmp_path, skipping_trace):
    """A directory of traces: a.db, ref.db, other.db, run.html (a trace named like a report), link.html (a symbolic
    link to a.db), hard.html (a hard link to other.db) and ranks/ (a run of two ranks)."""
    import shutil

    for name in ("a.db", "ref.db", "other.db", "run.html"):
        shutil.copy(skipping_trace, tmp_path / name)
    os.symlink(tmp_path / "a.db", tmp_path / "link.html")
    os.link(tmp_path / "other.db", tmp_path / "hard.html")
    (tmp_path / "ranks").mkdir()
    for r in (0, 1):
        shutil.copy(skipping_trace, tmp_path / "ranks" / f"run.rank{r}.db")
        c = sqlite3.connect(tmp_path / "ranks" / f"run.rank{r}.db")
        run = json.loads(c.execute("SELECT value FROM meta WHERE key = 'run'").fetchone()[0])
        c.execute("UPDATE meta SET value = ? WHERE key = 'run'", (json.dumps({**run, "rank": r, "world_size": 2}),))
        c.commit()
        c.close()
    return tmp_path


@pytest.mark.parametrize(
    "args, message",
    [
        (["a.db", "-o", "a.db"], "the output a.db is the input a.db"),
        (["a.db", "-o", "./a.db"], "the output ./a.db is the input a.db"),
        (["a.db", "--reference", "ref.db", "-o", "ref.db"], "the output ref.db is the input ref.db"),
        (["run.html"], "the default output run.html is the input run.html"),
        (["a.db", "-o", "other.db"], "the output other.db is a SQLite database (a trace?)"),
        (["a.db", "-o", "link.html"], "the output link.html is the input a.db"),
        (["a.db", "-o", "hard.html"], "the output hard.html is a SQLite database"),
        (["a.db", "-o", "a.db-wal"], "the output a.db-wal is SQLite's side file of the database"),
        (["a.db", "-o", "other.db-shm"], "side file of the database"),
        (["ranks", "-o", "ranks/run.rank1.db"], "the output ranks/run.rank1.db is the input"),
    ],
)
def test_report_never_writes_over_an_input_or_a_trace(inputs, monkeypatch, capsys, args, message):
    """Issue 21, item 1: `report a.db -o a.db` wrote HTML over the trace (then "not a SQLite database"). No input,
    no trace (told by its header: other.db, hard.html) and no SQLite side file is written over, under any name."""
    monkeypatch.chdir(inputs)
    before = _files(inputs)
    assert cli.main(["report", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("ampdoctor report: ") and message in err, err
    assert "ampdoctor never writes over" in err or "side file" in err
    assert _files(inputs) == before  # not a byte changed, no file added (no temporary file left either)
    assert cli.main(["info", "a.db"]) == 0


@pytest.mark.parametrize(
    "output, message",
    [
        ("{tmp}", "is a directory"),
        ("/dev/full", "is not a regular file"),
        ("{tmp}/no/such/dir/r.html", "no such directory for the output"),
        ("", "the output file name is empty"),
    ],
)
def test_report_to_an_output_it_cannot_be_is_one_line(skipping_trace, tmp_path, capsys, output, message):
    """Issue 21, item 8: `report -o` a directory or /dev/full ended in a traceback."""
    assert cli.main(["report", skipping_trace, "-o", output.format(tmp=tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "Traceback" not in err
    assert os.listdir(tmp_path) == []


FULL = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG) as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))
from ampdoctor.cli import main
sys.exit(main(["report", sys.argv[1], "-o", sys.argv[2]]))
"""


def test_a_report_that_cannot_be_written_leaves_the_old_file_and_no_partial_one(skipping_trace, tmp_path):
    """Issue 21, item 8: a write that fails half-way (here: a file-size limit, EFBIG, which fails like a full
    disk) is one line and exit 2; the file that was there is untouched and nothing half-written is left."""
    out = tmp_path / "report.html"
    out.write_text("the report of yesterday")
    r = subprocess.run(
        [sys.executable, "-c", FULL, skipping_trace, str(out)], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert r.returncode == 2 and r.stderr == f"ampdoctor report: cannot write {out} (File too large)\n", r.stderr
    assert out.read_text() == "the report of yesterday" and os.listdir(tmp_path) == ["report.html"]


def _unshare_works() -> bool:
    probe = ["unshare", "--user", "--map-root-user", "--mount", "true"]
    try:
        return subprocess.run(probe, capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.skipif(not _unshare_works(), reason="needs unshare(1) with user namespaces to mount a small tmpfs")
@pytest.mark.parametrize(
    "mount, message",
    [("size=256k", "No space left on device"), ("size=1m,ro", "Read-only file system")],
)
def test_a_full_or_read_only_file_system_is_one_line(skipping_trace, tmp_path, mount, message):
    """Issue 21, item 8, on real file systems: a 256 KB tmpfs (the report is megabytes) and a read-only one, each
    holding yesterday's report; mounted in a private mount namespace."""
    d = tmp_path / "mnt"
    d.mkdir()
    script = (
        f"mount -t tmpfs -o size=1m tmpfs {d} && echo yesterday > {d}/r.html && "
        f"mount -o remount,{mount} {d} && "
        f"{sys.executable} -m ampdoctor report {skipping_trace} -o {d}/r.html; echo rc=$?; cat {d}/r.html; ls -A {d}"
    )
    r = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert r.stderr == f"ampdoctor report: cannot write {d}/r.html ({message})\n", r.stderr
    assert r.stdout.split() == ["rc=2", "yesterday", "r.html"]


def test_a_report_replaces_a_file_whole_keeping_its_mode_and_links(skipping_trace, tmp_path):
    """What is replaced is replaced whole, by rename: the old file's permissions stay, a symbolic link stays a
    link (the file it names is replaced), nothing else is left in the directory."""
    target = tmp_path / "reports" / "r.html"
    target.parent.mkdir()
    target.write_text("old")
    os.chmod(target, 0o640)
    os.symlink(target, tmp_path / "latest.html")
    assert cli.main(["report", skipping_trace, "-o", str(tmp_path / "latest.html")]) == 0
    assert os.path.islink(tmp_path / "latest.html") and target.read_text().startswith("<!DOCTYPE html>")
    assert oct(os.stat(target).st_mode & 0o777) == oct(0o640)
    assert sorted(os.listdir(target.parent)) == ["r.html"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--poll", "nan"], "--poll nan: must be 0.1 to 86400 seconds"),
        (["--poll", "inf"], "--poll inf: must be 0.1 to 86400 seconds"),
        (["--poll", "0"], "--poll 0.0: must be 0.1 to 86400 seconds"),
        (["--poll", "-1"], "--poll -1.0: must be 0.1 to 86400 seconds"),
        (["--host", "999.1.1.1"], "cannot listen on 999.1.1.1:8050"),
    ],
)
def test_serve_arguments_out_of_range_are_one_line(skipping_trace, capsys, args, message):
    """Issue 21, item 8: `serve --poll nan|inf` ended in a traceback (int(nan * 1000)); an address the server
    cannot listen on printed werkzeug's message and exit 1."""
    assert cli.main(["serve", skipping_trace, *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"ampdoctor serve: {message}"), err


def test_serve_on_a_port_in_use_is_one_line(skipping_trace, capsys):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert cli.main(["serve", skipping_trace, "--port", str(port)]) == 2
    assert capsys.readouterr().err == f"ampdoctor serve: cannot listen on 127.0.0.1:{port} (Address already in use)\n"


def test_layers_step_beyond_any_int64_is_one_line(skipping_trace, capsys):
    assert cli.main(["layers", skipping_trace, "--step", str(10**30)]) == 2
    assert capsys.readouterr().err == f"step {10**30} has no full statistics; nearest full step: 15 " + (
        "(full statistics every 5 steps and at anomalies)\n"
    )
