"""The grading child's one audit hook, in its two modes: the file mode refuses everything that could
change how a test's outcome is observed; the pytest mode (`libraries=True`) lets through what real
libraries do at import (ctypes, `__defaults__`) and the stdlib doctest's tracer, nothing else.

Each case runs in a fresh interpreter: an audit hook cannot be removed once installed."""

from __future__ import annotations

import subprocess
import sys

import pytest

PROBES = {
    "ctypes": "import ctypes",
    "defaults": "def f(x=1): return x\nf.__defaults__ = (2,)",
    "namedtuple": "import collections\ncollections.namedtuple('P', 'x y', defaults=(0,))",
    "code": "def f(): pass\nf.__code__ = (lambda: 1).__code__",
    "settrace": "sys.settrace(lambda *a: None)",
    "setprofile": "sys.setprofile(lambda *a: None)",
    "proc_mem": "open('/proc/self/mem', 'rb')",
    "doctest": "import doctest\ndef g():\n    '''\n    >>> 1 + 1\n    2\n    '''\n"
               "doctest.run_docstring_examples(g, {})",
}
INSTALL = {
    "file": "sys.addaudithook(testrun.refuse_tampering)",
    "pytest": "sys.addaudithook(functools.partial(testrun.refuse_tampering, libraries=True))",
}
REFUSED = {
    "file": {"ctypes", "defaults", "namedtuple", "code", "settrace", "setprofile", "proc_mem", "doctest"},
    "pytest": {"code", "settrace", "setprofile", "proc_mem"},
}


@pytest.mark.parametrize("mode", sorted(INSTALL))
def test_each_mode_refuses_exactly_its_list(mode):
    script = "import functools, sys\nimport flywheel.env.testrun as testrun\n" + INSTALL[mode] + "\n" + (
        "probes = " + repr(PROBES) + "\nrefused = []\n"
        "for name, code in probes.items():\n"
        "    try:\n"
        "        exec(code, {'sys': sys})\n"
        "    except RuntimeError as exc:\n"
        "        assert 'is not allowed while the hidden tests run' in str(exc), exc\n"
        "        refused.append(name)\n"
        "print(' '.join(sorted(refused)))\n")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    assert set(run.stdout.split()) == REFUSED[mode]
