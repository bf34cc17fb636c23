"""The clean step's short way (collect/lane.py) on tiny Hugging Face models: called with keyword arguments (the
general path's pre-hook reads such a call, the lane still carries the step), dropout, AdamW, a late loss, a finite
loss spike and an Inf in an embedding row, whose steps the lane lets go to the general path. The trace is the one
the general path alone writes (core.LANE off), row for row and event for event."""

from __future__ import annotations

import pytest
import torch
from hf_models import SEQ, VOCAB, tiny
from runs import comparable

import ampdoctor
from ampdoctor.collect import core

SPIKE, BAD = 22, 31


def train(kind, path, lane, monkeypatch):
    monkeypatch.setattr(core, "LANE", lane)
    model, _ = tiny(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(3)
    with ampdoctor.attach(model, optimizer=opt, trace=path, live=False) as doc:
        for step in range(40):
            ids = torch.randint(2, VOCAB, (4, SEQ), generator=g)
            labels = {"gpt2": ids, "t5": ids.flip(1), "bert": torch.randint(0, 3, (4,), generator=g)}[kind]
            if step == BAD:  # one token's embedding row goes Inf: that step is non-finite, the replay localises it
                with torch.no_grad():
                    model.get_input_embeddings().weight[ids[0, 0]] = float("inf")
            loss = model(input_ids=ids, labels=labels).loss * (1000.0 if step == SPIKE else 1.0)
            opt.zero_grad()
            loss.backward()
            opt.step()
            doc.log_loss(loss)
        return doc._core.lane


@pytest.mark.parametrize("kind", ["gpt2", "bert", "t5"])
def test_the_lane_writes_what_the_general_path_writes_on_hugging_face_models(tmp_path, monkeypatch, kind):
    lane = train(kind, str(tmp_path / "lane.db"), True, monkeypatch)
    assert train(kind, str(tmp_path / "general.db"), False, monkeypatch) is None
    (s1, e1), (s2, e2) = comparable(str(tmp_path / "lane.db")), comparable(str(tmp_path / "general.db"))
    # the lane carried the clean sentinel steps (not the calibration, sampled, anomalous and flight recorder ones)
    sentinel = int((s1["reason"] == "sentinel").sum())
    assert lane is not None and sentinel >= 8 and lane.carried >= sentinel - 2
    assert s1.equals(s2), s1.compare(s2)
    assert e1.equals(e2), (e1, e2)
    assert (e1["kind"] == "loss_spike").any() and s1.loc[s1["step"] == BAD, "nonfinite"].item()
    assert (e1["step"] == BAD).any()
