"""Simulated users drive a served tiny model over HTTP and their events land as rewards on the right completions.

The first test runs a population against a real server on loopback that serves a real tiny model
(random weights: its answers are gibberish, sometimes with a broken tool call). The second serves a
scripted engine that answers each task one fixed way, so every branch of the user is reached for
certain: a correct edit kept, a wrong edit reverted after a dissatisfied follow-up, a needless
question, a needed one, broken tool calls (sent as the answer's text, counted, penalized).
"""

from __future__ import annotations

import json
import random
import sys
import time
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "live"))  # tiny_serving, shared with the server tests
from tiny_serving import KEYS, TOOL_ANSWER, tiny_registry_root  # noqa: E402

from flywheel.api.events import EventType  # noqa: E402
from flywheel.client import EventClient  # noqa: E402
from flywheel.env.families import generate  # noqa: E402
from flywheel.env.pool import PoolConfig, SandboxPool  # noqa: E402
from flywheel.env.task import JUST_DO_IT, Task  # noqa: E402
from flywheel.env.toolspec import ToolCall  # noqa: E402
from flywheel.live.deploy import Deployment, Router  # noqa: E402
from flywheel.live.monitors import Monitor, label_tests_passed  # noqa: E402
from flywheel.live.rewards import RewardConfig, RewardDistiller  # noqa: E402
from flywheel.live.server import LiveServer, ServeConfig, serve_in_thread  # noqa: E402
from flywheel.live.settings import LoopConfig  # noqa: E402
from flywheel.live.store import LiveStore  # noqa: E402
from flywheel.model.chat import IM_END  # noqa: E402
from flywheel.model.engine import Generation, SamplingParams  # noqa: E402
from flywheel.model.tokenizer import load_tokenizer  # noqa: E402
from flywheel.sim.feedback import (  # noqa: E402
    TESTS_FAIL,
    VAGUE,
    Trail,
    expected_line,
    words_for_failing_tests,
    words_for_needless_question,
)
from flywheel.sim.orgs import HouseRules, general_fix  # noqa: E402
from flywheel.sim.users import (  # noqa: E402
    WORK_ALONE,
    Population,
    UserProfile,
    plan_sessions,
    release_due,
    run_population,
)

REWARDS = RewardConfig()


@pytest.fixture(scope="module")
def registry_root(tmp_path_factory) -> Path:
    return tiny_registry_root(tmp_path_factory)


@pytest.fixture(scope="module")
def pool():
    with SandboxPool(PoolConfig(max_active=4, warm=1)) as p:
        yield p


def distill(store: LiveStore):
    completions, events = store.completions(), store.events()
    rewards = {r.completion_id: r for r in RewardDistiller(REWARDS).distill(completions, events, now=time.time())}
    return completions, events, rewards


