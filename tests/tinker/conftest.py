"""One `flywheel tinker serve` on loopback for the folder's tests: the tiny Registry of the live-server
tests (tests/live/tiny_serving.py) and three keys: two that train and sample, one that only samples."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "live"))  # tiny_serving, shared with the server tests
from installed import installed  # noqa: E402
from tiny_serving import make_registry  # noqa: E402

from flywheel.api.http import RunningServer  # noqa: E402
from flywheel.model.registry import Registry  # noqa: E402
from flywheel.tinker.server import TinkerConfig, create_app  # noqa: E402
from flywheel.tinker.service import TinkerService  # noqa: E402

KEYS = {"tml-alice": ["training", "sampling"], "tml-bob": ["training", "sampling"], "tml-viewer": ["sampling"]}


@pytest.fixture(scope="package")
def server(tmp_path_factory) -> Iterator[tuple[str, Registry]]:
    installed("tinker")
    torch.set_num_threads(1)
    saved = {k: os.environ.get(k) for k in ("TINKER_TELEMETRY", "TINKER_API_KEY", "TINKER_BASE_URL")}
    os.environ["TINKER_TELEMETRY"] = "0"  # the SDK's telemetry stays on this machine
    root = tmp_path_factory.mktemp("tinker")
    registry = make_registry(root / "registry")
    config = TinkerConfig(registry=root / "registry", root=root / "tinker", keys=KEYS)
    service = TinkerService(registry, config.root)
    with RunningServer(create_app(service, config)) as running:
        yield running.url, registry
    service.close()
    registry.close()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
