# The two commands of the README: `make test` and `make demo`. Both set up .venv from nothing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup test demo bench lint clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# The CPU build of torch from this machine's disk; any other spec pulls a multi-GB CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

lint: setup
	$(VENV)/bin/ruff check flywheel tests bench

test: lint
	$(PY) -m pytest

demo: setup
	$(VENV)/bin/flywheel demo --config configs/demo.toml

bench: setup
	$(PY) bench/sandbox.py

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
