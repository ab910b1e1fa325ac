"""Figures the live tests measure, printed in pytest's terminal summary (captured output would hide them)."""

from __future__ import annotations

import pytest
from tiny_serving import FUZZ_SUMMARY


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, exitstatus: int, config: pytest.Config) -> None:
    lines = config.stash.get(FUZZ_SUMMARY, [])
    if lines:
        terminalreporter.section("live server API fuzz")
        for line in lines:
            terminalreporter.write_line(line)
