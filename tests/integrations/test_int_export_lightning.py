"""The Lightning callback writes ampdoctor's figures and findings into the Trainer's own loggers (TensorBoard, CSV,
W&B offline, MLflow file store, in one real fit), read back with each package's reader; ``AMPDOCTOR=1`` adds the
callback to a Trainer whose code never mentions ampdoctor (the callbacks_factory entry point); ``halt_on`` stops
the Trainer (``should_stop``) with a checkpoint to resume from."""

import csv
import math

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, MLFlowLogger, TensorBoardLogger, WandbLogger
from lightning.pytorch.plugins.precision import MixedPrecision
from readback import mlflow_client, offline_backends, tb_scalars, tb_texts, tensorboard, wandb_run
from test_int_lightning import Regression, loader
from test_live import Attention

import ampdoctor
from ampdoctor.integrations.lightning import AmpDoctorCallback

LOG_EVERY = 2


class Overflowing(Regression):
    """test_live's attention without the 1/sqrt(d) scale (projections x200) in FP16: the forward pass overflows."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 32), Attention(), torch.nn.Linear(32, 1))


def sequences(n=64):
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(n, 16, 32, generator=g), torch.randn(n, 16, 1, generator=g))
    return torch.utils.data.DataLoader(data, batch_size=4)


def fit(tmp, module, callbacks=(), steps=8, **kw):
    trainer = pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        log_every_n_steps=LOG_EVERY,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        default_root_dir=str(tmp),
        callbacks=list(callbacks),
        **kw,
    )
    trainer.fit(module, sequences() if isinstance(module, Overflowing) else loader(64))
    return trainer


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pl_export")
    with offline_backends(tmp):
        import wandb

        loggers = [
            TensorBoardLogger(str(tmp), name="tb"),
            CSVLogger(str(tmp), name="csv"),
            WandbLogger(save_dir=str(tmp), offline=True),
            MLFlowLogger(tracking_uri=f"file://{tmp}/mlruns"),
        ]
        trainer = fit(
            tmp,
            Overflowing(),
            [AmpDoctorCallback(live=False)],
            logger=loggers,
            plugins=[MixedPrecision("16-mixed", "cpu")],
            enable_checkpointing=False,
        )
        wandb.finish()
        yield {
            "tmp": tmp,
            "trainer": trainer,
            "loggers": loggers,
            "trace": ampdoctor.load(tmp / "ampdoctor.db"),
            "wandb": wandb_run(str(tmp)),
            "client": mlflow_client(),
        }


def expected(tr):
    st = tr.steps()
    anomalous = set(st["step"][st["skipped"] | st["nonfinite"]].astype(int))
    return st, sorted({s for s in range(len(st)) if s % LOG_EVERY == 0} | anomalous)


def test_tensorboard_logger_gets_the_figures_at_lightnings_steps_and_the_findings(logged):
    st, steps = expected(logged["trace"])
    acc = tensorboard(logged["loggers"][0].log_dir)
    scale = tb_scalars(acc, "ampdoctor/loss_scale")
    assert sorted(scale) == steps
    assert [scale[s] for s in steps] == [float(st["loss_scale"][s]) for s in steps]
    # Lightning's own train_loss of step s and ampdoctor's loss of the trace's step s: one step axis
    own = tb_scalars(acc, "train_loss")
    loss = tb_scalars(acc, "ampdoctor/loss")
    for s in set(own) & set(loss):
        assert loss[s] == pytest.approx(own[s], rel=1e-5) or (math.isnan(loss[s]) and math.isnan(own[s]))
    assert set(own) & set(loss)
    assert tb_scalars(acc, "ampdoctor/skipped_total")[steps[-1]] == int(st["skipped"].sum()) > 0
    assert any("forward-overflow" in t for _, t in tb_texts(acc, "ampdoctor/findings"))


def test_any_other_logger_gets_the_figures_through_log_metrics(logged):
    st, steps = expected(logged["trace"])
    rows = list(csv.DictReader(open(f"{logged['loggers'][1].log_dir}/metrics.csv")))
    got = {int(r["step"]): float(r["ampdoctor/loss_scale"]) for r in rows if r.get("ampdoctor/loss_scale")}
    assert got == {s: float(st["loss_scale"][s]) for s in steps}


def test_wandb_logger_gets_the_figures_on_lightnings_step_axis(logged):
    st, steps = expected(logged["trace"])
    rows = [r for r in logged["wandb"]["history"] if "ampdoctor/loss_scale" in r]
    assert [r["trainer/global_step"] for r in rows] == steps
    assert [r["ampdoctor/loss_scale"] for r in rows] == [float(st["loss_scale"][s]) for s in steps]
    assert any(title.startswith("ampdoctor forward-overflow") for title, _, _ in logged["wandb"]["alerts"])


def test_mlflow_logger_gets_the_figures_and_the_findings_artifact(logged):
    st, steps = expected(logged["trace"])
    client, run_id = logged["client"], logged["loggers"][3].run_id
    hist = {m.step: m.value for m in client.get_metric_history(run_id, "ampdoctor/loss_scale")}
    assert hist == {s: float(st["loss_scale"][s]) for s in steps}
    path = client.download_artifacts(run_id, "ampdoctor/findings.md", str(logged["tmp"] / "dl"))
    assert "forward-overflow" in open(path).read()


def test_halt_on_stops_the_trainer_with_a_checkpoint(tmp_path):
    cb = AmpDoctorCallback(halt_on="critical")
    trainer = fit(tmp_path, Overflowing(), [cb], steps=2000, logger=False, plugins=[MixedPrecision("16-mixed", "cpu")])
    assert cb.halted is not None and cb.halted.rule == "forward-overflow"
    assert trainer.global_step < 2000 and trainer.should_stop
    ckpt = torch.load(cb.checkpoint, weights_only=False)
    assert ckpt["global_step"] == trainer.global_step  # resumable: fit(ckpt_path=cb.checkpoint)
    assert ampdoctor.load(tmp_path / "ampdoctor.db").n_steps == trainer.global_step


def test_ampdoctor_1_adds_the_callback_to_a_trainer_without_code(tmp_path, monkeypatch):
    monkeypatch.setenv("AMPDOCTOR", "1")
    monkeypatch.setenv("AMPDOCTOR_TRACE", str(tmp_path / "env.db"))
    monkeypatch.setenv("AMPDOCTOR_LIVE", "0")
    trainer = fit(tmp_path, Regression(), steps=3, logger=False, precision="bf16-mixed", enable_checkpointing=False)
    (cb,) = [c for c in trainer.callbacks if isinstance(c, AmpDoctorCallback)]
    assert cb.from_env
    assert ampdoctor.load(tmp_path / "env.db").n_steps == 3


def test_ampdoctor_1_with_the_callback_in_code_observes_once_and_0_switches_it_off(tmp_path, monkeypatch):
    monkeypatch.setenv("AMPDOCTOR", "1")
    mine = AmpDoctorCallback(trace=str(tmp_path / "mine.db"), live=False)
    trainer = fit(tmp_path, Regression(), [mine], steps=2, logger=False, enable_checkpointing=False)
    assert sum(isinstance(c, AmpDoctorCallback) for c in trainer.callbacks) == 2  # the user's and the entry point's
    assert ampdoctor.load(tmp_path / "mine.db").n_steps == 2
    assert not (tmp_path / "ampdoctor.db").exists()  # the entry point's stood aside
    monkeypatch.setenv("AMPDOCTOR", "0")
    off = AmpDoctorCallback(trace=str(tmp_path / "off.db"))
    fit(tmp_path, Regression(), [off], steps=2, logger=False, enable_checkpointing=False)
    assert off.doctor is None and not (tmp_path / "off.db").exists()
