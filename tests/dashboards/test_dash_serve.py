"""`ampdoctor serve`: arguments, the 0.0.0.0 warning, and what the browser can and cannot reach."""

import dash
import pytest
from ampdoctor.dashboards import data, diagnosis, server
from ampdoctor.dashboards.app import create_app, render
from ampdoctor.dashboards.pages import compare, formats, layer, layers, overview, precision, whatif
from ampdoctor.dashboards.pages import ranks as ranks_page

from ampdoctor.cli import main
from ampdoctor.commands import serve as command


def _record(monkeypatch, calls: list, apps: list | None = None) -> None:
    """Record the server ``ampdoctor serve`` would start (dashboards/server.py) instead of serving."""

    class Recorded:
        def __init__(self, app, host, port):
            calls.append({"host": host, "port": port, "debug": app.server.debug})
            if apps is not None:
                apps.append(app)
            self.port = port

        def serve_forever(self):
            pass

        def server_close(self):
            pass

    monkeypatch.setattr(server, "make_server", Recorded)


@pytest.fixture
def no_server(monkeypatch):
    calls = []
    _record(monkeypatch, calls)
    return calls


def test_serve_binds_loopback_by_default(traces, no_server, capsys):
    assert main(["serve", str(traces)]) == 0
    assert no_server == [{"host": "127.0.0.1", "port": 8050, "debug": False}]
    err = capsys.readouterr().err
    assert "WARNING" not in err and "http://127.0.0.1:8050/" in err


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.5"])
def test_serve_on_all_interfaces_warns(traces, no_server, capsys, host):
    assert main(["serve", str(traces / "bf16.db"), "--host", host, "--port", "8123"]) == 0
    assert no_server[0]["host"] == host and no_server[0]["debug"] is False
    err = capsys.readouterr().err
    assert "WARNING" in err and "anyone on the network" in err


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1", "127.0.0.2"])
def test_loopback_hosts(host):
    assert command.is_loopback(host)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["serve", "/no/such/dir"], "ampdoctor serve: /no/such/dir: no such file or directory"),
        (["serve", "{traces}", "--reference", "/no/ref.db"], "ampdoctor serve: --reference /no/ref.db: no such file"),
        (["serve", "{traces}", "--port", "70000"], "ampdoctor serve: --port 70000: not a port number"),
    ],
)
def test_serve_bad_usage_is_one_line_exit_2(traces, no_server, capsys, argv, message):
    assert main([a.format(traces=traces) for a in argv]) == 2
    assert capsys.readouterr().err == message + "\n"
    assert no_server == []


def test_serve_bad_trace_is_one_line_exit_2(tmp_path, no_server, capsys):
    bad = tmp_path / "empty.db"
    bad.write_bytes(b"")
    assert main(["serve", str(bad)]) == 2
    assert capsys.readouterr().err == f"ampdoctor: {bad}: empty file (0 bytes), not an ampdoctor trace\n"


@pytest.mark.parametrize(
    "run", ["../fp16_bad.db", "/etc/passwd", "..%2Ffp16_bad.db", "ddp/../fp16_bad.db", "run.rank0.db/../../bf16.db", ""]
)
def test_traversal_attempts_reach_nothing(traces, run):
    app = create_app(str(traces / "ddp"))
    ctx = app.ampdoctor
    assert ctx.resolve(run) is None and ctx.trace(run) is None
    _, page = render(ctx, "/", f"?run={run}")
    assert getattr(page, "id", None) == "unknown-run" or run == ""


def test_only_served_runs_resolve(traces):
    ctx = create_app(str(traces / "ddp"), reference=str(traces / "bf16.db")).ampdoctor
    assert set(ctx.runs()) == {"run.rank0.db", "run.rank1.db"}
    assert ctx.trace("run.rank1.db") is not None
    assert ctx.trace("reference").path.endswith("bf16.db")  # given on the command line


def test_http_paths_do_not_walk_the_file_system(traces):
    client = create_app(str(traces / "ddp")).server.test_client()
    for url in (
        "/assets/../../../../etc/passwd",
        "/assets/..%2f..%2f..%2fetc%2fpasswd",
        "/_dash-component-suites/../../etc/passwd",
        "/_dash-component-suites/dash/../../../../etc/passwd",
    ):
        r = client.get(url)
        assert b"root:" not in r.data and r.status_code in (200, 404), url
        assert r.status_code == 404 or b"<!DOCTYPE html>" in r.data  # the app shell, never a file