def check_events_land(store: LiveStore, stats) -> tuple[list, list, dict]:
    """What holds for any run: nothing lost, every event on a completion of its own session, and
    every outcome the user reported is a reward part of the completion it names."""
    assert stats.server_errors == 0, [r.error for r in stats.session_results]
    ev = stats.events
    assert ev["emitted"] == ev["accepted"] > 0 and ev["rejected"] == ev["failed"] == ev["dropped"] == 0, ev
    completions, events, rewards = distill(store)
    assert store.count_events() == ev["accepted"]  # every acknowledged event is in the store
    assert len(completions) == stats.completions
    by_id = {c.id: c for c in completions}
    for e in events:
        if e.completion_id is not None:
            assert by_id[e.completion_id].session_id == e.session_id
    weights = {EventType.EDIT_PERSISTED: REWARDS.edit_persisted, EventType.EDIT_REVERTED: REWARDS.edit_reverted}
    for e in events:
        if e.type in weights:
            assert rewards[e.completion_id].parts[e.type.value] == weights[e.type]
            # A failing edit may be kept by a lax user, a passing one is never reverted.
            assert isinstance(e.payload["tests_passed"], bool)
            assert e.type == EventType.EDIT_PERSISTED or not e.payload["tests_passed"]
        if e.type == EventType.FOLLOWUP and e.payload["dissatisfied"]:
            assert rewards[e.completion_id].parts["followup_dissatisfied"] == REWARDS.followup_dissatisfied
    for result in stats.session_results:
        mine = [c for c in completions if c.session_id == result.session_id]
        assert [c.id for c in mine] == result.completion_ids
        for c in mine:
            task_meta = {"family": result.family, "ambiguous": result.ambiguous, "task_id": result.task_id}
            assert task_meta.items() <= c.request_meta.items() and c.user_id == result.user_id
            if c.invalid_tool_calls:  # never dropped: a broken call costs, whoever made it
                assert rewards[c.id].parts["invalid_call_penalty"] == \
                    REWARDS.invalid_tool_call * c.invalid_tool_calls
        ends = [e for e in store.events_for_session(result.session_id) if e.type == EventType.SESSION_END]
        assert [e.payload["outcome"] for e in ends] == [result.outcome]
        assert rewards[mine[-1].id].parts[f"session_{result.outcome}"] == REWARDS.session_outcome[result.outcome]
    labelled = label_tests_passed(completions, events)
    passed = {r.session_id: r.tests_passed for r in stats.session_results}
    assert all(c.request_meta["tests_passed"] is passed[c.session_id] for c in labelled)
    return labelled, events, rewards


def test_a_population_drives_the_served_tiny_model_and_its_events_become_rewards(registry_root, pool, tmp_path):
    config = ServeConfig(loop=LoopConfig.at(tmp_path / "live.sqlite", registry_root), keys=KEYS, candidate_fraction=0.5,
                         threads=1)
    population = Population(seed=3, users=4, concurrency=3, tasks_per_family=2, max_tokens=96, profiles=[
        UserProfile(name="patient", patience=4, followup_propensity=1.0, thumbs_propensity=1.0),
        UserProfile(name="impatient", patience=3, thumbs_propensity=0.0, families={"ambiguous": 1.0, "bugfix": 1.0})])
    server = LiveServer.from_config(config)
    with server, serve_in_thread(server) as running:
        stats = run_population(running.url, "inference-key", population, 8, pool, events_key="events-key")
        labelled, events, rewards = check_events_land(server.store, stats)
    assert stats.sessions == 8 and stats.completions >= 8 and stats.latency_ms_p50 > 0
    # Gibberish without tool calls is a non-answer: on a clear task every one gets a dissatisfied follow-up.
    unhappy = {e.completion_id for e in events if e.type == EventType.FOLLOWUP and e.payload["dissatisfied"]}
    words = [c for c in labelled if not c.tool_calls and not c.request_meta["ambiguous"]]
    assert words and all(c.id in unhappy for c in words)
    # A random model writes broken tool calls now and then (about one answer in four at 96 tokens);
    # each is answered with its error and is a negative reward part, never dropped.
    broken = [c for c in labelled if c.invalid_tool_calls]
    assert broken and stats.invalid_tool_calls == sum(c.invalid_tool_calls for c in labelled)
    assert all(rewards[c.id].parts["invalid_call_penalty"] < 0 for c in broken)
    report = Monitor().run(labelled, list(rewards.values()))
    assert {"tests_passed_rate", "clarify_rate_clear", "invalid_call_rate"} <= {p.metric for p in report.series}


