"""The sentinel's every-step read compiled in C++ (csrc/step_record.cpp): the gradient norm and peak of a step in one
call that reads each ``.grad`` in C++. Inside a training loop a torch call from Python costs ~2-3 us (cold caches);
the Python around the numba kernel (collecting the gradients, checking each one's dtype, device and layout) was two
thirds of the sentinel's read (benchmarks/native_step_record.py).

The extension is built once per machine, Python and torch version (a torch extension needs a C++ compiler and ninja:
17-20 s on the project's 2-core machine), by a process of its own started at the first ``attach`` (niced, so that it
takes the spare core; it finishes even if the script that started it does not), into
``~/.cache/ampdoctor/ext/<tag>`` (AMPDOCTOR_BUILD_DIR moves it). Until it is there, and wherever it cannot be built,
the numba kernel and the torch passes serve, with the same figures. ``python -m ampdoctor.collect.compiled`` builds
it in the foreground (``make install`` does). AMPDOCTOR_NATIVE=0 keeps it off, as the numba kernels.

Loaded, it is checked once against torch on a few values of each dtype (NaN and Inf among them); an extension that
disagrees is never used."""

from __future__ import annotations

import hashlib
import importlib.util
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

SOURCE = Path(__file__).with_name("csrc") / "step_record.cpp"
# -fopenmp-simd: the loops' simd reductions vectorize (the float64 sum is reassociated there only, NaN and Inf kept);
# -ffp-contract=off: no fused multiply-add where the lane repeats a running mean of cadence.py (bit for bit)
CFLAGS = ["-O3", "-fopenmp-simd", "-ffp-contract=off"]
ENABLED = os.environ.get("AMPDOCTOR_NATIVE", "1") != "0"
RECHECK_S = 2.0  # while a build runs elsewhere, how often a caller looks for its result
BUILD_TIMEOUT_S = 600
STALE_BUILD_S = 900  # a build lock older than this is from a build that died

_ext: ModuleType | None = None
_lock = threading.Lock()
_started = False
_next_look = 0.0
info: dict[str, Any] = {}  # how it went: "loaded" (seconds), or "error" (for tests and the benchmarks)


def tag() -> str:
    """The build's identity: Python, torch, the source and the flags (a change of any builds again)."""
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(CFLAGS).encode()).hexdigest()[:12]
    py = f"py{sys.version_info[0]}{sys.version_info[1]}"
    return f"{py}-torch{torch.__version__.replace('+', '_')}-{digest}"


def build_dir() -> Path:
    """Where the build of this tag lives: under AMPDOCTOR_BUILD_DIR, else the user's cache (``$XDG_CACHE_HOME``, else
    ``~/.cache``) in ``ampdoctor/ext``. Not AMPDOCTOR_CACHE_DIR, which moves the dashboard's results: a run's
    results may be kept apart (the tests do) without building the extension again."""
    root = os.environ.get("AMPDOCTOR_BUILD_DIR")
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(xdg, "ampdoctor", "ext")
    return Path(root) / tag()


def module_name() -> str:
    return "ampdoctor_step_record_" + tag().rsplit("-", 1)[1]


def get() -> ModuleType | None:
    """The extension once it is loaded, else None (the first call starts its build, or its load, in the
    background). Cheap on every step: a global, and a look at the disk at most every RECHECK_S seconds."""
    global _next_look
    if _ext is not None or not ENABLED:
        return _ext
    now = time.monotonic()
    if now < _next_look:
        return None
    _next_look = now + RECHECK_S
    with _lock:
        if _ext is None and "error" not in info:
            _look()
    return _ext


def wait(timeout: float = BUILD_TIMEOUT_S) -> ModuleType | None:
    """Block until the extension is loaded, or its build failed, or ``timeout`` (benchmarks and tests)."""
    global _next_look
    end = time.monotonic() + timeout
    while ENABLED and _ext is None and "error" not in info and time.monotonic() < end:
        with _lock:
            _look()
        if _ext is None:
            time.sleep(0.2)
    _next_look = 0.0
    return _ext


def _look() -> None:
    """Load the extension, or start its build; whatever fails (a source missing from an install, a cache that cannot
    be written) is kept in ``info`` and the numba kernel serves: never an error in training."""
    try:
        _try_load()
    except Exception as exc:
        info["error"] = f"{type(exc).__name__}: {exc}"


def _try_load() -> None:
    global _ext, _started
    where = build_dir()
    library = where / (module_name() + ".so")
    if library.exists() and not _building(where):
        t0 = time.perf_counter()
        try:
            ext = _import(library)
            _self_check(ext)
        except Exception as exc:
            info["error"] = f"{type(exc).__name__}: {exc}"
        else:
            _ext = ext
            info["loaded"] = time.perf_counter() - t0
        return
    failed = where / "error.txt"
    if failed.exists():
        info["error"] = "the C++ extension did not build here: " + failed.read_text()[-300:].strip()
        return
    if not _started and not _building(where):
        _started = True
        _spawn_build()


