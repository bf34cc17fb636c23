"""make demo: a small model trained in FP16 autocast with a GradScaler on the CPU, ampdoctor attached.

The init scale is left at PyTorch's default (2^16); the first steps show the scaler calibrating. Writes
runs/demo.db (an existing one is kept: ampdoctor writes runs/demo-1.db instead and says so).
"""
import os
import sys

import torch

import ampdoctor


def main(path="runs/demo.db", steps=300):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.LayerNorm(128), torch.nn.GELU(),
        torch.nn.Linear(128, 128), torch.nn.LayerNorm(128), torch.nn.GELU(),
        torch.nn.Linear(128, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scaler = torch.amp.GradScaler("cpu")
    w = torch.randn(64, 10)
    with ampdoctor.attach(model, optimizer=opt, scaler=scaler, trace=path, every=20, hist_every=40) as doctor:
        for step in range(steps):
            x = torch.randn(128, 64)
            y = (x @ w).argmax(dim=1)
            with torch.autocast("cpu", dtype=torch.float16):
                logits = model(x)
            loss = torch.nn.functional.cross_entropy(logits.float(), y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            if step % 50 == 49:
                with torch.no_grad():
                    xv = torch.randn(512, 64)
                    acc = (model(xv).argmax(1) == (xv @ w).argmax(1)).float().mean()
                doctor.log_metric("val/acc", acc)
    print(f"wrote {doctor.path} ({steps} steps)")
    return doctor.path


if __name__ == "__main__":
    out = main(*sys.argv[1:2])
    with open(os.environ.get("AMPDOCTOR_DEMO_OUT", os.devnull), "w") as f:
        f.write(out)
