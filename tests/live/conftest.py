"""What the live tests share: the tiny served registry (one per test module) and the figures they
measure, printed in pytest's terminal summary (captured output would hide them)."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_serving import FUZZ_SUMMARY, tiny_registry_root


@pytest.fixture(scope="module")
def registry_root(tmp_path_factory) -> Path:
    return tiny_registry_root(tmp_path_factory)



def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, exitstatus: int, config: pytest.Config) -> None:
    lines = config.stash.get(FUZZ_SUMMARY, [])
    if lines:
        terminalreporter.section("live server API fuzz")
        for line in lines:
            terminalreporter.write_line(line)
