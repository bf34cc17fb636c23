"""What one dashboard app serves (Context): the runs under its root, the traces each request borrows from a pool
(each statement bounded in time and the file re-checked by server.py), results cached per trace content, and the work
that runs in the background (the diagnosis in its own process, step summaries kept on disk) with its state. The
pages are handed a Context; this module imports none of them."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from ampdoctor.trace import TraceError

from . import cache, catalog, diagnosis, figures, jobs, ranks, series, server

if TYPE_CHECKING:
    import subprocess

    from ampdoctor.lossscale import Evidence
    from ampdoctor.rules.result import Diagnosis
    from ampdoctor.trace import Trace

REFERENCE_KEY = "reference"
MAX_IDLE = 8  # open connections kept per trace file between requests
FINDINGS_EVERY_S = 5.0  # a growing trace is diagnosed again at most this often (a big run takes seconds)
SYNC_SUMMARY_STEPS = 50_000  # a run this short is summarised inside the request; a longer one in the background
KEPT_REPLAY_INPUTS = 4  # runs whose replay evidence and recorded steps stay in memory (the others: on disk)


class Context:
    """What one app serves: the runs under its root, opened traces, results cached per trace length, and the work
    that runs in the background (diagnoses, step summaries, long heat maps) with its state.

    Flask answers requests on several threads and a Trace (one SQLite connection, its snapshot a transaction) is
    not for sharing: a request borrows one Trace per file from a pool and gives it back when it ends (release).
    A background job opens its own.
    """

    def __init__(
        self,
        root: str,
        reference: str | None = None,
        poll_ms: int = 1500,
        files: set[str] | None = None,
        diagnose_in: str = "process",
    ) -> None:
        self.root = os.path.realpath(root)
        self.reference_path = reference
        self.poll_ms = poll_ms
        self._lock = threading.Lock()  # guards the dicts below; never held around file I/O
        self._idle: dict[str, list[Trace]] = {}  # path -> [Trace] not borrowed by any thread
        self._local = threading.local()  # .held: path -> Trace borrowed by this thread
        self._cache: dict[tuple[Any, ...], Any] = {}
        self._runs: tuple[float, dict[str, catalog.Run]] = (0.0, {})
        self.files = files  # a glob or list of one run's files: only these are served
        self._rank_meta: dict[str, tuple[int, int] | None] = {}  # path -> (rank, world size) from the trace's metadata
        self.jobs = jobs.Jobs(workers=2)
        self.diagnose_in = diagnose_in  # "process" (default: the server stays responsive) or "thread"
        if diagnose_in == "process":
            _WORKER.start()  # (its imports paid while the first page loads)
            _warm_figures()
        self._summaries: dict[str, series.StepSummary] = {}  # path -> series.StepSummary
        self._topping_up: dict[str, threading.Lock] = {}  # path -> Lock held while a request tops its summary up
        self._opening: dict[str, threading.Lock] = {}  # path -> Lock held while the file is first opened
        self._diagnosed: dict[
            str, tuple[str, float, tuple[int, ...]]
        ] = {}  # run key -> (version, time.monotonic() the version was asked for, the ranks it covers)
        self._formats: dict[
            str, tuple[str, dict[str, list[Any]] | None, str | None]
        ] = {}  # run key -> (version, formats table {column: values} or None, its error)
        # run key -> (diagnosis version, what it handed over before its rules: {"evidence": name, "summary": steps})
        self._handed: dict[str, tuple[str, dict[str, Any]]] = {}
        # run key -> (cache name, the replay's evidence, the recorded steps it is compared with)
        self._evidence: dict[str, tuple[str, Evidence, Any]] = {}
        self._gathering: dict[str, threading.Lock] = {}  # run key -> Lock held while a job gathers its evidence

    def runs(self) -> dict[str, catalog.Run]:
        """Traces under the root (rescanned at most every second, so new runs show up)."""
        with self._lock:
            stamp, runs = self._runs
        if time.monotonic() - stamp > 1.0:
            # outside the lock: a slow disk delays one request
            runs = ranks.with_ranks(catalog.discover_runs(self.root), self._rank_meta, self.files)
            with self._lock:
                self._runs = (time.monotonic(), runs)
        return runs

    def resolve(self, key: Any) -> catalog.Run | None:
        """The run a browser-supplied key names, or None: only keys of runs() (and the reference) exist."""
        if not isinstance(key, str):
            return None
        if key == REFERENCE_KEY and self.reference_path:
            path = os.path.realpath(self.reference_path)
            return catalog.Run(REFERENCE_KEY, path, "reference: " + os.path.basename(path), None)
        return self.runs().get(key)

    def default_key(self) -> str | None:
        runs = self.runs()
        return next(iter(runs), None)

    def peers(self, key: str) -> dict[int, str]:
        """rank -> run key of every rank of the run ``key`` belongs to ({} for a run of one trace)."""
        me = self.resolve(key)
        if me is None or me.rank is None:
            return {}
        return {r.rank: k for k, r in self.runs().items() if r.group == me.group and r.rank is not None}

    def trace(self, key: Any) -> Any:
        """This thread's open Trace of a run key, or None (unknown key or unreadable file)."""
        run = self.resolve(key)
        if run is None:
            return None
        held = self._held()
        tr = held.get(run.path)
        if tr is None:
            with self._lock:
                idle = self._idle.get(run.path)
                tr = idle.pop() if idle else None
            if tr is not None and not server.renew(tr):  # server.py: replaced or changed, so opened and checked anew
                tr.close()
                tr = None
            if tr is None:
                tr = self._open(run.path)
                if tr is None:
                    return None
            held[run.path] = tr
        return tr

    def _open(self, path: str) -> Trace | None:
        """A new Trace of ``path`` on a connection of its own (each statement bounded in time: server.py), reopened
        from the one this process checked (server.check: the reader's checks run once per file, again when the
        file was replaced or changed REVALIDATE_S ago), or None when it cannot be read."""
        with self._lock:
            opening = self._opening.setdefault(path, threading.Lock())
        with opening:  # the first visit's callbacks arrive together: one of them checks the file, the rest reuse it
            try:
                return server.open_checked(path)
            except TraceError:
                return None

    def _held(self) -> dict[str, Trace]:
        if not hasattr(self._local, "held"):
            self._local.held = {}
        held: dict[str, Trace] = self._local.held
        return held

    def release(self) -> None:
        """Give the traces this thread borrowed back to the pool (at the end of each request)."""
        held, self._local.held = self._held(), {}
        surplus: list[Trace] = []
        with self._lock:
            for path, tr in held.items():
                idle = self._idle.setdefault(path, [])
                (idle if len(idle) < MAX_IDLE else surplus).append(tr)
        for tr in surplus:
            tr.close()

    def n_steps(self, key: Any) -> int:
        """Steps of a run now (a primary-key look-up: cheap at every poll, unlike count(*))."""
        tr = self.trace(key)
        return 0 if tr is None else series.n_steps(tr)

    def cached(self, key: str, what: Any, fn: Callable[[Trace], Any]) -> Any:
        """``fn(trace)`` computed once per (run, trace length, what): a live trace invalidates itself as it grows."""
        tr = self.trace(key)
        if tr is None:
            return None
        # server.py: a file replaced by another is another trace
        k = (key, server.generation(tr), series.n_steps(tr), what)
        with self._lock:
            if k in self._cache:
                return self._cache[k]
        value = fn(tr)
        with self._lock:
            if len(self._cache) > 256:
                self._cache.clear()
            self._cache[k] = value
        return value

    def background(self, key: str, what: Any, fn: Callable[[Trace], Any], wait: float = 1.0) -> jobs.State:
        """``fn(trace)`` for the run ``key`` at its current length, computed in the background on a trace of its
        own; waits up to ``wait`` s (a short job shows at once). The state says whether the value is current."""
        run = self.resolve(key)
        n = self.n_steps(key)

        def work() -> Any:
            tr = self._open(run.path) if run is not None else None
            if tr is None:  # (run.key is key)
                raise jobs.Failed(f"{key} could not be opened as a trace")
            try:
                return fn(tr)
            finally:
                tr.close()

        return self.jobs.get((key, what), n, work, wait=wait)

    # -- the step summary of a run: every step, in buckets ---------------------------------------------------------
    def summary(self, key: str) -> tuple[series.StepSummary | None, jobs.State | None]:
        """The run's step summary when it covers the run (else what it has so far), and the state of its build:
        built in the request for a short run; for a long one by the diagnosis while it runs (from the steps table it
        reads anyway), else in the background; kept on disk."""
        run = self.resolve(key)
        tr = self.trace(key)
        if run is None or tr is None:
            return None, None
        n = series.n_steps(tr)
        with self._lock:
            sm = self._summaries.get(run.path)
        if sm is None:
            sm = cache.load_summary(tr) or series.StepSummary()
            with self._lock:
                sm = self._summaries.setdefault(run.path, sm)
        behind = n - sm.n_buckets * series.BUCKET
        if behind < series.BUCKET:
            return sm, None
        if behind <= SYNC_SUMMARY_STEPS:
            with self._lock:
                topping = self._topping_up.setdefault(run.path, threading.Lock())
            with topping:  # one thread tops it up (a bounded read); another request waits for it, then draws it all
                sm.update(tr)
            return sm, None
        self.diagnosis_state(key)  # started first: the diagnosis builds the summary from the steps table it reads
        if self._coming(key, "summary"):  # (diagjob) and hands it over with the formats table: no second reading
            return sm, None

        def build(t: Trace) -> Any:
            sm.update(t)
            cache.save_summary(t, sm)
            return sm.n_buckets

        state = self.background(key, "summary", build, wait=0.0)
        return sm, state

    def summary_state(self, key: str) -> jobs.State | None:
        """The state of the run's summary built in the background (None: none started), without starting one."""
        return self.jobs.peek((key, "summary"))

    def steps(
        self, key: str, x0: Any = None, x1: Any = None, max_points: int = series.MAX_POINTS
    ) -> series.StepSeries | None:
        """The step figures of [x0, x1] of a run, for its charts (see series.read)."""
        tr = self.trace(key)
        if tr is None:
            return None
        sm, _ = self.summary(key)
        return series.read(tr, x0, x1, max_points, sm)

    # -- the diagnosis ---------------------------------------------------------------------------------------------
    def findings(self, key: str) -> list[Diagnosis]:
        return self.findings_and_error(key)[0]

    def findings_and_error(self, key: str, wait: float = 30.0) -> tuple[list[Diagnosis], str | None]:
        """The run's findings, worst first, and None; or [] and the error when a rule failed on this snapshot of
        a live trace (the next poll tries again): someone else's rule never breaks the page. Waits up to ``wait``
        s for a diagnosis in progress (the views use diagnosis_state, which does not wait)."""
        st = self.diagnosis_state(key, wait=wait)
        if st is None:
            return [], None
        if st.error and not st.current:
            return [], st.error
        return list(st.value or []), None

    def diagnosis_state(self, key: str, wait: float = 0.0) -> jobs.State | None:
        """The state of the run's diagnosis (its findings as ``value``): from the cache on disk when this content
        was diagnosed before, else computed in the background. While a trace grows it is diagnosed again at
        most every FINDINGS_EVERY_S seconds; the previous findings stay on the page meanwhile."""
        run = self.resolve(key)
        tr = self.trace(key)
        if run is None or tr is None:
            return None
        if series.n_steps(tr) == 0:
            return jobs.State(value=[], current=True)
        ref = self.trace(REFERENCE_KEY) if self.reference_path and key != REFERENCE_KEY else None
        peers = {r: p.path for r, k in self.peers(key).items() if (p := self.resolve(k)) is not None}
        peer_traces = [self.trace(k) for k in self.peers(key).values()]
        version = cache.key("findings", tr, ref, *peer_traces, extra=sorted(peers.items()))
        ranks = tuple(sorted(peers))
        with self._lock:
            last = self._diagnosed.get(key)
            if (
                last is not None
                and last[0] != version
                and last[2] == ranks
                and time.monotonic() - last[1] < FINDINGS_EVERY_S
            ):
                version = last[0]  # a live trace: the same version until FINDINGS_EVERY_S have passed
            else:  # (a rank's trace that appeared or went is another run: diagnosed at once)
                self._diagnosed[key] = (version, time.monotonic(), ranks)
        spec = {
            "trace": run.path,
            "reference": os.path.realpath(self.reference_path) if ref is not None and self.reference_path else None,
            "peers": {str(r): p for r, p in peers.items()},
            "group": run.group,
        }

        def early(part: dict[str, Any]) -> None:  # the formats table, the evidence, the summary: pages redraw
            with self._lock:
                if "formats" in part:
                    self._formats[key] = (version, part.get("formats"), part.get("formats_error"))
                else:
                    last = self._handed.get(key)
                    handed = dict(last[1]) if last is not None and last[0] == version else {}
                    self._handed[key] = (version, {**handed, **part})
                    if part.get("summary") and run is not None:  # read from the disk at the next request
                        self._summaries.pop(run.path, None)
            self.jobs.touch()

        def work() -> Any:
            found = cache.load_json(version)
            if found is None:
                found = _diagnose(spec, self.diagnose_in, early)
                if found.get("error") is None:
                    cache.save_json(version, found)
            if found.get("error"):
                raise jobs.Failed(found["error"])
            with self._lock:
                self._formats[key] = (version, found.get("formats"), found.get("formats_error"))
            return [diagnosis.from_dict(d) for d in found["findings"]]

        return self.jobs.get((key, "findings"), version, work, wait=wait)

    def formats_table(self, key: str, wait: float = 0.0) -> tuple[Any, jobs.State | None, str | None]:
        """(the run's formats table as a DataFrame or None, the diagnosis' state, the table's error): the table comes
        with the diagnosis (diagjob: from the rules' own reads, before the rules run), cached on disk with it. Waits
        up to ``wait`` s for it: until the table arrives or the diagnosis ends, not for the rules after the table."""
        deadline = time.monotonic() + wait
        while True:
            seen = self.jobs.generation
            out = self._formats_table(key)
            st = out[1]
            left = deadline - time.monotonic()
            if out[0] is not None or st is None or not st.running or left <= 0:
                return out
            self.jobs.wait_change(seen, left)

    def _formats_table(self, key: str) -> tuple[Any, jobs.State | None, str | None]:
        import pandas as pd

        st = self.diagnosis_state(key)
        if st is None:
            return None, st, None
        with self._lock:
            version, table, error = self._formats.get(key, (None, None, None))
            asked = self._diagnosed.get(key, (None, 0.0))[0]
        if table is not None and version == asked and version != st.version:
            return pd.DataFrame(table), st, None  # computed before the rules of the diagnosis now running
        if st.value is None or version != st.version:
            return None, st, None
        if table is None:
            return None, st, error or "no formats table"
        return pd.DataFrame(table), st, None

    # -- the loss-scale replay's evidence: read once per trace content, for every setting the what-if page tries ----
    def evidence_coming(self, key: str) -> bool:
        """Whether the run's diagnosis is running and has not handed its replay evidence over yet: it reads it from
        the same pass over the peaks as the rules and the formats table (diagjob), so a replay waits for it rather
        than reading the trace a second time meanwhile."""
        return self._coming(key, "evidence")

    def _coming(self, key: str, part: str) -> bool:
        """Whether the run's diagnosis is running and has not handed ``part`` over yet."""
        with self._lock:
            asked = self._diagnosed.get(key, (None, 0.0))[0]
            version, handed = self._handed.get(key, (None, {}))
        st = self.jobs.peek((key, "findings"))
        return asked is not None and not (version == asked and part in handed) and st is not None and st.running

    def replay_ready(self, key: str) -> bool:
        """Whether the replay's inputs of the run as it holds now (its evidence and recorded steps) are in memory: a
        replay then steps the scaler only (~0.5 s at 10^6 steps), no read of the trace."""
        tr = self.trace(key)
        if tr is None:
            return False
        name = cache.evidence_name(tr)
        with self._lock:
            kept = self._evidence.get(key)
        return kept is not None and kept[0] == name

    def replay_inputs(self, key: str, tr: Trace) -> tuple[Evidence, Any]:
        """(the replay's evidence, the recorded steps: data.recorded_steps) of ``tr`` (a background job's trace of
        run ``key``) as it holds now, neither of which depends on the scaler settings: kept in memory, else the
        evidence on disk (written by the diagnosis process or an earlier replay), else read here and kept. Call it
        inside ``tr.snapshot()``: the evidence is that content's."""
        from ampdoctor.lossscale import gather

        from . import data

        with self._lock:
            gathering = self._gathering.setdefault(key, threading.Lock())
        with gathering:  # two settings replayed at once: one reads, the other waits for it
            name = cache.evidence_name(tr)
            with self._lock:
                kept = self._evidence.get(key)
            if kept is not None and kept[0] == name:
                return kept[1], kept[2]
            ev = cache.load_evidence(name)
            if ev is None:
                ev = gather(tr)
                cache.save_evidence(name, ev)
            recorded = data.recorded_steps(tr)
            with self._lock:
                self._evidence.pop(key, None)  # (the latest content only: an older one is not asked)
                self._evidence[key] = (name, ev, recorded)
                while len(self._evidence) > KEPT_REPLAY_INPUTS:  # the runs replayed longest ago (~60 MB a 10^6 steps)
                    self._evidence.pop(next(iter(self._evidence)))
            return ev, recorded

    def generation(self) -> int:
        """Bumped whenever background work ends: views that show its results redraw."""
        return self.jobs.generation


