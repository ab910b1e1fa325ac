"""Simulated organizations: the same bug in a codebase with house rules, graded for real. The general
fix repairs the logic and fails the organization's rules; the organization-aware fix passes both."""

from __future__ import annotations

import pytest

from flywheel.env.families import generate
from flywheel.env.grading import grade
from flywheel.env.sandbox import Snapshot
from flywheel.env.task import Edit, Task
from flywheel.sim.orgs import HouseRules, general_fix


def applied(task: Task, edits: tuple[Edit, ...]) -> Snapshot:
    files = dict(task.files)
    for e in edits:
        assert e.old in files[e.path], f"{e.path}: the edit's old text is not there"
        files[e.path] = files[e.path].replace(e.old, e.new, 1)
    return Snapshot.of_files(files)


def test_the_general_fix_fails_an_organizations_house_rules_and_the_aware_fix_passes():
    rules = HouseRules(org_id="acme", helper="audit", call="record", tests_dir="checks")
    general_tasks = generate("bugfix", "train", 3, seed=11)
    org_tasks = [rules.adapt(t) for t in general_tasks]
    general_on_general = [grade(t, applied(t, t.reference_edits)).all_passed for t in general_tasks]
    general_on_org = [grade(t, applied(t, (general_fix(t),))) for t in org_tasks]
    aware_on_org = [grade(t, applied(t, t.reference_edits)).all_passed for t in org_tasks]
    assert general_on_general == [1.0] * 3 and aware_on_org == [1.0] * 3
    assert [g.all_passed for g in general_on_org] == [0.0] * 3
    # It fails on the house rule only: every one of the task's own tests passes.
    for g in general_on_org:
        failed = [test for test, ok in g.tests.items() if not ok]
        assert len(failed) == 1 and "house_rules" in failed[0] and len(g.tests) > 1
    for t in org_tasks:
        assert t.id.startswith("acme/") and t.metadata.extra["org_id"] == "acme"
        assert t.test_command.endswith(" checks") and any(p.startswith("checks/") for p in t.files)
        assert not any(p.startswith("tests/") for p in t.files) and any(p.endswith("/audit.py") for p in t.files)
        assert grade(t, Snapshot.of_files(t.files)).all_passed == 0.0  # untouched, it fails as every task does
    with pytest.raises(ValueError, match="only bugfix"):
        rules.adapt(generate("implement", "train", 1, seed=11)[0])
