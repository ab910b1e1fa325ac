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
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from flywheel.env.sandbox import Sandbox, SandboxConfig, Snapshot
from flywheel.env.task import Task

RUNNER_PATH = "run_tests.py"
HIDDEN_DIR = "tests_hidden"
RUNNER_SOURCE = (Path(__file__).parent / "testrun.py").read_text()


class GradeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    timeout_s: float = 20.0  # whole hidden-test run; a solution that hangs scores 0, not forever
    pass_frac_weight: float = 0.5  # partial credit keeps a learning signal on hard tasks
    all_passed_weight: float = 0.5
    visible_tests_penalty: float = 0.1  # small: it only has to make tampering a strict loss


class TestOutcome(BaseModel):
    """What the hidden tests found: counts and indicators, never summed into a reward."""

    __test__ = False  # a record, not a pytest test class
    tests_passed_frac: float  # 0 when the run timed out or printed no result
    all_passed: bool
    timed_out: bool
    visible_tests_modified: bool


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


def grading_files(task: Task, final: Snapshot) -> tuple[dict[str, bytes], str]:
    """The files of the grading workspace and the nonce its result line will carry."""
    nonce = secrets.token_hex(16)
    files = {p: b for p, b in final.files.items() if not p.startswith(HIDDEN_DIR + "/")}
    files[RUNNER_PATH] = RUNNER_SOURCE.encode()
    files.update({p: t.encode() for p, t in task.hidden_tests.items()})
    files[".nonce"] = nonce.encode()
    return files, nonce


def parse_result(output: str, nonce: str) -> dict | None:
    for line in reversed(output.splitlines()):
        if line.startswith(nonce + " "):
            return json.loads(line[len(nonce) + 1 :])
    return None


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
    files, nonce = grading_files(task, final)
    with Sandbox.create(files, sandbox_config) as box:
        run = box.run(f"python3 -I {RUNNER_PATH} --nonce-file .nonce {HIDDEN_DIR}", timeout_s=config.timeout_s)
    result = None if run.timed_out else parse_result(run.output, nonce)
    passed = result["passed"] if result else 0
    failed = result["failed"] if result else len(task.hidden_tests)
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
        tests=result["tests"] if result else {},
        log="" if result else run.render()[-2000:],
    )