@pytest.mark.parametrize(
    "which, run",
    [
        ("traces", "fp16_bad.db"),
        ("traces", "fp16_under.db"),
        ("traces", "bf16.db"),
        ("traces", "ddp/run.rank1.db"),
        ("edge_traces", "zero.db"),
        ("edge_traces", "fp32.db"),
    ],
)
def test_every_page_and_callback_works_on_every_kind_of_trace(request, which, run):
    """No page or callback raises, whatever the trace: overflowing, underflowing, BF16, per rank, empty, FP32."""
    root = request.getfixturevalue(which)
    ctx = create_app(str(root), reference=str(request.getfixturevalue("traces") / "bf16.db")).ampdoctor
    tr = ctx.trace(run)
    search = f"?run={run}&site={int(tr.sites()['id'].iloc[-1]) if len(tr.sites()) else 0}"
    for path in ("/", "/layers", "/layer", "/precision", "/whatif", "/formats", "/compare", "/ranks", "/nope"):
        head, page = render(ctx, path, search)
        assert head is not None and page is not None
    version = {"run": run, "n": tr.n_steps}
    count, *_ = overview.update(ctx, version, search)
    assert count == f"{tr.n_steps} steps"
    for zoom in (None, {"x0": 1, "x1": 2}):
        figs = overview.charts(ctx, version, zoom, 0.6, ["log"], None, search)
        assert len(figs) == 5
        layer.update(ctx, version, search, "absmax_log2", zoom)
        whatif.update(ctx, "1024", "10", "2", "0.5", version, search, zoom)
        compare.update(ctx, "reference", "fp16_under", version, search, zoom)
    for kind in data.KINDS:
        for stat in data.STATS:
            layers.update(ctx, kind, stat, "worst", "", 0, "log", [], 1, version, None, search)
    layers.update(ctx, "act", "absmax_log2", "order", "/[/", 2, "clip", ["nonzero"], 3, version, None, search)
    whatif.update(ctx, None, None, None, None, version, search)  # emptied inputs: the run's own settings
    precision.update(ctx, "", [], 1, version, search)
    formats.update(ctx, "e4m3", "", 1, version, search)
    ranks_page.update(ctx, "loss_scale", version, search)
    if len(tr.sites("grad_out")):
        path = str(tr.sites("grad_out")["path"].iloc[0])
        assert layers.open_clicked(ctx, {"points": [{"y": path}]}, "grad_out", "fp16_under", search)[0] == "/layer"
    assert layers.open_clicked(ctx, {"points": []}, "grad_out", "fp16_under", search) == (
        dash.no_update,
        dash.no_update,
    )


def test_findings_are_cached_and_a_failing_rule_does_not_break_the_overview(traces, monkeypatch, tmp_path):
    monkeypatch.setenv("AMPDOCTOR_CACHE_DIR", str(tmp_path / "cache"))  # not the findings of an earlier test's server
    calls = []

    def failing(tr, reference=None, first=None):
        calls.append(tr.path)
        raise IndexError("boolean index did not match")

    monkeypatch.setattr(diagnosis, "diagnose_run", failing)
    ctx = create_app(str(traces), diagnose_in="thread").ampdoctor
    assert ctx.findings_and_error("bf16.db") == ([], "IndexError: boolean index did not match")
    assert ctx.findings("bf16.db") == [] and len(calls) == 1  # same trace content: not run again
    _, _, cards = overview.update(ctx, None, "?run=bf16.db")
    assert cards.id == "diagnosis-error" and "IndexError" in cards.children