class _Worker:
    """The process that diagnoses (diagjob), shared by every app of this process: started on first use, its
    imports paid once; replaced after MAX_TASKS diagnoses (memory a long run left behind) or when it died."""

    MAX_TASKS = 20

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[str] | None = None
        self._done = 0

    def run(self, spec: dict[str, Any], early: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
        with self._lock:  # one diagnosis at a time: the rules use a core, the server needs the other
            self._start()
            assert self._proc is not None  # (just started)
            stdin, stdout = self._proc.stdin, self._proc.stdout
            assert stdin is not None and stdout is not None  # (opened with pipes)
            try:
                stdin.write(json.dumps(spec) + "\n")
                stdin.flush()
                line = stdout.readline()
                while line and json.loads(line).get("early"):  # the formats table, before the findings
                    if early is not None:
                        early(json.loads(line))
                    line = stdout.readline()
            except OSError:
                line = ""
            if not line:
                self._stop()
                return {
                    "findings": [],
                    "error": "the diagnosis process died (out of memory?); it runs again as the trace grows",
                }
            self._done += 1
            out: dict[str, Any] = json.loads(line)
            return out

    def start(self) -> None:
        """Start the process now, before its first diagnosis: its imports (~1-2 s) are paid while the first page
        loads, not while the first diagnosis (and the formats table and replay evidence it reads) is waited for.
        Never waits: a diagnosis in progress (it holds the lock) has the process started already."""
        if self._lock.acquire(blocking=False):
            try:
                self._start()
            finally:
                self._lock.release()

    def _start(self) -> None:
        import subprocess
        import sys

        if self._proc is None or self._proc.poll() is not None or self._done >= self.MAX_TASKS:
            self._stop()
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "ampdoctor.dashboards.diagjob"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
                bufsize=1,
            )
            self._done = 0

    def _stop(self) -> None:
        if self._proc is not None:
            try:
                assert self._proc.stdin is not None  # (opened with a pipe)
                self._proc.stdin.close()
                self._proc.wait(timeout=5)
            except Exception:
                self._proc.kill()
            self._proc = None


_WORKER = _Worker()
_WARMED = threading.Event()


def _warm_figures() -> None:
    """figures.warm() in a thread, once per process (a server's first answer then does not pay plotly's first use);
    a failure there only leaves the first answer slower."""
    if _WARMED.is_set():
        return
    _WARMED.set()

    def run() -> None:
        with contextlib.suppress(Exception):
            figures.warm()

    threading.Thread(target=run, name="ampdoctor-warm", daemon=True).start()


def _diagnose(
    spec: dict[str, Any], where: str, early: Callable[[dict[str, Any]], None] | None = None
) -> dict[str, Any]:
    """Run diagjob over ``spec``: in the diagnosis process (the default), or in this thread. ``early``: given the
    formats table as soon as it is computed, before the findings."""
    from . import diagjob

    if where == "thread":
        return diagjob.run(spec, early)
    return _WORKER.run(spec, early)
