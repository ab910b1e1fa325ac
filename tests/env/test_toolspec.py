"""The tool contract stands apart from the sandbox: serving parses and validates calls without the jail."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def _loaded_by_serving() -> dict[str, bool]:
    # A fresh interpreter: this test process has long imported the sandbox through other tests.
    probe = (
        "import json, sys, flywheel.live.server; "
        "print(json.dumps({m: m in sys.modules for m in "
        "['flywheel.env.toolspec', 'flywheel.env.sandbox', 'flywheel.env.tools', 'flywheel.env.semantic']}))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # 26 s on the shared 2-core machine (load ~10)
def test_serving_imports_the_tool_contract_but_not_the_tools():
    loaded = _loaded_by_serving()
    assert loaded["flywheel.env.toolspec"]
    assert not loaded["flywheel.env.tools"] and not loaded["flywheel.env.semantic"]


@pytest.mark.slow  # 14 s on the shared 2-core machine (load ~10)
def test_serving_does_not_import_the_sandbox():
    assert not _loaded_by_serving()["flywheel.env.sandbox"]


def test_the_contract_module_imports_nothing_of_the_sandbox():
    probe = "import sys, flywheel.env.toolspec; print(sorted(m for m in sys.modules if m.startswith('flywheel.')))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "['flywheel.env', 'flywheel.env.toolspec']"
