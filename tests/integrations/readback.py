"""Reading back what the real packages wrote: TensorBoard event files (tensorboard's EventAccumulator), a W&B
offline run (its .wandb record file, parsed with wandb's own protobuf classes) and an MLflow file store (its
client). Shared by the exporter tests."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import struct
import time

import pytest


def tensorboard(logdir: str):
    """An EventAccumulator over ``logdir`` holding every event (no sampling)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(logdir, size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def tb_scalars(acc, tag: str) -> dict:
    return {e.step: e.value for e in acc.Scalars(tag)}


def tb_texts(acc, tag: str) -> list[tuple[int, str]]:
    """The text summaries under ``tag`` (torch's SummaryWriter.add_text stores them as ``<tag>/text_summary``)."""
    tags = [t for t in acc.Tags()["tensors"] if t == tag or t == tag + "/text_summary"]
    return [(e.step, e.tensor_proto.string_val[0].decode()) for t in tags for e in acc.Tensors(t)]


def _wandb_chunks(path: str):
    """The records of a .wandb file: LevelDB's log format (32 KiB blocks, 7-byte record headers, records split
    FIRST / MIDDLE / LAST across blocks) after a 7-byte ':W&B' file header."""
    data = open(path, "rb").read()
    assert data[:4] == b":W&B", path
    pos, block, parts = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:  # the zero padding at a block's end
            pos += left
            continue
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            yield chunk
        elif kind == 2:
            parts = chunk
        elif kind == 3:
            parts += chunk
        elif kind == 4:
            yield parts + chunk


def wandb_run(folder: str, timeout: float = 60.0) -> dict:
    """The offline run under ``folder`` (WANDB_DIR): {"history": [row dicts], "alerts": [(title, text, level)]}.
    W&B's service process writes the file: ``wandb.finish()`` may return before its last records are there (seen
    with two test processes on two cores), so the file is read once it ends with the run's exit record."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = glob.glob(os.path.join(folder, "wandb", "offline-run-*", "run-*.wandb"))
    end = time.monotonic() + timeout
    while True:
        records = []
        try:
            for raw in _wandb_chunks(path):
                r = pb.Record()
                r.ParseFromString(raw)
                records.append(r)
        except Exception:  # (a record the service is still writing)
            records = []
        if records and records[-1].WhichOneof("record_type") == "exit":
            break
        assert time.monotonic() < end, f"{path}: no exit record {timeout:.0f} s after wandb.finish()"
        time.sleep(0.2)
    out: dict = {"history": [], "alerts": []}
    for r in records:
        kind = r.WhichOneof("record_type")
        if kind == "history":
            out["history"].append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item})
        elif kind == "alert":
            out["alerts"].append((r.alert.title, r.alert.text, r.alert.level))
    return out


def mlflow_client():
    from mlflow.tracking import MlflowClient

    return MlflowClient()


def mlflow_runs(client) -> list:
    return client.search_runs([e.experiment_id for e in client.search_experiments()])


@contextlib.contextmanager
def offline_backends(folder):
    """W&B offline and an MLflow file store under ``folder`` for the block's duration (the environment restored)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_MODE", "offline")
        mp.setenv("WANDB_DIR", str(folder))
        mp.setenv("WANDB_SILENT", "true")
        mp.setenv("WANDB_DISABLE_GIT", "true")
        mp.setenv("MLFLOW_TRACKING_URI", f"file://{folder}/mlruns")
        mp.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the file store behind this switch
        # both packages keep process-wide state past the environment (W&B its settings and folder, MLflow the
        # tracking URI a callback set): reset it, so that one test's run does not land in another's folder
        import mlflow
        import wandb

        wandb.teardown()
        mlflow.set_tracking_uri(f"file://{folder}/mlruns")
        try:
            yield
        finally:
            while mlflow.active_run() is not None:
                mlflow.end_run()
            wandb.teardown()
