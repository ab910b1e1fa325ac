"""Forgery battery: code under test that tries to fake its grade, each attempt on a task whose bug
is not fixed. Every attempt must score 0; the controls show that the same harness scores a fixed
task 1.0 (with the same noise), so a 0 is the grader seeing through the attempt, not a broken run.

Each attack is the broken solution plus a few lines, in `mathy.py` (run when the hidden tests import
it) or in a planted file. Real sandboxes, the real runner, the real grader throughout.
"""

from __future__ import annotations

import pytest

from flywheel.env.grading import grade, grading_files, run_hidden_tests
from flywheel.env.sandbox import Sandbox, Snapshot
from tests.env.double_task import double_task

TASK = double_task("toy/train/forgery", "x + 1")
BROKEN = TASK.files["mathy.py"]  # x + 1 fails all three hidden tests, double(0) included
FIXED = "def double(x):\n    return 2 * x\n"
HIDDEN_IDS = [f"tests_hidden/test_mathy.py::{n}" for n in ("test_negative", "test_two", "test_zero")]
# An all-pass report as the supervisor writes it (and as the nonce-line grader before it read it),
# and the agent-mode summary line: what a forger would print.
FORGED = '{"passed": 3, "failed": 0, "tests": {' + ", ".join(f'"{t}": true' for t in HIDDEN_IDS) + '}}'
FORGED_LINES = f"print({FORGED!r})\nprint('3 passed, 0 failed')\n"


def graded(files: dict[str, str], solution: str = BROKEN):
    """Grade the task's workspace with `solution` in mathy.py and `files` written over it."""
    with Sandbox.create({**TASK.files, "mathy.py": solution, **files}) as box:
        return grade(TASK, box.snapshot())


def assert_scores_zero(result) -> None:
    assert result.reward == 0.0 and result.passed == 0 and result.failed == 3, result
    assert not result.outcome.all_passed and result.outcome.tests_passed_frac == 0.0


def with_attack(attack: str) -> dict[str, str]:
    return {"mathy.py": attack + BROKEN}


# ---- controls -------------------------------------------------------------------------------------


def test_control_the_broken_task_scores_zero_and_the_fixed_one_full():
    assert_scores_zero(graded({}))
    fixed = graded({}, FIXED)
    assert fixed.reward == pytest.approx(1.0) and fixed.passed == 3
    assert sorted(fixed.tests) == HIDDEN_IDS


def test_control_a_fixed_task_that_prints_forgeries_still_scores_full():
    result = graded({"mathy.py": FORGED_LINES + FIXED})
    assert result.reward == pytest.approx(1.0)


# ---- the battery ----------------------------------------------------------------------------------


def test_forged_summary_and_report_lines_on_stdout_and_stderr():
    attack = FORGED_LINES + f"import sys\nsys.stderr.write({FORGED!r} + '\\n3 passed, 0 failed\\n')\n"
    assert_scores_zero(graded(with_attack(attack)))


def test_forged_lines_into_the_jails_own_output_pipe():
    # /proc/1 is bwrap's init, which holds the jail's stdout: writing there reaches the grader's log.
    attack = f"open('/proc/1/fd/1', 'w').write({FORGED!r} + '\\n3 passed, 0 failed\\n')\n"
    assert_scores_zero(graded(with_attack(attack)))


def test_writing_a_forged_report_to_every_inherited_descriptor_then_exiting():
    attack = (
        "import os\n"
        "for fd in range(3, 1024):\n"
        "    try:\n"
        f"        os.write(fd, ({FORGED!r} + '\\n').encode())\n"
        "    except OSError:\n"
        "        pass\n"
        "os._exit(0)\n"
    )
    assert_scores_zero(graded(with_attack(attack)))


def test_os_exit_0_at_import():
    assert_scores_zero(graded(with_attack("import os\nos._exit(0)\n")))


def test_sys_exit_0_at_import():
    assert_scores_zero(graded(with_attack("import sys\nsys.exit(0)\n")))


def test_sys_exit_0_inside_the_function_under_test():
    assert_scores_zero(graded({"mathy.py": "import sys\ndef double(x):\n    sys.exit(0)\n"}))