class TaskScriptedEngine:
    """An Engine that answers each task's conversation with that task's fixed text."""

    def __init__(self, tokenizer, answers: dict[str, str]):
        self.tokenizer = tokenizer
        self.answers = {instruction: tokenizer(text, add_special_tokens=False)["input_ids"]
                        for instruction, text in answers.items()}
        self.prompts: dict[str, list[str]] = {instruction: [] for instruction in answers}

    @property
    def version(self) -> int:
        return 0

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams) -> Future[Generation]:
        prompt = self.tokenizer.decode(list(prompt_ids), skip_special_tokens=False)
        (instruction,) = [i for i in self.answers if i in prompt]
        self.prompts[instruction].append(prompt)
        ids = self.answers[instruction][: params.max_tokens]
        future: Future[Generation] = Future()
        future.set_result(Generation(ids, [-0.5] * len(ids), [0] * len(ids), "stop"))
        return future

    def update_weights(self, weights, version: int, timeout_s: float = 60.0) -> None:
        raise NotImplementedError("a scripted engine has no weights")

    def close(self) -> None:
        pass


def calls(*calls: tuple[str, dict]) -> str:
    return "".join(f"\n<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>" for n, a in calls)


def fix(task: Task) -> str:
    return "Fixing it." + calls(*[("edit_file", e.model_dump()) for e in task.reference_edits],
                                ("finish", {"summary": "fixed"})) + IM_END


def test_users_keep_good_edits_revert_bad_ones_and_answer_questions_by_need(registry_root, pool, tmp_path):
    good, wrong = generate("bugfix", "train", 2, seed=5)
    clear, vague, broken = (generate(f, "train", 1, seed=5)[0] for f in ("implement", "ambiguous", "crossfile"))
    assert vague.metadata.ambiguous and not clear.metadata.ambiguous
    question = "Which behaviour do you want exactly?" + IM_END
    answers = {good.instruction: fix(good), clear.instruction: question, vague.instruction: question,
               broken.instruction: TOOL_ANSWER,
               wrong.instruction: "Done." + calls(("edit_file", {"path": "notes.txt", "old": "", "new": "todo\n"}),
                                                  ("finish", {})) + IM_END}
    tokenizer = load_tokenizer(registry_root / "checkpoints" / "v0")
    engine = TaskScriptedEngine(tokenizer, answers)
    config = ServeConfig(loop=LoopConfig.at(tmp_path / "live.sqlite"), keys=KEYS)
    server = LiveServer(config, Router(lambda version: (engine, tokenizer), Deployment(production=0)),
                        LiveStore(config.loop.store.path))
    population = Population(concurrency=3, max_tokens=512, profiles=[UserProfile(
        name="strict", patience=2, followup_propensity=1.0, thumbs_propensity=1.0, revert_strictness=1.0,
        followup_vague_share=0.0, followup_wrong_share=0.0)])
    tasks = [good, wrong, clear, vague, broken]
    with server, serve_in_thread(server) as running:
        stats = run_population(running.url, "admin-key", population, len(tasks), pool, tasks=tasks)
        _, events, rewards = check_events_land(server.store, stats)
    results = {r.task_id: r for r in stats.session_results}
    kinds, texts = {}, {}
    for e in events:
        if e.type == EventType.FOLLOWUP:
            texts.setdefault(e.completion_id, []).append(e.payload["text"])
    for e in sorted(events, key=lambda e: e.time):  # batches may land out of order; event times do not
        kinds.setdefault(e.completion_id, []).append((e.type.value, e.payload.get("dissatisfied", e.payload.get("up"))))

    # A correct edit: applied, kept, thumbs up, success.
    r = results[good.id]
    (c,) = r.completion_ids
    assert (r.outcome, r.tests_passed, r.kept, r.edit_completions) == ("success", True, True, [c])
    assert kinds[c] == [("edit_applied", None), ("edit_persisted", None), ("thumbs", True)]
    assert rewards[c].parts == {"edit_persisted": 1.0, "thumbs_up": 0.5, "session_success": 0.5}

    # A wrong edit: the tests fail, the user says so, the agent tries again (its edit fails now), the edit is reverted.
    r = results[wrong.id]
    first, second = r.completion_ids
    assert (r.outcome, r.tests_passed, r.kept, r.edit_completions, r.dissatisfied) == ("unhappy", False, False, [first],
                                                                                       1)
    assert kinds[first] == [("edit_applied", None), ("followup", True), ("edit_reverted", None)]
    assert kinds[second] == [("thumbs", False)]
    # It says what went wrong, in the words the agent then reads: the wrong file, no test run.
    (fix_path,) = {e.path for e in wrong.reference_edits}
    (said,) = texts[first]
    assert f"You changed notes.txt, but the problem is in {fix_path}." in said
    assert f"You never ran the tests: run `{wrong.test_command}`" in said
    assert said in engine.prompts[wrong.instruction][1]

    # A needless question on a clear task: always a dissatisfied follow-up; the question is never refunded.
    r = results[clear.id]
    assert (r.outcome, r.questions, r.dissatisfied, r.edit_completions) == ("abandoned", 2, 2, [])
    for c in r.completion_ids:
        assert ("followup", True) in kinds[c]
        assert rewards[c].parts["clarify"] == -REWARDS.clarify_cost and "clarify_refund" not in rewards[c].parts
    assert JUST_DO_IT in engine.prompts[clear.instruction][1]
    assert texts[r.completion_ids[0]] == [JUST_DO_IT]

    # On an ambiguous task the first question is answered with the detail (not a dissatisfier); asking again is.
    r = results[vague.id]
    first, second = r.completion_ids
    assert (r.questions, r.dissatisfied) == (2, 1)
    assert kinds[first][0] == ("followup", False) and kinds[second][0] == ("followup", True)
    assert vague.metadata.clarification in engine.prompts[vague.instruction][1]
    assert texts[first] == [vague.metadata.clarification] and texts[second] == [JUST_DO_IT]

    # Broken tool calls: the server sends them as the answer's text (no client could dispatch them),
    # so nothing runs for them and they go back as the assistant's words; the valid one runs. Each
    # is counted (the response's flywheel.invalid_tool_calls) and costs its completion all the same.
    r = results[broken.id]
    assert (r.invalid_tool_calls, r.outcome, r.edit_completions) == (4, "abandoned", [])
    follow_up = engine.prompts[broken.instruction][1]
    assert "error: invalid tool call" not in follow_up
    assert '{"name": "read_file", "arguments": {"path": 3}}' in follow_up
    assert "<tool_response>\nerror: no such file or folder: a.py" in follow_up
    assert all(rewards[c].parts["invalid_call_penalty"] == 2 * REWARDS.invalid_tool_call
               for c in r.completion_ids)
    assert (stats.persisted, stats.reverted, stats.edits, stats.tests_passed) == (1, 1, 2, 1)


