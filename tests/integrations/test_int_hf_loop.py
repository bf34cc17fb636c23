"""Hugging Face models in a plain training loop: ModelOutput and tuple returns, past key values, integer inputs,
gradient checkpointing."""

import contextlib

import torch
from hf_models import SEQ, VOCAB, tiny  # transformers is in the test extra: a missing one fails, never skips

import ampdoctor

BATCH = 4


def ids(step):
    return torch.randint(2, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))


def past(output) -> dict:
    """The cache of the first half as the keyword this transformers version takes (``cache`` from 5.x on)."""
    cache = getattr(output, "cache", None)
    return {"cache": cache} if cache is not None else {"past_key_values": output.past_key_values}


def gpt2_loop(trace=None, steps=3, checkpointing=False, incremental=False, options=None):
    """GPT-2 trained on its own ModelOutput loss under BF16 autocast; ``incremental``: the second half of each
    sequence runs on the first half's past key values (two forwards per step)."""
    model, _ = tiny("gpt2")
    if checkpointing:
        model.gradient_checkpointing_enable()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    doc = ampdoctor.attach(model, optimizer=opt, trace=trace, live=False, **(options or {})) if trace else None
    losses = []
    with doc or contextlib.nullcontext():
        for step in range(steps):
            x = ids(step)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                if incremental:
                    first = model(input_ids=x[:, :4], use_cache=True)
                    out = model(input_ids=x[:, 4:], labels=x[:, 4:], **past(first))
                else:
                    out = model(input_ids=x, labels=x)
            opt.zero_grad()
            out.loss.backward()
            opt.step()
            losses.append(out.loss.item())
            if doc:
                doc.log_loss(out.loss)
    return model, losses


def test_modeloutput_past_key_values_and_integer_inputs(tmp_path):
    ref, ref_losses = gpt2_loop(incremental=True)
    got, losses = gpt2_loop(str(tmp_path / "t.db"), incremental=True, options={"every": 1})
    assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), got.parameters())) and losses == ref_losses
    tr = ampdoctor.load(tmp_path / "t.db")
    st = tr.steps()
    assert st["loss"].tolist() == losses
    # two forwards of the model per step; the batch size is read from the integer input_ids
    assert st["microbatches"].tolist() == [2] * 3 and st["samples"].tolist() == [2 * BATCH] * 3
    act = tr.sites("act").set_index("path")
    assert act.loc["(model)", "dtype"] == "bfloat16"  # the logits inside the ModelOutput
    assert {"transformer.h.0.attn", "lm_head", "transformer.wte"} <= set(act.index)
    assert "transformer.h.0.attn" in set(tr.sites("grad_out")["path"])
    assert (tr.records("numel", kind="act")[:, list(act.index).index("lm_head")] == 2 * BATCH * 4 * VOCAB).all()


def test_tuple_outputs(tmp_path):
    """return_dict=False: a tuple (loss, logits) instead of a ModelOutput."""
    model, _ = tiny("bert")
    model.config.return_dict = False
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    labels = torch.tensor([0, 1, 2, 1])
    with ampdoctor.attach(model, optimizer=opt, trace=str(tmp_path / "t.db"), live=False) as doc:
        for step in range(3):
            out = model(input_ids=ids(step), labels=labels)
            assert isinstance(out, tuple)
            opt.zero_grad()
            out[0].backward()
            opt.step()
            doc.log_loss(out[0])
    tr = ampdoctor.load(tmp_path / "t.db")
    assert tr.n_steps == 3 and tr.steps()["samples"].tolist() == [BATCH] * 3
    act = tr.sites("act")
    root = act[act["path"] == "(model)"]
    assert root["shape"].tolist() == [""]  # the site takes the first tensor's shape: the scalar loss
    assert "bert.encoder.layer.0.attention.self" in set(tr.sites("grad_out")["path"])


def test_gradient_checkpointing_records_what_a_plain_run_records(tmp_path):
    """Recomputed forwards during backward are not counted again: the same sites and numbers as without it."""
    plain, _ = gpt2_loop(str(tmp_path / "plain.db"), options={"every": 1})
    ckpt, _ = gpt2_loop(str(tmp_path / "ckpt.db"), checkpointing=True, options={"every": 1})
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), ckpt.parameters()))
    a, b = ampdoctor.load(tmp_path / "plain.db"), ampdoctor.load(tmp_path / "ckpt.db")
    for kind in ("act", "grad_out"):
        sa, sb = a.sites(kind), b.sites(kind)
        assert sa["path"].tolist() == sb["path"].tolist()
        for stat in ("numel", "absmax"):
            assert (a.records(stat, kind=kind) == b.records(stat, kind=kind)).all()
    assert b.steps()["microbatches"].tolist() == [1, 1, 1]
