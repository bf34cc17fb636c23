"""What the torchrun training scripts (ddp_train.py, fsdp_train.py) share: the model, each rank's data, the command
line, and the phases run one after the other on a gloo process group (one CPU thread per rank)."""

from __future__ import annotations

import argparse
from typing import Callable

import torch
import torch.distributed as dist


def mlp() -> torch.nn.Sequential:
    """The same initial weights on every rank (DDP also broadcasts them; FSDP shards them)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)
    )


def batches(steps: int, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each rank its own shard of the data: 16 samples of 16 features a step, a linear target."""
    g = torch.Generator().manual_seed(100 + rank)
    w = torch.randn(16, 1, generator=g)
    out = []
    for _ in range(steps):
        x = torch.randn(16, 16, generator=g)
        out.append((x, x @ w))
    return out


def arguments(steps: int, nan_steps: list[int], phases: list[str], step_code: str) -> argparse.ArgumentParser:
    """The options both scripts take (a script adds its own): where to write, how long, the faulty rank and steps,
    the phases, and the backward-to-update lines a diagnosis printed (``step_code``: which phase runs them)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--fault-rank", type=int, default=1)
    ap.add_argument("--nan-steps", type=int, nargs="*", default=nan_steps)
    ap.add_argument("--phases", nargs="+", default=phases)
    ap.add_argument("--step-code", default=None, help=f"{step_code}: the lines from backward() to update()")
    return ap


def run_phases(train: Callable[[str, str, argparse.Namespace, int], None], args: argparse.Namespace) -> None:
    """``train(phase, out, args, rank)`` for each phase in turn, every rank together (torchrun's environment)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        for phase in args.phases:
            train(phase, args.out, args, dist.get_rank())
            dist.barrier()
    finally:
        dist.destroy_process_group()