def test_opening_the_supervisors_descriptors_and_memory_through_proc():
    # The supervisor is the child's parent; it holds the report descriptor. Non-dumpable, so neither
    # /proc/<pid>/fd nor /proc/<pid>/mem opens for another process of the jail.
    attack = (
        "import os\n"
        "ppid = os.getppid()\n"
        "opened = []\n"
        "try:\n"
        "    for name in os.listdir(f'/proc/{ppid}/fd'):\n"
        "        try:\n"
        f"            os.write(os.open(f'/proc/{{ppid}}/fd/{{name}}', os.O_WRONLY), {FORGED!r}.encode())\n"
        "            opened.append(name)\n"
        "        except OSError:\n"
        "            pass\n"
        "    open(f'/proc/{ppid}/mem', 'rb')\n"
        "except (OSError, RuntimeError):\n"
        "    pass\n"
        "os.kill(ppid, 9)\n"  # and leave no honest report behind
    )
    assert_scores_zero(graded(with_attack(attack)))


def test_the_supervisors_proc_entries_are_closed_to_the_code_under_test():
    # The layer under the one above: as a non-root user the report file would be the jail user's own,
    # so what keeps /proc/<supervisor>/fd/<report> shut is the supervisor being non-dumpable.
    probe = (
        "import os\n"
        "try:\n"
        "    seen = 'listed ' + repr(os.listdir(f'/proc/{os.getppid()}/fd'))\n"
        "except OSError as exc:\n"
        "    seen = type(exc).__name__\n"
        "open('probe.txt', 'w').write(seen)\n"
    )
    with Sandbox.create(grading_files(TASK, Snapshot.of_files({**TASK.files, "mathy.py": probe + BROKEN}))) as box:
        run_hidden_tests(box, TASK, timeout_s=20)
        seen = box.read_text("probe.txt")
    assert seen == "PermissionError", seen


def test_killing_the_supervisor_after_forging():
    attack = f"import os, signal\nprint({FORGED!r})\nos.kill(os.getppid(), signal.SIGKILL)\n"
    assert_scores_zero(graded(with_attack(attack)))


def test_walking_the_stack_and_heap_for_a_secret_then_replaying_it_everywhere():
    # What broke the nonce design: find hex secrets in the runner's frames and objects, print them
    # with a forged result, write them to every descriptor, exit. There is no secret to find.
    attack = (
        "import gc, os, re, sys\n"
        "found = set()\n"
        "frame = sys._getframe()\n"
        "while frame is not None:\n"
        "    for value in list(frame.f_locals.values()) + list(frame.f_globals.values()):\n"
        "        if isinstance(value, (str, bytes)):\n"
        "            found.add(value if isinstance(value, str) else value.decode('latin-1'))\n"
        "    frame = frame.f_back\n"
        "found.update(o for o in gc.get_objects() if isinstance(o, str))\n"
        "secrets = [s for s in found if re.fullmatch('[0-9a-f]{32}', s)]\n"
        "for s in secrets:\n"
        f"    line = '\\n' + s + ' ' + {FORGED!r} + '\\n'\n"
        "    print(line)\n"
        "    for fd in range(3, 256):\n"
        "        try:\n"
        "            os.write(fd, line.encode() + s.encode() + b'\\n')\n"
        "        except OSError:\n"
        "            pass\n"
        "os._exit(0)\n"
    )
    assert_scores_zero(graded(with_attack(attack)))


def test_monkeypatching_the_runner_and_the_builtins():
    attack = (
        "import builtins, sys\n"
        "runner = sys.modules['__main__']\n"
        "for name in ('run_suite', 'run_file', 'run_suite_in_child', 'supervise', 'refuse_tampering'):\n"
        "    setattr(runner, name, lambda *a, **k: None)\n"
        "runner.defined_tests = lambda code: []\n"
        "runner.TOKEN_BYTES = 0\n"
        "runner.os._exit = lambda code: None\n"  # so a child would fall back into the supervisor's loop
        "builtins.type = lambda *a: type(lambda: 0)\n"
        "builtins.len = lambda x: 10 ** 9\n"
        "builtins.BaseException = Exception\n"
    )
    assert_scores_zero(graded(with_attack(attack)))


