"""A normal (non-editable) install works: the built wheel holds every module of the source tree, and installed
alone in a fresh venv its ``ampdoctor`` command runs --help, diagnose and serve (the first page answers).

The editable install the suite runs under hides a package missing from setup.cfg (it imports from the source
tree), so this builds the wheel offline (no build isolation), installs it without its dependencies into a new
venv and lets that venv see the dependencies of the running one through a .pth line (where .pth files, the
editable ampdoctor's among them, are not run).
"""

import json
import os
import shutil
import site
import socket
import subprocess
import sys
import time
import urllib.request
import zipfile

import pytest
import torch
from ampdoctor.dashboards import ids
from runs import mlp, train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# source folder -> where its files go in the installed package (setup.cfg's package_dir)
TREES = {"ampdoctor": "ampdoctor", "dashboards": "ampdoctor/dashboards"}
BUILD_FILES = ("setup.cfg", "pyproject.toml", "README.md")

pytestmark = pytest.mark.slow


def source_files() -> set:
    """Every file of the source tree (modules, and any data file) as its path inside the wheel; walking the tree
    finds a subpackage added later that setup.cfg does not list yet."""
    out = set()
    for src, dest in TREES.items():
        for dirpath, dirnames, files in os.walk(os.path.join(ROOT, src)):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            rel = os.path.relpath(dirpath, os.path.join(ROOT, src))
            out.update(os.path.normpath(os.path.join(dest, rel, f)).replace(os.sep, "/") for f in files)
    return out


def missing_from(wheel: str) -> list:
    with zipfile.ZipFile(wheel) as z:
        return sorted(source_files() - set(z.namelist()))


def build_wheel(tmp, setup_cfg=None) -> str:
    """Build the wheel from a clean copy of the tree (a stale build/ folder could hide a missing package)."""
    src, dist = tmp / "src", tmp / "dist"
    src.mkdir()
    for name in BUILD_FILES:
        shutil.copy(os.path.join(ROOT, name), src / name)
    for tree in TREES:
        shutil.copytree(os.path.join(ROOT, tree), src / tree, ignore=shutil.ignore_patterns("__pycache__"))
    if setup_cfg is not None:
        (src / "setup.cfg").write_text(setup_cfg(open(os.path.join(ROOT, "setup.cfg")).read()))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-w",
            str(dist),
            str(src),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    (wheel,) = dist.glob("ampdoctor-*.whl")
    return str(wheel)


def fresh_venv(path, wheel) -> str:
    """A venv holding only the wheel; the running interpreter's site-packages (dependencies) as a plain path."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=120)
    py = str(path / "bin" / "python")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", py, "install", "-q", "--no-deps", "--no-index", wheel],
        check=True,
        capture_output=True,
        timeout=120,
    )
    purelib = subprocess.run(
        [py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    with open(os.path.join(purelib, "_ampdoctor_test_deps.pth"), "w") as f:
        f.write("\n".join(site.getsitepackages()) + "\n")
    return str(path / "bin")


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wheel")
    wheel = build_wheel(tmp)
    return wheel, fresh_venv(tmp / "venv", wheel), tmp


def _env():
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PYTHONNOUSERSITE"] = "1"
    return env


def test_wheel_holds_every_file_of_the_tree(installed):
    wheel, _, _ = installed
    assert "ampdoctor/dashboards/pages/overview.py" in source_files()
    assert missing_from(wheel) == []


def test_a_package_left_out_of_setup_cfg_is_caught(tmp_path):
    """The check above fails the way it should: a wheel built without ampdoctor.dashboards.pages lacks its files."""
    wheel = build_wheel(tmp_path, lambda cfg: cfg.replace("    ampdoctor.dashboards.pages\n", ""))
    assert "ampdoctor/dashboards/pages/overview.py" in missing_from(wheel)


def test_installed_wheel_runs_help_diagnose_and_serve(installed):
    _, bin_dir, tmp = installed
    run = dict(cwd=str(tmp), env=_env(), capture_output=True, text=True, timeout=120)
    where = subprocess.run(
        [
            os.path.join(bin_dir, "python"),
            "-c",
            "import ampdoctor, ampdoctor.dashboards.pages as p; print(ampdoctor.__file__, p.__file__)",
        ],
        **run,
    )
    assert where.returncode == 0, where.stderr
    assert all(f.startswith(os.path.dirname(bin_dir) + os.sep) for f in where.stdout.split()), where.stdout
    exe = os.path.join(bin_dir, "ampdoctor")

    helped = subprocess.run([exe, "--help"], **run)
    assert helped.returncode == 0, helped.stderr
    for command in ("info", "layers", "diagnose", "replay", "serve", "report"):
        assert command in helped.stdout

    trace = str(tmp / "faulty.db")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 32-wide MLP gains nothing from threads; a loaded machine, ~10x
    try:
        train(mlp(width=32), 30, init_scale=2.0**30, trace=trace, attach_options={"every": 5})
    finally:
        torch.set_num_threads(threads)
    found = subprocess.run([exe, "diagnose", trace], **run)
    assert found.returncode == 1, found.stderr
    assert "init-scale-too-high" in found.stdout and "GradScaler(" in found.stdout

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [exe, "serve", trace, "--port", str(port)],
        cwd=str(tmp),
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        page = _first_answer(f"http://127.0.0.1:{port}/", server)
        assert "_dash-config" in page
        overview = _route(f"http://127.0.0.1:{port}", "/", "?run=faulty.db")  # what the browser asks next
        assert "faulty.db" in overview and "Findings" in overview and f'"id":"{ids.FINDINGS}"' in overview
    finally:
        server.terminate()
        _out, err = server.communicate(timeout=30)
    assert "ModuleNotFoundError" not in err and "Traceback" not in err, err


def _route(base, pathname, search) -> str:
    """The page the app's routing callback renders for a URL (the request the browser sends after loading)."""
    outputs = [(ids.HEADER, "children"), (ids.PAGE, "children"), (ids.ERROR, "children")]
    body = {
        "output": ".." + "...".join(f"{i}.{p}" for i, p in outputs) + "..",
        "outputs": [{"id": i, "property": p} for i, p in outputs],
        "inputs": [
            {"id": ids.URL, "property": "pathname", "value": pathname},
            {"id": ids.URL, "property": "search", "value": search},
        ],
        "changedPropIds": [f"{ids.URL}.pathname"],
    }
    req = urllib.request.Request(
        f"{base}/_dash-update-component", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return r.read().decode()


def _first_answer(url, server, timeout=60.0) -> str:
    """The body of the first successful GET of ``url`` while ``server`` starts (fails if it exits first)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if server.poll() is not None:
            pytest.fail(f"ampdoctor serve exited with {server.returncode}: {server.stderr.read()}")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                return r.read().decode()
        except OSError:
            time.sleep(0.3)
    pytest.fail(f"{url} did not answer within {timeout:.0f} s")
