"""The scripted expert solves every family through the tools only, in real sandboxes."""

from __future__ import annotations

import pytest

from flywheel.env.families import FAMILIES, generate
from flywheel.env.grading import grade
from flywheel.env.pool import PoolConfig, SandboxPool
from flywheel.env.sandbox import Snapshot
from flywheel.sim.expert import CLARIFYING_QUESTION, ScriptedExpert, run_policy


@pytest.fixture(scope="module")
def pool():
    with SandboxPool(PoolConfig(max_active=4, warm=2)) as p:
        yield p


@pytest.mark.parametrize("family", [*FAMILIES, "humaneval"])
@pytest.mark.parametrize("difficulty", [1, 2, 3])
def test_expert_solves_what_the_untouched_workspace_fails(pool, family, difficulty):
    if family == "humaneval" and difficulty != 2:
        pytest.skip("HumanEval tasks have one difficulty level")
    expert = ScriptedExpert(seed=difficulty)
    for task in generate(family, "eval", 2, seed=7, difficulty=difficulty):
        untouched = grade(task, Snapshot.of_files(task.files))
        assert not untouched.all_passed, f"{task.id}: hidden tests pass without any change"
        episode = run_policy(task, expert.play(task), pool)
        assert episode.finished
        tool_names = {c.name for action, _ in episode.turns for c in action.calls}
        assert {"edit_file", "run_command", "finish"} <= tool_names
        result = grade(task, episode.final)
        assert result.all_passed, f"{task.id}: expert failed: {result.log or result.tests}"
        assert not result.outcome.visible_tests_modified


def test_expert_asks_first_on_ambiguous_tasks_and_gets_the_detail(pool):
    task = generate("ambiguous", "train", 1, seed=3)[0]
    episode = run_policy(task, ScriptedExpert().play(task), pool)
    first_action, reply = episode.turns[0]
    assert first_action.text == CLARIFYING_QUESTION and not first_action.calls
    assert reply == task.metadata.clarification


def test_expert_with_mistakes_fails_some_tasks(pool):
    expert = ScriptedExpert(seed=0, mistake_rate=1.0)
    tasks = generate("bugfix", "train", 4, seed=11, difficulty=2)
    results = [grade(t, run_policy(t, expert.play(t), pool).final) for t in tasks]
    assert sum(r.all_passed for r in results) < len(tasks)


@pytest.mark.parametrize("family", FAMILIES)
def test_expert_reads_only_what_it_has_seen_named(pool, family):
    """What SFT can teach: every path the expert reads and every name it greps for appears in the
    instruction or in an earlier tool result (no argument comes from the hidden reference edits)."""
    for task in generate(family, "train", 6, seed=5, difficulty=1):
        seen = task.instruction
        for action, observation in run_policy(task, ScriptedExpert(seed=1).play(task), pool).turns:
            for call in action.calls:
                if call.name == "read_file":
                    assert call.arguments["path"] in seen, f"{task.id}: read {call.arguments['path']} unseen"
                if call.name == "grep":
                    name = call.arguments["pattern"].removeprefix("def ").replace("\\b", "")
                    assert name in seen, f"{task.id}: grep for {name!r} unseen"
            seen += observation if isinstance(observation, str) else "".join(r.content for r in observation)


def test_expert_recovers_from_a_wrong_package_through_the_errors_hint(pool):
    """wrong_path_rate: a named file is first read under another package; the next read is the
    path the error suggested, and the task is still solved."""
    task = next(t for t in generate("ambiguous", "train", 8, seed=3, difficulty=1)
                if (t.reference_edits[0].path in t.instruction))
    episode = run_policy(task, ScriptedExpert(seed=0, wrong_path_rate=1.0).play(task), pool)
    reads = [(c.arguments["path"], r) for action, results in episode.turns if not isinstance(results, str)
             for c, r in zip(action.calls, results, strict=True) if c.name == "read_file"]
    (wrong, failed), (right, found) = reads[:2]
    assert wrong != right and wrong.split("/")[1:] == right.split("/")[1:]
    assert not failed.ok and failed.content.endswith(f"did you mean {right}?") and found.ok
    assert grade(task, episode.final).all_passed
    plain = run_policy(task, ScriptedExpert(seed=0).play(task), pool)
    assert [c.arguments["path"] for a, _ in plain.turns for c in a.calls if c.name == "read_file"] == [right]


def test_expert_repairs_after_a_failing_test_run_only(pool):
    """repair_rate: an episode that left part of its fix out and sees its test run fail reads the
    code again, makes the rest of the fix and runs the tests again; a green run is left alone."""
    repaired = 0
    for task in generate("crossfile", "train", 6, seed=11, difficulty=1):
        episode = run_policy(task, ScriptedExpert(seed=0, mistake_rate=1.0, repair_rate=1.0).play(task), pool)
        runs = [r for action, results in episode.turns if not isinstance(results, str)
                for c, r in zip(action.calls, results, strict=True) if c.name == "run_command"]
        assert episode.finished
        if runs[0].content.endswith("[exit code 0]"):
            assert len(runs) == 1
            continue
        repaired += 1
        assert len(runs) == 2 and runs[1].content.endswith("[exit code 0]")
        assert grade(task, episode.final).all_passed, f"{task.id}: the repair did not fix it"
    assert repaired >= 3