def test_a_diagnosis_runs_in_its_own_process_and_is_kept_on_disk(traces, tmp_path, monkeypatch):
    """The first diagnosis of a trace's content runs in a separate process; a second server (a restart) reads it
    from the cache directory instead of diagnosing again; new steps make a new key. Nothing is written next to the
    trace."""
    import os
    import shutil
    import time

    from ampdoctor.dashboards import cache

    monkeypatch.setenv("AMPDOCTOR_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "runs").mkdir()
    shutil.copy(traces / "fp16_bad.db", tmp_path / "runs" / "a.db")
    os.chmod(tmp_path / "runs", 0o555)  # a read-only directory of traces
    try:

        def ours():  # (SQLite's own -wal/-shm files of a WAL trace are the reader's, not the cache's)
            return sorted(f for f in os.listdir(tmp_path / "runs") if not f.endswith(("-wal", "-shm")))

        before = ours()
        ctx = create_app(str(tmp_path / "runs")).ampdoctor
        state = ctx.diagnosis_state("a.db")
        assert state.running and state.value is None  # the page is not held up
        deadline = time.time() + 60
        while time.time() < deadline and not ctx.diagnosis_state("a.db").current:
            time.sleep(0.2)
        found = ctx.findings("a.db")
        want = diagnosis.findings(ctx.trace("a.db"))
        assert [d.to_dict() for d in found] == [d.to_dict() for d in want] and found
        assert len(cache.prefix_files("findings-", "json")) == 1
        monkeypatch.setattr(diagnosis, "findings", lambda *a, **k: 1 / 0)  # a second server must not diagnose
        again = create_app(str(tmp_path / "runs"), diagnose_in="thread").ampdoctor
        assert [d.to_dict() for d in again.findings("a.db")] == [d.to_dict() for d in want]
        assert ours() == before  # nothing written next to the trace
    finally:
        os.chmod(tmp_path / "runs", 0o755)


def test_serve_command_serves_the_app_on_loopback(traces):
    """The real command in a subprocess: the page and its layout come back from 127.0.0.1, nothing crashes."""
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "ampdoctor", "serve", str(traces), "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        body = None
        deadline = time.time() + 30
        while time.time() < deadline and body is None:
            try:
                body = urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2).read().decode()
            except OSError:
                time.sleep(0.3)
        assert body is not None and "<title>ampdoctor</title>" in body
        layout = urllib.request.urlopen(f"http://127.0.0.1:{port}/_dash-layout", timeout=5).read().decode()
        assert '"id":"page"' in layout.replace(" ", "")
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=10)
    assert f"ampdoctor dashboard on http://127.0.0.1:{port}/" in err
    assert "Traceback" not in err and "WARNING: binding" not in err


def _finishes(fn, fifo, timeout=10.0):
    """Run ``fn`` in a thread: its result, or an AssertionError when it hangs (then the FIFO gets a writer, so
    a reader blocked in open() returns)."""
    import os
    import threading

    out = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        t.join(timeout)
        raise AssertionError(f"blocked on the FIFO {fifo}")
    return out[0]


@pytest.mark.skipif(not hasattr(__import__("os"), "mkfifo"), reason="no FIFOs here")
def test_a_fifo_in_the_served_directory_is_skipped_unopened(traces, tmp_path, monkeypatch, capsys):
    """A FIFO named like a trace blocks whoever opens it: serve starts, and a FIFO that appears later is never
    opened by the rescan that every callback does."""
    import os
    import shutil
    import time

    apps = []
    _record(monkeypatch, [], apps)
    shutil.copy(traces / "bf16.db", tmp_path / "bf16.db")
    os.mkfifo(tmp_path / "early.db")
    assert _finishes(lambda: main(["serve", str(tmp_path)]), tmp_path / "early.db") == 0
    ctx = apps[0].ampdoctor
    assert set(ctx.runs()) == {"bf16.db"}
    os.mkfifo(tmp_path / "late.db")
    time.sleep(1.1)  # the run list is rescanned at most once a second
    assert set(_finishes(ctx.runs, tmp_path / "late.db")) == {"bf16.db"}
    capsys.readouterr()
    assert main(["serve", str(tmp_path / "late.db")]) == 2
    assert capsys.readouterr().err == f"ampdoctor serve: {tmp_path / 'late.db'}: not a regular file or a directory\n"


def test_serve_answers_the_names_its_options_allow(traces, monkeypatch, capsys):
    """--host and --allow-host reach the app: a wildcard bind answers addresses and the allowed name, not others."""
    apps = []
    _record(monkeypatch, [], apps)
    assert main(["serve", str(traces), "--host", "0.0.0.0", "--allow-host", "dash.example"]) == 0
    client = apps[0].server.test_client()
    for host, status in (
        ("dash.example:8050", 200),
        ("10.1.2.3:8050", 200),
        ("localhost:8050", 200),
        ("attacker.example:8050", 403),
    ):
        assert client.get("/", headers={"Host": host}).status_code == status, host
    capsys.readouterr()
    assert main(["serve", str(traces), "--allow-host", "not a name"]) == 2
    assert capsys.readouterr().err == "ampdoctor serve: --allow-host not a name: not a host name\n"


