"""The dashboard's diagnosis of one run, in a process of its own: ``python -m ampdoctor.dashboards.diagjob SPEC``.

A separate process keeps the server answering while the rules run (they hold the GIL for seconds on a long run),
and a diagnosis that runs out of memory or crashes ends that process, not the dashboard. SPEC is a JSON file
{"trace", "reference", "peers": {rank: path}, "group", "out"}; the result is written to "out" as JSON:
{"findings": [Diagnosis.to_dict(), ...], "error": null | "Type: message", "seconds": s}.
"""

from __future__ import annotations

import json
import os
import sys
import time


def run(spec: dict) -> dict:
    """Diagnose ``spec["trace"]`` (against ``spec["reference"]``) plus the rank rules over ``spec["peers"]``."""
    from ampdoctor.trace import load
    from ampdoctor.trace.run import RankRun

    from . import diagnosis

    t0 = time.perf_counter()
    try:
        tr = load(spec["trace"])
        ref = load(spec["reference"]) if spec.get("reference") else None
        found = diagnosis.findings(tr, ref)
        peers = {int(r): p for r, p in (spec.get("peers") or {}).items()}
        if len(peers) > 1:
            from ampdoctor.rules.multirank import rank_findings

            traces = {r: load(p) for r, p in peers.items()}
            if all(t.n_steps for t in traces.values()):
                found += rank_findings(RankRun(spec.get("group") or "", traces, max(traces) + 1))
        found = sorted(found, key=lambda d: diagnosis.SEVERITY_ORDER.get(d.severity, 3))
        return {"findings": [d.to_dict() for d in found], "error": None, "seconds": time.perf_counter() - t0}
    except Exception as exc:  # one line for the page; the server goes on
        return {"findings": [], "error": f"{type(exc).__name__}: {exc}", "seconds": time.perf_counter() - t0}


def main(argv: list[str]) -> int:
    with open(argv[0], encoding="utf-8") as f:
        spec = json.load(f)
    result = run(spec)
    out = spec["out"]
    tmp = out + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(result, f)
    os.replace(tmp, out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
