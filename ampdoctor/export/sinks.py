"""Where exported figures go: TensorBoard event files, a Weights & Biases run, an MLflow run, CSV and Parquet tables.
Offline side: no torch import (TensorBoard's events are written with the ``tensorboard`` package's own writer).

A sink takes Points (one step's figures, rows.py) and new findings. Each backend is imported when its sink is made,
and a missing package is one line (``ExportError``). A sink given an object the user or a framework owns (a
``SummaryWriter``, a W&B run, an MLflow run id) writes into it and never closes it.
"""

from __future__ import annotations

import csv
import importlib
import math
import os
import time

from . import text as T
from .rows import NAMES, Point

PREFIX = "ampdoctor/"
DEFAULT_EVERY = 10  # dashboards: every 10th step (and every anomalous one); tables (CSV, Parquet): every step
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow", "parquet": "pyarrow"}


class ExportError(Exception):
    """An export that cannot start (a missing package, a file that exists): one line."""


def need(name: str, package: str | None = None):
    """Import ``package`` for the ``name`` exporter, or one line saying what to install."""
    package = package or PACKAGES[name]
    try:
        return importlib.import_module(package)
    except ImportError:
        extra = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow", "parquet": "parquet"}[name]
        raise ExportError(
            f'exporting to {name} needs the {package.split(".")[0]} package: pip install "ampdoctor[{extra}]"'
        ) from None


def _check_every(every) -> int:
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise ValueError(f"Argument every should be a positive int, but given {every!r}")
    return every


class Sink:
    """The base: which steps to write (``every`` N-th exported step, and every anomalous one), the exported step
    number (``step_offset``: 1 where a framework counts the first optimizer step as step 1) and the names."""

    kind = "sink"

    def __init__(self, every: int = DEFAULT_EVERY, prefix: str = PREFIX, step_offset: int = 0):
        self.every = _check_every(every)
        self.prefix = prefix
        self.step_offset = step_offset

    def wants(self, p: Point) -> bool:
        return p.anomalous or (p.step + self.step_offset) % self.every == 0

    def write(self, points: list[Point]) -> None:
        """Write the scalars of ``points`` (already filtered by ``wants``)."""

    def findings(self, new: list, everything: list, step: int) -> None:
        """``new`` findings were reported (``everything``: all so far) while the trace was at ``step``."""

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.flush()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(every={self.every})"


# -- TensorBoard -------------------------------------------------------------------------------------------------
class TensorBoard(Sink):
    """Event files in ``logdir`` (a new file next to any there: nothing is overwritten), or into ``writer``: any
    object with ``add_scalar(tag, value, step)`` and ``add_text(tag, text, step)`` (torch's or tensorboardX's
    ``SummaryWriter``, Lightning's ``TensorBoardLogger.experiment``). Findings go to the text dashboard."""

    kind = "tensorboard"

    def __init__(self, logdir: str | None = None, *, writer=None, every: int = DEFAULT_EVERY, **kw):
        super().__init__(every, **kw)
        if (logdir is None) == (writer is None):
            raise ValueError("Argument logdir or writer should be given (one of them)")
        self.logdir = logdir
        self._writer = writer
        self._own = writer is None
        if self._own:
            need("tensorboard")
            from tensorboard.compat.proto import event_pb2, summary_pb2
            from tensorboard.summary.writer.event_file_writer import EventFileWriter

            os.makedirs(logdir, exist_ok=True)
            self._events = EventFileWriter(logdir)
            self._pb = (event_pb2, summary_pb2)

    def write(self, points: list[Point]) -> None:
        if not self._own:
            for p in points:
                for name, v in p.values.items():
                    self._writer.add_scalar(self.prefix + name, v, p.step + self.step_offset)
            return
        event_pb2, summary_pb2 = self._pb
        for p in points:
            values = [summary_pb2.Summary.Value(tag=self.prefix + n, simple_value=v) for n, v in p.values.items()]
            self._events.add_event(
                event_pb2.Event(
                    wall_time=p.time or time.time(),
                    step=p.step + self.step_offset,
                    summary=summary_pb2.Summary(value=values),
                )
            )

    def findings(self, new: list, everything: list, step: int) -> None:
        for d in new:
            at = (d.steps[0] if d.steps else step) + self.step_offset
            if not self._own:
                self._writer.add_text(self.prefix + "findings", T.markdown(d), at)
            else:
                self._text(self.prefix + "findings", T.markdown(d), at)

    def _text(self, tag: str, body: str, step: int) -> None:
        """One text summary, laid out as TensorBoard's text plugin reads it (a string tensor of shape [1])."""
        from tensorboard.compat.proto import tensor_pb2, tensor_shape_pb2, types_pb2
        from tensorboard.plugins.text.metadata import create_summary_metadata

        event_pb2, summary_pb2 = self._pb
        tensor = tensor_pb2.TensorProto(
            dtype=types_pb2.DT_STRING,
            string_val=[body.encode("utf-8")],
            tensor_shape=tensor_shape_pb2.TensorShapeProto(dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=1)]),
        )
        value = summary_pb2.Summary.Value(
            tag=tag, metadata=create_summary_metadata(display_name="", description=""), tensor=tensor
        )
        self._events.add_event(
            event_pb2.Event(wall_time=time.time(), step=step, summary=summary_pb2.Summary(value=[value]))
        )

    def flush(self) -> None:
        (self._events if self._own else self._writer).flush()

    def close(self) -> None:
        if self._own:
            self._events.close()
        else:
            self._writer.flush()