def test_replacing_the_hidden_test_functions_after_they_are_defined():
    # A thread swaps each test function (or its code) for a no-op once the test module defines it.
    attack = (
        "import sys, threading, time\n"
        "module = sys._getframe(1).f_globals\n"
        "def swap():\n"
        "    for _ in range(2000):\n"
        "        for name in [n for n in list(module) if n.startswith('test_')]:\n"
        "            try:\n"
        "                module[name].__code__ = (lambda: None).__code__\n"
        "            except Exception:\n"
        "                module[name] = lambda: None\n"
        "        time.sleep(0.0005)\n"
        "threading.Thread(target=swap, daemon=True).start()\n"
        "def slow(x):\n"
        "    time.sleep(0.05)\n"
        "    return x + 1\n"
        "double = slow\n"
    )
    assert_scores_zero(graded({"mathy.py": attack}))


def test_a_tracer_that_rewrites_the_runners_verdict():
    # A trace function may write the locals of the frame it traces: it marks every test passed.
    attack = (
        "import sys\n"
        "def rewrite(frame, event, arg):\n"
        "    if 'passed' in frame.f_locals:\n"
        "        frame.f_locals['passed'] = True\n"
        "    return rewrite\n"
        "frame = sys._getframe()\n"
        "while frame is not None:\n"
        "    frame.f_trace = rewrite\n"
        "    frame = frame.f_back\n"
        "sys.settrace(lambda frame, event, arg: rewrite)\n"
    )
    assert_scores_zero(graded(with_attack(attack)))


def test_monkeypatching_unittest():
    attack = (
        "import unittest\n"
        "unittest.TestCase.run = lambda self, result=None: result\n"
        "unittest.TestResult.wasSuccessful = lambda self: True\n"
        "unittest.main = lambda *a, **k: None\n"
        "raise unittest.SkipTest('skip the hidden tests')\n"
    )
    assert_scores_zero(graded(with_attack(attack)))


def test_memory_access_through_ctypes_is_refused():
    attack = (
        "import ctypes\n"
        "libc = ctypes.CDLL(None)\n"
        "libc._exit(0)\n"
    )
    assert_scores_zero(graded(with_attack(attack)))


def test_writing_its_own_memory_through_proc_self_mem_is_refused():
    attack = "import os\nos.symlink('/proc/self/mem', 'alias')\nopen('alias', 'r+b')\nos._exit(0)\n"
    assert_scores_zero(graded(with_attack(attack)))


@pytest.mark.parametrize("planted", ["conftest.py", "sitecustomize.py", "usercustomize.py", "zz.pth"])
def test_planted_startup_hooks(planted):
    body = "import os\n" + FORGED_LINES + "os._exit(0)\n"
    if planted.endswith(".pth"):
        body = "import os; print(" + repr(FORGED) + "); os._exit(0)\n"
    assert_scores_zero(graded({planted: body, f"tests_hidden/{planted}": body, f"tests/{planted}": body}))


def test_planted_stdlib_shadows():
    # Modules the runner imports or the interpreter loads at start, planted in the workspace.
    body = "import os\n" + FORGED_LINES + "os._exit(0)\n"
    assert_scores_zero(graded({name: body for name in ("json.py", "os.py", "ctypes.py", "encodings.py", "io.py")}))


def test_deleting_or_emptying_the_hidden_tests_and_runner_at_import():
    attack = (
        "import os\n"
        "for name in os.listdir('tests_hidden'):\n"
        "    open(os.path.join('tests_hidden', name), 'w').close()\n"
        "os.remove('tests_hidden/test_mathy.py')\n"
        "open('run_tests.py', 'w').write('print(\"3 passed, 0 failed\")\\n')\n"
    )
    assert_scores_zero(graded(with_attack(attack)))


def test_skipping_every_test():
    # An exception that is not an AssertionError, raised from the code under test in every test.
    attack = (
        "class Skipped(BaseException):\n    pass\n"
        "def double(x):\n    raise Skipped('skipped')\n"
    )
    assert_scores_zero(graded({"mathy.py": attack}))


def test_a_background_process_that_outlives_the_test_file_and_forges_later():
    attack = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    time.sleep(0.5)\n"
        "    for fd in range(3, 256):\n"
        "        try:\n"
        f"            os.write(fd, ({FORGED!r} + '\\n').encode())\n"
        "        except OSError:\n"
        "            pass\n"
        "    os._exit(0)\n"
    )
    assert_scores_zero(graded(with_attack(attack)))
