"""``AmpDoctorCallback`` for the Hugging Face ``Trainer``: ``Trainer(..., callbacks=[AmpDoctorCallback()])``.

At train begin it attaches to the Trainer's model with its optimizer (accelerate's ``AcceleratedOptimizer``,
unwrapped to the torch optimizer, so trace steps are optimizer steps after gradient accumulation) and accelerate's
GradScaler (FP16); it records the training loss the Trainer backpropagates and every evaluation metric, and closes
the trace when training ends.
"""

from __future__ import annotations

import torch

try:
    from transformers import TrainerCallback
except ImportError as exc:  # pragma: no cover - the message is the point
    raise ImportError(
        'ampdoctor.integrations.transformers needs transformers: pip install "ampdoctor[transformers]"'
    ) from exc

from ._common import MetricLog, trace_path


class AmpDoctorCallback(TrainerCallback):
    """Observe a ``Trainer`` run. ``trace`` defaults to ``<output_dir>/ampdoctor.db``; ``options`` are attach()'s
    (every, hist_every, include, halt_on, ...). The Doctor of the current run is ``callback.doctor``."""

    def __init__(self, trace: str | None = None, **options):
        self.trace = trace
        self.options = options
        self.doctor = None
        self._loss_hook = None
        self._metrics = MetricLog()

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        import ampdoctor

        self._close()
        self._metrics = MetricLog()
        self.doctor = ampdoctor.attach(
            model, optimizer=optimizer, trace=trace_path(self.trace, args.output_dir), **self.options
        )
        doc = self.doctor
        if doc.active and not doc.scaler_enabled:
            # With a GradScaler the loss is read in scaler.scale(); without one, from the model's output.
            self._loss_hook = model.register_forward_hook(self._watch_loss)

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
