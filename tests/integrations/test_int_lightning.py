"""Lightning with AmpDoctorCallback ("bf16-mixed", and "16-mixed" through an explicit CPU MixedPrecision plugin,
since Lightning turns precision="16-mixed" on the CPU into bf16), and a LightningModule attached by hand."""

import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision

import ampdoctor
from ampdoctor.integrations.lightning import AmpDoctorCallback

BATCH = 4


class Regression(pl.LightningModule):
    """training_step calls the inner network: the LightningModule's own forward never runs."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
        self.losses = []

    def training_step(self, batch, i):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x).float(), y)
        self.losses.append(loss.item())
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, i):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x).float(), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def loader(n=32):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 8, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=BATCH)


def fit(tmp_path, module, callbacks, steps=4, accumulation=2, **kwargs):
    trainer = pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        accumulate_grad_batches=accumulation,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=1,
        val_check_interval=steps * accumulation,
        log_every_n_steps=1,
        num_sanity_val_steps=0,
        default_root_dir=str(tmp_path),
        callbacks=callbacks,
        **kwargs,
    )
    trainer.fit(module, loader(), loader(8))
    return trainer


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_lightning_callback_records_steps_losses_metrics_and_scaler(tmp_path, precision):
    module, cb = Regression(), AmpDoctorCallback(live=False)
    kwargs = {"precision": precision} if precision == "bf16-mixed" else {"plugins": [MixedPrecision("16-mixed", "cpu")]}
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        trainer = fit(tmp_path, module, [cb], **kwargs)
    assert not [x for x in w if "ampdoctor" in str(x.message)]
    tr = ampdoctor.load(tmp_path / "ampdoctor.db")  # the default: in default_root_dir
    st = tr.steps()
    assert tr.n_steps == trainer.global_step == 4
    assert st["microbatches"].tolist() == [2] * 4 and st["samples"].tolist() == [2 * BATCH] * 4
    # the loss Lightning backpropagates: each micro-batch's loss / accumulate_grad_batches, summed over the step
    per_step = [sum(module.losses[2 * k : 2 * k + 2]) / 2 for k in range(4)]
    assert st["loss"].tolist() == pytest.approx(per_step, rel=1e-6)
    # the LightningModule's forward never ran: the callback marked the batches, so the data wait is measured
    assert tr.config["step_start"] == "begin_batch" and st["data_time"].notna().all()
    dtype = "bfloat16" if precision == "bf16-mixed" else "float16"
    assert tr.config["autocast"] == {"device_type": "cpu", "enabled": True, "dtype": dtype}
    if precision == "16-mixed":
        scaler = trainer.precision_plugin.scaler
        assert tr.config["scaler"]["class"] == "GradScaler" and st["loss_scale"].notna().all()
        assert st["loss_scale_next"].iloc[-1] == scaler.get_scale()
    else:
        assert "scaler" not in tr.config
    m = tr.metrics()
    assert set(m["name"]) == {"train_loss", "val_loss"}
    val = m[m["name"] == "val_loss"]
    assert val["value"].tolist() == [pytest.approx(trainer.callback_metrics["val_loss"].item())]
    assert val["step"].tolist() == [3]
    assert len(m[m["name"] == "train_loss"]) == 4  # one per optimizer step (log_every_n_steps=1)
    assert not cb.doctor.active and not any(x._forward_hooks for x in module.modules())


class AttachByHand(pl.Callback):
    """What users wrote before the callback existed: attach to the LightningModule with Lightning's optimizer."""

    def on_train_start(self, trainer, pl_module):
        opt = pl_module.optimizers()  # a LightningOptimizer wrapping the torch optimizer
        from lightning.pytorch.core.optimizer import LightningOptimizer

        self.wrapped = isinstance(opt, LightningOptimizer)
        self.doctor = ampdoctor.attach(
            pl_module, optimizer=opt, trace=str(trainer.default_root_dir) + "/hand.db", live=False
        )

    def on_train_end(self, trainer, pl_module):
        self.doctor.close()


def test_lightning_module_attached_by_hand_warns_and_time_rules_stay_silent(tmp_path):
    hand = AttachByHand()
    with pytest.warns(RuntimeWarning, match=r"Regression.forward was never called.*AmpDoctorCallback"):
        trainer = fit(tmp_path, Regression(), [hand], steps=8, accumulation=1, precision="bf16-mixed")
    assert hand.wrapped
    tr = ampdoctor.load(tmp_path / "hand.db")
    st = tr.steps()
    assert tr.n_steps == trainer.global_step == 8
    assert st["data_time"].isna().all() and st["samples"].isna().all()
    rules = [f.rule for f in ampdoctor.diagnose(tr)]
    assert "input-pipeline-bound" not in rules
    assert tr.config["autocast"]["enabled"] is True  # found inside training_step's autocast
    assert tr.config["optimizer"]["class"] == "SGD"  # the torch optimizer inside Lightning's wrapper


class TwoOptimizers(Regression):
    """Manual optimization with two optimizers (a GAN's pattern): one recorded step per training batch."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, i):
        x, y = batch
        for opt in self.optimizers():
            loss = torch.nn.functional.mse_loss(self.net(x).float(), y)
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
        self.losses.append(loss.item())

    def configure_optimizers(self):
        return [torch.optim.SGD(self.net[0].parameters(), lr=0.05), torch.optim.SGD(self.net[2].parameters(), lr=0.05)]


def test_lightning_callback_with_two_optimizers_records_one_step_per_batch(tmp_path):
    module = TwoOptimizers()
    trainer = fit(tmp_path, module, [AmpDoctorCallback(live=False)], steps=6, accumulation=1, precision="bf16-mixed")
    tr = ampdoctor.load(tmp_path / "ampdoctor.db")
    assert trainer.global_step == 6 and tr.n_steps == 3  # Lightning counts each optimizer's step
    assert tr.config["boundary"] == "manual" and tr.steps()["microbatches"].tolist() == [1, 1, 1]
