"""The SDK and the cookbook these tests drive: a skip with the install line where they are missing,
except in CI (FLYWHEEL_CI=1, .ci/run), where that is a failure: CI must never pass by skipping them."""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest

INSTALL = {"tinker": "pip install -e '.[tinker]' (make setup does)",
           "tinker_cookbook": "pip install --no-deps tinker-cookbook==0.6.1 (make setup does)",
           "chz": "pip install -e '.[dev]' (make setup does)"}


def installed(module: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError:
        reason = f"{module} is not installed: {INSTALL[module]}"
        if os.environ.get("FLYWHEEL_CI") == "1":
            pytest.fail(reason)
        pytest.skip(reason, allow_module_level=True)
