"""Grading runs the hidden tests in a fresh real sandbox; tampering and hacks gain nothing."""

from __future__ import annotations

import pytest

from flywheel.env.families import generate
from flywheel.env.grading import GradeConfig, grade
from flywheel.env.outcome import TestOutcome
from flywheel.env.sandbox import Sandbox
from tests.env.double_task import double_task

TASK = double_task("toy/train/0", "x")
SOLUTION_STUB = TASK.files["mathy.py"]  # double returns x


def final_with(files: dict[str, str | None]):
    """The task's workspace with `files` written over it (None deletes a file)."""
    merged = {p: t for p, t in {**TASK.files, **files}.items() if t is not None}
    with Sandbox.create(merged) as box:
        return box.snapshot()


def test_correct_solution_gets_full_reward():
    result = grade(TASK, final_with({"mathy.py": "def double(x):\n    return 2 * x\n"}))
    assert result.passed == 3 and result.failed == 0 and result.all_passed and result.reward == pytest.approx(1.0)
    assert result.outcome == TestOutcome(tests_passed_frac=1.0, all_passed=True, timed_out=False,
                                         visible_tests_modified=False)
    assert result.parts == {"pass_frac": 0.5, "all_passed_bonus": 0.5, "visible_tests_penalty": 0.0}


def test_partial_solution_gets_partial_credit():
    # right for 0 only: passes test_zero, fails the other two
    result = grade(TASK, final_with({"mathy.py": "def double(x):\n    return 0\n"}))
    assert (result.passed, result.failed) == (1, 2)
    assert result.reward == pytest.approx(0.5 / 3)
    assert result.tests["tests_hidden/test_mathy.py::test_zero"] is True


def test_deleting_or_editing_visible_tests_gains_nothing():
    untouched = grade(TASK, final_with({}))
    deleted = grade(TASK, final_with({"tests/test_mathy.py": None}))
    gutted = grade(TASK, final_with({"tests/test_mathy.py": "def test_two():\n    pass\n"}))
    for tampered in (deleted, gutted):
        assert tampered.outcome.visible_tests_modified
        assert tampered.parts["visible_tests_penalty"] == pytest.approx(-0.1)
        assert sum(tampered.parts.values()) == pytest.approx(tampered.reward)
        assert tampered.reward < untouched.reward


def test_printing_a_fake_result_line_does_not_count():
    forged = (
        "import sys\n"
        "print('0' * 32 + ' {\"passed\": 99, \"failed\": 0, \"tests\": {}}')\n"
        "sys.stderr.write('3 passed, 0 failed\\n')\n"
        "def double(x):\n    return x\n"
    )
    result = grade(TASK, final_with({"mathy.py": forged}))
    assert result.passed == 1 and result.failed == 2  # only test_zero: double(0) == 0


def test_replacing_the_runner_or_planting_hidden_tests_does_not_count():
    fake_runner = "print('all good')\n"
    planted = "def test_ok():\n    pass\n"
    result = grade(TASK, final_with({"run_tests.py": fake_runner, "tests_hidden/test_mine.py": planted}))
    assert result.passed == 1 and result.failed == 2 and "tests_hidden/test_mine.py::test_ok" not in result.tests


def test_output_flood_does_not_hide_the_result():
    flood = "import os\nos.system('yes | head -c 10000000')\nprint('x' * 5_000_000)\n" + SOLUTION_STUB.replace(
        "return x", "return 2 * x"
    )
    result = grade(TASK, final_with({"mathy.py": flood}))
    assert result.all_passed


def test_a_hanging_solution_times_out_with_zero_reward():
    hang = "def double(x):\n    while True:\n        pass\n"
    result = grade(TASK, final_with({"mathy.py": hang}), GradeConfig(timeout_s=2))
    assert result.outcome.timed_out and result.reward == 0.0


def test_hidden_tests_are_not_in_the_episode_workspace():
    for task in generate("bugfix", "train", 3):
        assert not any(p.startswith("tests_hidden/") for p in task.files)
        with Sandbox.create(task.files) as box:
            assert box.run("ls tests_hidden").exit_code != 0


def test_the_agents_run_tests_still_prints_a_readable_summary():
    with Sandbox.create(TASK.files) as box:
        broken = box.run(TASK.test_command)
        box.write_text("mathy.py", "def double(x):\n    return 2 * x\n")
        fixed = box.run(TASK.test_command)
    assert broken.exit_code == 1 and "FAILED tests/test_mathy.py::test_two" in broken.output
    assert "assert double(2) == 4" in broken.output and broken.output.rstrip().endswith("0 passed, 1 failed")
    assert fixed.exit_code == 0 and fixed.output.strip() == "1 passed, 0 failed"


def test_deleting_the_hidden_tests_while_they_run_changes_nothing():
    # The supervisor read and compiled them before any workspace code ran, and the grader lists the
    # tests itself: each one is in `tests`, graded on its merits.
    remover = "import os\nos.remove('tests_hidden/test_mathy.py')\n" + SOLUTION_STUB
    result = grade(TASK, final_with({"mathy.py": remover}))
    assert sorted(result.tests) == [f"tests_hidden/test_mathy.py::{n}"
                                    for n in ("test_negative", "test_two", "test_zero")]
    assert result.tests["tests_hidden/test_mathy.py::test_zero"] is True  # double(0) == 0 holds for the stub
    assert (result.passed, result.failed) == (1, 2)
