"""The dashboard behind a real threaded HTTP server (the one ``app.run`` starts): Host names it answers, concurrent
requests, and bad input answered with a message on the page instead of a 500."""

import json
import shutil
import threading
import time
import urllib.error
import urllib.request

import pytest
import runs
from ampdoctor.dashboards import hosts, ids
from ampdoctor.dashboards.app import create_app
from werkzeug.serving import make_server

import ampdoctor


class Server:
    """``app`` served on 127.0.0.1 by werkzeug's threaded server, as ``ampdoctor serve`` runs it."""

    def __init__(self, app):
        self.httpd = make_server("127.0.0.1", 0, app.server, threaded=True)
        self.port = self.httpd.server_port
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        self.deps = json.loads(self.get("/_dash-dependencies")[1])

    def close(self):
        self.httpd.shutdown()

    def request(self, path, body=None, host=None):
        """(status, body text) of a GET (or a POST of ``body`` as JSON), with the Host header ``host``."""
        headers = {"Content-Type": "application/json", **({"Host": host} if host else {})}
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}",
            headers=headers,
            data=None if body is None else json.dumps(body).encode(),
        )
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
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

    def start(app):
        servers.append(Server(app))
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
