"""``AmpDoctorCallback`` for the Hugging Face ``Trainer``: ``Trainer(..., callbacks=[AmpDoctorCallback()])``.

At train begin it attaches to the Trainer's model with its optimizer (accelerate's ``AcceleratedOptimizer``,
unwrapped to the torch optimizer, so trace steps are optimizer steps after gradient accumulation) and accelerate's
GradScaler (FP16); it records the training loss the Trainer backpropagates and every evaluation metric, writes
ampdoctor's figures and findings where ``report_to`` sends the Trainer's logs (TensorBoard, W&B, MLflow) at each of
its log events, stops the Trainer (``should_training_stop`` and ``should_save``: a checkpoint to resume from) when a
finding reaches ``halt_on``, and closes the trace when training ends. The AMPDOCTOR_* environment variables switch
it off (``AMPDOCTOR=0``) or configure it without editing the script.
"""

from __future__ import annotations

import glob
import logging
import os

import torch

try:
    from transformers import TrainerCallback
except ImportError as exc:  # pragma: no cover - the message is the point
    raise ImportError(
        'ampdoctor.integrations.transformers needs transformers: pip install "ampdoctor[transformers]"'
    ) from exc

from ..export import sinks as S
from . import env as E
from ._common import LoggerExport, MetricLog, halt_line, plan, trace_path

log = logging.getLogger("ampdoctor")

# The Trainer logs after its first optimizer step as global_step 1; the trace calls that step 0.
STEP_OFFSET = 1


class AmpDoctorCallback(TrainerCallback):
    """Observe a ``Trainer`` run. ``trace`` defaults to ``<output_dir>/ampdoctor.db``; ``export``: ``"loggers"``
    (where ``report_to`` logs, at its ``logging_steps``), None, or what ``attach(export=...)`` takes; ``options`` are
    attach()'s (every, hist_every, include, halt_on, ...). The AMPDOCTOR_* environment variables override them.
    The Doctor of the current run is ``callback.doctor``."""

    def __init__(self, trace: str | None = None, *, export="loggers", export_every: int | None = None, **options):
        self.trace = trace
        self.export = export
        self.export_every = export_every
        self.options = options
        self.doctor = None
        self.halted = None  # the finding that stopped training
        self._loss_hook = None
        self._metrics = MetricLog()
        self._export: LoggerExport | None = None
        self._halt_pending = False

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        import ampdoctor

        self._close()
        self.halted, self._halt_pending = None, False
        p = plan(self.trace, self.options, self.export, self.export_every)
        if p is None:  # AMPDOCTOR=0
            return
        self._metrics = MetricLog()
        options = dict(p.options)
        if options.get("halt_on") is not None:
            options.setdefault("on_halt", self._on_halt)
        self.doctor = ampdoctor.attach(
            model,
            optimizer=optimizer,
            trace=trace_path(p.trace, args.output_dir),
            export=None if p.export == "loggers" else E.export_option(p.export, p.export_every),
            **options,
        )
        doc = self.doctor
        if doc.active and not doc.scaler_enabled:
            # With a GradScaler the loss is read in scaler.scale(); without one, from the model's output.
            self._loss_hook = model.register_forward_hook(self._watch_loss)
        if p.export == "loggers" and doc.active and state.is_world_process_zero:
            every = p.export_every or (int(args.logging_steps) if args.logging_strategy == "steps" else 1)
            sinks = report_to_sinks(args, max(every, 1))
            if sinks:
                self._export = LoggerExport(doc, sinks, max(every, 1))

    def _watch_loss(self, module, args, output):
        """The Trainer backpropagates the model's loss times a factor (1 / accumulation steps, or 1 when the model
        normalises by the whole step's tokens); the gradient reaching that loss is the factor, so loss * grad is
        exactly what the Trainer trains on and what it logs as ``loss`` (summed over the step's micro-batches)."""
        doc = self.doctor
        if doc is None or not doc.active or not (module.training and torch.is_grad_enabled()):
            return
        try:
            loss = (
                output.get("loss")
                if isinstance(output, dict)
                else (output[0] if isinstance(output, (tuple, list)) and output else None)
            )
            if isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.requires_grad:
                value = loss.detach()
                loss.register_hook(lambda g: doc.log_loss(value.float() * g.float()))
        except Exception as exc:  # never break training: the Doctor warns once and stops
            doc.fail(exc)

    def _on_halt(self, finding) -> None:
        """Called by the Doctor at the step boundary; the Trainer is told at this step's on_step_end."""
        self.halted = finding
        self._halt_pending = True
        log.warning(halt_line(finding, "should_training_stop, with a checkpoint"))

    def on_step_end(self, args, state, control, **kwargs):
        if self._halt_pending:
            self._halt_pending = False
            control.should_training_stop = True
            control.should_save = True  # the Trainer saves a checkpoint, then stops
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self._export is not None:
            self._export.poll()

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        if self.doctor is not None:
            self._metrics.send(self.doctor, metrics)

    def on_train_end(self, args, state, control, **kwargs):
        self._close()

    def _close(self) -> None:
        if self._loss_hook is not None:
            self._loss_hook.remove()
            self._loss_hook = None
        if self.doctor is not None:
            self.doctor.close()
        if self._export is not None:
            self._export.close()  # after the trace closed: its last steps, and the findings of the whole run
            self._export = None


def report_to_sinks(args, every: int) -> list:
    """Sinks for the integrations in ``args.report_to`` whose run is open: TensorBoard (a file of ampdoctor's next to
    the Trainer's in its log folder), the W&B run (plotted against ``train/global_step`` as the Trainer's logs are)
    and the active MLflow run; each at the Trainer's step numbers."""
    names = args.report_to if isinstance(args.report_to, (list, tuple)) else [args.report_to]
    kw = {"every": every, "step_offset": STEP_OFFSET}
    out: list = []
    if "tensorboard" in names:
        out.append(S.TensorBoard(_tensorboard_dir(args), **kw))
    if "wandb" in names:
        import wandb

        if wandb.run is not None:
            out.append(S.WandB(run=wandb.run, step_key="train/global_step", **kw))
    if "mlflow" in names:
        import mlflow

        if mlflow.active_run() is not None:
            out.append(S.MLflow(**kw))
    return out


def _tensorboard_dir(args) -> str:
    """The folder the Trainer's TensorBoard writer uses: the one holding an event file of this process (the writer
    names its files ``events.out.tfevents.<time>.<host>.<pid>.<n>``), else ``$TENSORBOARD_LOGGING_DIR`` or
    ``<output_dir>/runs/ampdoctor``."""
    root = os.getenv("TENSORBOARD_LOGGING_DIR") or os.path.join(args.output_dir, "runs")
    mine = [
        f
        for f in glob.glob(os.path.join(glob.escape(root), "**", "events.out.tfevents.*"), recursive=True)
        if f".{os.getpid()}." in os.path.basename(f)
    ]
    if mine:
        return os.path.dirname(max(mine, key=os.path.getmtime))
    return os.getenv("TENSORBOARD_LOGGING_DIR") or os.path.join(args.output_dir, "runs", "ampdoctor")
