"""The toy task the grading tests share: make double(x) return twice x, with three hidden tests
(double(0) among them) and the real test runner in the workspace."""

from __future__ import annotations

from flywheel.env.task import Edit, Task, TaskMetadata
from flywheel.env.testrun import __file__ as RUNNER_FILE

RUNNER = open(RUNNER_FILE).read()
HIDDEN_TESTS = (
    "from mathy import double\n\n"
    "def test_two():\n    assert double(2) == 4\n\n"
    "def test_zero():\n    assert double(0) == 0\n\n"
    "def test_negative():\n    assert double(-3) == -6\n"
)


def double_task(task_id: str, body: str) -> Task:
    """The task with `mathy.py`'s double returning `body` (e.g. "x", "x + 1"); its reference edit fixes it."""
    return Task(
        id=task_id,
        family="toy",
        split="train",
        instruction="Make double(x) return twice x.",
        files={
            "run_tests.py": RUNNER,
            "mathy.py": f"def double(x):\n    return {body}\n",
            "tests/test_mathy.py": "from mathy import double\n\ndef test_two():\n    assert double(2) == 4\n",
        },
        hidden_tests={"tests_hidden/test_mathy.py": HIDDEN_TESTS},
        test_command="python3 run_tests.py tests",
        metadata=TaskMetadata(difficulty=1),
        reference_edits=(Edit(path="mathy.py", old=f"return {body}", new="return 2 * x"),),
    )