def test_background_agents_work_alone_and_their_outcome_arrives_hours_later(registry_root, pool, tmp_path):
    good, wrong = generate("bugfix", "train", 2, seed=5)
    idle = generate("implement", "train", 1, seed=5)[0]
    answers = {good.instruction: fix(good), idle.instruction: "What exactly should I do?" + IM_END,
               wrong.instruction: "Done." + calls(("edit_file", {"path": "notes.txt", "old": "", "new": "todo\n"}),
                                                  ("finish", {})) + IM_END}
    tokenizer = load_tokenizer(registry_root / "checkpoints" / "v0")
    engine = TaskScriptedEngine(tokenizer, answers)
    config = ServeConfig(loop=LoopConfig.at(tmp_path / "live.sqlite"), keys=KEYS)
    server = LiveServer(config, Router(lambda version: (engine, tokenizer), Deployment(production=0)),
                        LiveStore(config.loop.store.path))
    hours = 3600.0
    population = Population(concurrency=3, max_tokens=512, profiles=[UserProfile(
        name="agent", kind="background", patience=4, org_id="acme", outcome_delay_s=(2 * hours, 5 * hours))])
    tasks, deferred = [good, wrong, idle], []
    with server, serve_in_thread(server) as running:
        stats = run_population(running.url, "admin-key", population, len(tasks), pool, tasks=tasks,
                               deferred=deferred)
        assert server.store.count_events() == 0 and len(deferred) == 3  # nothing reported while the agent ran
        with EventClient(running.url, "events-key") as client:
            assert release_due(deferred, client, time.time()) == 0  # due hours from now
            assert release_due(deferred, client, time.time() + 6 * hours) == 3 and not deferred
            assert client.flush(timeout_s=60)
        completions, events, _ = distill(server.store)
    results = {r.task_id: r for r in stats.session_results}
    assert {e.type for e in events} == {EventType.OUTCOME}
    assert results[good.id].outcome in ("merged", "ci_green") and results[good.id].tests_passed
    assert (results[wrong.id].outcome, results[idle.id].outcome) == ("reverted", "abandoned")
    assert len(results[idle.id].completion_ids) == 4 and results[idle.id].questions == 4
    assert WORK_ALONE in engine.prompts[idle.instruction][1]
    assert all(c.session_kind == "background" and c.org_id == "acme" for c in completions)
    for r in results.values():
        (event,) = [e for e in events if e.session_id == r.session_id]
        assert event.payload["outcome"] == r.outcome and event.time == r.outcome_at
        assert 2 * hours <= event.time - max(c.created_at for c in completions if c.session_id == r.session_id)
    rewards = {x.completion_id: x for x in RewardDistiller(REWARDS).distill(completions, events,
                                                                           now=time.time() + 6 * hours)}
    assert {rewards[c].parts.get("outcome_reverted") for c in results[wrong.id].completion_ids} == {-1.0}


