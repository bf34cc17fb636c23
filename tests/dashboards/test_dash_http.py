"""The dashboard behind a real threaded HTTP server (the one ``app.run`` starts): Host names it answers, concurrent
requests, and bad input answered with a message on the page instead of a 500."""

import base64
import gzip
import hashlib
import json
import os
import re
import shutil
import socket
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
import runs
from ampdoctor.dashboards import hosts, ids, server
from ampdoctor.dashboards.app import create_app

import ampdoctor


class Server:
    """``app`` served on 127.0.0.1 by the server ``ampdoctor serve`` runs (werkzeug's, with dashboards/server.py's
    limits; ``limits``: its keyword arguments)."""

    def __init__(self, app, **limits):
        self.httpd = server.make_server(app, "127.0.0.1", 0, **limits)
        self.port = self.httpd.server_port
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        self.deps = json.loads(self.get("/_dash-dependencies")[1])

    def close(self):
        self.httpd.shutdown()

    def request(self, path, body=None, host=None, headers=None):
        """(status, body text) of a GET (or a POST of ``body`` as JSON), with the Host header ``host``; the response
        headers go to ``headers`` (a dict) when given."""
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}",
            headers={"Content-Type": "application/json", **({"Host": host} if host else {})},
            data=None if body is None else json.dumps(body).encode(),
        )
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                if headers is not None:
                    headers.update(r.headers)
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def get(self, path, host=None):
        return self.request(path, host=host)

    def callback(self, output: str, values: dict, host=None):
        """Call the Dash callback whose outputs include ``output`` ("id.prop") with ``values`` ("id.prop" ->
        value) for its inputs and state, as the browser does: (status, {"id": {"prop": value}}), or (status, text)
        when the server refused it."""
        dep = next(d for d in self.deps if output in d["output"].strip(".").split("..."))
        outputs = [dict(zip(("id", "property"), o.rsplit(".", 1))) for o in dep["output"].strip(".").split("...")]

        def props(items):
            return [
                {"id": i["id"], "property": i["property"], "value": values.get(f"{i['id']}.{i['property']}")}
                for i in items
            ]

        body = {
            "output": dep["output"],
            "outputs": outputs if len(outputs) > 1 else outputs[0],
            "inputs": props(dep["inputs"]),
            "state": props(dep["state"]),
            "changedPropIds": [f"{i['id']}.{i['property']}" for i in dep["inputs"]],
        }
        status, text = self.request("/_dash-update-component", body, host)
        if status != 200:
            return status, text
        out = json.loads(text)
        return status, {**out.get("response", {}), **out.get("sideUpdate", {})}  # set_props: sideUpdate


@pytest.fixture
def serve():
    servers = []

    def start(app, **limits):
        servers.append(Server(app, **limits))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def test_only_the_names_the_server_was_started_for_are_answered(traces, serve):
    """A DNS-rebinding page reaches the server under its own name: 403 for it, the app for loopback names."""
    srv = serve(create_app(str(traces)))
    for host in (f"127.0.0.1:{srv.port}", f"localhost:{srv.port}", f"[::1]:{srv.port}", "localhost:9999"):
        status, body = srv.get("/", host)
        assert status == 200 and "<title>ampdoctor</title>" in body, host
    for host in (
        f"attacker.example:{srv.port}",
        "attacker.example",
        f"192.168.1.5:{srv.port}",
        f"127.0.0.1.nip.io:{srv.port}",
    ):
        for path in ("/", "/_dash-layout", "/_dash-dependencies"):
            status, body = srv.get(path, host)
            assert status == 403 and "--allow-host" in body and "trace" not in body, (host, path)
        status, body = srv.callback(f"{ids.SUMMARY}.children", {f"{ids.URL}.search": "?run=bf16.db"}, host)
        assert status == 403 and "bf16" not in body
    assert srv.get("/", "bad host:1:2")[0] == 400


