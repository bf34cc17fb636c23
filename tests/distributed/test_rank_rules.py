"""The rank rules and the run loader on what torchrun's environment makes of separate processes: each "rank" is a
real FP16 + GradScaler training run with RANK / WORLD_SIZE set as torchrun sets them (no process group: ranks that
do not wait for each other), one of them different."""

from __future__ import annotations

import time

import pytest
import torch
from runs import batches, mlp, train

import ampdoctor
from ampdoctor.cli import main as cli

STEPS = 8


class Slow(torch.nn.Module):
    """An activation that takes 300 ms more per call: a rank on a slower device (several times the FP16 step of the
    others on a CPU, even a loaded one: FP16 matmuls run slowly there)."""

    def forward(self, x):
        time.sleep(0.3)
        return torch.relu(x)


@pytest.fixture(scope="module", autouse=True)
def warm(tmp_path_factory):
    """The first observed FP16 run of a process pays for kernel and hook set-up over several steps: not what a
    rank is compared on."""
    train(
        mlp(width=32, depth=2),
        STEPS,
        precision="fp16",
        trace=str(tmp_path_factory.mktemp("warm") / "w.db"),
        attach_options={"live": False},
    )


def late(data, seconds):
    """A loader that takes ``seconds`` per batch: a rank whose input pipeline is slow."""
    for batch in data:
        time.sleep(seconds)
        yield batch


def rank_run(monkeypatch, path, rank, world, *, slow=False, slow_data=False, init_scale=2.0**10, run_id="job-a"):
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("LOCAL_RANK", str(rank))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", run_id)
    model = mlp(width=32, depth=2, seed=0)
    if slow:
        model[1] = Slow()
    train(
        model,
        STEPS,
        precision="fp16",
        init_scale=init_scale,
        trace=str(path),
        attach_options={"live": False},
        data=late(batches(STEPS, seed=1 + rank), 0.1 if slow_data else 0.0),
    )


def test_healthy_ranks_get_no_rank_finding_and_a_missing_rank_is_reported(tmp_path, monkeypatch, capsys):
    for r in (0, 1):
        rank_run(monkeypatch, tmp_path / "ok-{rank}.db", r, 3)
    rr = ampdoctor.load_run(tmp_path)
    assert rr.ranks == [0, 1] and rr.world_size == 3 and list(map(str, rr.missing)) == ["2"]
    # (rank-straggler is not asked here: these ranks run one after the other on a shared machine, not under one
    # load; the torchrun test asks it of two concurrent healthy ranks)
    assert not [d for d in ampdoctor.diagnose(tmp_path) if d.rule in ("rank-nonfinite", "rank-scale-divergence")]
    assert cli(["info", str(tmp_path)]) == 0
    assert "missing    no trace for rank(s) 2" in capsys.readouterr().out


def test_slow_rank_is_named_a_compute_straggler(tmp_path, monkeypatch):
    for r in (0, 1, 2):
        rank_run(monkeypatch, tmp_path / "s-{rank}.db", r, 3, slow=r == 2)
    found = [d for d in ampdoctor.diagnose(str(tmp_path / "s-*.db")) if d.rule == "rank-straggler"]
    assert len(found) == 1 and found[0].ranks == [2] and "steps take longer" in found[0].title
    times = found[0].evidence["step_time_median_s"]
    assert times["rank 2"] - max(times["rank 0"], times["rank 1"]) >= 0.15  # the 300 ms sleep, less noise


def test_rank_waiting_for_data_is_a_data_straggler_and_its_fix_runs(tmp_path, monkeypatch):
    """A rank whose loader takes 100 ms a batch: named, and the loader code of the fix runs as printed under a
    process group (a one-process gloo group stands in for the job's)."""
    for r in (0, 1, 2):
        rank_run(monkeypatch, tmp_path / "d-{rank}.db", r, 3, slow_data=r == 1)
    found = [d for d in ampdoctor.diagnose(str(tmp_path / "d-*.db")) if d.rule == "rank-straggler"]
    assert len(found) == 1 and found[0].ranks == [1] and "input pipeline" in found[0].title
    code = [p.text for p in found[0].fix if p.kind == "code"]
    assert len(code) == 1
    dataset = torch.utils.data.TensorDataset(torch.randn(64, 4))
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        names = {"torch": torch, "dataset": dataset, "batch_size": 16}
        exec(code[0], names)
        assert sum(len(b[0]) for b in names["loader"]) == 64
    finally:
        torch.distributed.destroy_process_group()


def test_the_odd_scale_out_is_named_by_majority(tmp_path, monkeypatch):
    for r in (0, 1, 2):
        rank_run(monkeypatch, tmp_path / "m-{rank}.db", r, 3, init_scale=2.0**12 if r == 1 else 2.0**10)
    found = [d for d in ampdoctor.diagnose(str(tmp_path / "m-*.db")) if d.rule == "rank-scale-divergence"]
    assert len(found) == 1 and found[0].ranks == [1] and found[0].steps[0] == 0
    assert found[0].evidence["loss_scale_before"] == {"rank 0": 1024.0, "rank 1": 4096.0, "rank 2": 1024.0}


@pytest.mark.parametrize(
    "second,message",
    [
        ({"rank": 0}, "two traces of rank 0"),  # a rank twice: two runs in one directory
        ({"rank": 1, "run_id": "job-b"}, "come from different runs"),
    ],
)
def test_files_of_different_runs_are_refused_with_one_line(tmp_path, monkeypatch, capsys, second, message):
    rank_run(monkeypatch, tmp_path / "a-{rank}.db", 0, 2)
    rank_run(monkeypatch, tmp_path / "b-{rank}.db", second["rank"], 2, run_id=second.get("run_id", "job-a"))
    with pytest.raises(ampdoctor.TraceError, match=message):
        ampdoctor.load_run(tmp_path)
    for command in ("info", "diagnose", "report"):
        assert cli([command, str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".db") == ["a-0.db", f"b-{second['rank']}.db"]
