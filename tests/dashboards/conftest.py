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