@pytest.mark.parametrize(
    "bind, allow, host, ok",
    [
        ("127.0.0.1", (), "localhost:8050", True),
        ("127.0.0.1", (), "10.0.0.7:8050", False),
        ("127.0.0.1", ("dash.example",), "DASH.example.:8050", True),
        ("127.0.0.1", ("*",), "anything.example", True),
        ("0.0.0.0", (), "10.0.0.7:8050", True),  # an address: never what a rebinding page sends
        ("0.0.0.0", (), "attacker.example:8050", False),
        ("10.0.0.7", ("dash.example",), "dash.example", True),
        ("myhost.lan", (), "myhost.lan:8050", True),
    ],
)
def test_host_policy_of_the_serve_command(bind, allow, host, ok):
    assert hosts.for_bind(bind, allow).allows(host) is ok


def test_a_request_does_not_read_inside_another_threads_snapshot(tmp_path, serve):
    """A diagnosis reads a live trace inside one read transaction (Trace.snapshot). With one connection shared
    by the server's threads, every other request ran inside it too: stale step counts, and its ROLLBACK cut into
    their reads. Here the test thread holds such a snapshot while training goes on; a request sees the new steps."""
    gates = [threading.Event(), threading.Event()]

    def batches():
        data = runs.batches(11)
        for i, batch in enumerate(data):
            if i in (5, 10):
                assert gates[i // 10].wait(60)
            yield batch

    path = tmp_path / "live.db"
    training = threading.Thread(
        target=runs.train,
        args=(runs.mlp(),),
        daemon=True,
        kwargs=dict(steps=11, precision="bf16", trace=str(path), data=batches()),
    )
    training.start()
    try:
        _wait_for_steps(path, 4)  # a step is written when the next one begins
        app = create_app(str(tmp_path))
        srv = serve(app)
        with app.ampdoctor.trace("live.db").snapshot() as held:
            assert held.n_steps == 4
            gates[0].set()
            _wait_for_steps(path, 9)
            assert held.n_steps == 4  # the snapshot holds
            status, resp = srv.callback(f"{ids.STEP_COUNT}.children", {f"{ids.URL}.search": "?run=live.db"})
            assert status == 200 and resp[ids.STEP_COUNT]["children"] == "9 steps"
    finally:
        for g in gates:
            g.set()
        training.join(60)


def _wait_for_steps(path, n, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            try:
                with ampdoctor.load(path) as tr:
                    if tr.n_steps >= n:
                        return
            except ampdoctor.TraceError:
                pass
        time.sleep(0.1)
    raise AssertionError(f"{path} did not reach {n} steps")


def test_concurrent_first_diagnoses_against_one_reference(traces, tmp_path, serve):
    """Browsers fire several callbacks at once: 4 concurrent first diagnoses of 4 runs against one reference."""
    for i in range(4):
        shutil.copy(traces / "fp16_bad.db", tmp_path / f"run{i}.db")
    srv = serve(create_app(str(tmp_path), reference=str(traces / "bf16.db")))
    results = {}

    def overview(i):
        """Ask as the page does, until the diagnosis is there (it runs in the background)."""
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            results[i] = srv.callback(f"{ids.FINDINGS}.children", {f"{ids.URL}.search": f"?run=run{i}.db"})
            if results[i][0] != 200 or '"diagnosing"' not in json.dumps(results[i][1]):
                return
            time.sleep(0.5)

    threads = [threading.Thread(target=overview, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(150)
    assert [results[i][0] for i in range(4)] == [200] * 4
    texts = {
        json.dumps(resp[ids.FINDINGS]["children"]).replace(f"run{i}.db", "run.db")  # (links name the run)
        for i, (_, resp) in results.items()
    }
    assert len(texts) == 1 and "diagnosis-error" not in texts.pop()  # the same findings for every copy


def test_bad_input_is_a_message_on_the_page(traces, hostile, serve):
    """What-if factors GradScaler refuses, a site id int() refuses, a reference whose layers are all NaN."""
    srv = serve(create_app(str(traces), reference=str(hostile[0])))
    search = {f"{ids.URL}.search": "?run=fp16_bad.db"}
    for box, value, words in (
        (ids.WHATIF_BACKOFF, "5", "backoff factor should be a number between 0 and 1"),
        (ids.WHATIF_GROWTH, "0.5", "growth factor should be a number above 1"),
        (ids.WHATIF_INTERVAL, "2.5", "growth interval should be a whole number"),
        (ids.WHATIF_INIT, "-1", "init scale should be a positive number"),
        (ids.WHATIF_INIT, "lots", "init scale should be a positive number"),
    ):
        status, resp = srv.callback(f"{ids.WHATIF_SUMMARY}.children", {**search, f"{box}.value": value})
        assert status == 200 and words in json.dumps(resp[ids.WHATIF_SUMMARY]), (box, value)
    status, resp = srv.callback(f"{ids.LAYER_TITLE}.children", {f"{ids.URL}.search": "?run=fp16_bad.db&site=²"})
    assert status == 200 and resp[ids.LAYER_TITLE]["children"]["props"]["id"] == "no-such-layer"
    status, resp = srv.callback(
        f"{ids.COMPARE_LAYERS}.figure",
        {**search, f"{ids.COMPARE_OTHER}.value": "reference", f"{ids.COMPARE_STAT}.value": "absmax_log2"},
    )
    assert status == 200
    bars = resp[ids.COMPARE_LAYERS]["figure"]["data"]
    assert set(bars[0]["y"]) == set(ampdoctor.load(traces / "fp16_bad.db").sites("grad_out")["path"])


def test_a_failing_callback_says_so_on_the_page(traces, serve, monkeypatch):
    """Whatever else raises in a callback reaches the page as a message, not as a 500 without one."""
    from ampdoctor.dashboards import figures

    def broken(*args, **kwargs):
        raise RuntimeError("replay exploded")

    monkeypatch.setattr(figures, "whatif_figure", broken)
    srv = serve(create_app(str(traces)))
    status, resp = srv.callback(f"{ids.WHATIF_SUMMARY}.children", {f"{ids.URL}.search": "?run=fp16_bad.db"})
    assert status == 200 and resp[ids.ERROR]["children"] == (
        "This view could not be updated: RuntimeError: replay exploded"
    )


# -- issue 21, items 9-11: what one request may cost, traces changed under the server, headers ----------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _peak_rss_mb(pid: int) -> float:
    """The process's peak resident memory (VmHWM), MB."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024


def _post_streamed(port: int, total: int, chunked: bool = False) -> int:
    """POST ``total`` bytes of a JSON body to /_dash-update-component, 1 MB at a time (the test never holds it),
    and return the status of the answer."""
    head = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {total}"
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(
            f"POST /_dash-update-component HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"{head}\r\n\r\n".encode()
        )
        block = b'{"output": "' + b"x" * (2**20 - 12)
        try:
            for sent in range(0, total, len(block)):
                part = block[: min(len(block), total - sent)]
                s.sendall(b"%x\r\n%s\r\n" % (len(part), part) if chunked else part)
            if chunked:
                s.sendall(b"0\r\n\r\n")
        except OSError:  # the server answered and closed while we were still sending
            pass
        return int(s.recv(4096).split(b" ", 2)[1])


def test_a_request_body_over_the_limit_is_refused_413_and_costs_no_memory(traces, tmp_path):
    """Issue 21, item 9: a 300 MB JSON body to /_dash-update-component took the server from 112 MB to 1.6 GB.
    Now `ampdoctor serve` answers 413 (with a length given, and streamed in chunks without one) and its peak
    memory stays where it was."""
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "ampdoctor", "serve", str(traces / "bf16.db"), "--port", str(port)],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert "ampdoctor dashboard on" in proc.stderr.readline()
        url = f"http://127.0.0.1:{port}/"
        assert urllib.request.urlopen(url, timeout=60).status == 200
        before = _peak_rss_mb(proc.pid)
        assert _post_streamed(port, 300 * 2**20) == 413
        assert _post_streamed(port, server.MAX_BODY + 2**20, chunked=True) == 413
        assert _post_streamed(port, 1000, chunked=True) == 400  # within the limit: read (and not a callback)
        assert _peak_rss_mb(proc.pid) < before + 64
        assert urllib.request.urlopen(url, timeout=60).status == 200  # and it goes on serving
    finally:
        proc.terminate()
        proc.wait(30)


def _deleted_fds(path) -> list:
    """This process's open descriptors on a deleted file of that name."""
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target == f"{path} (deleted)":
            fds.append(fd)
    return fds


def test_a_trace_replaced_by_rename_is_read_anew(traces, tmp_path, serve):
    """Issue 21, item 10: what rsync (or cp + mv) does to a served trace. The pool kept the old, deleted file open
    and the dashboard showed it; now the next request opens (and checks) the file the name holds."""
    shutil.copy(traces / "ddp" / "run.rank0.db", tmp_path / "a.db")  # 6 steps
    srv = serve(create_app(str(tmp_path)))
    count = f"{ids.STEP_COUNT}.children"
    status, resp = srv.callback(count, {f"{ids.URL}.search": "?run=a.db"})
    assert status == 200 and resp[ids.STEP_COUNT]["children"] == "6 steps"
    shutil.copy(traces / "bf16.db", tmp_path / "a.db.partial")  # 30 steps
    os.replace(tmp_path / "a.db.partial", tmp_path / "a.db")
    status, resp = srv.callback(count, {f"{ids.URL}.search": "?run=a.db"})
    assert status == 200 and resp[ids.STEP_COUNT]["children"] == "30 steps"
    assert _deleted_fds(tmp_path / "a.db") == []


RECURSIVE_VIEW = (
    "ALTER TABLE steps RENAME TO steps_old; CREATE VIEW steps AS WITH RECURSIVE r(x) AS (SELECT 0 UNION ALL "
    "SELECT x + 1 FROM r) SELECT steps_old.* FROM r, steps_old"
)


def test_a_schema_changed_under_the_server_is_checked_again(traces, tmp_path, serve):
    """Issue 21, item 10: the steps table replaced by a recursive view after the dashboard opened the trace made
    the next request spin at 100% CPU forever. SQLite's schema cookie tells the server; the trace is checked
    again and refused: the request returns at once and shows none of it."""
    shutil.copy(traces / "bf16.db", tmp_path / "a.db")
    srv = serve(create_app(str(tmp_path)))
    count = f"{ids.STEP_COUNT}.children"
    status, resp = srv.callback(count, {f"{ids.URL}.search": "?run=a.db"})
    assert status == 200 and resp[ids.STEP_COUNT]["children"] == "30 steps"
    conn = sqlite3.connect(tmp_path / "a.db")
    conn.executescript(RECURSIVE_VIEW)
    conn.close()
    t0 = time.monotonic()
    status, resp = srv.callback(count, {f"{ids.URL}.search": "?run=a.db"})
    assert time.monotonic() - t0 < 10
    assert status == 200 and "steps" not in json.dumps(resp[ids.STEP_COUNT])


def test_every_query_is_bounded_in_time(traces, tmp_path):
    """The schema may change between a request's check and its queries: a query that would never end is
    interrupted after the limit (a TraceError, shown on the page); a trace held longer than that, query after
    query, is not."""
    shutil.copy(traces / "bf16.db", tmp_path / "a.db")
    tr = server.open_trace(str(tmp_path / "a.db"), limit_s=1.0)
    assert server.renew(tr)
    for _ in range(3):  # 3 s of short queries
        assert len(tr.steps()) == 30
        time.sleep(1.0)
    conn = sqlite3.connect(tmp_path / "a.db")
    conn.executescript(RECURSIVE_VIEW)
    conn.close()
    t0 = time.monotonic()
    with pytest.raises(ampdoctor.TraceError, match="interrupted"):
        tr.steps()
    assert time.monotonic() - t0 < 5
    assert not server.renew(tr)  # and the next request opens it again (and refuses it)
    tr.close()


def test_partial_requests_are_dropped_and_connections_are_capped(traces, serve):
    """Issue 21, item 11: 400 partial requests held 400 connections and 403 threads for ever. Now a connection
    that stops sending is dropped after the socket timeout, and at most max_connections are served at once (one
    thread each); the ones beyond are answered 503 without a thread."""
    srv = serve(create_app(str(traces)), max_connections=8, timeout_s=1.5)
    before = threading.active_count()
    socks = []
    for _ in range(40):
        s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
        s.sendall(b"GET / HTTP/1.1\r\nHost: 127")  # and never the rest
        socks.append(s)
    time.sleep(0.5)
    assert threading.active_count() - before <= 8
    answers = []
    for s in socks:
        try:
            answers.append(s.recv(4096))  # the 503 at once; the held ones: nothing until the timeout closes them
        except OSError as exc:
            answers.append(exc)
        s.close()
    # at most 8 held (one fewer when a slot was still busy with an earlier connection on a loaded machine), every
    # other one answered 503 at once
    held = sum(a == b"" for a in answers)  # closed by the server after 1.5 s of silence
    assert 7 <= held <= 8
    assert sum(a.startswith(b"HTTP/1.1 503") for a in answers if isinstance(a, bytes)) == 40 - held
    assert srv.get("/")[0] == 200
    deadline = time.monotonic() + 10
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert threading.active_count() <= before


def test_pages_forbid_framing_sniffing_referrers_and_foreign_script(traces, serve):
    """Issue 21, item 11: the pages show local data. Every response says: no framing (X-Frame-Options, CSP
    frame-ancestors), no type sniffing, no referrer; its CSP allows this server's scripts and exactly the inline
    script the page holds (by its hash)."""
    srv = serve(create_app(str(traces)))
    headers: dict = {}
    status, page = srv.request("/?run=bf16.db", headers=headers)
    assert status == 200
    assert headers["X-Frame-Options"] == "DENY"
    assert headers["X-Content-Type-Options"] == "nosniff"
    assert headers["Referrer-Policy"] == "no-referrer"
    csp = dict(d.strip().split(" ", 1) for d in headers["Content-Security-Policy"].split(";"))
    assert csp["frame-ancestors"] == "'none'" and csp["default-src"] == "'self'" and csp["object-src"] == "'none'"
    page = re.sub(r"<!--.*?-->", "", page, flags=re.S)  # (an old-IE notice sits in a comment)
    inline = re.findall(r"<script(?![^>]*\bsrc=)(?![^>]*application/json)[^>]*>(.*?)</script>", page, re.S)
    assert inline == ["var renderer = new DashRenderer();"]
    digest = base64.b64encode(hashlib.sha256(inline[0].encode()).digest()).decode()
    assert csp["script-src"] == f"'self' 'sha256-{digest}'"
    for path in ("/_dash-layout", "/_dash-dependencies"):  # the JSON the page fetches carries them too
        more: dict = {}
        assert srv.request(path, headers=more)[0] == 200
        assert (
            more["X-Frame-Options"] == "DENY" and more["Content-Security-Policy"] == headers["Content-Security-Policy"]
        )


def test_plotly_js_is_the_partial_bundle_unless_plotly_py_ships_another_version(traces, serve, monkeypatch):
    """Where Dash's renderer fetches plotly.js, the server answers with the vendored partial bundle (plotly.js of the
    version plotly.py writes its figures for), cached by its ETag and with the pages' headers; were plotly.py to ship
    another plotly.js, its own full bundle (Dash's) serves instead, in the dashboard and in the report."""
    import pkgutil

    from ampdoctor.dashboards import plotlyjs, report

    with open(plotlyjs.BUNDLE, "rb") as f:
        partial = f.read()
    full = pkgutil.get_data("plotly", "package_data/plotly.min.js")
    assert len(partial) < 0.4 * len(full)
    srv = serve(create_app(str(traces)))
    headers: dict = {}
    req = urllib.request.Request(f"http://127.0.0.1:{srv.port}/{plotlyjs.DASH_PATH}")
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.read() == partial
        headers.update(r.headers)
    assert headers["Content-Type"].startswith("text/javascript") and headers["X-Content-Type-Options"] == "nosniff"
    again = urllib.request.Request(req.full_url, headers={"If-None-Match": headers["ETag"]})
    with pytest.raises(urllib.error.HTTPError) as exc:  # (urllib raises on a 304)
        urllib.request.urlopen(again, timeout=60)
    assert exc.value.code == 304

    monkeypatch.setattr(plotlyjs, "plotly_version", lambda: "0.0.1")
    assert plotlyjs.bundle() is None
    other = serve(create_app(str(traces)))
    assert other.get("/")[0] == 200  # (Dash registers the files it serves as it writes the page)
    with urllib.request.urlopen(f"http://127.0.0.1:{other.port}/{plotlyjs.DASH_PATH}", timeout=60) as r:
        assert r.read() == full
    assert gzip.decompress(base64.b64decode(report._plotly_gz())).decode() == full.decode()
