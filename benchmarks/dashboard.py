"""The dashboard and the report on long runs, measured as a user meets them: `ampdoctor serve` in its own process,
the pages opened in headless Chromium, `ampdoctor report` in its own process.

For each generated trace (benchmarks/tracegen.py, as benchmarks/offline_scale.py: default tiers, a GPT-like model of
19 blocks, 1,010 sites; 20,000 and 1,000,000 steps by default, kept in --dir for later runs; or --trace FILE) it
prints:
- the server's start (the command checks the trace before it serves),
- per page, the seconds from navigation until the page is usable (its chart or table drawn with data; a preview of
  a long range counts, and is said), on the first visit (an empty cache) and for the overview on a second visit
  (a new server, the cache kept), and when the diagnosis appeared,
- the peak resident memory of the server and of its diagnosis process,
- `ampdoctor report`: seconds, peak resident memory (the process and its children), file size;
each against its target (issue 18: overview <= 2 s first visit, every page <= 3 s; report <= 20 s, <= 1 GB,
<= 10 MB). With ``--plotlyjs partial,full`` each trace is measured with both plotly.js bundles one after the other
(the vendored partial bundle, the dashboards' default, and plotly.py's full one: AMPDOCTOR_PLOTLYJS=full), side by
side in one run; the overview's first visit also gives Chromium's own script time (Performance.getMetrics'
ScriptDuration: plotly.js parsed and run, the charts drawn) and the load average is printed with each column.

    python benchmarks/dashboard.py [--sizes 20000x19,1000000x19] [--dir /tmp/ampdoctor-bench] [--trace FILE]
        [--no-report] [--no-dashboard] [--plotlyjs partial,full] [--before DIR] [--repeat N]
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import psutil
import tracegen
from ampdoctor.dashboards import ids

MEMORY_MB = 6144  # the diagnosis process's and the report's address space: a failure, not the machine swapping
TARGETS = {"overview": 2.0, "page": 3.0, "report_s": 20.0, "report_mb": 1024.0, "report_size_mb": 10.0}


class Peak:
    """Peak resident memory of a process and its children, sampled every 50 ms in a thread."""

    def __init__(self, pid: int):
        self.proc = psutil.Process(pid)
        self.peak = {"self": 0, "children": 0}
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self):
        while not self._stop.is_set():
            try:
                me = self.proc.memory_info().rss
                kids = sum(c.memory_info().rss for c in self.proc.children(recursive=True))
            except psutil.Error:
                break
            self.peak["self"] = max(self.peak["self"], me)
            self.peak["children"] = max(self.peak["children"], kids)
            time.sleep(0.05)

    def stop(self) -> dict:
        self._stop.set()
        self._t.join(1)
        return {k: v / 2**20 for k, v in self.peak.items()}


def _limit() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_MB * 2**20, MEMORY_MB * 2**20))


def _children_cpu() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(bundle: str) -> dict:
    """The environment of a command measured with plotly.js ``bundle`` ("partial": the default; "full")."""
    env = dict(os.environ)
    env.pop("AMPDOCTOR_PLOTLYJS", None)
    if bundle == "full":
        env["AMPDOCTOR_PLOTLYJS"] = "full"
    return env


def serve(trace: str, cache: str, bundle: str = "partial"):
    """`ampdoctor serve TRACE` in its own process: (process, base URL, seconds until it answered)."""
    port = _port()
    env = dict(_env(bundle), AMPDOCTOR_CACHE_DIR=cache, AMPDOCTOR_DIAGNOSIS_MEMORY_MB=str(MEMORY_MB))
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "ampdoctor", "serve", trace, "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    while True:
        try:
            urllib.request.urlopen(url + "/", timeout=2).read()
            break
        except OSError:
            if proc.poll() is not None:
                raise SystemExit(f"ampdoctor serve {trace} exited with {proc.returncode}") from None
            time.sleep(0.1)
    return proc, url, time.perf_counter() - t0


def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options

    opts = Options()
    profile = tempfile.mkdtemp(prefix="ampdoctor-bench-chrome-")
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
    if shutil.which("chromium"):
        opts.binary_location = shutil.which("chromium")
    return webdriver.Chrome(options=opts), profile


_DRAWN = """
var host = document.getElementById(arguments[0]);
if (!host) return null;
var gd = host.classList.contains('js-plotly-plot') ? host : host.querySelector('.js-plotly-plot');
if (gd) {
  if (!gd.data || !gd.data.length) return null;
  var notes = (gd.layout.annotations || []).map(function (a) { return a.text || ''; }).join(' ');
  return notes.indexOf('preview') >= 0 ? 'preview' : 'data';
}
return host.querySelector('tr, li') ? 'data' : null;
"""


def visit(driver, url: str, element: str, timeout: float = 600.0) -> tuple[float, str]:
    """Seconds from navigation until ``element`` (a graph with data, or a table/list with rows) is on the page."""
    t0 = time.perf_counter()
    driver.get(url)
    while time.perf_counter() - t0 < timeout:
        try:
            state = driver.execute_script(_DRAWN, element)
        except Exception:
            state = None
        if state:
            return time.perf_counter() - t0, state
        time.sleep(0.05)
    return float("inf"), "timed out"


def script_seconds(driver) -> float:
    """Chromium's script time of the current page so far (Performance.getMetrics' ScriptDuration, seconds)."""
    metrics = driver.execute_cdp_cmd("Performance.getMetrics", {})["metrics"]
    return next((m["value"] for m in metrics if m["name"] == "ScriptDuration"), float("nan"))


def wait_text(driver, selector: str, words, timeout: float = 1800.0) -> float:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        try:
            text = driver.execute_script(
                "var e = document.querySelector(arguments[0]); return e ? e.innerText : ''", selector
            )
        except Exception:
            text = ""
        if any(w in text for w in words):
            return time.perf_counter() - t0
        time.sleep(0.2)
    return float("inf")


def _grad_site(trace: str) -> int:
    """The id of the trace's first output-gradient site (the Layer page's subject)."""
    from ampdoctor.trace import load

    with load(trace) as tr:
        return int(tr.sites("grad_out")["id"].iloc[0])


def bench_trace(
    trace: str, n_steps: int, report: bool = True, dashboard: bool = True, bundle: str = "partial", before=None
) -> dict:
    out: dict = {"load average at start": os.getloadavg()[0]}
    if dashboard:
        out.update(bench_dashboard(trace, n_steps, bundle))
    if report:
        out.update(bench_report(trace, bundle, before))
    out["load average at end"] = os.getloadavg()[0]
    return out


def bench_dashboard(trace: str, n_steps: int, bundle: str = "partial") -> dict:
    out: dict = {}
    cache = tempfile.mkdtemp(prefix="ampdoctor-bench-cache-")
    driver, profile = browser()
    try:
        proc, url, out["server start (s)"] = serve(trace, cache, bundle)
        mem = Peak(proc.pid)
        run = os.path.basename(os.path.realpath(trace))  # the key the server gives a served file
        t_first = time.perf_counter()
        driver.execute_cdp_cmd("Performance.enable", {})
        t, state = visit(driver, f"{url}/?run={run}", ids.LOSS_GRAPH)
        out["overview, first visit (s)"] = (t, state)
        out["overview, first visit: Chromium script time (s)"] = script_seconds(driver)
        out["plotly.js fetched (MB)"] = driver.execute_script(
            "return performance.getEntriesByType('resource').filter(function (e) { return /plotly/.test(e.name); })"
            ".reduce(function (a, e) { return a + e.decodedBodySize; }, 0) / 1048576"
        )
        site = str(_grad_site(trace))
        pages = {
            "layers": (f"/layers?run={run}", ids.LAYERS_HEATMAP),
            "layer": (f"/layer?run={run}&site={site}&stat=fp16_under", ids.LAYER_SERIES),
            "precision map": (f"/precision?run={run}", ids.PRECISION_TABLE),
            "what-if": (f"/whatif?run={run}", ids.WHATIF_GRAPH),
            "formats": (f"/formats?run={run}", ids.FORMATS_SHARES),
            "zoom 1% of the run": (f"/?run={run}&x0={n_steps // 2}&x1={n_steps // 2 + n_steps // 100}", ids.LOSS_GRAPH),
        }
        for name, (path, element) in pages.items():  # while the diagnosis runs, as a user meets them
            out[f"{name} (s)"] = visit(driver, url + path, element)
        visit(driver, f"{url}/?run={run}", ids.LOSS_GRAPH)
        wait_text(driver, f"#{ids.FINDINGS}", ("CRITICAL", "WARNING", "INFO", "No findings", "failed"))
        out["findings shown, from the first visit (s)"] = time.perf_counter() - t_first
        out["server peak RSS (MB)"] = mem.stop()
        proc.terminate()
        proc.wait(30)
        proc, url, _ = serve(trace, cache, bundle)  # a restart: the cache on disk
        out["overview, second visit (s)"] = visit(driver, f"{url}/?run={run}", ids.LOSS_GRAPH)
        proc.terminate()
        proc.wait(30)
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)
        shutil.rmtree(cache, ignore_errors=True)
    return out


# `python -c BEFORE ROOT ampdoctor-args...`: the ampdoctor command of another checkout at ROOT, its dashboards/ as
# ampdoctor.dashboards (an editable install maps that name to this checkout's dashboards/ whatever PYTHONPATH says)
BEFORE = """
import importlib.util, sys
root = sys.argv.pop(1)
sys.path.insert(0, root)
import ampdoctor
spec = importlib.util.spec_from_file_location(
    "ampdoctor.dashboards", f"{root}/dashboards/__init__.py", submodule_search_locations=[f"{root}/dashboards"]
)
mod = sys.modules["ampdoctor.dashboards"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
ampdoctor.dashboards = mod
from ampdoctor.cli import main
sys.exit(main(sys.argv[1:]))
"""


def bench_report(trace: str, bundle: str = "partial", before: str | None = None) -> dict:
    """`ampdoctor report TRACE` in its own process (``before``: another checkout's, with its own plotly.js):
    seconds, CPU seconds, peak RSS (with its children), the file's size."""
    out: dict = {}
    html = tempfile.mktemp(suffix=".html", prefix="ampdoctor-bench-")
    t0 = time.perf_counter()
    code = ["-m", "ampdoctor"] if before is None else ["-c", BEFORE, os.path.abspath(before)]
    cpu0 = _children_cpu()
    rep = subprocess.Popen(
        [sys.executable, *code, "report", trace, "-o", html],
        env=_env(bundle),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_limit,
    )
    mem = Peak(rep.pid)
    err = rep.communicate()[1]
    peak = mem.stop()
    out["report (s)"] = time.perf_counter() - t0
    out["report CPU (s)"] = _children_cpu() - cpu0  # (the report, waited for: its own user + system time)
    out["report peak RSS (MB)"] = peak["self"] + peak["children"]
    out["report size (MB)"] = os.path.getsize(html) / 2**20 if os.path.exists(html) else float("nan")
    out["report exit status"] = rep.returncode if rep.returncode == 0 else f"{rep.returncode}: {err.strip()[-120:]}"
    if os.path.exists(html):
        os.unlink(html)
    return out


def _label(variant: str, n: int) -> str:
    if n == 1:
        return ""
    return ", code before (--before)" if variant == "before" else f", {variant} plotly.js"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--sizes",
        default="20000x19,1000000x19",
        help="STEPSxBLOCKS, comma-separated (benchmarks/tracegen.py: 19 blocks are 214 modules, 1,010 sites)",
    )
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "ampdoctor-bench"))
    ap.add_argument("--trace", action="append", default=[], help="a trace to measure instead (repeatable)")
    ap.add_argument("--no-report", action="store_true", help="the dashboard only (benchmarks/offline_scale.py: report)")
    ap.add_argument("--no-dashboard", action="store_true", help="`ampdoctor report` only")
    ap.add_argument(
        "--plotlyjs",
        default="partial",
        help="plotly.js bundles to measure, comma-separated, one column each: partial (the default), full",
    )
    ap.add_argument(
        "--before",
        metavar="DIR",
        help="also `ampdoctor report` with the code of another checkout (git worktree add DIR REV): a column of it",
    )
    ap.add_argument(
        "--repeat", type=int, default=1, help="rounds, variants interleaved (the least report CPU or first visit shown)"
    )
    args = ap.parse_args()
    bundles = args.plotlyjs.split(",")
    if not set(bundles) <= {"partial", "full"}:
        raise SystemExit(f"--plotlyjs: partial and/or full, not {args.plotlyjs}")
    variants = [(b, None) for b in bundles] + ([("before", args.before)] if args.before else [])
    os.makedirs(args.dir, exist_ok=True)
    print(f"load average at start: {os.getloadavg()[0]:.1f} ({os.cpu_count()} CPUs)")
    todo = []  # (label, trace, steps)
    for trace in args.trace:
        from ampdoctor.trace import load

        with load(trace) as tr:
            todo.append((os.path.basename(trace), trace, tr.n_steps))
    for size in [] if args.trace else args.sizes.split(","):
        steps, blocks = (int(v) for v in size.lower().split("x"))
        t0 = time.perf_counter()
        trace = tracegen.cached(args.dir, steps=steps, blocks=blocks)  # the traces offline_scale.py measures
        print(f"{trace} ({os.path.getsize(trace) / 2**20:.0f} MB) ready in {time.perf_counter() - t0:.0f} s")
        todo.append((size, trace, steps))
    results: dict = {}
    rounds: dict = {}
    for label, trace, n in todo:
        for r in range(args.repeat):  # the variants interleaved, round after round
            for b, before in variants:
                name = label + _label(b, len(variants))
                if before:  # the report only: the other checkout's serve would need its own install
                    got = bench_trace(trace, n, True, False, "partial", before)
                else:
                    got = bench_trace(trace, n, not args.no_report, not args.no_dashboard, b)
                rounds.setdefault(name, []).append(got)
                print(f"{name}, round {r + 1}: done", flush=True)
    for name, got in rounds.items():  # the round of least report CPU, else first visit (noise only adds to them)
        first = "overview, first visit (s)"
        results[name] = min(got, key=lambda g: g["report CPU (s)"] if "report CPU (s)" in g else g[first][0])
        if len(got) > 1:
            pages = [k for k, v in got[0].items() if isinstance(v, tuple)]  # every page's visit, round by round
            for k in ("report CPU (s)", *pages, "overview, first visit: Chromium script time (s)"):
                if k in got[0]:
                    every = [g[k][0] if isinstance(g[k], tuple) else g[k] for g in got]
                    results[name][k[:-4] + ", every round (s)"] = " / ".join(f"{v:.2f}" for v in every)
    print(f"load average at end: {os.getloadavg()[0]:.1f}")
    keys = list(dict.fromkeys(k for r in results.values() for k in r))
    print(f"\n| measure | {' | '.join(results)} | target |")
    print(f"|---|{'---|' * len(results)}---|")
    for k in keys:
        target = ""
        if k == "overview, first visit (s)":
            target = f"<= {TARGETS['overview']} s"
        elif k.endswith("(s)") and not k.startswith(("server", "findings", "report", "overview,")):
            target = f"<= {TARGETS['page']} s"
        elif k == "report (s)":
            target = f"<= {TARGETS['report_s']} s"
        elif k == "report peak RSS (MB)":
            target = f"<= {TARGETS['report_mb']:.0f} MB"
        elif k == "report size (MB)":
            target = f"<= {TARGETS['report_size_mb']} MB"
        cells = []
        for r in results.values():
            v = r.get(k, "")
            if isinstance(v, tuple):
                cells.append(f"{v[0]:.2f}" + (" (preview)" if v[1] == "preview" else ""))
            elif isinstance(v, dict):
                cells.append(", ".join(f"{a} {b:.0f}" for a, b in v.items()))
            elif isinstance(v, float):
                cells.append(f"{v:.2f}")
            else:
                cells.append(str(v))
        print(f"| {k} | {' | '.join(cells)} | {target} |")


if __name__ == "__main__":
    main()
