"""The dashboard's diagnoses, in a process of their own: ``python -m ampdoctor.dashboards.diagjob``.

A separate process keeps the server answering while the rules run (they hold the GIL for seconds on a long run),
and a diagnosis that runs out of memory or crashes ends that process, not the dashboard. The process reads one
JSON spec a line on stdin, {"trace", "reference", "peers": {rank: path}, "group"}, and answers each with one JSON
line on stdout: {"findings": [Diagnosis.to_dict(), ...], "error": null | "Type: message", "seconds": s, "formats":
{column: [values]} | null, "formats_error": null | "Type: message"}, after one line {"early": true, "formats",
"formats_error"} as soon as the table is computed (before the rules run: the page shows it while they do; a first
such line, without the FP8 columns, before the pass over the peaks those need), then one
line {"early": true, "evidence": cache name | null} once the loss-scale replay's evidence is kept on disk (cache.py),
and one {"early": true, "summary": steps | null} once the run's step summary is (from the steps table the rules read):
the formats table (ampdoctor.whatif) and the evidence (ampdoctor.lossscale.gather) are computed from the rules' own
reads of the trace (its histograms, statistics and peaks pass), not from the file again. (Not
multiprocessing: its spawned workers import the parent's main script again, which a script serving the dashboard
without a ``__main__`` guard would not survive.)
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any


def run(
    spec: dict[str, Any],
    early: Callable[[dict[str, Any]], None] | None = None,
    read: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Diagnose ``spec["trace"]`` (against ``spec["reference"]``) plus the rank rules over ``spec["peers"]``.
    ``early``: called with {"formats", "formats_error"} as soon as the table is computed, before the rules run (the
    rules' Run reads the steps, histograms and the pass over the peaks first; the table needs nothing else), then with
    {"evidence"} and {"summary"} (made from the same reads). ``read``: called once they are handed over, before the
    rules run."""
    from ampdoctor.trace import load
    from ampdoctor.trace.run import RankRun

    from . import diagnosis

    t0 = time.perf_counter()
    try:
        tr = load(spec["trace"])
        ref = load(spec["reference"]) if spec.get("reference") else None
        table: list[tuple[dict[str, list[Any]] | None, str | None]] = []

        def first(rules_run: Any) -> None:
            if early is not None:  # FP16 / BF16 first: the FP8 columns wait for the pass over every step's peaks
                half = _formats(rules_run, fp8=False)
                if half[0] is not None:
                    early({"formats": half[0], "formats_error": None})
            table.append(_formats(rules_run))
            if early is not None:
                early({"formats": table[0][0], "formats_error": table[0][1]})
            name = _evidence(tr, rules_run)
            if early is not None:
                early({"evidence": name})
                early({"summary": _summary(tr, rules_run)})
            if read is not None:
                read()

        found, rules_run = diagnosis.diagnose_run(tr, ref, first)
        formats, formats_error = table[0] if table else _formats(rules_run)
        peers = {int(r): p for r, p in (spec.get("peers") or {}).items()}
        if len(peers) > 1:
            from ampdoctor.rules.multirank import rank_findings

            traces = {r: load(p) for r, p in peers.items()}
            if all(t.n_steps for t in traces.values()):
                found += rank_findings(RankRun(spec.get("group") or "", traces, max(traces) + 1))
        found = diagnosis.worst_first(found)
        return {
            "findings": [d.to_dict() for d in found],
            "error": None,
            "seconds": time.perf_counter() - t0,
            "formats": formats,
            "formats_error": formats_error,
        }
    except MemoryError:
        return {
            "findings": [],
            "error": "MemoryError: the rules ran out of memory on this trace",
            "seconds": time.perf_counter() - t0,
        }
    except Exception as exc:  # one line for the page; the server goes on
        return {"findings": [], "error": f"{type(exc).__name__}: {exc}", "seconds": time.perf_counter() - t0}


def _formats(rules_run: Any, fp8: bool = True) -> tuple[dict[str, list[Any]] | None, str | None]:
    """The formats table of the diagnosed trace as {column: [values]} (None and the error when it fails: the
    findings still go to the page); ``fp8=False``: without the FP8 columns (data.format_table)."""
    from . import data

    if rules_run.n_steps == 0:
        return None, None
    try:
        return data.format_table(rules_run, fp8=fp8).to_dict(orient="list"), None
    except MemoryError:
        return None, "MemoryError: the formats table ran out of memory on this trace"
    except Exception as exc:
        return None, f"{type(exc).__name__}: {exc}"


