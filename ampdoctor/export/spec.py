"""``export=`` as the user writes it: ``"tensorboard:runs/tb"``, ``"wandb"``, ``"mlflow:my-experiment"``,
``"csv:out/"``, several joined by commas, a sink object, or a list of them. Offline side: no torch import."""

from __future__ import annotations

import os
from typing import NamedTuple

from .sinks import CSV, MLflow, Parquet, Sink, TensorBoard, WandB

KINDS = ("tensorboard", "wandb", "mlflow", "csv", "parquet")
_USAGE = (
    "'tensorboard[:DIR]', 'wandb[:PROJECT]', 'mlflow[:EXPERIMENT]', 'csv[:DIR]' or 'parquet[:DIR]' "
    "(several joined by commas), a sink from ampdoctor.export, or a list of them"
)


class Spec(NamedTuple):
    """A spec string with its cadence: ``Spec("tensorboard:runs/tb", every=50)``."""

    text: str
    every: int | None = None


def default_folder(trace: str, kind: str) -> str:
    """Where an export without a folder goes: next to the trace, ``runs/exp.db`` -> ``runs/exp-tensorboard``."""
    return os.path.splitext(os.fspath(trace))[0] + f"-{kind}"


def parse(spec) -> list[tuple[str, str | None]]:
    """``(kind, argument)`` pairs of a spec string; a ValueError of one line for anything else. Makes nothing."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"Argument export should be {_USAGE}, but given {spec!r}")
    out = []
    for item in spec.split(","):
        kind, _, arg = item.strip().partition(":")
        kind = kind.strip().lower()
        if kind not in KINDS:
            raise ValueError(f"Argument export should be {_USAGE}, but given {item.strip()!r}")
        out.append((kind, arg.strip() or None))
    return out


def make(kind: str, arg: str | None, trace: str, every: int | None = None) -> Sink:
    """The sink of one parsed entry; ``every`` defaults to the kind's (10 for dashboards, 1 for tables)."""
    kw = {} if every is None else {"every": every}
    if kind == "tensorboard":
        return TensorBoard(arg or default_folder(trace, kind), **kw)
    if kind == "wandb":
        return WandB(project=arg, **kw)
    if kind == "mlflow":
        return MLflow(experiment=arg, **kw)
    if kind == "csv":
        return CSV(arg or default_folder(trace, kind), **kw)
    return Parquet(arg or default_folder(trace, kind), **kw)


def make_sinks(spec, trace: str, every: int | None = None) -> list[Sink]:
    """The sinks ``spec`` names, made now (a missing package or an existing table file raises ExportError here,
    before training starts); a sink given as an object is used as it is."""
    items = list(spec) if isinstance(spec, (list, tuple)) else [spec]
    if not items:
        raise ValueError(f"Argument export should be {_USAGE}, but given {spec!r}")
    parsed: list = []
    for item in items:
        if isinstance(item, Sink):
            parsed.append(item)
        elif isinstance(item, Spec):
            parsed.extend((*p, item.every) for p in parse(item.text))
        else:
            parsed.extend((*p, every) for p in parse(item))  # every string checked before any sink is made
    made: list[Sink] = []
    try:
        for item in parsed:
            made.append(item if isinstance(item, Sink) else make(item[0], item[1], trace=trace, every=item[2]))
    except BaseException:
        for s in made:
            if not any(s is p for p in parsed):
                s.close()
        raise
    return made
