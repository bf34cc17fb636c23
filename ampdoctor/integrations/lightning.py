"""``AmpDoctorCallback`` for Lightning: ``lightning.Trainer(..., callbacks=[AmpDoctorCallback()])``.

At train start it attaches to the LightningModule with the Trainer's optimizer and the precision plugin's GradScaler
("16-mixed"). A LightningModule's ``forward`` is often never called (``training_step`` calls an inner model), so
the callback marks each training batch itself (``Doctor.begin_batch``) for the step timing and batch sizes. It
records the loss Lightning backpropagates, Lightning's logged metrics, and closes the trace when training ends.
"""

from __future__ import annotations

try:
    from lightning.pytorch import Callback
except ImportError:  # the standalone package of older installs
    try:
        from pytorch_lightning import Callback
    except ImportError as exc:  # pragma: no cover - the message is the point
        raise ImportError(
            'ampdoctor.integrations.lightning needs lightning: pip install "ampdoctor[lightning]"'
        ) from exc

from ._common import MetricLog, trace_path


class AmpDoctorCallback(Callback):
    """Observe a Lightning ``fit``. ``trace`` defaults to ``<default_root_dir>/ampdoctor.db``; ``options`` are
    attach()'s. With several optimizers (manual optimization) each training batch is one recorded step."""

    def __init__(self, trace: str | None = None, **options):
        self.trace = trace
        self.options = options
        self.doctor = None
        self._manual_steps = False
        self._steps_seen = 0
        self._metrics = MetricLog()

    def on_train_start(self, trainer, pl_module):
        import ampdoctor

        self._close()
        self._metrics = MetricLog()
        self._steps_seen = 0
        optimizers = list(trainer.optimizers)
        self._manual_steps = len(optimizers) != 1
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self.doctor = ampdoctor.attach(
            pl_module,
            optimizer=None if self._manual_steps else optimizers[0],
            scaler=scaler,
            trace=trace_path(self.trace, trainer.default_root_dir),
            **self.options,
        )

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