# -- Weights & Biases ----------------------------------------------------------------------------------------------
class WandB(Sink):
    """Into a W&B run: ``run`` (a ``wandb`` Run), else the process's active run (``wandb.run``), else a new one in
    ``project`` (finished at close; ``WANDB_MODE=offline`` works as for any run). The figures are plotted against
    ``step_key`` (``<prefix>step`` by default, declared with ``define_metric``): ampdoctor's rows never move the
    run's own step axis. Findings: a table ``<prefix>findings``, and ``run.alert`` for the critical ones."""

    kind = "wandb"

    def __init__(
        self,
        run=None,
        *,
        project: str | None = None,
        every: int = DEFAULT_EVERY,
        step_key: str | None = None,
        alert: bool = True,
        **kw,
    ):
        super().__init__(every, **kw)
        self._wandb = need("wandb")
        self._own = False
        if run is None:
            run = self._wandb.run
        if run is None:
            run = self._wandb.init(project=project or "ampdoctor")
            self._own = True
        self.run = run
        self.alert = alert
        self.step_key = step_key or self.prefix + "step"
        if step_key is None:
            run.define_metric(self.step_key, hidden=True)
            run.define_metric(self.prefix + "*", step_metric=self.step_key)

    def write(self, points: list[Point]) -> None:
        for p in points:
            row = {self.prefix + n: v for n, v in p.values.items()}
            row[self.step_key] = p.step + self.step_offset
            self.run.log(row)

    def findings(self, new: list, everything: list, step: int) -> None:
        table = self._wandb.Table(
            columns=["severity", "rule", "layers", "steps", "title", "summary", "fix"],
            data=[
                [d.severity, d.rule, ", ".join(map(str, d.layers)), T.step_span(d), d.title, d.summary, T.fix_text(d)]
                for d in everything
            ],
        )
        self.run.log({self.prefix + "findings": table, self.step_key: step + self.step_offset})
        if self.alert:
            for d in new:
                if d.severity == "critical":
                    self.run.alert(
                        title=f"ampdoctor {d.rule}: {d.title}",
                        text=T.markdown(d),
                        level=self._wandb.AlertLevel.ERROR,
                        wait_duration=0,
                    )

    def close(self) -> None:
        if self._own:
            self.run.finish()


# -- MLflow ----------------------------------------------------------------------------------------------------
class MLflow(Sink):
    """Into an MLflow run: ``run_id``, else the active run (``mlflow.active_run()``), else a new run in
    ``experiment`` (ended at close), through ``client`` (an ``MlflowClient``; by default one for the tracking URI
    in force). Findings: the artifact ``<prefix>findings.md``, rewritten as they come, and the tag
    ``<prefix>findings`` counting them."""

    kind = "mlflow"
    BATCH = 1000  # MLflow's limit of metrics per log_batch call

    def __init__(
        self,
        run_id: str | None = None,
        *,
        client=None,
        experiment: str | None = None,
        every: int = DEFAULT_EVERY,
        **kw,
    ):
        super().__init__(every, **kw)
        mlflow = need("mlflow")
        self._entities = importlib.import_module("mlflow.entities")
        self.client = client or mlflow.tracking.MlflowClient()
        self._own = False
        if run_id is None:
            active = mlflow.active_run()
            run_id = active.info.run_id if active is not None else None
        if run_id is None:
            name = experiment or "ampdoctor"
            exp = self.client.get_experiment_by_name(name)
            exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(name)
            run_id = self.client.create_run(exp_id).info.run_id
            self._own = True
        self.run_id = run_id

    def write(self, points: list[Point]) -> None:
        Metric = self._entities.Metric
        metrics = [
            Metric(self.prefix + n, v, int((p.time or time.time()) * 1000), p.step + self.step_offset)
            for p in points
            for n, v in p.values.items()
        ]
        for i in range(0, len(metrics), self.BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + self.BATCH])

    def findings(self, new: list, everything: list, step: int) -> None:
        body = "\n\n---\n\n".join(T.markdown(d) for d in everything)
        self.client.log_text(self.run_id, body, self.prefix + "findings.md")
        counts = {s: sum(d.severity == s for d in everything) for s in ("critical", "warning", "info")}
        self.client.set_tag(
            self.run_id, self.prefix + "findings", ", ".join(f"{n} {s}" for s, n in counts.items() if n)
        )

    def close(self) -> None:
        if self._own:
            self.client.set_terminated(self.run_id)


