"""ampdoctor's cost on an FSDP2 model against the same model unsharded (FP32), in one process (a gloo group of one rank,
so that no other process's pace enters the figures): bare training and training with ampdoctor attached
(default mode) interleave in rounds, each variant's steps timed in blocks; printed per model: the median of the
per-round ratios (observed / bare), and the host microseconds ampdoctor adds per step. What the FSDP side adds on
top of an unsharded run is the gap between the two ratios (the shards' local views, the per-parameter proxies).

    python benchmarks/fsdp_overhead.py [--rounds 7] [--steps 40] [--layers 8] [--width 256]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import ampdoctor


def model(layers: int, width: int, shard: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Sequential(
        *[torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU()) for _ in range(layers)]
    )
    if shard:
        for block in m:  # FP32 (FSDP's default policy): the figures are the observer's, not the CPU's BF16
            fully_shard(block)
        fully_shard(m)
    return m


def block(m, opt, x, steps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = m(x).square().mean()
        loss.backward()
        opt.step()
    return (time.perf_counter() - t0) / steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=256)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp()
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
    x = torch.randn(64, args.width)
    runs = {}
    for name, shard in (("fsdp2", True), ("plain", False)):
        for observed in (False, True):
            m = model(args.layers, args.width, shard)
            opt = torch.optim.SGD(m.parameters(), lr=1e-3)
            doc = (
                ampdoctor.attach(m, optimizer=opt, trace=os.path.join(tmp, f"{name}.db"), live=False)
                if observed
                else None
            )
            block(m, opt, x, 15)  # warm-up, ampdoctor's calibration steps included
            runs[(name, observed)] = (m, opt, doc, [])
    for _ in range(args.rounds):
        for m, opt, _, times in runs.values():
            times.append(block(m, opt, x, args.steps))
    print(f"{args.layers} x Linear({args.width}) + ReLU, batch 64, FP32, {args.rounds} rounds of {args.steps} steps")
    for name in ("fsdp2", "plain"):
        bare, seen = runs[(name, False)][3], runs[(name, True)][3]
        ratios = [s / b for s, b in zip(seen, bare)]
        added = statistics.median(s - b for s, b in zip(seen, bare)) * 1e6
        ratio = statistics.median(ratios)
        ms = statistics.median(bare) * 1e3
        print(f"{name:6s} bare {ms:7.3f} ms/step, with ampdoctor x{ratio:.3f} (+{added:.0f} us/step)")
    for _, _, doc, _ in runs.values():
        if doc is not None:
            doc.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
