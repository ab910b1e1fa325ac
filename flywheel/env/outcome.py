"""The record of what a task's hidden tests found, apart from the grader that runs them.

`TestOutcome` travels with every `Trajectory` (and so into serving, the live cycle and reports);
it lives here rather than in `grading.py` so that reading a trajectory does not import the jail.
"""

from __future__ import annotations

from pydantic import BaseModel


class TestOutcome(BaseModel):
    """What the hidden tests found: counts and indicators, never summed into a reward."""

    __test__ = False  # a record, not a pytest test class
    tests_passed_frac: float  # 0 when the run timed out or the supervisor wrote no report
    all_passed: bool
    timed_out: bool
    visible_tests_modified: bool