def test_a_population_is_planned_from_its_seed():
    population = Population(seed=1, users=5, tasks_per_family=3)
    plan = plan_sessions(population, 30)
    assert [(p.user, p.task.id) for p in plan] == [(p.user, p.task.id) for p in plan_sessions(population, 30)]
    assert [p.task.id for p in plan] != [p.task.id
                                         for p in plan_sessions(population.model_copy(update={"seed": 2}), 30)]
    for p in plan:
        assert p.profile.families.get(p.task.family, 0) > 0
        assert p.profile == plan_sessions(population, 30)[p.index].profile
    assert len({p.profile.name for p in plan if p.user == plan[0].user}) == 1  # a user keeps their habits
    with pytest.raises(ValueError, match="unknown task families"):
        UserProfile(name="x", families={"bugfx": 1.0})
    with pytest.raises(ValueError, match="unique"):
        Population(profiles=[UserProfile(name="x"), UserProfile(name="x")])


def test_an_organizations_users_send_its_house_rule_tasks_and_a_general_fix_fails_them(registry_root, pool,
                                                                                         tmp_path):
    """A population with an organization (house rules) and general users: the organization's users
    work on its codebase's tasks, name it in every request, and the general model's fix, which
    passes the general users' tests, fails theirs (its logging rule)."""
    acme = HouseRules(org_id="acme", helper="audit", call="record", tests_dir="checks")
    population = Population(users=6, concurrency=3, tasks_per_family=4, max_tokens=512, profiles=[
        UserProfile(name="general", patience=1, families={"bugfix": 1.0}),
        UserProfile(name="acme-dev", patience=1, families={"bugfix": 1.0}, house_rules=acme)])
    plan = plan_sessions(population, 10)
    by_org = {p.profile.org_id for p in plan}
    assert by_org == {"", "acme"}, "the seed should draw users of both kinds"
    for p in plan:
        org = p.profile.org_id == "acme"
        assert p.task.id.startswith("acme/") == org and (p.task.metadata.extra.get("org_id") == "acme") == org
    # What a general model writes: the logic fix alone, the same text for the same bug in either codebase.
    answers = {p.task.instruction: "Fixing it." + calls(("edit_file", general_fix(p.task).model_dump()
                                                         if p.profile.house_rules else p.task.reference_edits[0]
                                                         .model_dump()), ("finish", {"summary": "fixed"})) + IM_END
               for p in plan}
    tokenizer = load_tokenizer(registry_root / "checkpoints" / "v0")
    config = ServeConfig(loop=LoopConfig.at(tmp_path / "live.sqlite"), keys=KEYS)
    engine = TaskScriptedEngine(tokenizer, answers)
    server = LiveServer(config, Router(lambda version: (engine, tokenizer), Deployment(production=0)),
                        LiveStore(config.loop.store.path))
    with server, serve_in_thread(server) as running:
        stats = run_population(running.url, "admin-key", population, len(plan), pool)
        completions = server.store.completions()
    passed = {"acme": [], "": []}
    for r in stats.session_results:
        org = "acme" if r.task_id.startswith("acme/") else ""
        passed[org].append(r.tests_passed)
        assert {c.org_id for c in completions if c.session_id == r.session_id} == {org}
    assert passed["acme"] and not any(passed["acme"])  # the house rule fails the general fix
    assert passed[""] and all(passed[""])
    with pytest.raises(ValueError, match="bugfix tasks only"):
        UserProfile(name="x", house_rules=acme)
    with pytest.raises(ValueError, match="differs from its house_rules"):
        UserProfile(name="x", families={"bugfix": 1.0}, house_rules=acme, org_id="globex")


