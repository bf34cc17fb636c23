# The two set-up commands of the README: `make demo` (the main job) and `make test`.
PY      ?= python3
VENV    ?= .venv
BIN      = $(VENV)/bin
TORCH    = torch==2.13.0   # the CPU wheel on these machines; an unpinned torch pulls a multi-GB CUDA build

.PHONY: demo test lint install browser bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

install: $(BIN)/python
	@$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[test]"
	@# the sentinel's C++ read (collect/compiled.py): built once per machine and torch version, ~20 s; without a
	@# compiler the numba kernel serves (the tests of the C++ read then fail with the build's error)
	$(BIN)/python -m ampdoctor.collect.compiled || true

# A fault (FAULT=overflow | init-scale | no-scaler | half-weights), its diagnosis, the printed fix applied, a healthy
# rerun.
FAULT   ?= overflow
demo: install
	$(BIN)/python examples/demo.py --fault $(FAULT) --out runs/demo.db

# Debian's chromium + chromium-driver for the dashboard's browser tests (root; skipped when already there).
browser:
	@command -v chromedriver >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq chromium chromium-driver >/dev/null)

# Lint and format check (ruff), the type check (mypy: its settings in pyproject.toml), then the suite.
lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

test: install browser lint
	$(BIN)/python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile tests

bench: install
	$(BIN)/pip install -q -e ".[bench]"
	$(BIN)/python benchmarks/overhead.py
	$(BIN)/python benchmarks/trace_io.py
	$(BIN)/python benchmarks/probe_overhead.py

clean:
	rm -rf runs build *.egg-info