# -- tables ----------------------------------------------------------------------------------------------------------
FINDING_COLUMNS = ("severity", "rule", "title", "summary", "layers", "first_step", "last_step", "ranks", "fix")


def _finding_row(d) -> list:
    steps = list(d.steps or [])
    return [
        d.severity,
        d.rule,
        d.title,
        d.summary,
        ", ".join(map(str, d.layers)),
        steps[0] if steps else None,
        steps[-1] if steps else None,
        ", ".join(map(str, d.ranks)),
        T.fix_text(d),
    ]


def _new_file(path: str) -> str:
    if os.path.lexists(path):
        raise ExportError(f"{path} exists; nothing was written (choose another --out or move it)")
    return path


class _Table(Sink):
    """The steps as a table (``steps.<ext>``: step, rank where a run has several, every figure; a figure a step did
    not record is empty) and the findings (``findings.<ext>``) in ``folder``; existing files are never replaced."""

    ext = ""

    def __init__(self, folder: str, *, every: int = 1, rank: int | None = None, **kw):
        super().__init__(every, **kw)
        self.folder = folder
        self.rank = rank  # set by the exporter of a multi-rank run: one table, a rank column
        os.makedirs(folder, exist_ok=True)
        self.steps_path = _new_file(os.path.join(folder, f"steps.{self.ext}"))
        self.findings_path = _new_file(os.path.join(folder, f"findings.{self.ext}"))
        self._findings: list = []
        self.columns = ["step", "rank", *NAMES] if rank is not None else ["step", *NAMES]

    def _rows(self, points: list[Point]) -> list[list]:
        front = (lambda p: [p.step + self.step_offset, self.rank]) if self.rank is not None else None
        return [(front(p) if front else [p.step + self.step_offset]) + [p.values.get(n) for n in NAMES] for p in points]

    def findings(self, new: list, everything: list, step: int) -> None:
        self._findings.extend(new)  # written at close: a run's findings are few


class CSV(_Table):
    kind = "csv"
    ext = "csv"

    def __init__(self, folder: str, **kw):
        super().__init__(folder, **kw)
        self._file = open(self.steps_path, "x", newline="", encoding="utf-8")  # noqa: SIM115 - open while exporting
        self._csv = csv.writer(self._file)
        self._csv.writerow(self.columns)

    def write(self, points: list[Point]) -> None:
        self._csv.writerows([["" if v is None else _csv_number(v) for v in r] for r in self._rows(points)])

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()
        with open(self.findings_path, "x", newline="", encoding="utf-8") as f:
            w = csv.writer(f)
            w.writerow(FINDING_COLUMNS)
            w.writerows([["" if v is None else v for v in _finding_row(d)] for d in self._findings])


def _csv_number(v):
    """Numbers as Python writes them (``repr``: reads back exactly); NaN and Inf as nan / inf / -inf."""
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    return v


class Parquet(_Table):
    kind = "parquet"
    ext = "parquet"

    def __init__(self, folder: str, **kw):
        self._pa = need("parquet")
        self._pq = need("parquet", "pyarrow.parquet")
        super().__init__(folder, **kw)
        pa = self._pa
        fields = [pa.field("step", pa.int64())]
        if self.rank is not None:
            fields.append(pa.field("rank", pa.int64()))
        fields += [pa.field(n, pa.float64()) for n in NAMES]
        self._schema = pa.schema(fields)
        self._writer = self._pq.ParquetWriter(self.steps_path, self._schema)

    def write(self, points: list[Point]) -> None:
        if not points:
            return
        cols = list(zip(*self._rows(points)))
        self._writer.write_table(self._pa.Table.from_arrays([self._pa.array(c) for c in cols], schema=self._schema))

    def close(self) -> None:
        self._writer.close()
        pa = self._pa
        rows = [_finding_row(d) for d in self._findings]
        types = {"first_step": pa.int64(), "last_step": pa.int64()}
        table = pa.table(
            {c: pa.array([r[i] for r in rows], type=types.get(c, pa.string())) for i, c in enumerate(FINDING_COLUMNS)}
        )
        self._pq.write_table(table, _new_file(self.findings_path))
