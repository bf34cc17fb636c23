"""benchmarks/device_check.py, the one command that checks ampdoctor on a GPU, runs here on the CPU, small: every
section passes (so the script is known to work before a device is lent), its report and JSON say so, and bad
arguments get one line and exit code 2."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "device_check.py")
SECTIONS = [
    "bit-identical training with and without ampdoctor",
    "autocast op lists observed on the device",
    "host syncs per step",
    "fault scenarios and Hugging Face GPT-2",
    "overhead on real kernels",
    "FP8 what-if against real casts",
]
VARIANTS = [
    "ampdoctor defaults",
    "ampdoctor budget=0.03",
    "ampdoctor debug",
    "naive per-layer .item() hooks",
    "transformers DebugUnderflowOverflow",
]


def run(*args, timeout=900):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


@pytest.fixture(scope="module")
def small_cpu_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("device_check")
    proc = run("--device", "cpu", "--small", "--out", str(out))
    return proc, out


def test_every_section_passes_on_the_cpu(small_cpu_run):
    proc, out = small_cpu_run
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    result = json.load(open(out / "device_check.json"))
    assert result["passed"] and result["environment"]["device"] == "cpu" and result["small"]
    sections = result["sections"]
    assert [s["title"] for s in sections] == SECTIONS
    for s in sections:
        assert s["passed"] and s["error"] is None and s["checks"], s["title"]
        assert all(c["ok"] for c in s["checks"]), [c for c in s["checks"] if not c["ok"]]
        assert s["seconds"] > 0
    report = open(out / "device_check.txt").read()
    assert report.count("PASS  ") == len(SECTIONS) and "FAIL" not in report
    assert f"{len(SECTIONS)} of {len(SECTIONS)} sections passed" in proc.stdout


def test_the_sections_measure_what_they_say(small_cpu_run):
    """The figures behind the pass lines: replays ran in the bit-identical runs, the GradScaler's one read per step
    and the loop's own reads are told apart from ampdoctor's, no call that waits on CUDA, the overhead table has
    every variant on both models and precisions, the FP8 comparison lost values to compare."""
    _, out = small_cpu_run
    sections = {s["number"]: s for s in json.load(open(out / "device_check.json"))["sections"]}
    assert all("replays at steps" in c["detail"] and "37" in c["detail"] for c in sections[1]["checks"])
    syncs = sections[3]["data"]
    assert syncs["fp16"]["scaler_per_step"] == 1.0 and syncs["bf16"]["scaler_per_step"] == 0.0
    assert 0 < syncs["fp16"]["loop_per_step"] < 1  # loss.item() every 10th step (and nothing else)
    assert len(syncs["fp16"]["clean_steps"]) >= 20
    # none of ampdoctor's calls that would wait for the device on CUDA (bincount, nonzero, boolean indexing...) on a
    # clean step, full-statistics and histogram steps included: checked per precision, and the figures agree
    waits = [c for c in sections[3]["checks"] if "wait for the device on CUDA" in c["name"]]
    assert [c["name"][:5] for c in waits] == ["fp16:", "bf16:"] and all(c["ok"] for c in waits)
    for precision in ("fp16", "bf16"):
        calls = {int(t): n for t, n in syncs[precision]["cuda_sync_calls"].items()}
        assert not any(calls.get(t, 0) for t in syncs[precision]["clean_steps"])
    overhead = sections[5]["data"]
    assert set(overhead) == {"reference-fp16", "reference-bf16", "gpt2-fp16", "gpt2-bf16"}
    for res in overhead.values():
        assert [r["variant"] for r in res["rows"]] == ["bare", *VARIANTS]
        assert all(r["ratio_med"] > 0 for r in res["rows"])
    assert sections[6]["data"]["0-act-e4m3"]["lost"] > 0


def test_bad_arguments_get_one_line_and_exit_code_2(tmp_path):
    proc = run("--sections", "7", "--out", str(tmp_path))
    assert proc.returncode == 2 and len(proc.stdout.strip().splitlines()) == 1
    out = tmp_path / "done"
    out.mkdir()
    (out / "device_check-2.json").write_text("{}")
    proc = run("--device", "cpu", "--sections", "2", "--out", str(out))  # never overwrites an earlier report
    assert proc.returncode == 2 and "exists" in proc.stdout
    assert (out / "device_check-2.json").read_text() == "{}"
    if not _cuda():
        proc = run("--device", "cuda", "--out", str(tmp_path / "cuda"))
        assert proc.returncode == 2 and "no CUDA device" in proc.stdout
        assert not (tmp_path / "cuda").exists()


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def test_sync_warnings_are_charged_to_their_caller_and_other_warnings_pass(monkeypatch):
    """The CUDA counter (set_sync_debug_mode's warnings), run here with the mode switch stubbed out: a sync warning
    raised while ampdoctor's code runs is ampdoctor's, one raised by the loop the loop's; any other warning is shown
    as before; the warning filters are put back."""
    import warnings

    import torch

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import hostsync

    modes = []
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    ns = {"warnings": warnings}
    code = "def sync():\n    warnings.warn('called a synchronizing CUDA operation (Triggered internally)')\n"
    exec(compile(code, os.path.join(hostsync._PACKAGE, "collect", "stats.py"), "exec"), ns)
    filters = list(warnings.filters)
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        with hostsync.SyncWarnings() as counter:
            counter.step = 4
            ns["sync"]()
            ns["sync"]()
            warnings.warn("called a synchronizing CUDA operation", stacklevel=1)  # (this test: the loop)
            warnings.warn("something else", stacklevel=1)
    assert dict(counter.counts["ampdoctor"]) == {4: 2} and dict(counter.counts["loop"]) == {4: 1}
    assert list(counter.where["ampdoctor"]) == ["stats.py:2 in sync"]
    assert [str(w.message) for w in shown] == ["something else"]
    assert modes == ["warn", 0] and warnings.filters == filters