def test_the_formats_table_shows_before_the_rules_end(traces, monkeypatch, tmp_path):
    """The diagnosis hands its formats table over before its rules run: the page shows it while they do, the same
    table the finished diagnosis has."""
    import threading

    monkeypatch.setenv("AMPDOCTOR_CACHE_DIR", str(tmp_path / "cache"))
    release, original = threading.Event(), diagnosis.diagnose_run

    def slow(tr, reference=None, first=None):
        def then_wait(run):
            first(run)
            assert release.wait(60)

        return original(tr, reference, then_wait)

    monkeypatch.setattr(diagnosis, "diagnose_run", slow)
    ctx = create_app(str(traces), diagnose_in="thread").ampdoctor
    for _ in range(200):
        early, st, _ = ctx.formats_table("bf16.db", wait=0.1)
        if early is not None and not data.fp8_pending(early):  # (its FP16 / BF16 columns came first)
            break
    assert early is not None and st is not None and st.value is None  # the rules have not ended
    release.set()
    assert ctx.findings_and_error("bf16.db")[1] is None
    done, st, _ = ctx.formats_table("bf16.db")
    assert st.value is not None and done.equals(early)


def test_fp16_and_bf16_columns_show_before_the_pass_over_the_peaks(traces, monkeypatch, tmp_path):
    """The FP8 columns need every observed step's amax (the pass over the peaks, most of a long run's reading); the
    FP16 / BF16 columns come before it, with the numbers the whole table has, and the page ranks by the run's own
    format meanwhile, its FP8 cells marked as coming."""
    import threading

    import pandas as pd

    from ampdoctor.trace import peaks

    monkeypatch.setenv("AMPDOCTOR_CACHE_DIR", str(tmp_path / "cache"))
    release, original = threading.Event(), peaks.scan

    def held(*args, **kw):
        assert release.wait(60)
        return original(*args, **kw)

    monkeypatch.setattr(peaks, "scan", held)
    ctx = create_app(str(traces), diagnose_in="thread").ampdoctor
    try:
        for _ in range(300):
            half, st, _ = ctx.formats_table("bf16.db", wait=0.1)
            if half is not None:
                break
        assert half is not None and st is not None and st.value is None
        assert data.fp8_pending(half) and "bf16_lost" in half and not any(c.startswith("e4m3") for c in half)
        _, _, fig, listing, _ = formats.update(ctx, "e4m3", "", 1, None, "?run=bf16.db")
        assert "worst in BF16 first" in fig.layout.title.text  # (a BF16 run) not an empty E4M3 ranking
        assert "reading the amax of every observed step" in str(listing)
        assert '"…"' in str(listing) or "\\u2026" in str(listing)  # the E4M3 / E5M2 cells
    finally:
        release.set()
    assert ctx.findings_and_error("bf16.db")[1] is None
    whole, _, _ = ctx.formats_table("bf16.db")
    assert not data.fp8_pending(whole) and {"e4m3_lost", "e5m2_lost"} <= set(whole.columns)
    pd.testing.assert_frame_equal(half, whole[half.columns])  # the same FP16 / BF16 numbers


def test_a_rank_trace_that_appears_is_diagnosed_with_the_run_at_once(tmp_path, monkeypatch):
    """A growing trace is diagnosed again at most every few seconds, but a rank's trace that appears (copied in
    after the others, a rank that started late) makes another run: the next ask diagnoses the ranks together, not
    the ranks seen before. Two ranks whose scalers started apart: rank 0 alone has nothing to compare."""
    import shutil
    import time

    import rule_runs

    monkeypatch.setenv("AMPDOCTOR_CACHE_DIR", str(tmp_path / "cache"))
    for r in (0, 1):
        rule_runs._rank(str(tmp_path / "m-{rank}.db"), r, 2, init_scale=2.0**12 if r == 1 else 2.0**10)
    (tmp_path / "runs").mkdir()
    shutil.copy(tmp_path / "m-0.db", tmp_path / "runs" / "m-0.db")
    ctx = create_app(str(tmp_path / "runs"), diagnose_in="thread").ampdoctor

    def findings():
        deadline = time.time() + 60
        while time.time() < deadline and not ctx.diagnosis_state("m-0.db").current:
            time.sleep(0.2)
        return [d.rule for d in ctx.findings("m-0.db")]

    assert "rank-scale-divergence" not in findings()
    shutil.copy(tmp_path / "m-1.db", tmp_path / "runs" / "m-1.db")
    time.sleep(1.1)  # the served directory is rescanned every second
    assert sorted(ctx.peers("m-0.db")) == [0, 1]
    assert "rank-scale-divergence" in findings()  # asked again within the growing trace's interval