def test_follow_up_words_name_what_went_wrong_and_a_share_are_vague_or_wrong():
    task = generate("crossfile", "train", 1, seed=5)[0]
    fix_paths = sorted({e.path for e in task.reference_edits})
    broken = ToolCall("c0", "edit_file", {"path": 3}, error="path must be a string")
    trail = Trail()
    trail.saw([broken, ToolCall("c1", "edit_file", {"path": "notes.txt", "old": "", "new": "x"}),
               ToolCall("c2", "run_command", {"command": "ls"})], [False, True, True])
    said = words_for_failing_tests(task, trail, random.Random(0))
    assert "(edit_file: path must be a string)" in said and "You changed notes.txt" in said
    assert f"the problem is in {', '.join(fix_paths)}" in said and "You never ran the tests" in said
    # The right files edited the wrong way and the tests run: the user quotes the line the fix writes.
    done = Trail(edited=fix_paths, ran_tests=True)
    said = words_for_failing_tests(task, done, random.Random(0))
    path, line = next((p, expected_line(task, p)) for p in fix_paths if expected_line(task, p))
    assert said == f"{TESTS_FAIL.split(' Please')[0]} In {path} it should say: {line}"
    assert any(line in e.new.splitlines()[i].strip() for e in task.reference_edits
               for i in range(len(e.new.splitlines())) if e.path == path)
    assert line not in next(e.old for e in task.reference_edits if e.path == path)
    # Nothing the fix writes is new (it only deletes): nothing specific is left to say.
    deleting = task.model_copy(update={"reference_edits": tuple(e.model_copy(update={"new": ""})
                                                                for e in task.reference_edits)})
    assert words_for_failing_tests(deleting, done, random.Random(0)) == TESTS_FAIL
    # The configured shares, over many follow-ups: vague ones name nothing, wrong ones a file the fix does not touch.
    rng, n = random.Random(1), 2000
    words = [words_for_failing_tests(task, trail, rng, vague_share=0.3, wrong_share=0.2) for _ in range(n)]
    vague = sum(w in VAGUE for w in words) / n
    wrong = [w for w in words if "; look there." in w]
    assert abs(vague - 0.3) < 0.04 and abs(len(wrong) / n - 0.2) < 0.04
    assert all(p not in w for w in wrong for p in fix_paths)
    assert words_for_needless_question("", random.Random(0)).startswith("You sent nothing back.")
    assert sum(words_for_needless_question("Which?", rng, 0.5) != JUST_DO_IT for _ in range(n)) / n == \
        pytest.approx(0.5, abs=0.04)
