"""The `Task` record: one coding problem an agent solves inside a sandbox.

A task carries everything needed to set up, converse about and grade an episode:
the starting workspace (`files`), what the user asks (`instruction`), the tests the agent never
sees (`hidden_tests`, copied in only for grading) and the command that runs tests.
`reference_edits` is the known solution; only the scripted expert and the tests read it.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Iterable
from importlib import resources
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from flywheel.env.jsonl import read_records

Split = Literal["train", "eval"]
SPLITS: tuple[Split, ...] = ("train", "eval")

# The reply a user gives when asked a question about a request that was already clear.
JUST_DO_IT = "Please just do it: the request has everything you need."


class Edit(BaseModel):
    """Replace `old` by `new` in `path` (an empty `old` creates the file with `new`)."""

    model_config = ConfigDict(frozen=True)
    path: str
    old: str
    new: str


class TaskMetadata(BaseModel):
    model_config = ConfigDict(frozen=True)
    difficulty: int = Field(ge=1, le=3)
    ambiguous: bool = False
    # On an ambiguous task: the detail the instruction leaves out, given when the agent asks.
    clarification: str | None = None
    extra: dict[str, str | int | float | bool] = Field(default_factory=dict)


class Task(BaseModel):
    model_config = ConfigDict(frozen=True)
    id: str
    family: str
    split: Split
    instruction: str
    files: dict[str, str]
    hidden_tests: dict[str, str]
    test_command: str
    metadata: TaskMetadata
    reference_edits: tuple[Edit, ...] = ()
    # Real-repository tasks (flywheel/env/repos.py): the pip requirement lines of the dependency
    # environment bound at /env (environments.EnvSpec; empty: the standard library only), and the
    # pytest node ids that grade it with SWE-bench semantics: FAIL_TO_PASS must pass after the fix,
    # PASS_TO_PASS must keep passing. With either set, grading runs pytest (grading.py).
    environment: tuple[str, ...] = ()
    fail_to_pass: tuple[str, ...] = ()
    pass_to_pass: tuple[str, ...] = ()
    # Who grades: flywheel's supervisor over `hidden_tests` (grading.py), or an imported Harbor task's
    # own tests/test.sh and the reward file it writes (harbor.py; its tests are `hidden_tests`).
    grader: Literal["flywheel", "harbor"] = "flywheel"

    @property
    def graded_by_pytest(self) -> bool:
        return bool(self.fail_to_pass or self.pass_to_pass)

    def answer_question(self, question: str) -> str:
        """The user's reply when the agent asks something instead of acting.

        On an ambiguous task the user supplies the missing detail; on a clear one they
        only say to get on with it. Either way the question has cost the agent a turn.
        """
        del question  # the simulated user answers the same whatever was asked
        if self.metadata.ambiguous and self.metadata.clarification:
            return self.metadata.clarification
        return JUST_DO_IT

    def content_key(self) -> str:
        """A hash of what makes the task a distinct problem (not its id, split or test runner).

        The shipped runner (`run_tests.py`, testrun.py verbatim) is no part of the problem: it is
        hashed as the frozen text in `keyed_runner.txt` whatever its current text, so the runner can
        change without redrawing any task (tests/env/test_tasks.py pins keys measured before)."""
        files = self.files
        if RUNNER_FILE in files:
            files = {**files, RUNNER_FILE: keyed_runner_text()}
        fields: list = [self.family, self.instruction, files, self.hidden_tests]
        if self.graded_by_pytest or self.environment:  # absent from the keys of the generated families
            fields += [self.environment, self.fail_to_pass, self.pass_to_pass]
        if self.grader != "flywheel":
            fields.append(self.grader)
        body = json.dumps(fields, sort_keys=True)
        return hashlib.sha256(body.encode()).hexdigest()[:16]

    def visible_test_paths(self) -> list[str]:
        return sorted(p for p in self.files if is_test_path(p))


RUNNER_FILE = "run_tests.py"  # the workspace's copy of testrun.py


@functools.cache
def keyed_runner_text() -> str:
    """testrun.py as it was when task keys were first drawn (never edit `keyed_runner.txt`: every
    generated task's content key, and so its split and its place in a draw, hashes this text)."""
    return resources.files("flywheel.env").joinpath("keyed_runner.txt").read_text()


def is_test_path(path: str) -> bool:
    name = path.rsplit("/", 1)[-1]
    return name.startswith("test_") and name.endswith(".py")


def split_of(key: str, eval_fraction: float = 0.2) -> Split:
    """Deterministic split from a content key, so one problem can never be in both splits."""
    bucket = int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return "eval" if bucket < eval_fraction else "train"


def write_tasks(path: Path, tasks: Iterable[Task]) -> int:
    """Write `tasks` to `path` as JSON lines, one Task record a line (`flywheel tasks export`); returns
    how many. `read_tasks` reads them back equal."""
    lines = [task.model_dump_json() + "\n" for task in tasks]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(lines))
    return len(lines)


def read_tasks(path: Path) -> list[Task]:
    """The Task records of a JSON-lines file (blank lines skipped). A missing file, a line that is no
    Task, or a file with no task raises ValueError naming the file (and the line), so a bad battery
    is refused before anything runs on it."""
    return read_records(path, Task, what="Task", plural="tasks", command="flywheel tasks export")
