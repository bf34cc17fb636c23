"""Tiny Hugging Face models (GPT-2, BERT, T5) built from configs with random weights, trained on the CPU in a plain
loop with ampdoctor attached. No downloads: every model comes from a config. FP16 models stay <= 64 wide."""

from __future__ import annotations

import contextlib

import torch

import ampdoctor

VOCAB, SEQ, BATCH = 128, 8, 4
MAX_POS = 16  # positions the models hold: a run may use sequences up to this long
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": None}
FAST = {"every": 2, "hist_every": 2, "weight_every": 2}  # dense cadence for short runs


def gpt2(seed=0, **over):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = dict(vocab_size=VOCAB, n_positions=MAX_POS, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(GPT2Config(**{**cfg, **over}))


def bert(seed=0, **over):
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(seed)
    cfg = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=MAX_POS,
    )
    return BertForMaskedLM(BertConfig(**{**cfg, **over}))


def t5(seed=0, **over):
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(seed)
    cfg = dict(
        vocab_size=VOCAB,
        d_model=32,
        d_kv=16,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=2,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    return T5ForConditionalGeneration(T5Config(**{**cfg, **over}))


MODELS = {"gpt2": gpt2, "bert": bert, "t5": t5}


def batch(name, g, size=BATCH, seq=SEQ):
    """One batch of token ids with labels, as the model's forward takes them (a learnable pattern: a shifted copy)."""
    ids = torch.randint(1, VOCAB, (size, seq), generator=g)
    if name == "t5":
        return {"input_ids": ids, "labels": torch.roll(ids, 1, dims=1)}
    return {"input_ids": ids, "labels": ids.clone()}


def train(
    model_name,
    trace=None,
    *,
    steps=20,
    precision="fp16",
    scaler=True,
    init_scale=2.0**16,
    growth_interval=2000,
    lr=1e-3,
    optimizer="adamw",
    eps=1e-8,
    half=False,
    model=None,
    setup=None,
    attach=None,
    seed=1,
    size=BATCH,
    seq=SEQ,
):
    """Train one of MODELS with loss = model(**batch).loss; returns (losses, model, optimizer, scaler).

    ``setup(ns)`` runs after model, optimizer and scaler exist (ns holds them by name: model, optimizer, scaler,
    torch) and may replace any of them: it is how a printed fix is applied as printed.
    """
    model = model if model is not None else MODELS[model_name]()
    if half:
        model = model.half()
    opt = (
        torch.optim.AdamW(model.parameters(), lr=lr, eps=eps)
        if optimizer == "adamw"
        else torch.optim.SGD(model.parameters(), lr=lr)
    )
    sc = (
        torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
        if scaler and precision == "fp16"
        else None
    )
    ns = {"model": model, "optimizer": opt, "scaler": sc, "torch": torch, "ampdoctor": ampdoctor, "lr": lr}
    if setup is not None:
        setup(ns)
    model, opt, sc = ns["model"], ns["optimizer"], ns["scaler"]
    dtype = DTYPES[precision]
    g = torch.Generator().manual_seed(seed)
    doc = (
        ampdoctor.attach(model, optimizer=opt, scaler=sc, trace=trace, **{**FAST, **(attach or {})})
        if trace is not None
        else contextlib.nullcontext()
    )
    losses = []
    with doc:
        for _ in range(steps):
            b = batch(model_name, g, size, seq)
            opt.zero_grad(set_to_none=True)
            ctx = torch.autocast("cpu", dtype=dtype) if dtype is not None else contextlib.nullcontext()
            with ctx:
                loss = model(**b).loss
            losses.append(float(loss.detach()))
            if sc is not None:
                sc.scale(loss).backward()
                sc.step(opt)
                sc.update()
            else:
                loss.backward()
                if trace is not None:
                    doc.log_loss(loss)
                opt.step()
            if ns.get("scheduler") is not None:
                ns["scheduler"].step()
    return losses, model, opt, sc


def run(tmp, tag, model_name, **kw):
    """Train with ampdoctor attached into a new trace under ``tmp``; returns (trace path, losses)."""
    path = str(tmp / f"{tag}.db")
    losses, *_ = train(model_name, path, **kw)
    return path, losses


def serious(path, **kw):
    """The findings a CI gate fails on (`diagnose --fail-on warning`)."""
    return [d for d in ampdoctor.diagnose(path, **kw) if d.severity != "info"]
