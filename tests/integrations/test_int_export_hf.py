"""The Trainer callback writes ampdoctor's figures and findings where ``report_to`` sends the Trainer's own logs:
TensorBoard, W&B (offline) and MLflow (a file store), all three in one real Trainer run, read back with each
package's own reader; and a finding at ``halt_on`` stops the Trainer with a checkpoint instead of raising."""

import glob
import json
import math
import os

import pytest
import torch
import transformers
from hf_models import Examples, tiny
from readback import mlflow_client, mlflow_runs, offline_backends, tb_scalars, tb_texts, tensorboard, wandb_run

import ampdoctor
from ampdoctor.integrations.transformers import AmpDoctorCallback

STEPS, LOG_EVERY, FAULT_AT = 8, 2, 5  # the Trainer's global_step after which a weight blows up


class Fault(transformers.TrainerCallback):
    """A weight scaled to 1e38 after step FAULT_AT: the next forward overflows (inf, then NaN), as a run does whose
    weights diverged."""

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step == FAULT_AT:
            with torch.no_grad():
                model.transformer.h[0].mlp.c_fc.weight.mul_(1e38)


class Logs(transformers.TrainerCallback):
    def __init__(self):
        self.train = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if "loss" in logs:
            self.train.append((state.global_step, logs["loss"]))


def trainer(tmp, callbacks, report_to=(), steps=STEPS, **args):
    model, make = tiny("gpt2")
    targs = transformers.TrainingArguments(
        str(tmp / "out"),
        per_device_train_batch_size=2,
        max_steps=steps,
        use_cpu=True,
        bf16=True,
        logging_steps=LOG_EVERY,
        report_to=list(report_to),
        save_strategy="no",
        disable_tqdm=True,
        **args,
    )
    return transformers.Trainer(model=model, args=targs, train_dataset=Examples(make, 64), callbacks=callbacks)


@pytest.fixture(scope="module")
def reported(tmp_path_factory):
    """One Trainer run reporting to TensorBoard, W&B and MLflow at once, with ampdoctor and a fault."""
    tmp = tmp_path_factory.mktemp("hf_export")
    with offline_backends(tmp):
        import wandb

        logs = Logs()
        t = trainer(tmp, [AmpDoctorCallback(live=False), Fault(), logs], ("tensorboard", "wandb", "mlflow"))
        t.train()
        wandb.finish()
        client = mlflow_client()
        (run,) = mlflow_runs(client)
        yield {
            "tmp": tmp,
            "logs": logs,
            "trace": ampdoctor.load(tmp / "out" / "ampdoctor.db"),
            "client": client,
            "run": run,
            "wandb": wandb_run(str(tmp)),
        }


def exported_steps(n):
    """The Trainer's steps at which a figure is written: every logging step, and every anomalous step."""
    return lambda anomalous: sorted({s for s in range(1, n + 1) if s % LOG_EVERY == 0} | set(anomalous))


def expected(tr):
    """Trace step s -> the Trainer's step s + 1: the loss and skipped count the trace recorded."""
    st = tr.steps()
    anomalous = [int(s) + 1 for s in st["step"][st["nonfinite"] | st["skipped"]]]
    return st, exported_steps(len(st))(anomalous)


def critical(reported) -> list:
    """The run's critical findings, as ampdoctor.diagnose gives them for its trace (what every backend must show)."""
    found = [f for f in ampdoctor.diagnose(reported["tmp"] / "out" / "ampdoctor.db") if f.severity == "critical"]
    assert found  # the fault makes at least one
    return found


def same(a, b):
    return (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-6)


