"""The training side's state as two plain objects: what one step has gathered so far (StepState: a new one every
step, never a dozen fields reset by hand), and what training has shown about the run (RunFacts: the observed
precision configuration, across steps)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .options import Observe

if TYPE_CHECKING:
    import torch


@dataclass(slots=True)
class StepState:
    """One step between two boundaries. The cadence decides ``observe``/``reason``/``store_hist`` when it starts."""

    index: int
    observe: Observe
    reason: str
    store_hist: bool
    micro: int = 0  # micro-batches (root forwards or begin_batch calls) seen this step
    samples: int = 0
    t_first: float | None = None  # when its first micro-batch started (the end of the data wait)
    # floats, or 0-d device tensors read with the step's transfer
    losses: list[float | torch.Tensor] = field(default_factory=list)
    scale_before: Any = None  # the loss scale in force when the step's loss was scaled
    opt_stepped: bool = False  # the optimizer applied this step (the scaler did not skip it)
    # inside optimizer.step(): a closure's zero_grad() and backward there (LBFGS) are the step's own, not a missed one
    in_update: bool = False
    grads_seen: bool = False  # an output gradient was observed (a backward ran)
    look_at_autocast: bool = True  # the first observed forward still has to read the autocast state
    first_backward: bool = False  # the next output gradient is the first of a micro-batch's backward
    # copies of the weights before the optimizer step (update steps only)
    weights_before: list[torch.Tensor] | None = None
    figures: tuple[Any, ...] | None = None  # the sentinel's (gradient norm, largest gradient), once computed
    # the gradient-norm spike and the loss spike, each once judged (a running mean moves once per step); the loss
    # stays unjudged while the step has none (a loop may log it after optimizer.step(), past the early verdict)
    grad_spike: bool | None = None
    loss_spike: bool | None = None
    updates: int = 0  # optimizer updates applied before this step started (its replay is exact while unchanged)
    replay: Any = None  # the anomaly replay of this step, when one ran
    replay_record: Any = None  # the replay's full observation of every site (a StepRecord), when it observed


@dataclass
class RunFacts:
    """What training showed about the run: written into the trace's ``config`` after the first step."""

    device: str | None = None  # the model's device type, read at every step start (a model may move)
    autocast: dict[str, Any] = field(default_factory=dict)  # device_type, enabled, dtype at the first forward
    loss_dtype: str | None = None
    external_batches: bool = False  # begin_batch() marks the micro-batches (frameworks' callbacks)
    step_starts: int = 0  # micro-batch starts seen (root forwards or begin_batch calls)
    missed_steps: int = 0  # gradients cleared by zero_grad() while no step boundary came
    updates: int = 0  # optimizer updates applied so far (a replay is exact while a step's count still holds)
