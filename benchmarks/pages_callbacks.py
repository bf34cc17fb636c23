"""The What-if and Formats pages' callbacks called directly in one process on a fresh cache (run 9 of
benchmarks/README.md): how soon each answers right after the overview's first requests, when the formats table and
the replay are shown, and how long a changed setting takes; with ``--outputs PREFIX``, once everything is done, the
pages' final outputs (what-if: the run's own settings and init 2^17; formats: fp16 and e4m3, page 2) json-dumped
with plotly's encoder to PREFIX.<name>.json, to compare two versions of the code byte for byte.

    python benchmarks/pages_callbacks.py TRACE [--outputs PREFIX]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import tempfile
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--outputs", metavar="PREFIX", help="write the final outputs instead of timing the first visit")
    args = ap.parse_args()
    os.environ["AMPDOCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="ampdoctor-pages-")  # a fresh cache
    from ampdoctor.dashboards.app import create_app

    ctx = create_app(args.trace).ampdoctor
    run = os.path.basename(args.trace)
    if args.outputs:
        outputs(ctx, run, args.outputs)
    else:
        timings(ctx, run)


def _until(check, timeout: float = 600.0) -> float:
    t0 = time.perf_counter()
    while not check() and time.perf_counter() - t0 < timeout:
        time.sleep(0.1)
    return time.perf_counter() - t0


def timings(ctx, run: str) -> None:
    from ampdoctor.dashboards.pages import formats, overview, whatif

    search, version = f"?run={run}", {"run": run, "n": ctx.n_steps(run)}
    print("load average", os.getloadavg()[0], flush=True)
    t0 = time.perf_counter()
    overview.update(ctx, version, search)
    overview.charts(ctx, version, None, 0.6, [], None, search)
    print(f"overview's first requests {time.perf_counter() - t0:.2f} s", flush=True)
    t = time.perf_counter()
    r = whatif.update(ctx, None, None, None, None, version, search)
    print(f"what-if first answer {time.perf_counter() - t:.2f} s: {str(r[1])[:70]}", flush=True)
    t = time.perf_counter()
    f = formats.update(ctx, "fp16", "", 1, version, search)
    print(f"formats first answer {time.perf_counter() - t:.2f} s: table {'drawn' if f[3] is not None else 'waiting'}")
    done: dict[str, float] = {}
    while len(done) < 2 and time.perf_counter() - t0 < 600:
        if "formats" not in done and formats.update(ctx, "fp16", "", 1, version, search)[3] is not None:
            done["formats"] = time.perf_counter() - t0
        if "whatif" not in done and str(whatif.update(ctx, None, None, None, None, version, search)[1]).startswith(
            "simulated"
        ):
            done["whatif"] = time.perf_counter() - t0
        time.sleep(0.25)
    print(
        f"formats table shown {done.get('formats', float('nan')):.2f} s, what-if replay shown "
        f"{done.get('whatif', float('nan')):.2f} s after the overview's first requests",
        flush=True,
    )
    s = _until(lambda: str(whatif.update(ctx, "131072", None, None, None, version, search)[1]).startswith("simulated"))
    print(f"a setting changed (init 2^17): replay shown {s:.2f} s", flush=True)
    error = ctx.findings_and_error(run, wait=600)[1]
    print(f"findings error: {error}; all done {time.perf_counter() - t0:.1f} s; load average {os.getloadavg()[0]}")


def outputs(ctx, run: str, prefix: str) -> None:
    import plotly.utils
    from ampdoctor.dashboards.pages import formats, whatif

    search, version = f"?run={run}", {"run": run, "n": ctx.n_steps(run)}
    print("findings error:", ctx.findings_and_error(run, wait=900)[1], flush=True)
    res = {}
    for name, init in (("whatif-default", None), ("whatif-init2^17", "131072")):

        def replayed(init=init, name=name) -> bool:
            res[name] = whatif.update(ctx, init, None, None, None, version, search)
            return not str(res[name][1]).startswith("replaying")

        _until(replayed)
    for by in ("fp16", "e4m3"):

        def shown(by=by) -> bool:
            res["formats-" + by] = r = formats.update(ctx, by, "", 2, version, search)
            return r[3] is not None and not str(r[0]).startswith("reading")

        _until(shown)
    for k, v in res.items():
        text = json.dumps(v, cls=plotly.utils.PlotlyJSONEncoder, sort_keys=True)
        with open(f"{prefix}.{k}.json", "w") as f:
            f.write(text)
        print(k, hashlib.sha256(text.encode()).hexdigest(), len(text))


if __name__ == "__main__":
    main()
