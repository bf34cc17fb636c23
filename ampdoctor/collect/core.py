"""The training side's core for one run: its parts made, each given what it needs explicitly, and wired together
(session.Doctor is the facade over it). Who talks to whom:

- ``Collector`` (collector.py): the module hooks -> the step's record (record.py) and state (state.py).
- ``BoundaryHooks`` (boundary_hooks.py): the optimizer's and the scaler's calls -> the collector, a step's end.
- ``StepLoop`` (steploop.py): a step begins as the ``Cadence`` (cadence.py) plans it; at its end ``StepEnd``
  (boundary.py) closes the record into a flight.
- ``Flights`` (flights.py): the finished steps -> their verdicts (StepEnd), the flight recorder (the cadence), a
  replay of an anomalous step (``Replays``, replays.py and anomaly.py) -> the writer's packets, in order."""

from __future__ import annotations

from typing import Any

import torch

from ..trace.writer import Writer
from . import compiled, hooks, meta, sharded, stats
from .boundary import StepEnd
from .boundary_hooks import BoundaryHooks
from .cadence import Budget, Cadence
from .collector import Collector, LateLoss
from .flights import Flights
from .guards import Guard
from .lane import Lane
from .live import LiveDiagnosis
from .options import Boundary, Mode, Options
from .probe import StepProbe
from .record import StepRecord
from .replays import Replays
from .sites import Sites
from .state import RunFacts
from .steploop import StepLoop

# Clean host steps take the lane (lane.py) where the run allows it; False keeps every step on the general path (the
# tests compare the two).
LANE = True


class Core:
    """The parts of one run, made once its writer exists; step 0 begins at once. ``install`` registers the hooks
    and wrapped methods that feed them."""

    def __init__(
        self,
        guard: Guard,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        scaler: Any,
        options: Options,
        writer: Writer,
        *,
        boundary: Boundary,
        scaler_enabled: bool,
        live: LiveDiagnosis | None,
    ) -> None:
        put = writer.put
        stats.native()  # the native kernels start loading now, beside the first (calibration) steps
        compiled.get()  # and the C++ reads: loaded, or built by a process of their own
        every, peak_every, hist_every = options.every, options.peak_every, options.hist_every
        assert every is not None and peak_every is not None and hist_every is not None  # (Options fills them in)
        cadence = self.cadence = Cadence(
            options.mode,
            every=every,
            peak_every=peak_every,
            hist_every=hist_every,
            calibration=options.calibration,
            weight_every=options.weight_every,
        )
        # FSDP: a sharded parameter is read as this rank's shard (collect/sharded.py), never gathered
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        params = self.params = sharded.local_params(model, trainable)
        modules = hooks.select_modules(model, options.include, options.exclude)
        record, sites, facts = self.record, self.sites, self.facts = StepRecord(), Sites(model, put), RunFacts()
        collector = self.collector = Collector(
            guard,
            model,
            modules,
            sites,
            record,
            facts,
            params,
            boundary_name=boundary.value,
            keep_hooks=type(model).__name__ == "OptimizedModule",
        )
        end = StepEnd(
            guard,
            record,
            sites,
            params,
            cadence,
            put,
            optimizer=optimizer,
            scaler=scaler,
            scaler_enabled=scaler_enabled,
            model_name=type(model).__name__,
        )
        if options.probe_every:
            collector.probe = StepProbe(modules, sites, put, guard.fail, options.probe_every)
        self.replays: Replays | None = None
        if options.replay:
            self.replays = Replays(
                guard,
                model,
                modules,
                params,
                collector,
                facts,
                sites,
                put,
                boundary=boundary,
                scaler_enabled=scaler_enabled,
                heal=options.heal,
            )
            collector.on_root_call = self.replays.capture.on_call
        replays = self.replays
        flights = self.flights = Flights(end, cadence, replays, put)
        collector.on_step_start = flights.on_step_start
        loop = self.loop = StepLoop(
            guard,
            collector,
            end,
            flights,
            cadence,
            facts,
            writer,
            budget=Budget(options.budget, cadence) if options.budget is not None else None,
            capture=replays.capture if replays is not None else None,
            probe=collector.probe,
            config=lambda: meta.config(model, optimizer, scaler, scaler_enabled, facts, boundary.value),
            live=live,
            on_halt=options.on_halt,
        )
        self.boundary_hooks = BoundaryHooks(
            guard,
            collector,
            end,
            flights,
            replays,
            facts,
            scaler=scaler,
            boundary=boundary,
            has_optimizer=optimizer is not None,
            reads_weights=cadence.reads_weights,
            end_step=loop.end_step,
        )
        self.lane: Lane | None = None
        if (
            optimizer is not None
            and boundary is Boundary.OPTIMIZER
            and not scaler_enabled
            and collector.probe is None
            and collector.anchor is not None
            and collector.anchor.is_cpu  # (an accelerator's steps all take the general path: no extra call a hook)
            and not collector.keep_hooks
            and not end.half_params
            and all(type(p) is torch.nn.Parameter for _, p in params)  # (not shards: FSDP's are read their own way)
            and options.mode is not Mode.DEBUG  # (every step observed)
            and LANE
        ):
            self.lane = Lane(
                guard,
                collector,
                end,
                flights,
                loop,
                self.boundary_hooks,
                replays,
                facts,
                cadence,
                optimizer,
            )
            collector.on_step_start = self.lane.step_start
            loop.on_begin = self.lane.take
        loop.begin_step(0)

    def install(
        self, handles: hooks.Handles, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, scaler: Any
    ) -> None:
        """Every hook and wrapped method on the user's objects, each undone by ``handles.remove()``."""
        collector, boundary_hooks, lane = self.collector, self.boundary_hooks, self.lane
        # (the lane's hooks pass every call of a step it does not hold to the general path's)
        root_pre = lane.root_pre if lane is not None else collector.on_root_pre
        handles.add(model.register_forward_pre_hook(hooks.eager(root_pre), with_kwargs=True))
        if self.replays is not None:
            root_out = lane.root_out if lane is not None else self.replays.on_root_output
            handles.add(model.register_forward_hook(hooks.eager(root_out)))
        if collector.probe is not None:
            handles.on_remove(collector.probe.disarm)
        handles.on_remove(collector.unhook)
        if optimizer is not None:
            opt_pre, opt_post = boundary_hooks.on_opt_pre, boundary_hooks.on_opt_post
            if lane is not None:
                opt_pre, opt_post = lane.opt_pre, lane.opt_post
            handles.add(optimizer.register_step_pre_hook(opt_pre))
            handles.add(optimizer.register_step_post_hook(opt_post))
        if scaler is not None:
            hooks.wrap_method(handles, scaler, "scale", boundary_hooks.wrap_scale)
            hooks.wrap_method(handles, scaler, "update", boundary_hooks.wrap_update)

    def last_open(self) -> LateLoss | None:
        """The finished step a loss logged now joins: the lane's last clean step while its row waits, else the
        general path's (Flights.last_open). (Never both: the lane adds a row only while the flights are empty.)"""
        if self.lane is not None and self.lane.open:
            return self.lane
        return self.flights.last_open()

    def drain(self) -> None:
        """Every finished step to the writer, in order (close())."""
        if self.lane is not None:
            self.lane.flush()
        self.flights.drain()
