"""Small FSDP training runs for ``torchrun --nproc_per_node=2`` (gloo, CPU), observed by ampdoctor. Used by
tests/distributed/test_fsdp.py; runnable by hand:

    torchrun --nproc_per_node=2 tests/distributed/fsdp_train.py --out runs/fsdp

Phases (each writes ``OUT/PHASE-{rank}.db`` and, on rank 0, ``OUT/ref-PHASE.json``: the reference):
- ``bf16``: FSDP2 (``fully_shard`` per Linear and the root) with ``MixedPrecisionPolicy(param_dtype=bfloat16)``;
  on ``--fault-rank`` a corrupt sample (a row of 3e38) makes the forward overflow at ``--nan-steps``; the loop, as
  many do, drops the gradients of a step whose total norm is not finite before ``optimizer.step()``.
- ``fp16``: FSDP2 computing in FP16 with no loss scaler.
- ``fsdp1``: FSDP1 (``FullyShardedDataParallel``, flat parameters) with ``MixedPrecision(param_dtype=bfloat16)``.
- ``lonely``: only rank 1 attaches ampdoctor, observing every site every step and probing: a collective started by
  the observer would hang both ranks.
- ``fixed`` / ``fp16fixed``: as ``bf16`` (no fault) / ``fp16``, with the code a diagnosis printed (``--policy-code``:
  it defines ``mp_policy``; ``--scaler-code``: it defines ``scaler``; ``--step-code``: backward to update) run as
  printed.

The reference is computed here from the whole tensors (gathered by this script with FSDP's own collectives, after
``optimizer.step()``, where ampdoctor observes them): per step the global gradient norm and peak, and per parameter
the statistics of its whole gradient, weight and update, counted with real casts to FP16/BF16.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
from rank_job import arguments, batches, mlp, run_phases
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision, MixedPrecisionPolicy, fully_shard

import ampdoctor

WEIGHT_EVERY = 4
COMPARED = ("bf16", "fsdp1", "fsdp1orig", "hsdp")
SHORT = {"lonely": 6, "hsdp": 8, "fsdp1orig": 8, "fp16": 8, "fp16fixed": 8}  # steps of the phases that need fewer


def stats(t: torch.Tensor) -> dict:
    """What a whole tensor holds, computed independently of ampdoctor: counts, extremes, norms, what a real cast to
    FP16 / BF16 does to each value, and the binade histogram (floor(log2|x|), from frexp)."""
    f = t.detach().float().reshape(-1)
    finite = torch.isfinite(f)
    nonzero = finite & (f != 0)
    out = {
        "numel": f.numel(),
        "nan": int(torch.isnan(f).sum()),
        "inf": int(torch.isinf(f).sum()),
        "zeros": int((f == 0).sum()),
        "absmax": float(f[finite].abs().max()) if finite.any() else 0.0,
        "minabs": float(f[nonzero].abs().min()) if nonzero.any() else 0.0,
        "norm": float(f[finite].double().norm()),
        "sum": float(f[finite].double().sum()),
    }
    for name, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        c = f.to(dtype)
        tiny = torch.finfo(dtype).tiny  # the smallest normal
        out[f"{name}_over"] = int((finite & torch.isinf(c)).sum())
        out[f"{name}_flush"] = int((nonzero & (c == 0)).sum())
        out[f"{name}_sub"] = int((nonzero & (c != 0) & (c.abs() < tiny)).sum())
    exp = torch.frexp(f[nonzero])[1] - 1  # |x| = m * 2^e, 0.5 <= m < 1: binade e - 1
    out["hist"] = {str(int(e)): int(c) for e, c in zip(*torch.unique(exp.clamp(min=-127), return_counts=True))}
    return out


def data(steps: int, rank: int, args, fault: bool) -> list:
    out = batches(steps, rank)
    for step, (x, _) in enumerate(out):
        if fault and rank == args.fault_rank and step in args.nan_steps:
            # a corrupt sample (its target was computed before): finite in FP32 and BF16, the first Linear overflows
            x[0] = 3e38
    return out


def build(phase: str, args) -> tuple[torch.nn.Module, dict]:
    model = mlp()
    ns: dict = {"torch": torch}
    if phase in ("fsdp1", "fsdp1orig"):
        mp = MixedPrecision(param_dtype=torch.bfloat16)
        orig = phase == "fsdp1orig"
        return FullyShardedDataParallel(
            model, mixed_precision=mp, device_id=torch.device("cpu"), use_orig_params=orig
        ), ns
    if phase == "hsdp":  # two replicas of one shard each: a rank's shard is the whole tensor, held twice
        mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
        fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        return model, ns
    if phase in ("fixed", "fp16fixed") and args.policy_code:
        exec(compile(open(args.policy_code).read(), args.policy_code, "exec"), ns)
        mp = ns["mp_policy"]
    elif phase in ("fp16", "fp16fixed"):
        mp = MixedPrecisionPolicy(param_dtype=torch.float16)
    else:
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model, ns


def whole(model: torch.nn.Module, phase: str, grads: bool) -> dict:
    """name -> the whole tensor (every rank takes part: FSDP's collectives, in the training script)."""
    if phase == "fsdp1orig":
        with FullyShardedDataParallel.summon_full_params(model, with_grads=grads):
            return {
                n: (None if (p.grad if grads else p) is None else (p.grad if grads else p).detach().clone())
                for n, p in model.named_parameters()
            }
    if phase != "fsdp1":
        out = {}
        for name, p in model.named_parameters():
            t = p.grad if grads else p
            out[name] = None if t is None else t.full_tensor().detach().clone()
        return out
    out = {}
    for flat in model.parameters():  # a flat parameter: gather the padded shards, cut, split
        t = flat.grad if grads else flat.detach()
        if t is None:
            continue
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, t.contiguous())
        full = torch.cat(parts)[: sum(flat._numels)]
        for fqn, piece, shape in zip(flat._fqns, full.split(list(flat._numels)), flat._shapes):
            out[fqn] = piece.reshape(shape).clone()
    return out


