"""Settings over a trace: ``replay`` one (the run's own where not given) and ``suggest`` the best of a grid.

``replay`` lives here with ``suggest`` rather than in scaler.py: both open a trace and read its evidence (evidence.py)
before stepping the scaler model (scaler.py) over it; scaler.py works on evidence already gathered.
"""

from __future__ import annotations

import math
import os
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from itertools import islice

from ..trace import Trace
from ..trace.view import View
from .defaults import Settings
from .evidence import Evidence, gather, open_trace
from .scaler import Replay, gradscaler_code, initial_tracker, lost_many, resolve, simulate

# --suggest search space. Powers of two only: a power-of-two scale multiplies and divides gradients exactly, which is
# also why the factors stay at the run's (2 / 0.5 by default) rather than being searched.
SUGGEST_INIT_EXPONENTS = range(0, 25)  # 1 .. 2^24 (MindSpore's default init is 2^24)
SUGGEST_INTERVALS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)

TraceLike = Trace | View | str | os.PathLike[str]  # what ``replay`` and ``suggest`` read (evidence.open_trace)
GridPoint = tuple[float, float, int, int]  # growth_factor, backoff_factor, growth_interval, log2 init_scale


@dataclass(eq=False)
class Suggestion:
    """Best scaler settings found by ``suggest`` and the replays behind them."""

    settings: Settings
    replay: Replay
    baseline: Replay  # the run's own settings
    device: str = "cuda"
    searched: int = 0  # settings tried
    notes: list[str] = field(default_factory=list)

    @property
    def improves(self) -> bool:
        return self.replay.lost < self.baseline.lost

    @property
    def code(self) -> str:
        """The GradScaler line to paste (arguments left at torch's defaults are omitted, init_scale always shown)."""
        return gradscaler_code(self.settings, self.device)


def replay(
    trace_or_path: TraceLike | Evidence,
    init_scale: float | None = None,
    growth_factor: float | None = None,
    backoff_factor: float | None = None,
    growth_interval: int | None = None,
) -> Replay:
    """Simulate GradScaler over a recorded trace (or its evidence, gathered before: the settings do not change it);
    arguments left at None keep the run's own settings (torch's defaults for a run without a scaler). With no
    arguments the recorded scale history is reproduced exactly."""
    ev = trace_or_path if isinstance(trace_or_path, Evidence) else gather(open_trace(trace_or_path))
    s = resolve(ev, init_scale, growth_factor, backoff_factor, growth_interval)
    own = (
        s["init_scale"] == ev.run_settings["init_scale"] and s["growth_interval"] == ev.run_settings["growth_interval"]
    )
    tracker = initial_tracker(ev) if own else 0
    out = simulate(ev, s, tracker)
    out.growth_tracker = tracker
    return out


def suggest(
    trace_or_path: TraceLike,
    search_factors: bool = False,
    progress: Callable[[list[GridPoint]], Iterable[object]] | None = None,
) -> Suggestion:
    """Search init_scale (powers of two, 1 .. 2^24) and growth_interval for the settings that lose the least
    gradient information (``Replay.lost``: skipped steps count fully, applied steps by their FP16 underflow share).

    Ties go to the growth_interval nearest the run's own, then to the run's own factors, then to the larger
    init_scale (more underflow headroom);
    when nothing beats the run's own settings, they are the suggestion.
    The factors stay at the run's own unless ``search_factors`` (then growth 2/4 and backoff 0.5/0.25 are tried).
    ``progress`` wraps the list of settings to try (e.g. ``tqdm``) to show the search advancing.
    """
    tr = open_trace(trace_or_path)
    ev = gather(tr)
    own = resolve(ev, None, None, None, None)
    baseline = simulate(ev, own, initial_tracker(ev))
    n = len(ev.steps)
    longer = [i for i in SUGGEST_INTERVALS if i > n][:1]  # one interval that never grows within the trace
    intervals = sorted({i for i in SUGGEST_INTERVALS if i <= n} | set(longer) | {int(own["growth_interval"])})
    own_pair = (own["growth_factor"], own["backoff_factor"])
    factors = [own_pair]
    if search_factors:
        factors += sorted({(2.0, 0.5), (4.0, 0.5), (2.0, 0.25), (4.0, 0.25)} - {own_pair})
    grid: list[GridPoint] = [
        (growth, backoff, gi, e) for growth, backoff in factors for gi in intervals for e in SUGGEST_INIT_EXPONENTS
    ]
    settings: list[Settings] = [
        {"init_scale": 2.0**e, "growth_factor": growth, "backoff_factor": backoff, "growth_interval": gi}
        for growth, backoff, gi, e in grid
    ]
    bar = iter(progress(grid) if progress else ())
    # the bar, k settings on; a setting whose skips alone lose more than the run's own settings cannot be chosen
    lost = lost_many(ev, settings, advance=lambda k: deque(islice(bar, k), maxlen=0), bound=baseline.lost)
    deque(bar, maxlen=0)  # and to its end (a bar closes once its list is used up)
    best_key: tuple[float, float, bool, int] | None = None
    best_i = 0
    for i, ((growth, backoff, gi, e), r_lost) in enumerate(zip(grid, lost)):
        key = (
            round(r_lost, 12),
            abs(math.log2(gi / own["growth_interval"])),
            (growth, backoff) != own_pair,
            -e,
        )  # ties: the run's own factors first
        if best_key is None or key < best_key:
            best_key, best_i = key, i
    best = simulate(ev, settings[best_i])
    if not best.lost < baseline.lost:  # nothing beats the run's own settings: keep them
        best = baseline
    notes: list[str] = []
    if best.estimated.any():
        notes.append(f"{int(best.estimated.sum())} skip decision(s) estimated from neighbouring steps")
    if ev.assumed_fp16:
        notes.append("the run computed no gradient in FP16: replayed as if it had")
    if not ev.has_scaler:
        notes.append("the run had no GradScaler: compared with torch's defaults")
    return Suggestion(
        settings=best.settings, replay=best, baseline=baseline, device=ev.device, searched=len(grid), notes=notes
    )
