"""VLLMServer's start-up, against stand-ins for vLLM's interpreter that fail the way it does (no
vLLM needed: these are the cases a real server reaches only by chance)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from flywheel.model.vllm_server import ServerError, VLLMConfig, VLLMServer

CONFIG = {"vocab_size": 300, "hidden_size": 64, "num_attention_heads": 2, "head_dim": 32}


def interpreter(tmp_path: Path, body: str) -> Path:
    """An executable standing in for .venv-vllm/bin/python: it ignores vLLM's arguments and runs `body`."""
    path = tmp_path / "python"
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return path


def test_a_server_whose_engine_core_failed_to_start_is_named_at_once_and_stopped(tmp_path):
    """vLLM's API server does not exit when its engine core fails to start (a worker killed while it
    started): it waits for the engine's handshake. Its log says so; the start fails then, not at
    `startup_timeout_s`, and the process group is stopped."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(CONFIG))
    python = interpreter(tmp_path, "echo 'ERROR [core.py:1510] EngineCore failed to start.'\nexec sleep 300")
    server = VLLMServer(model, VLLMConfig(python=python, startup_timeout_s=120), log_path=tmp_path / "server.log")
    start = time.monotonic()
    with pytest.raises(ServerError, match="engine core failed to start"):
        server.start().wait_ready()
    assert time.monotonic() - start < 30 and not server.alive()
    with pytest.raises(ProcessLookupError):
        os.killpg(server.process.pid, 0)


def test_an_earlier_servers_failure_in_the_same_log_is_not_this_ones(tmp_path):
    """The log file is appended to (a port used again): only what this server wrote counts."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(CONFIG))
    log = tmp_path / "server.log"
    log.write_text("ERROR [core.py:1510] EngineCore failed to start.\n")
    python = interpreter(tmp_path, "exec sleep 300")  # never healthy, never failed
    server = VLLMServer(model, VLLMConfig(python=python, startup_timeout_s=3), log_path=log)
    with pytest.raises(ServerError, match="not ready within 3 s"):
        server.start().wait_ready()
    assert not server.alive()
