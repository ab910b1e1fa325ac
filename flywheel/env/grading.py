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

Real-repository tasks (`Task.graded_by_pytest`: FAIL_TO_PASS / PASS_TO_PASS node ids) are graded
the same way by the supervisor's pytest mode, in a jail with the task's dependency environment
bound, over the test files their ids name; the task's conftest.py and pytest config files replace
the agent's (`PYTEST_CONTROL_FILES`). Their reward parts split `pass_frac` in two:
  `fail_to_pass`           pass_frac_weight x the FAIL_TO_PASS tests passed / all graded tests
  `pass_to_pass`           pass_frac_weight x the PASS_TO_PASS tests passed / all graded tests
and `all_passed_bonus` is SWE-bench's "resolved". tests/env/test_repos.py checks the counts
against pytest run outside the sandbox.
"""

from __future__ import annotations

import json
import shlex
import tempfile
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from flywheel.env.environments import task_environment
from flywheel.env.outcome import TestOutcome
from flywheel.env.sandbox import ENV_MOUNT, Sandbox, SandboxConfig, Snapshot
from flywheel.env.task import Task
from flywheel.env.testrun import defined_tests

RUNNER_PATH = "run_tests.py"
# Where a real-repository task's grading workspace gets the runner: a repository may have its own
# run_tests.py, and pytest collects neither name.
PYTEST_RUNNER_PATH = ".flywheel_grader.py"
HIDDEN_DIR = "tests_hidden"
# Files that change how pytest collects, runs or reports (hooks, plugins, addopts): a pytest-graded
# task grades with the task's own copies, and any the agent added are dropped.
PYTEST_CONTROL_FILES = frozenset({"conftest.py", "pytest.ini", "tox.ini", "setup.cfg", "pyproject.toml"})
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
    if task.graded_by_pytest:  # what decides how pytest runs and reports is the task's, not the agent's
        files = {p: b for p, b in files.items() if p.rsplit("/", 1)[-1] not in PYTEST_CONTROL_FILES}
        files.update({p: t.encode() for p, t in task.files.items() if p.rsplit("/", 1)[-1] in PYTEST_CONTROL_FILES})
    files[PYTEST_RUNNER_PATH if task.graded_by_pytest else RUNNER_PATH] = RUNNER_SOURCE.encode()
    files.update({p: t.encode() for p, t in task.hidden_tests.items()})
    return files


def hidden_test_ids(task: Task) -> list[str]:
    """`path::name` of every hidden test, computed from the task, never from the graded run (a
    pytest-graded task: its FAIL_TO_PASS then PASS_TO_PASS node ids)."""
    if task.graded_by_pytest:
        return list(dict.fromkeys(task.fail_to_pass + task.pass_to_pass))
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


def pytest_files(task: Task) -> list[str]:
    """The test files holding the task's node ids (`path::name[param]` -> path), in order."""
    return list(dict.fromkeys(test.split("::", 1)[0] for test in hidden_test_ids(task)))


def run_hidden_tests(box: Sandbox, task: Task, timeout_s: float):
    """(command result, reported outcomes or None) of the hidden tests in `box`."""
    with tempfile.TemporaryFile() as report:  # unlinked: nothing in the jail can open it by name
        fd = report.fileno()
        if task.graded_by_pytest:
            paths = " ".join(shlex.quote(p) for p in pytest_files(task))
            command = f"exec python3 -I -S {PYTEST_RUNNER_PATH} --report-fd {fd} --pytest {ENV_MOUNT}/site -- {paths}"
        else:
            paths = " ".join(shlex.quote(p) for p in sorted(task.hidden_tests))
            command = f"exec python3 -I -S {RUNNER_PATH} --report-fd {fd} {paths}"
        run = box.run(command, timeout_s=timeout_s, pass_fds=(fd,))
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
    environment = task_environment(task)
    if task.grader == "harbor":  # an imported Harbor task: its own test.sh and reward file
        from flywheel.env.harbor import grade_harbor  # noqa: PLC0415  (harbor.py builds on this module)

        return grade_harbor(task, final, config, sandbox_config, environment)
    with Sandbox.create(grading_files(task, final), sandbox_config, environment=environment) as box:
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
    if task.graded_by_pytest:  # SWE-bench: the part each kind of test earned, summing to pass_frac's
        f2p = sum(tests.get(t, False) for t in task.fail_to_pass)
        p2p = sum(tests.get(t, False) for t in ids if t not in set(task.fail_to_pass))
        parts = {"fail_to_pass": config.pass_frac_weight * f2p / total if total else 0.0,
                 "pass_to_pass": config.pass_frac_weight * p2p / total if total else 0.0}
    else:
        parts = {"pass_frac": config.pass_frac_weight * frac}
    parts |= {"all_passed_bonus": config.all_passed_weight * all_passed,
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
