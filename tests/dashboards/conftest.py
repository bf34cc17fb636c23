"""Traces for the dashboard tests (real CPU training runs, small) and headless Chromium for dash_duo."""

import atexit
import os
import shutil
import tempfile

import pytest
import runs


def pytest_setup_options():
    """Chromium options for dash_duo: headless, no sandbox (CI runs as root), nothing fetched in the background."""
    from selenium.webdriver.chrome.options import Options

    opts = Options()
    profile = tempfile.mkdtemp(prefix="ampdoctor-chrome-")  # a fresh profile per browser, removed at exit
    atexit.register(shutil.rmtree, profile, ignore_errors=True)
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        "--window-size=1400,1000",
        f"--user-data-dir={profile}",
    ):
        opts.add_argument(arg)
    if shutil.which("chromium") and not os.environ.get("DASH_TEST_CHROMEPATH"):
        opts.binary_location = shutil.which("chromium")
    return opts  # pluggy collects hook results into a list; dash takes the first


@pytest.fixture(scope="session")
def traces(tmp_path_factory):
    """A directory with two faulty FP16 runs (init scale 2^24: the first steps overflow and are skipped; no
    scaler and a loss x 1e-5: gradients underflow layer by layer), a BF16 run and two per-rank traces of one run."""
    d = tmp_path_factory.mktemp("traces")
    runs.train(
        runs.mlp(),
        30,
        precision="fp16",
        scaler=False,
        loss_weight=1e-5,
        trace=str(d / "fp16_under.db"),
        attach_options={"every": 5, "hist_every": 5},
    )
    runs.train(
        runs.mlp(),
        30,
        precision="fp16",
        init_scale=2.0**24,
        trace=str(d / "fp16_bad.db"),
        attach_options={"every": 5, "hist_every": 5},
    )
    runs.train(runs.mlp(), 30, precision="bf16", trace=str(d / "bf16.db"), attach_options={"every": 5})
    (d / "ddp").mkdir()
    for r in (0, 1):
        runs.train(runs.mlp(seed=r), 6, precision="bf16", trace=str(d / "ddp" / f"run.rank{r}.db"))
    return d


@pytest.fixture(scope="session")
def edge_traces(tmp_path_factory):
    """Traces at the edges: no step at all, and an FP32 run without autocast or scaler."""
    d = tmp_path_factory.mktemp("edge")
    runs.train(runs.mlp(), 0, precision="fp16", trace=str(d / "zero.db"))
    runs.train(runs.mlp(), 3, precision="fp32", trace=str(d / "fp32.db"))
    return d


@pytest.fixture(scope="session")
def tracker():
    """A loopback HTTP server that records every request: (port, paths). A page that renders a hostile name
    as markup would make the browser fetch from it."""
    import http.server
    import threading

    paths = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            paths.append(self.path)
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_port, paths
    server.shutdown()


@pytest.fixture(scope="session")
def hostile(tmp_path_factory, tracker):
    """(trace, name): a real FP16 run with two faults: a LayerNorm kept in FP16 (a warning) and a layer that
    overflows in every forward pass (critical; every gradient statistic is NaN from then on). That layer is
    named like an attack: a Markdown image and an HTML link to the tracker, and an escape sequence that sets a
    terminal's title."""
    import collections

    import torch

    port = tracker[0]
    name = f"![t](http://localhost:{port}/md)<a href='http://localhost:{port}/a'>a</a><b>B</b>\x1b]0;pwned\x07"
    torch.manual_seed(0)
    big = torch.nn.Linear(32, 32)
    with torch.no_grad():
        big.weight.mul_(3e5)  # outputs ~1e5, beyond the FP16 max 65504
    model = torch.nn.Sequential(
        collections.OrderedDict(
            [
                ("inp", torch.nn.Linear(32, 32)),
                ("norm", torch.nn.LayerNorm(32).half()),
                (name, big),
                ("post", torch.nn.LayerNorm(32)),  # brings the values back in range (an FP32 island can end here)
                ("act", torch.nn.ReLU()),
                ("out", torch.nn.Linear(32, 1)),
            ]
        )
    )
    path = tmp_path_factory.mktemp("hostile") / "hostile.db"
    runs.train(model, 4, precision="fp16", scaler=False, trace=str(path))  # GradScaler refuses FP16 weights
    return path, name


