"""The no-code switch: ampdoctor.auto() and the callbacks under AMPDOCTOR=1 / 0 and the AMPDOCTOR_* variables;
invalid values are one warning line each; the docs list every variable."""

import os
import warnings

import pytest
import torch
import transformers
from hf_models import Examples, tiny
from runs import batches, mlp

import ampdoctor
from ampdoctor.collect.session import Doctor
from ampdoctor.integrations import env as E
from ampdoctor.integrations.transformers import AmpDoctorCallback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def loop(doctor, model, opt, n=4):
    for x, y in batches(n):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        doctor.log_loss(loss)


def public(cls) -> set:
    return {n for n in dir(cls) if not n.startswith("_")}


def test_auto_is_a_no_op_with_the_doctors_public_methods_unless_switched_on(tmp_path, monkeypatch):
    monkeypatch.delenv("AMPDOCTOR", raising=False)
    monkeypatch.chdir(tmp_path)
    model = mlp(width=16)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with ampdoctor.auto(model, optimizer=opt) as doc:
        loop(doc, model, opt)
    assert isinstance(doc, E.NoDoctor) and not doc.active and doc.findings == [] and doc.n_steps == 0
    assert not os.path.exists("runs") and not any(m._forward_pre_hooks for m in model.modules())
    methods = {n for n in public(Doctor) if callable(getattr(Doctor, n)) or isinstance(getattr(Doctor, n), property)}
    attributes = {"model", "optimizer", "scaler", "guard"}  # (guard: the core's shared switch, not for users)
    assert methods - attributes <= public(E.NoDoctor)


def test_auto_with_ampdoctor_1_attaches_with_the_environments_options(tmp_path, monkeypatch):
    monkeypatch.setenv("AMPDOCTOR", "1")
    monkeypatch.setenv("AMPDOCTOR_TRACE", str(tmp_path / "env.db"))
    monkeypatch.setenv("AMPDOCTOR_MODE", "debug")
    monkeypatch.setenv("AMPDOCTOR_LIVE", "0")
    monkeypatch.setenv("AMPDOCTOR_EXPORT", f"csv:{tmp_path / 'csv'}")
    monkeypatch.setenv("AMPDOCTOR_EXPORT_EVERY", "2")
    model = mlp(width=16)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with ampdoctor.auto(model, optimizer=opt, mode="default", trace=str(tmp_path / "code.db")) as doc:
        loop(doc, model, opt, n=5)
    assert isinstance(doc, Doctor) and doc.mode == "debug" and doc.path == str(tmp_path / "env.db")
    assert doc._live is None  # AMPDOCTOR_LIVE=0
    tr = ampdoctor.load(tmp_path / "env.db")
    assert tr.meta["run"]["mode"] == "debug" and tr.n_steps == 5
    steps = [ln.split(",")[0] for ln in open(tmp_path / "csv" / "steps.csv").read().splitlines()[1:]]
    assert steps == ["0", "2", "4"]
    assert not (tmp_path / "code.db").exists()


@pytest.mark.parametrize(
    "name, value, message",
    [
        (
            "AMPDOCTOR",
            "maybe",
            "AMPDOCTOR='maybe' is not valid (one of 1, true, yes, on, 0, false, no, off); ampdoctor stays off",
        ),
        ("AMPDOCTOR_MODE", "dbg", "AMPDOCTOR_MODE='dbg' is not valid (default or debug); ignored"),
        ("AMPDOCTOR_EVERY", "ten", "AMPDOCTOR_EVERY='ten' is not valid (a positive integer); ignored"),
        (
            "AMPDOCTOR_HALT_ON",
            "fatal",
            "AMPDOCTOR_HALT_ON='fatal' is not valid (one of info, warning, critical or none); ignored",
        ),
        ("AMPDOCTOR_EXPORT", "tensorbord", "AMPDOCTOR_EXPORT='tensorbord' is not valid"),
        ("AMPDOCTOR_EXPORT_EVERY", "-3", "AMPDOCTOR_EXPORT_EVERY='-3' is not valid (a positive integer); ignored"),
    ],
)
def test_an_invalid_value_is_one_warning_line_and_the_rest_still_applies(name, value, message):
    env = {"AMPDOCTOR": "1", "AMPDOCTOR_MODE": "debug", name: value}
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        got = E.read(env)
    (line,) = [str(x.message) for x in w]
    assert line.startswith("ampdoctor: " + message) and "\n" not in line
    assert got.switch is (name != "AMPDOCTOR")
    if name != "AMPDOCTOR_MODE":
        assert got.options["mode"] == "debug"


def test_trainer_callback_follows_the_environment(tmp_path, monkeypatch):
    """In the callback list, the callback is switched off by AMPDOCTOR=0 and configured by the variables."""

    def run(sub):
        model, make = tiny("gpt2")
        cb = AmpDoctorCallback(live=False)
        args = transformers.TrainingArguments(
            str(tmp_path / sub),
            per_device_train_batch_size=2,
            max_steps=2,
            use_cpu=True,
            report_to=[],
            save_strategy="no",
            disable_tqdm=True,
        )
        transformers.Trainer(model=model, args=args, train_dataset=Examples(make, 4), callbacks=[cb]).train()
        return cb

    monkeypatch.setenv("AMPDOCTOR", "0")
    assert run("off").doctor is None and not (tmp_path / "off" / "ampdoctor.db").exists()
    monkeypatch.setenv("AMPDOCTOR", "1")
    monkeypatch.setenv("AMPDOCTOR_TRACE", str(tmp_path / "hf.db"))
    monkeypatch.setenv("AMPDOCTOR_MODE", "debug")
    cb = run("on")
    assert cb.doctor.mode == "debug" and ampdoctor.load(tmp_path / "hf.db").n_steps == 2


def test_docs_list_every_variable():
    text = open(os.path.join(ROOT, "docs", "integrations.md"), encoding="utf-8").read()
    assert [v for v in E.VARIABLES if f"`{v}" not in text] == []
