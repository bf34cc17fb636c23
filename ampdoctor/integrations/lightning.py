"""``AmpDoctorCallback`` for Lightning: ``lightning.Trainer(..., callbacks=[AmpDoctorCallback()])``, or no code at all:
with ampdoctor installed, ``AMPDOCTOR=1`` adds it to every Trainer (the ``lightning.pytorch.callbacks_factory`` entry
point, ``env_callbacks`` below).

At train start it attaches to the LightningModule with the Trainer's optimizer and the precision plugin's GradScaler
("16-mixed"). A LightningModule's ``forward`` is often never called (``training_step`` calls an inner model), so
the callback marks each training batch itself (``Doctor.begin_batch``) for the step timing and batch sizes. It
records the loss Lightning backpropagates, Lightning's logged metrics, writes ampdoctor's figures and findings into
the Trainer's loggers (TensorBoard, W&B, MLflow, any other ``Logger``), stops the Trainer (``should_stop``, a
checkpoint saved) when a finding reaches ``halt_on``, and closes the trace when training ends.
"""

from __future__ import annotations

import logging
import os

try:
    from lightning.pytorch import Callback
except ImportError:  # the standalone package of older installs
    try:
        from pytorch_lightning import Callback
    except ImportError as exc:  # pragma: no cover - the message is the point
        raise ImportError(
            'ampdoctor.integrations.lightning needs lightning: pip install "ampdoctor[lightning]"'
        ) from exc

from ..export import sinks as S
from . import env as E
from ._common import LoggerExport, MetricLog, halt_line, plan, trace_path

log = logging.getLogger("ampdoctor")

# Lightning's loggers count the first optimizer step as step 0 (``trainer.global_step`` before it), as the trace does
STEP_OFFSET = 0


class AmpDoctorCallback(Callback):
    """Observe a Lightning ``fit``. ``trace`` defaults to ``<default_root_dir>/ampdoctor.db``; ``export``:
    ``"loggers"`` (the Trainer's loggers, every ``log_every_n_steps``), None, or what ``attach(export=...)`` takes;
    ``options`` are attach()'s. The AMPDOCTOR_* environment variables override them all. With several optimizers
    (manual optimization) each training batch is one recorded step."""

    def __init__(self, trace: str | None = None, *, export="loggers", export_every: int | None = None, **options):
        self.trace = trace
        self.export = export
        self.export_every = export_every
        self.options = options
        self.doctor = None
        self.halted = None  # the finding that stopped training
        self.checkpoint: str | None = None  # the checkpoint saved when it did
        self.from_env = False  # made by the entry point (AMPDOCTOR=1), not by the user's code
        self._manual_steps = False
        self._steps_seen = 0
        self._metrics = MetricLog()
        self._export: LoggerExport | None = None
        self._trainer = None

    def on_train_start(self, trainer, pl_module):
        import ampdoctor

        self._close()
        self.halted, self.checkpoint = None, None
        p = plan(self.trace, self.options, self.export, self.export_every)
        if p is None:  # AMPDOCTOR=0
            return
        if self.from_env and any(isinstance(c, AmpDoctorCallback) and not c.from_env for c in trainer.callbacks):
            return  # the user's own callback observes this run
        self._trainer = trainer
        self._metrics = MetricLog()
        self._steps_seen = 0
        optimizers = list(trainer.optimizers)
        self._manual_steps = len(optimizers) != 1
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        options = dict(p.options)
        if options.get("halt_on") is not None:
            options.setdefault("on_halt", self._on_halt)
        attach_export = None if p.export == "loggers" else E.export_option(p.export, p.export_every)
        self.doctor = ampdoctor.attach(
            pl_module,
            optimizer=None if self._manual_steps else optimizers[0],
            scaler=scaler,
            trace=trace_path(p.trace, trainer.default_root_dir),
            export=attach_export,
            **options,
        )
        if p.export == "loggers" and self.doctor.active and trainer.loggers:
            every = p.export_every or max(int(trainer.log_every_n_steps), 1)
            self._export = LoggerExport(self.doctor, [_logger_sink(lg, every) for lg in trainer.loggers], every)

    def _on_halt(self, finding) -> None:
        """Called by the Doctor at the step boundary: Lightning stops after this batch (and saves a checkpoint)."""
        self.halted = finding
        log.warning(halt_line(finding, "trainer.should_stop"))
        if self._trainer is not None:
            self._trainer.should_stop = True

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.doctor is not None:
            self.doctor.begin_batch(batch)

    def on_before_backward(self, trainer, pl_module, loss):
        """The loss Lightning backpropagates (divided by accumulate_grad_batches); with a GradScaler it is read in
        scaler.scale() instead."""
        doc = self.doctor
        if doc is not None and not doc.scaler_enabled:
            doc.log_loss(loss)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        doc = self.doctor
        if doc is None:
            return
        if self._manual_steps and doc.boundary == "manual":
            doc.step()
        if doc.n_steps != self._steps_seen:  # an optimizer step ended: what Lightning logged for it
            self._steps_seen = doc.n_steps
            self._metrics.send(doc, trainer.logged_metrics)
            if self._export is not None and doc.n_steps % self._export.every == 0:
                self._export.poll()
        if self.halted is not None and self.checkpoint is None:
            self._save(trainer)

    def _save(self, trainer) -> None:
        """The checkpoint to resume from with the fix, next to the Trainer's own (none when checkpointing is off)."""
        cb = trainer.checkpoint_callback
        if cb is None:
            self.checkpoint = ""
            return
        folder = getattr(cb, "dirpath", None) or os.path.join(trainer.default_root_dir, "checkpoints")
        self.checkpoint = os.path.join(folder, f"ampdoctor-halted-step={trainer.global_step}.ckpt")
        trainer.save_checkpoint(self.checkpoint)
        log.warning(f"ampdoctor: checkpoint saved to {self.checkpoint}")

    def on_validation_end(self, trainer, pl_module):
        if self.doctor is not None and not trainer.sanity_checking:
            self._metrics.send(self.doctor, trainer.callback_metrics)

    def on_train_epoch_end(self, trainer, pl_module):
        if self.doctor is not None:  # epoch-level values (on_epoch=True) are logged at the epoch end
            self._metrics.send(self.doctor, trainer.logged_metrics)

    def on_train_end(self, trainer, pl_module):
        self._close()

    def on_exception(self, trainer, pl_module, exception):
        self._close()

    def _close(self) -> None:
        if self.doctor is not None:
            self.doctor.close()
        if self._export is not None:
            self._export.close()  # after the trace closed: its last steps, and the findings of the whole run
            self._export = None


