"""What the training side sends the writer thread: one small immutable message type per kind, dispatched by type
(STYLE 14: typed messages between threads, no positional tuples behind a string tag). Torch-free, so the writer
stays on the offline side of the import graph."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, NamedTuple

import numpy as np

from .vectors import Entry


class EventKind(str, Enum):
    """The ``events`` table's ``kind`` column (the values are the stored text)."""

    NONFINITE = "nonfinite"  # where the first NaN/Inf of an observed step came from
    NONFINITE_UNKNOWN = "nonfinite_unknown"  # a NaN/Inf on a step that observed no site and was not replayed
    NONFINITE_WEIGHTS = "nonfinite_weights"  # weights NaN/Inf after an optimizer step
    GRAD_SPIKE = "grad_spike"  # a finite gradient-norm spike
    LOSS_SPIKE = "loss_spike"  # a finite loss spike
    PROBE = "probe"  # a precision-loss probe ran on this step
    REPLAY = "replay"  # an anomalous step was replayed and observed in full
    OPERATION = "operation"  # the first operation that produced a non-finite value (or overflowed the format)
    HEAL = "heal"  # heal=True kept a module in FP32 from this step on
    CADENCE = "cadence"  # the budget stretched (or restored) the sampled tiers; a lasting anomaly observed less


class SiteMsg(NamedTuple):
    """A site seen for the first time."""

    id: int
    path: str
    module: str
    kind: str
    module_type: str | None
    dtype: str | None
    shape: str | None
    first_step: int


class MetaMsg(NamedTuple):
    """A ``meta`` entry (JSON value), written again when it changes."""

    key: str
    value: Any


class MetricMsg(NamedTuple):
    step: int
    name: str
    value: float
    time: float


class EventMsg(NamedTuple):
    step: int | None
    kind: EventKind
    site: int | None
    phase: str | None
    message: str
    data: Any = None


class ProbeMsg(NamedTuple):
    """A probed step: per-module rows (step, site, calls, k, numel, dtype, *PROBE_FIELDS) and what was skipped."""

    step: int
    rows: Sequence[tuple[Any, ...]]
    info: dict[str, Any]


class Sync(NamedTuple):
    """Set ``done`` once everything before it is committed."""

    done: threading.Event


class Close(NamedTuple):
    """The last message: commit and stop."""


@dataclass(slots=True)
class StepPacket:
    """One finished step: the row figures known on the training thread, the step's one host transfer and where each
    observation sits in it, and the verdict the training thread reached (the writer does not decide again)."""

    step: int
    row: dict[str, Any]  # steps-table fields known on the training thread
    values: np.ndarray  # the step's one host transfer
    bases: dict[str, int]  # where each block starts in values: "p<dtype>" peaks, "f" full vectors, "x" extras
    entries: list[Entry]
    loss: float | None
    scale: float | None
    scale_next: float | None
    grad_norm: float | None
    skipped: bool  # the optimizer did not apply this step (the scaler skipped it, or its scale backed off)
    nonfinite: bool  # a NaN/Inf in the loss, the gradients or any observed value
    store_hist: bool
    late_loss: object = None  # a loss logged after the step boundary, resolved before writing


class StepBatch(NamedTuple):
    """Consecutive finished steps sent together (the clean steps of collect/lane.py): one queue item and one wake-up
    of the writer for many steps, which it writes with the others it holds."""

    packets: list[StepPacket]
