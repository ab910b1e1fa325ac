"""The tool contract stands apart from the sandbox: serving parses and validates calls without the jail."""

from __future__ import annotations

import json
import subprocess
import sys


def test_serving_imports_the_tool_contract_but_not_the_sandbox():
    # A fresh interpreter: this test process has long imported the sandbox through other tests.
    probe = (
        "import json, sys, flywheel.live.server; "
        "print(json.dumps({m: m in sys.modules for m in "
        "['flywheel.env.toolspec', 'flywheel.env.sandbox', 'flywheel.env.tools', 'flywheel.env.semantic']}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, check=True
    )
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert loaded == {
        "flywheel.env.toolspec": True,
        "flywheel.env.sandbox": False,
        "flywheel.env.tools": False,
        "flywheel.env.semantic": False,
    }


def test_the_contract_module_imports_nothing_of_the_sandbox():
    probe = "import sys, flywheel.env.toolspec; print(sorted(m for m in sys.modules if m.startswith('flywheel.')))"
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "['flywheel.env', 'flywheel.env.toolspec']"
