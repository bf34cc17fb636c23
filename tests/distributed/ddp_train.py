"""A small DDP training run for ``torchrun --nproc_per_node=2`` (gloo, CPU, FP16 autocast + GradScaler), with
faults injected on one rank only. Used by tests/distributed/test_torchrun.py; runnable by hand:

    torchrun --nproc_per_node=2 tests/distributed/ddp_train.py --out runs/ddp

Phase ``ddp`` (trace ``OUT/ddp-{rank}.db``): DistributedDataParallel; on ``--fault-rank`` one input element is
blown up to FP16 overflow at ``--nan-steps`` and every batch waits ``--slow-ms`` for its data (a straggling input
pipeline). Phase ``manual`` (trace ``OUT/manual.db``, no ``{rank}``: ampdoctor adds it): no DDP; gradients are
averaged by hand *after* ``scaler.unscale_`` (a real bug: each rank's scaler judged its own gradients before the
average), with the same overflow on ``--fault-rank``, so the ranks' loss scales part. Phase ``fixed`` (trace
``OUT/fixed-{rank}.db``): as ``manual``, but the backward-to-update lines are the code in ``--step-code`` (the fix a
diagnosis printed), run as written. Each phase also writes the scale GradScaler really had after every update to
``OUT/scales-PHASE-RANK.json``: the reference the traces are compared with.
"""

from __future__ import annotations

import json
import os
import time

import torch
import torch.distributed as dist
from rank_job import arguments, batches, mlp, run_phases

import ampdoctor


def train(phase: str, out: str, args, rank: int) -> None:
    model, data = mlp(), batches(args.steps, rank)
    net = torch.nn.parallel.DistributedDataParallel(model) if phase == "ddp" else model
    step_code = compile(open(args.step_code).read(), args.step_code, "exec") if phase == "fixed" else None
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    # the manual phase starts calibrated, so that its first divergence is the injected fault's
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16 if phase == "ddp" else 2.0**10)
    faulty = rank == args.fault_rank
    trace = os.path.join(out, {"ddp": "ddp-{rank}.db", "manual": "manual.db", "fixed": "fixed-{rank}.db"}[phase])
    scales = []
    with ampdoctor.attach(net, optimizer=opt, scaler=scaler, trace=trace, live=False):
        for step, (x, y) in enumerate(data):
            if faulty and phase == "ddp" and args.slow_ms:
                time.sleep(args.slow_ms / 1000)  # this rank's input pipeline is slow
            if faulty and step in args.nan_steps:
                x = x.clone()
                x[0, 0] = 1e6  # -> Inf in FP16 in the first Linear
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.float16):
                out_ = net(x)
            loss = torch.nn.functional.mse_loss(out_.float(), y)
            if step_code is not None:
                exec(
                    step_code,
                    {"scaler": scaler, "loss": loss, "model": model, "opt": opt, "dist": dist, "torch": torch},
                )
                scales.append(scaler.get_scale())
                continue
            scaler.scale(loss).backward()
            if phase == "manual":
                scaler.unscale_(opt)  # the bug: found_inf is judged per rank ...
                for p in model.parameters():  # ... before the gradients are averaged
                    dist.all_reduce(p.grad)
                    p.grad /= dist.get_world_size()
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
    with open(os.path.join(out, f"scales-{phase}-{rank}.json"), "w") as f:
        json.dump(scales, f)


def main() -> None:
    ap = arguments(steps=24, nan_steps=[6, 14], phases=["ddp", "manual"], step_code="phase fixed")
    ap.add_argument("--slow-ms", type=float, default=40.0)
    run_phases(train, ap.parse_args())


if __name__ == "__main__":
    main()