def _logger_sink(logger, every: int) -> S.Sink:
    """A sink writing into one of the Trainer's loggers: TensorBoard's writer, the W&B run, the MLflow run (their
    findings as text, tables, alerts); any other Logger gets the figures through ``log_metrics``."""
    kw = {"every": every, "step_offset": STEP_OFFSET}
    name = type(logger).__name__
    if name == "TensorBoardLogger":
        return S.TensorBoard(writer=logger.experiment, **kw)
    if name == "WandbLogger":
        return S.WandB(run=logger.experiment, step_key="trainer/global_step", **kw)
    if name == "MLFlowLogger":
        return S.MLflow(run_id=logger.run_id, client=logger.experiment, **kw)
    return _LoggerMetrics(logger, **kw)


class _LoggerMetrics(S.Sink):
    """Any Lightning Logger: the figures through ``log_metrics(metrics, step)``; the findings only in the trace."""

    kind = "logger"

    def __init__(self, logger, **kw):
        super().__init__(**kw)
        self.logger = logger

    def write(self, points) -> None:
        for p in points:
            self.logger.log_metrics({self.prefix + n: v for n, v in p.values.items()}, step=p.step + self.step_offset)

    def flush(self) -> None:
        save = getattr(self.logger, "save", None)
        if callable(save):
            save()


def env_callbacks() -> list:
    """The ``lightning.pytorch.callbacks_factory`` entry point: an AmpDoctorCallback for every Trainer when
    ``AMPDOCTOR=1`` (configured by the AMPDOCTOR_* variables), nothing otherwise."""
    if not E.read(quiet=True).switch:  # the callback reads (and checks) the variables at train start
        return []
    cb = AmpDoctorCallback()
    cb.from_env = True
    return [cb]


__all__ = ["AmpDoctorCallback", "env_callbacks"]