def train(phase: str, out: str, args, rank: int) -> None:
    model, ns = build(phase, args)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = None
    if phase == "fp16fixed" and args.scaler_code:
        exec(compile(open(args.scaler_code).read(), args.scaler_code, "exec"), ns)
        scaler = ns["scaler"]
    step_code = compile(open(args.step_code).read(), args.step_code, "exec") if scaler is not None else None
    steps = SHORT.get(phase, args.steps)
    batches = data(steps, rank, args, fault=phase == "bf16")
    ref: dict = {"steps": {}}
    doctor = None
    if phase != "lonely" or rank == 1:
        opts = {"mode": "debug", "probe_every": 1} if phase == "lonely" else {"weight_every": WEIGHT_EVERY}
        doctor = ampdoctor.attach(
            model, optimizer=opt, scaler=scaler, trace=os.path.join(out, f"{phase}-{{rank}}.db"), live=False, **opts
        )
    for step, (x, y) in enumerate(batches):
        opt.zero_grad(set_to_none=True)
        out_ = model(x)
        loss = torch.nn.functional.mse_loss(out_.float(), y)
        if doctor is not None and scaler is None:
            doctor.log_loss(loss)
        if step_code is not None:
            exec(step_code, {**ns, "scaler": scaler, "loss": loss, "optimizer": opt})
            continue
        loss.backward()
        if phase == "bf16":
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e30)
            if not torch.isfinite(norm.full_tensor() if hasattr(norm, "full_tensor") else norm):
                opt.zero_grad(set_to_none=True)  # a non-finite step: its gradients are dropped
        if phase not in COMPARED:  # the phases whose statistics the test compares
            opt.step()
            continue
        before = whole(model, phase, grads=False) if step % WEIGHT_EVERY == 0 else None
        opt.step()
        grads, weights = whole(model, phase, grads=True), whole(model, phase, grads=False)
        # every rank computes the reference (a rank busy alone between steps would look like a straggler)
        present = [g for g in grads.values() if g is not None]
        flat = torch.cat([g.reshape(-1).double() for g in present]) if present else None
        rec = {
            "grad_norm": float(flat.norm()) if flat is not None else None,
            "grad_max": float(flat.abs().max()) if flat is not None else None,
            "grad": {n: stats(g) for n, g in grads.items() if g is not None},
            "weight": {n: stats(w) for n, w in weights.items()},
        }
        if before is not None:
            rec["update"] = {n: stats(weights[n] - before[n]) for n in weights}
        ref["steps"][step] = rec
    if doctor is not None:
        with open(os.path.join(out, f"active-{phase}-{rank}.json"), "w") as f:
            json.dump(doctor.active, f)  # collection never stopped
        doctor.close()
    if rank == 0:
        with open(os.path.join(out, f"ref-{phase}.json"), "w") as f:
            json.dump(ref, f)


def main() -> None:
    phases = ["bf16", "fp16", "fsdp1", "fsdp1orig", "hsdp", "lonely"]
    ap = arguments(steps=20, nan_steps=[5, 13], phases=phases, step_code="phase fp16fixed")
    ap.add_argument("--policy-code", default=None, help="phases fixed/fp16fixed: code that defines mp_policy")
    ap.add_argument("--scaler-code", default=None, help="phase fp16fixed: code that defines scaler")
    run_phases(train, ap.parse_args())


if __name__ == "__main__":
    main()
