"""Grade a finished episode: hidden tests, run in a fresh sandbox over the final workspace.

The hidden tests are copied in only now, after the episode ended, so the agent never saw them.
The grading sandbox starts from the final files with `run_tests.py` restored to the pristine
runner and anything the agent put under `tests_hidden/` removed.

A `Grade` says two things, kept apart so that each field means one thing:
- `outcome` (`TestOutcome`): what the tests found, as counts and indicators: the fraction of hidden
  tests passed, whether all passed, whether the run timed out (the fraction then counts 0), whether
  a visible test file was edited or deleted (other than one the task itself requires changing, such
  as the callers of a renamed function). None of these is a reward.
- `parts`: the additive terms of the reward, which sum to `reward`:
  `pass_frac`              pass_frac_weight x the fraction passed
  `all_passed_bonus`       all_passed_weight when every hidden test passed
  `visible_tests_penalty`  -visible_tests_penalty when a visible test file was modified

Editing or deleting the visible tests gains nothing (the hidden tests are a superset of them)
and costs `visible_tests_penalty`.

How the verdict is made (the full design and its limits are in `testrun.py`'s docstring): the
hidden tests run under a supervisor that runs no workspace code, forks one child per hidden test
file and hands each test a random token that the child's runner writes back once the test returned.
The supervisor writes the outcomes to a descriptor of an unlinked host file (not the command's
output, which anything in the jail can write), and the verdict here counts them against the test
names computed here from the hidden tests: a test that is missing, skipped, never reached or
reported only in the output is a failure. tests/env/test_grading_forgery.py tries the forgeries.
"""

from __future__ import annotations

import json
import shlex
import tempfile
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from flywheel.env.outcome import TestOutcome
from flywheel.env.sandbox import Sandbox, SandboxConfig, Snapshot
from flywheel.env.task import Task
from flywheel.env.testrun import defined_tests

RUNNER_PATH = "run_tests.py"
HIDDEN_DIR = "tests_hidden"
RUNNER_SOURCE = (Path(__file__).parent / "testrun.py").read_text()


class GradeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    timeout_s: float = 20.0  # whole hidden-test run; a solution that hangs scores 0, not forever
    pass_frac_weight: float = 0.5  # partial credit keeps a learning signal on hard tasks
    all_passed_weight: float = 0.5
    visible_tests_penalty: float = 0.1  # small: it only has to make tampering a strict loss


class Grade(BaseModel):
    reward: float
    parts: dict[str, float]  # additive terms of `reward` (module docstring)
    outcome: TestOutcome
    passed: int
    failed: int
    tests: dict[str, bool]
    log: str  # the runner's output when no result could be read, for debugging

    @property
    def all_passed(self) -> bool:
        return self.outcome.all_passed


def grading_files(task: Task, final: Snapshot) -> dict[str, bytes]:
    """The files of the grading workspace: the final one, pristine runner, the hidden tests."""
    files = {p: b for p, b in final.files.items() if not p.startswith(HIDDEN_DIR + "/")}
    files[RUNNER_PATH] = RUNNER_SOURCE.encode()
    files.update({p: t.encode() for p, t in task.hidden_tests.items()})
    return files


def hidden_test_ids(task: Task) -> list[str]:
    """`path::name` of every hidden test, computed from the task, never from the graded run."""
    return [
        f"{path}::{name}"
        for path, source in sorted(task.hidden_tests.items())
        for name in defined_tests(compile(source, path, "exec", dont_inherit=True))
    ]


def parse_report(data: bytes) -> dict[str, bool] | None:
    """The supervisor's `{"tests": {id: passed}}`, or None when it wrote none (it died or timed out)."""
    try:
        tests = json.loads(data)["tests"]
    except (ValueError, KeyError, TypeError):
        return None
    return tests if isinstance(tests, dict) else None


def run_hidden_tests(box: Sandbox, task: Task, timeout_s: float):
    """(command result, reported outcomes or None) of the hidden tests in `box`."""
    paths = " ".join(shlex.quote(p) for p in sorted(task.hidden_tests))
    with tempfile.TemporaryFile() as report:  # unlinked: nothing in the jail can open it by name
        fd = report.fileno()
        run = box.run(f"exec python3 -I -S {RUNNER_PATH} --report-fd {fd} {paths}", timeout_s=timeout_s,
                      pass_fds=(fd,))
        report.seek(0)
        data = report.read()
    return run, None if run.timed_out else parse_report(data)


def visible_tests_modified(task: Task, final: Snapshot) -> bool:
    """Whether a visible test file the task does not ask to change was edited or deleted.

    Some tasks legitimately change tests (a rename updates every caller, tests included); the
    files their reference solution touches are not counted."""
    expected_changes = {e.path for e in task.reference_edits}
    protected = [p for p in task.visible_test_paths() if p not in expected_changes]
    return any(final.files.get(p) != task.files[p].encode() for p in protected)


def grade(task: Task, final: Snapshot, config: GradeConfig | None = None,
          sandbox_config: SandboxConfig | None = None) -> Grade:
    config = config or GradeConfig()
    with Sandbox.create(grading_files(task, final), sandbox_config) as box:
        run, reported = run_hidden_tests(box, task, config.timeout_s)
    ids = hidden_test_ids(task)
    tests = {test: reported.get(test) is True for test in ids} if reported is not None else {}
    passed = sum(tests.values())
    failed = len(ids) - passed
    total = passed + failed
    frac = passed / total if total else 0.0
    all_passed = float(total > 0 and failed == 0)
    modified = float(visible_tests_modified(task, final))
    reward = config.pass_frac_weight * frac + config.all_passed_weight * all_passed
    reward -= config.visible_tests_penalty * modified
    parts = {"pass_frac": config.pass_frac_weight * frac,
             "all_passed_bonus": config.all_passed_weight * all_passed,
             "visible_tests_penalty": -config.visible_tests_penalty * modified}
    return Grade(
        reward=reward,
        parts=parts,
        outcome=TestOutcome(tests_passed_frac=frac, all_passed=bool(all_passed), timed_out=run.timed_out,
                            visible_tests_modified=bool(modified)),
        passed=passed,
        failed=failed,
        tests=tests,
        log="" if reported is not None else run.render()[-2000:],
    )