def _building(where: Path) -> bool:
    lock = where / "building"
    try:
        return time.time() - lock.stat().st_mtime < STALE_BUILD_S
    except OSError:
        return False


def _spawn_build() -> None:
    """The build in a process of its own, niced: it takes the spare core, and it finishes even where the script that
    started it ends first (a build interrupted halfway would leave torch's own lock behind)."""
    # (this ampdoctor, wherever it was imported from: a source tree put on sys.path by the script itself too)
    package_root = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join([package_root, *filter(None, [os.environ.get("PYTHONPATH")])])
    try:
        subprocess.Popen(
            [sys.executable, "-m", "ampdoctor.collect.compiled", "--quiet"],
            env={**os.environ, "PYTHONPATH": path},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=lambda: os.nice(10),
        )
    except Exception as exc:  # (no fork here, a read-only interpreter: the numba kernel serves)
        info["error"] = f"could not start the C++ build: {type(exc).__name__}: {exc}"


def _import(library: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(module_name(), library)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build() -> Path:
    """Build the extension here and now (a lock file marks the build for other processes meanwhile); a failure is
    written to ``error.txt`` beside it, so that runs on this machine do not try again (remove it to retry)."""
    from torch.utils import cpp_extension

    where = build_dir()
    where.mkdir(parents=True, exist_ok=True)
    lock = where / "building"
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        if _building(where):
            raise RuntimeError(f"another process is building the extension in {where}") from None
        lock.unlink(missing_ok=True)  # (a build that died)
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    os.close(fd)
    # (the ninja of the pip package sits beside this interpreter, which is not on PATH outside an activated venv)
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    try:
        cpp_extension.load(module_name(), [str(SOURCE)], extra_cflags=CFLAGS, build_directory=str(where), verbose=False)
    except Exception as exc:
        (where / "error.txt").write_text(f"{type(exc).__name__}: {exc}"[-4000:])
        raise
    finally:
        lock.unlink(missing_ok=True)
    return where / (module_name() + ".so")


def _self_check(ext: ModuleType) -> None:
    """Figures of a few values of each dtype (NaN and Inf among them) compared with torch's."""
    values = torch.tensor([0.0, -1e-40, 3e-8, 2.0**-25, 1.5, -65519.0, 70000.0, 3.0e38, -7.0] * 300)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        p = torch.nn.Parameter(torch.zeros(values.shape, dtype=dtype))
        p.grad = values.to(dtype, copy=True)
        norm, peak, read = ext.Grads([p]).figures()
        wide = p.grad.double()
        want_norm, want_peak = float(wide.norm()), float(wide.abs().max())
        if read != 1 or peak != want_peak or not math.isclose(norm, want_norm, rel_tol=1e-9):
            got, want = (norm, peak), (want_norm, want_peak)
            raise RuntimeError(f"the C++ figures disagree with torch on {dtype}: {got} against {want}")
        p.grad[5] = math.nan
        norm, peak, _ = ext.Grads([p]).figures()
        if not (math.isnan(norm) and math.isnan(peak)):
            raise RuntimeError(f"the C++ figures lose a NaN in {dtype}")
    x = torch.zeros(6, 2)
    x.add_(1)  # (version 1)
    seen = [ext.call_state(x, True), ext.call_state(None, False)]
    with torch.no_grad():
        seen.append(ext.call_state(x, True))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        seen.append(ext.call_state(torch.tensor(1.0), False))
    expected = [(True, None, 6, 1), (True, None, -1, -1), (False, None, -1, -1), (True, torch.bfloat16, -1, 0)]
    states = [s[:4] for s in seen]
    if states != expected or not torch.equal(seen[0][4], torch.default_generator.get_state()):
        raise RuntimeError(f"the C++ call state disagrees with torch: {states} against {expected}")
    w = torch.ones(3, requires_grad=True)
    out = w * 2
    seed = ext.keep_seed(out, 1 << 22)
    (out * 3).sum().backward()  # type: ignore[no-untyped-call]  # (unannotated in torch)
    grad = seed.get()
    if grad is None or not torch.equal(grad, torch.full((3,), 3.0)) or ext.keep_seed(out.detach(), 8) is not None:
        raise RuntimeError(f"the C++ seed hook disagrees with torch: {grad}")


def main() -> None:
    quiet = "--quiet" in sys.argv
    t0 = time.perf_counter()
    try:
        library = build()
        _self_check(_import(library))
    except Exception as exc:
        if not quiet:
            print(
                f"ampdoctor: the C++ extension did not build ({type(exc).__name__}: {str(exc)[-500:]}); "
                "the numba kernels serve instead"
            )
        sys.exit(0 if quiet else 1)
    if not quiet:
        print(f"ampdoctor: C++ extension ready in {library.parent} ({time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
