"""The Hugging Face Trainer with AmpDoctorCallback, on tiny GPT-2, BERT and T5 models built from configs (no
downloads), and accelerate's wrapped optimizer in a plain FP16 loop. transformers, accelerate and lightning are in
the test extra: a missing one fails these tests, never skips them."""

import pytest
import torch
import transformers
from hf_models import Examples, tiny

import ampdoctor
from ampdoctor.integrations.transformers import AmpDoctorCallback
from ampdoctor.precision_label import describe_precision


class Logs(transformers.TrainerCallback):
    """What the Trainer itself reports, to compare the trace with."""

    def __init__(self):
        self.train, self.eval = [], []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if "loss" in logs:
            self.train.append(logs)

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.eval.append(dict(metrics))


def run_trainer(tmp_path, kind, steps=3, accumulation=2, **args):
    model, make = tiny(kind)
    cb, logs = AmpDoctorCallback(live=False), Logs()
    targs = transformers.TrainingArguments(
        str(tmp_path / "out"),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=accumulation,
        max_steps=steps,
        use_cpu=True,
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=steps,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        learning_rate=1e-3,
        **args,
    )
    trainer = transformers.Trainer(
        model=model, args=targs, train_dataset=Examples(make), eval_dataset=Examples(make, 4), callbacks=[cb, logs]
    )
    hooks_before = sum(len(m._forward_hooks) for m in model.modules())
    trainer.train()
    return trainer, cb, logs, hooks_before


@pytest.mark.parametrize("kind", ["gpt2", "bert", "t5"])
def test_trainer_bf16_records_each_optimizer_step_loss_and_eval_metrics(tmp_path, kind):
    trainer, cb, logs, hooks_before = run_trainer(tmp_path, kind, bf16=True)
    tr = ampdoctor.load(tmp_path / "out" / "ampdoctor.db")  # the default: in the Trainer's output_dir
    st = tr.steps()
    # one trace step per optimizer step, each of 2 micro-batches of 2 examples
    assert tr.n_steps == trainer.state.global_step == 3
    assert st["microbatches"].tolist() == [2, 2, 2] and st["samples"].tolist() == [4, 4, 4]
    # the loss the Trainer trained on and logged, step by step (no GradScaler: read from the model's output)
    assert st["loss"].tolist() == pytest.approx([log["loss"] for log in logs.train], rel=1e-6)
    # the norm of the gradients the optimizer applied: after the Trainer's clipping to max_grad_norm (it logs the
    # norm before clipping)
    clip = trainer.args.max_grad_norm
    assert st["grad_norm"].tolist() == pytest.approx([min(log["grad_norm"], clip) for log in logs.train], rel=1e-4)
    m = tr.metrics()
    for name, value in logs.eval[-1].items():
        row = m[m["name"] == name]
        assert row["value"].tolist() == [pytest.approx(value)] and row["step"].tolist() == [2]
    # autocast is entered inside forward by accelerate: still an O1 run
    assert tr.config["autocast"] == {"device_type": "cpu", "enabled": True, "dtype": "bfloat16"}
    assert describe_precision(tr.config) == "O1-style: autocast bfloat16, FP32 master weights"
    assert "bfloat16" in set(tr.sites("act")["dtype"])
    assert tr.config["optimizer"]["class"] == "AdamW"  # the torch optimizer inside accelerate's wrapper
    # closed at the end: nothing of ampdoctor left on the model or the optimizer
    assert not cb.doctor.active
    assert sum(len(m._forward_hooks) for m in trainer.model.modules()) == hooks_before
    assert not trainer.optimizer.optimizer._optimizer_step_post_hooks


def test_trainer_fp16_on_cpu_trains_fp32_and_the_trace_says_so(tmp_path):
    """accelerate enables FP16 autocast and its GradScaler only on accelerators: on the CPU ``fp16=True`` trains in
    FP32 without a scaler, and the trace reports what really ran."""
    _trainer, _cb, _logs, _ = run_trainer(tmp_path, "gpt2", steps=2, accumulation=1, fp16=True)
    tr = ampdoctor.load(tmp_path / "out" / "ampdoctor.db")
    assert tr.n_steps == 2 and tr.config["autocast"]["enabled"] is False and "scaler" not in tr.config
    assert describe_precision(tr.config).startswith("O0")


def test_accelerated_optimizer_with_gradscaler_fp16_plain_loop(tmp_path):
    """attach() takes accelerate's AcceleratedOptimizer: steps come from the torch optimizer inside, the GradScaler
    it carries is adopted, skipped steps are seen, and training is bit-identical to a run without ampdoctor."""
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer

    Accelerator(cpu=True)  # the state accelerate's optimizer reads

    def run(trace):
        model, make = tiny("gpt2")
        ds = Examples(make, 12)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**17, growth_interval=3)
        opt = AcceleratedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), scaler=scaler)
        doc = ampdoctor.attach(model, optimizer=opt, trace=trace, live=False) if trace else None
        skipped = []
        for i in range(0, 12, 2):
            batch = {k: torch.stack([ds[j][k] for j in (i, i + 1)]) for k in ("input_ids", "labels")}
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(**batch).loss
            opt.zero_grad()
            scaler.scale(loss).backward()
            opt.step()  # scaler.step(optimizer) and scaler.update() inside
            skipped.append(opt.step_was_skipped)
        if doc:
            doc.close()
        return model, skipped

    ref, _ = run(None)
    got, skipped = run(str(tmp_path / "t.db"))
    assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), got.parameters()))
    tr = ampdoctor.load(tmp_path / "t.db")
    assert tr.steps()["skipped"].tolist() == skipped and any(skipped) and not all(skipped)
    assert tr.config["scaler"]["class"] == "GradScaler" and tr.config["scaler"]["init_scale"] == 2.0**17
    assert tr.steps()["loss"].notna().all()


def test_importing_ampdoctor_imports_no_framework():
    import subprocess
    import sys

    code = (
        "import sys, ampdoctor, ampdoctor.collect.session, ampdoctor.integrations; "
        "print(sorted(m for m in ('transformers', 'accelerate', 'lightning', 'pytorch_lightning') "
        "if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