def test_tensorboard_gets_the_figures_next_to_the_trainers_own(reported):
    st, steps = expected(reported["trace"])
    logdir = os.path.dirname(
        next(
            os.path.join(d, f)
            for d, _, fs in os.walk(reported["tmp"] / "out" / "runs")
            for f in fs
            if f.startswith("events.out.tfevents")
        )
    )
    acc = tensorboard(logdir)  # the Trainer's run folder: its train/* and ampdoctor/* side by side
    assert "train/loss" in acc.Tags()["scalars"]
    loss = tb_scalars(acc, "ampdoctor/loss")
    assert sorted(loss) == steps
    for s in steps:
        assert same(loss[s], float(st["loss"][s - 1])), s
    # aligned with the Trainer: its logged loss at step 2k is the mean of the trace's losses of steps 2k-2, 2k-1
    hf = tb_scalars(acc, "train/loss")
    before = [s for s in hf if s <= FAULT_AT]
    assert before
    for s in before:
        assert hf[s] == pytest.approx(float(st["loss"][s - 2 : s].mean()), rel=1e-3)
    # the fault: NaN losses from the step after it, counted whatever the cadence
    assert math.isnan(loss[FAULT_AT + 1]) and tb_scalars(acc, "ampdoctor/nonfinite_total")[STEPS] >= 1
    texts = tb_texts(acc, "ampdoctor/findings")
    for f in critical(reported):
        assert any(f"CRITICAL {f.rule}" in t for _, t in texts), f.rule


def test_wandb_run_gets_figures_on_the_trainers_step_axis_a_findings_table_and_an_alert(reported):
    st, steps = expected(reported["trace"])
    rows = [r for r in reported["wandb"]["history"] if "ampdoctor/loss" in r]
    assert [r["train/global_step"] for r in rows] == steps
    for r in rows:
        s = r["train/global_step"]
        v = r["ampdoctor/loss"]
        assert same(float("nan") if v == "NaN" else float(v), float(st["loss"][s - 1])), s
    (table,) = [r for r in reported["wandb"]["history"] if "ampdoctor/findings/_type" in r][-1:]
    assert table["ampdoctor/findings/_type"] == "table-file"
    (path,) = glob.glob(str(reported["tmp"] / "wandb" / "offline-run-*" / "files" / table["ampdoctor/findings/path"]))
    found = json.load(open(path))
    assert found["columns"][:2] == ["severity", "rule"]
    alerts = reported["wandb"]["alerts"]  # wandb.alert for each critical finding, none for the others
    for f in critical(reported):
        assert ["critical", f.rule] in [row[:2] for row in found["data"]]
        assert f"ampdoctor {f.rule}: {f.title}" in [a[0] for a in alerts]
    assert len(alerts) == sum(row[0] == "critical" for row in found["data"])
    assert {level for _, _, level in alerts} == {"ERROR"}


def test_mlflow_run_gets_figures_at_the_trainers_steps_and_the_findings_artifact(reported):
    client, run = reported["client"], reported["run"]
    st, steps = expected(reported["trace"])
    assert [m.value for m in client.get_metric_history(run.info.run_id, "ampdoctor/skipped_total")] == [
        float(st["skipped"][:s].sum()) for s in steps
    ]
    hist = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "ampdoctor/loss")}
    assert sorted(hist) == steps
    trainer_steps = [m.step for m in client.get_metric_history(run.info.run_id, "loss")]
    assert set(trainer_steps) <= set(hist)  # the Trainer's own loss points all have ampdoctor's beside them
    path = client.download_artifacts(run.info.run_id, "ampdoctor/findings.md", str(reported["tmp"] / "dl"))
    text = open(path).read()
    assert all(f"CRITICAL {f.rule}" in text for f in critical(reported))
    assert "critical" in run.data.tags["ampdoctor/findings"]


def test_halt_on_stops_the_trainer_and_saves_a_checkpoint(tmp_path):
    cb = AmpDoctorCallback(halt_on="critical")
    # room for the live checks to come round on a loaded machine (they keep to 2% of the run's time): a run that
    # halts stops long before the last step
    t = trainer(tmp_path, [cb, Fault()], steps=4000)
    t.train()  # no TrainingHalted: the Trainer stops itself
    assert cb.halted is not None and cb.halted.severity == "critical"
    stopped = t.state.global_step
    assert FAULT_AT < stopped < 4000
    ckpt = tmp_path / "out" / f"checkpoint-{stopped}"
    assert (ckpt / "model.safetensors").exists() and (ckpt / "trainer_state.json").exists()
    assert ampdoctor.load(tmp_path / "out" / "ampdoctor.db").n_steps == stopped