def _evidence(tr: Any, rules_run: Any) -> str | None:
    """The replay's evidence of the diagnosed trace (lossscale.gather over the rules' View: the pass over the peaks is
    the one the formats table and the rules read), kept on disk under its cache name for the server's what-if
    replays, or taken from there when the server gathered it first (the rules' search then reads it too). The name
    when it is on disk, else None (the server then gathers it itself)."""
    from ampdoctor.lossscale import evidence

    from . import cache

    if rules_run.n_steps == 0:
        return None
    try:
        name = cache.evidence_name(tr)  # (inside the diagnosis' snapshot: the name says what the View reads)
        kept = cache.load_evidence(name)
        if kept is not None:
            evidence.keep(rules_run.view, kept)
            return name
        return name if cache.save_evidence(name, evidence.gather(rules_run.view)) else None
    except Exception:  # the rules' own search reads it again and says what failed
        return None


def _summary(tr: Any, rules_run: Any) -> int | None:
    """The run's step summary (series.StepSummary: the dashboard's step charts) from the steps table the rules read
    (StepSummary.of_steps: the same buckets as read from the file), kept on disk for the server, which then does not
    read every step itself; the steps it covers, or None (not kept: the server builds it)."""
    from . import cache, series

    try:
        sm = series.StepSummary.of_steps(tr, rules_run.view.steps)
        if not sm.n_buckets or not cache.save_summary(tr, sm):
            return None
        return sm.n_buckets * series.BUCKET
    except Exception:  # the server reads the file instead
        return None


def _limit_memory() -> None:
    """``AMPDOCTOR_DIAGNOSIS_MEMORY_MB``: the most address space this process may take; past it the rules get a
    MemoryError (one line on the page) instead of the machine running out."""
    mb = os.environ.get("AMPDOCTOR_DIAGNOSIS_MEMORY_MB", "")
    if mb.isdigit() and int(mb) > 0:
        import resource

        limit = int(mb) * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _exit_with_parent() -> None:
    """End this process when the server that started it is gone (killed mid-diagnosis, its pipe is not read)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, daemon=True).start()


# Linux: a thread's priority is its own (and a new thread starts at its creator's), so each diagnosis runs in a thread
# that lowers its own priority once the reads two pages wait for are done; elsewhere the whole process runs lower.
PER_THREAD_PRIORITY = sys.platform.startswith("linux")


def _yield_cpu(thread: bool = False) -> None:
    """Run at a lower priority than the server: on a machine of two cores the rules would otherwise take the core the
    page's charts are drawn with (a first visit waits for them, not for the findings). ``thread``: this thread only
    (Linux): the reads of the trace before it (the formats table and the replay's evidence, which the Formats and
    What-if pages wait for: the server no longer reads them itself) ran at the server's priority."""
    try:
        if thread:
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + 10)
        else:
            os.nice(10)
    except OSError:  # not allowed here: the same priority
        pass


def _in_thread(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``fn()`` in a thread of its own, waited for (its priority, lowered by _yield_cpu, ends with it)."""
    out: list[dict[str, Any]] = []
    t = threading.Thread(target=lambda: out.append(fn()), name="ampdoctor-diagnosis")
    t.start()
    t.join()
    return out[0] if out else {"findings": [], "error": "the diagnosis thread ended without an answer", "seconds": 0.0}


def main() -> int:
    """Answer specs until stdin closes. Anything the rules print goes to stderr: stdout carries the answers."""
    _limit_memory()
    if not PER_THREAD_PRIORITY:
        _yield_cpu()
    _exit_with_parent()
    from . import data, diagnosis  # noqa: F401  (imported before the first spec arrives: the server starts this early)

    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w", encoding="utf-8")
    sys.stdout = sys.stderr
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            spec = json.loads(line)
        except ValueError as exc:
            result = {"findings": [], "error": f"bad request ({exc})", "seconds": 0.0}
        else:
            result = _answer_spec(spec, answers)
        _answer(answers, result)
    return 0


def _answer_spec(spec: dict[str, Any], answers: Any) -> dict[str, Any]:
    """One diagnosis, its early lines written as they come (in a thread of its own where priorities are per thread)."""

    def early(part: dict[str, Any]) -> None:
        _answer(answers, {"early": True, **part})

    if PER_THREAD_PRIORITY:
        return _in_thread(lambda: run(spec, early, lambda: _yield_cpu(thread=True)))
    return run(spec, early)


def _answer(answers: Any, result: dict[str, Any]) -> None:
    answers.write(json.dumps(result) + "\n")
    answers.flush()


if __name__ == "__main__":
    sys.exit(main())