# -- one Chromium for the session, apps served on real threaded servers ------------------------------------------
class Browser:
    """A headless Chromium (one per session) and the apps it visits, each on a werkzeug threaded server as
    ``ampdoctor serve`` runs it. Figures are read from the page (plotly's own data), never from pixels."""

    def __init__(self):
        from selenium import webdriver

        opts = pytest_setup_options()
        opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
        self.driver = webdriver.Chrome(options=opts)
        self.driver.set_window_size(1400, 1000)
        self._servers = []

    def serve(self, app) -> str:
        """Serve ``app`` on 127.0.0.1 (a port of its own) until the session ends; its base URL."""
        import threading

        from werkzeug.serving import make_server

        srv = make_server("127.0.0.1", 0, app.server, threaded=True)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        self._servers.append(srv)
        return f"http://127.0.0.1:{srv.server_port}"

    def open(self, url: str) -> None:
        self.driver.get(url)

    def wait(self, condition, timeout: float = 30.0, what: str = ""):
        """Poll ``condition()`` (JS errors and missing elements count as not yet) until it is truthy."""
        import time

        from selenium.common.exceptions import WebDriverException

        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            try:
                value = condition()
                if value:
                    return value
            except (WebDriverException, KeyError, IndexError, TypeError, StopIteration, ValueError) as exc:
                last = exc
            time.sleep(0.15)
        raise AssertionError(f"timed out waiting for {what or condition} ({last})")

    def css(self, selector: str):
        from selenium.webdriver.common.by import By

        return self.driver.find_elements(By.CSS_SELECTOR, selector)

    def text(self, selector: str) -> str:
        from selenium.common.exceptions import StaleElementReferenceException

        for _ in range(5):  # an element the page redrew between finding it and reading it: found again
            els = self.css(selector)
            try:
                return els[0].text if els else ""
            except StaleElementReferenceException:
                continue
        return ""

    def figure(self, graph_id: str) -> dict | None:
        """The figure a dcc.Graph shows, as plotly holds it in the page ({"data": [...], "layout": {...}}), arrays
        decoded; None before it is drawn."""
        fig = self.driver.execute_script(
            """
            var host = document.getElementById(arguments[0]);
            var gd = host && (host.classList.contains('js-plotly-plot') ? host : host.querySelector('.js-plotly-plot'));
            if (!gd || !gd.data || !gd._fullLayout) return null;
            function L(v) {
              if (v === null || v === undefined) return v;
              if (v.bdata) return {bdata: v.bdata, dtype: v.dtype, shape: v.shape};
              if (ArrayBuffer.isView(v)) return Array.from(v, Number);
              if (Array.isArray(v)) return v.map(L);
              return v;
            }
            var data = gd.data.map(function (t) {
              return {name: t.name, type: t.type, meta: t.meta || null, x: L(t.x), y: L(t.y), z: L(t.z),
                      opacity: t.opacity, line: t.line || null, yaxis: t.yaxis || null};
            });
            var lay = gd.layout;
            return {data: data, layout: {xaxis: {range: gd._fullLayout.xaxis && gd._fullLayout.xaxis.range,
                                                 type: gd._fullLayout.xaxis && gd._fullLayout.xaxis.type},
                                         yaxis: {type: gd._fullLayout.yaxis && gd._fullLayout.yaxis.type,
                                                 ticktext: lay.yaxis && lay.yaxis.ticktext,
                                                 tickvals: L(lay.yaxis && lay.yaxis.tickvals)},
                                         title: lay.title && lay.title.text, shapes: lay.shapes || [],
                                         annotations: (lay.annotations || []).map(function (a) { return a.text; })}};
            """,
            graph_id,
        )
        if fig is not None:
            for t in fig["data"]:
                for k in ("x", "y", "z"):
                    t[k] = decode(t[k])
        return fig

    def undrawn(self) -> list:
        """Every chart of the page that plotly.js did not draw as asked: a graph without its figure, or a trace
        whose type the loaded plotly.js lacks (it then silently draws nothing, or a heat map's data as a scatter:
        plotly.js coerces an unknown type to its default and logs nothing at its default level). Empty: all drawn."""
        return self.driver.execute_script(
            """
            var out = [];
            document.querySelectorAll('.js-plotly-plot').forEach(function (gd, g) {
              var name = (gd.closest('[id]') || {}).id || ('graph ' + g);
              if (!gd._fullData || !gd._fullLayout || !gd.querySelector('.main-svg')) {
                out.push(name + ': not drawn');
                return;
              }
              (gd.data || []).forEach(function (t, i) {
                var full = gd._fullData.find(function (f) { return f.index === i; });
                var want = t.type || 'scatter';
                if (!full || full.type !== want || !full._module)
                  out.push(name + ': trace ' + i + ' ' + want + ' drawn as ' + (full ? full.type : 'nothing'));
              });
            });
            return out;
            """
        )

    def errors(self) -> list:
        """Console errors since the last call."""
        return [e for e in self.driver.get_log("browser") if e.get("level") == "SEVERE"]

    def close(self):
        for srv in self._servers:
            srv.shutdown()
        self.driver.quit()


def decode(v):
    """A figure array as the browser holds it: a list, or plotly's typed-array encoding {dtype, bdata, shape}."""
    import base64

    import numpy as np

    if isinstance(v, dict) and "bdata" in v:
        a = np.frombuffer(base64.b64decode(v["bdata"]), dtype=np.dtype(v["dtype"]))
        if v.get("shape"):
            a = a.reshape([int(s) for s in str(v["shape"]).split(",")])
        return a
    return v


@pytest.fixture(scope="session")
def browser():
    b = Browser()
    yield b
    b.close()


@pytest.fixture(scope="session", autouse=True)
def _private_cache(tmp_path_factory):
    """The dashboards' results cache of this test session: never the user's own ~/.cache."""
    old = os.environ.get("AMPDOCTOR_CACHE_DIR")
    os.environ["AMPDOCTOR_CACHE_DIR"] = str(tmp_path_factory.mktemp("ampdoctor-cache"))
    yield
    if old is None:
        os.environ.pop("AMPDOCTOR_CACHE_DIR", None)
    else:
        os.environ["AMPDOCTOR_CACHE_DIR"] = old
