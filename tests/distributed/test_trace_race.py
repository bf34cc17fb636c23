"""Two real processes opening the same trace path at the same moment (e.g. DDP ranks given a path without
``{rank}``, or two jobs left at the default path): each must end with its own complete trace, and neither may
delete the other's."""

from __future__ import annotations

import multiprocessing as mp
import os

import ampdoctor

ROUNDS = 10  # each round both processes attach to one fresh path at the same instant


def _attach_and_write(barrier, results, paths):
    """Child: for each path, wait for the other process, attach to the same path, record 3 steps, close."""
    import warnings

    import torch

    torch.set_num_threads(1)
    model = torch.nn.Linear(4, 1)
    for path in paths:
        barrier.wait()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            doc = ampdoctor.attach(model, trace=path, live=False)
            for _ in range(3):
                model(torch.randn(2, 4)).sum().backward()
                doc.step()
            doc.close()
        results.put((os.getpid(), path, doc.path, [str(w.message) for w in caught]))


def test_two_processes_racing_on_one_path_each_keep_their_own_trace(tmp_path):
    paths = [str(tmp_path / f"race{i}.db") for i in range(ROUNDS)]
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_attach_and_write, args=(barrier, results, paths)) for _ in range(2)]
    for p in procs:
        p.start()
    got = [results.get(timeout=120) for _ in range(2 * ROUNDS)]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    for path in paths:
        mine = [g for g in got if g[1] == path]
        assert len(mine) == 2
        for pid, _, out, warned in mine:
            assert os.path.exists(out), f"{out} (pid {pid}) was deleted"
            assert not any("cannot write" in w or "may be incomplete" in w for w in warned), warned
        written = {g[2] for g in mine}
        assert len(written) == 2, f"both processes wrote {written}"  # never one shared file
        assert path in written
        for pid, _, out, warned in mine:
            tr = ampdoctor.load(out)
            assert tr.meta["run"]["pid"] == pid
            assert tr.meta["closed"]["steps"] == 3 and tr.n_steps == 3
            tr.close()
            if out != path:  # the loser says where its trace went
                assert any(out in w for w in warned), warned
