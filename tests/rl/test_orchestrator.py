"""The Orchestrator: staleness bound, partial rollouts, dynamic sampling, durable resume.

Episodes run in real sandboxes with real tools and grading. The engine is a scripted one with
random, long-tailed latencies (so that the interleavings the bound must survive actually happen)
and the learner a recording one: what is under test is the scheduling, not the model. The loop
that drives them is the real one, `flywheel.rl.train.learn`, wired as `train` wires it.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import textwrap
import time
from concurrent.futures import Future

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flywheel.env.families import generate
from flywheel.env.pool import PoolConfig, SandboxPool
from flywheel.model.engine import SamplingParams
from flywheel.model.tokenizer import train_tokenizer
from flywheel.rl.audit import audit, lost_samples
from flywheel.rl.orchestrator import Orchestrator, OrchestratorConfig, OrchestratorStalled, newest_version
from flywheel.rl.run_folder import RunFolder
from flywheel.rl.train import resume

FAKES = textwrap.dedent('''
    import json, random, threading, time
    from concurrent.futures import Future
    from flywheel.model.engine import Generation
    from flywheel.rl.orchestrator import Orchestrator
    from flywheel.rl.run_folder import RunFolder
    from flywheel.rl.train import learn

    def call(name, **arguments):
        return "<tool_call>\\n" + json.dumps({"name": name, "arguments": arguments}) + "\\n</tool_call>"

    class RandomLatencyEngine:
        """Answers each turn after a long-tailed delay with a tool call, ending with finish or a solution."""

        def __init__(self, tokenizer, tasks, seed=0, mean_delay_s=0.01, solve_rate=0.5, max_turns=4, slow_tasks=(),
                     broken_rate=0.0, solve_rates=None):
            self.tokenizer, self.rng, self.mean = tokenizer, random.Random(seed), mean_delay_s
            self.solve_rates = solve_rates or {}  # task id -> its own solve rate, instead of solve_rate
            self.broken_rate = broken_rate  # a turn that is not the last calls a tool that does not exist
            self.slow = {t.instruction for t in slow_tasks}  # 10x slower: the stragglers the bound must survive
            self.tasks = {t.instruction: t for t in tasks}
            self.solve_rate, self.max_turns = solve_rate, max_turns
            self._version, self._lock = 0, threading.Lock()
            self.turn_versions = []
            self.priorities = []  # (priority, task id) of every turn

        @property
        def version(self):
            return self._version

        def submit(self, prompt_ids, params):
            future = Future()
            text = self.tokenizer.decode(prompt_ids)
            task = next((t for i, t in self.tasks.items() if i in text), None)
            with self._lock:
                delay = self.rng.paretovariate(1.5) * self.mean
                turn = text.count("<|im_start|>assistant") - 1
                rate = self.solve_rates.get(task.id, self.solve_rate) if task is not None else self.solve_rate
                solve = self.rng.random() < rate
                last = turn + 1 >= self.max_turns or self.rng.random() < 0.4
                broken = self.rng.random() < self.broken_rate
            with self._lock:
                self.priorities.append((params.priority, task.id if task is not None else None))
            if task is not None and task.instruction in self.slow:
                delay *= 10
            if last and solve and task is not None and task.reference_edits:
                e = task.reference_edits[0]
                body = call("edit_file", path=e.path, old=e.old, new=e.new) + call("finish")
            elif last:
                body = call("finish")
            elif broken:
                body = call("no_such_tool")
            else:
                body = call("list_dir")
            ids = self.tokenizer(body + "<|im_end|>", add_special_tokens=False)["input_ids"]

            def answer():
                time.sleep(delay)
                with self._lock:
                    version = self._version
                    self.turn_versions.append(version)
                future.set_result(Generation(ids, [-0.1] * len(ids), [version] * len(ids), "stop"))
            threading.Thread(target=answer, daemon=True).start()
            return future

        def update_weights(self, weights, version, timeout_s=60.0):
            with self._lock:
                self._version = version

        def close(self):
            pass

    class RecordingLearner:
        """Counts versions like the Learner and records what each step was given."""

        def __init__(self, version=0, step_s=0.0):
            self.version, self.step_s, self.batches = version, step_s, []

        def train_step(self, trajectories, advantages):
            staleness = [self.version - t.version_span()[0] for t in trajectories if t.generated_tokens]
            self.batches.append({"groups": sorted({t.group_id for t in trajectories}), "staleness": staleness,
                                 "advantages": list(advantages)})
            time.sleep(self.step_s)
            self.version += 1
            return {"loss": 0.0}

        def weights(self):
            return {}

        def state(self):
            return {"version": self.version, "batches": list(self.batches)}  # a copy: saved while training goes on

        def load_state(self, state):
            self.version, self.batches = state["version"], list(state["batches"])

    def orchestrator(config, tasks, engine, learner, tokenizer, pool, run_dir):
        """An Orchestrator wired as flywheel.rl.train wires it: the version comes from the learner."""
        return Orchestrator(config, tasks, engine, tokenizer, pool, run_dir, version=lambda: learner.version)

    def train(orch, learner, until=None):
        """flywheel.rl.train's loop over this Orchestrator, its engine and `learner`."""
        return learn(orch.config, orch, learner, orch.engine, RunFolder(orch.run.root), until)
''')
namespace: dict = {}
exec(FAKES, namespace)  # the same fakes run in the subprocess of the kill test
RandomLatencyEngine, RecordingLearner = namespace["RandomLatencyEngine"], namespace["RecordingLearner"]
orchestrator, train = namespace["orchestrator"], namespace["train"]


@pytest.fixture(scope="module")
def tasks():
    return generate("bugfix", "train", 6, seed=11, difficulty=1)


@pytest.fixture(scope="module")
def tokenizer(tasks):
    corpus = [t.instruction for t in tasks] + ['<tool_call>\n{"name": "list_dir", "arguments": {}}\n</tool_call>'] * 20
    return train_tokenizer(corpus, vocab_size=600)


@pytest.fixture(scope="module")
def pool():
    with SandboxPool(PoolConfig(max_active=24, warm=4)) as p:
        yield p


def config(**overrides) -> OrchestratorConfig:
    base = {"group_size": 2, "groups_per_step": 2, "concurrency": 12, "max_steps": 4, "stall_timeout_s": 60,
            "episode": {"max_turns": 4, "max_tokens_per_turn": 200}}
    return OrchestratorConfig.model_validate(base | overrides)


@pytest.mark.slow  # 10 s on the shared 2-core machine (load ~10)
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(max_staleness=st.integers(0, 3), seed=st.integers(0, 10_000), group_size=st.integers(1, 2),
       filter_zero=st.booleans())
def test_staleness_never_exceeds_the_bound(tmp_path_factory, tasks, tokenizer, pool, max_staleness, seed, group_size,
                                          filter_zero):
    cfg = config(max_staleness=max_staleness, group_size=group_size, filter_zero_signal=filter_zero and group_size > 1,
                 max_steps=4)
    engine = RandomLatencyEngine(tokenizer, tasks, seed=seed, mean_delay_s=0.005, slow_tasks=tasks[::3])
    learner = RecordingLearner()
    with orchestrator(cfg, tasks, engine, learner, tokenizer, pool, tmp_path_factory.mktemp("run")) as orch:
        history = train(orch, learner)
    assert len(history) == 4 and learner.version == 4
    for batch in learner.batches:
        assert batch["staleness"] and max(batch["staleness"]) <= max_staleness
        assert len(batch["groups"]) >= cfg.groups_per_step
    assert max(engine.turn_versions) >= 3  # the engine got the new versions


@pytest.mark.parametrize("max_staleness", [0, 3])
def test_the_learners_wait_is_split_into_waiting_for_rollouts_and_for_the_staleness_bound(tmp_path, tasks, tokenizer,
                                                                                          pool, max_staleness):
    """At bound 0 every group is due at the version it started at, so every wait is the bound's; at 3
    no group of a 3-step run comes due, so every wait is for complete groups. The episodes' tool
    calls, grading and sandbox creation are summed into each batch."""
    engine, learner = RandomLatencyEngine(tokenizer, tasks, seed=5, mean_delay_s=0.02), RecordingLearner()
    with orchestrator(config(max_staleness=max_staleness, max_steps=3), tasks, engine, learner, tokenizer, pool,
                      tmp_path) as orch:
        history = train(orch, learner)
    by_bound = sum(m["time/wait_staleness"] for m in history)
    for_groups = sum(m["time/wait_rollouts"] for m in history)
    assert (by_bound > 0 and for_groups == 0) if max_staleness == 0 else (by_bound == 0 and for_groups > 0)
    for m in history:
        assert m["time/wait_staleness"] + m["time/wait_rollouts"] <= m["wait_s"]
        assert m["time/episode_grade"] > 0 and m["time/episode_sandbox"] > 0 and m["time/episode_tools"] > 0
        assert "time/engine_decode" not in m  # a fake engine counts nothing


def test_async_rollouts_continue_under_new_weights(tmp_path, tasks, tokenizer, pool):
    """Partial rollouts: episodes started under one version finish under the next, and both are recorded."""
    engine = RandomLatencyEngine(tokenizer, tasks, seed=3, mean_delay_s=0.02)
    learner = RecordingLearner(step_s=0.05)
    with orchestrator(config(max_staleness=2, max_steps=6), tasks, engine, learner, tokenizer, pool, tmp_path) as orch:
        train(orch, learner)
    mixed = 0
    for line in (tmp_path / "trajectories.jsonl").read_text().splitlines():
        traj = json.loads(line)["trajectory"]
        versions = {v for v, m in zip(traj["versions"], traj["loss_mask"], strict=True) if m}
        mixed += len(versions) > 1
    assert mixed > 0  # some episodes span a weight update: interrupted and resumed, not dropped


def test_every_turn_asks_the_engine_with_its_groups_start_order(tmp_path, tasks, tokenizer, pool):
    """Older groups first when the engine has more requests than rows: a turn's priority is the
    number of the group it belongs to, so the groups the learner waits on are served first."""
    engine, learner = RandomLatencyEngine(tokenizer, tasks, seed=4), RecordingLearner()
    with orchestrator(config(max_staleness=1, max_steps=3), tasks, engine, learner, tokenizer, pool,
                      tmp_path) as orch:
        train(orch, learner)
    started = {int(r["group"][1:]): r["task"]
               for r in map(json.loads, (tmp_path / "groups.jsonl").read_text().splitlines())}
    assert len({p for p, _ in engine.priorities}) > 2
    assert all(p in started and started[p] == task for p, task in engine.priorities)


def test_sync_mode_trains_only_on_policy(tmp_path, tasks, tokenizer, pool):
    engine = RandomLatencyEngine(tokenizer, tasks, seed=5)
    learner = RecordingLearner()
    with orchestrator(config(mode="sync", max_staleness=3), tasks, engine, learner, tokenizer, pool, tmp_path) as orch:
        train(orch, learner)
    assert all(max(b["staleness"]) == 0 for b in learner.batches)


def test_tasks_come_in_a_fresh_seeded_order_each_pass(tmp_path, tokenizer, pool):
    mixed = [t for family in ("bugfix", "implement") for t in generate(family, "train", 4, seed=11, difficulty=1)]
    engine, learner = RandomLatencyEngine(tokenizer, mixed, seed=2), RecordingLearner()
    with orchestrator(config(max_steps=6), mixed, engine, learner, tokenizer, pool, tmp_path) as orch:
        train(orch, learner)
    started = [json.loads(line)["task"] for line in (tmp_path / "groups.jsonl").read_text().splitlines()]
    first, second = started[:8], started[8:16]
    assert sorted(first) == sorted(t.id for t in mixed) == sorted(second)  # every task once per pass
    assert first != second  # a fresh order each pass
    assert {t.split("/")[0] for t in first[:4]} == {"bugfix", "implement"}  # not family by family
    with orchestrator(config(shuffle_tasks=False), mixed, engine, RecordingLearner(), tokenizer, pool,
                      tmp_path / "in-order") as orch:
        assert [orch._task(n).id for n in range(10)] == [t.id for t in mixed + mixed[:2]]


def test_zero_signal_groups_are_counted_and_replaced(tmp_path, tasks, tokenizer, pool):
    engine = RandomLatencyEngine(tokenizer, tasks, seed=1, solve_rate=0.0)  # nobody solves: every group is all-equal
    learner = RecordingLearner()
    cfg = config(max_steps=1, filter_zero_signal=True, zero_signal_patience=2)
    with orchestrator(cfg, tasks, engine, learner, tokenizer, pool, tmp_path) as orch:
        with pytest.raises(OrchestratorStalled, match="had equal rewards"):
            train(orch, learner)
        assert orch._counts["zero_signal_groups"] >= 5 and orch._counts["filtered_groups"] >= 5
    engine, learner = RandomLatencyEngine(tokenizer, tasks, seed=1, solve_rate=0.0), RecordingLearner()
    with orchestrator(config(max_steps=1, filter_zero_signal=False), tasks, engine, learner, tokenizer, pool,
                      tmp_path / "kept") as orch:
        (metrics,) = train(orch, learner)
    assert metrics["zero_signal_groups"] >= 2 and metrics["filtered_groups"] == 0


@pytest.mark.slow  # 6 s on the shared 2-core machine (load ~10)
def test_the_rollout_pass_rate_counts_the_groups_dynamic_sampling_drops(tmp_path, tasks, tokenizer, pool):
    # Groups of two that mostly solve: all-pass groups carry no signal and are filtered, so every
    # trained group is one pass and one failure (trained pass rate 0.5) while most episodes pass.
    engine, learner = RandomLatencyEngine(tokenizer, tasks, seed=5, solve_rate=0.8), RecordingLearner()
    with orchestrator(config(max_steps=6, zero_signal_patience=20), tasks, engine, learner, tokenizer, pool,
                      tmp_path) as orch:
        history = train(orch, learner)
    assert all(m["pass_rate"] == 0.5 for m in history)
    seen = sum(m["rollout_episodes"] for m in history)
    passed_seen = sum(m["rollout_pass_rate"] * m["rollout_episodes"] for m in history if m["rollout_episodes"])
    assert seen >= sum(m["episodes_trained"] for m in history)  # each trained group was counted once, when it completed
    assert all(m["rollout_episodes"] % 2 == 0 for m in history)  # whole groups
    # Above the trained batches' 0.5 (the engine's draws depend on thread timing, so 0.8 is only an expectation)
    assert history[-1]["filtered_groups"] > 0 and passed_seen / seen > 0.55, (passed_seen, seen)


def test_sibling_groups_give_signal_to_a_policy_that_answers_every_sibling_alike(tmp_path, tokenizer, pool):
    # The engine knows the answer to one task per template and answers the others with no edit,
    # the way a policy that ignores the detail that tells siblings apart would. Each task alone
    # always gets the same reward: one-task groups have no signal; groups of siblings do.
    tasks = generate("ambiguous", "train", 12, seed=11, difficulty=1)
    known = list({t.metadata.extra["template"]: t for t in reversed(tasks)}.values())
    solo = config(max_steps=1, zero_signal_patience=2)
    learner = RecordingLearner()
    with orchestrator(solo, tasks, RandomLatencyEngine(tokenizer, known, seed=1, solve_rate=1.0), learner,
                      tokenizer, pool, tmp_path / "solo") as orch:
        with pytest.raises(OrchestratorStalled, match="had equal rewards"):
            train(orch, learner)
    learner = RecordingLearner()
    siblings = config(max_steps=2, tasks_per_group=2, zero_signal_patience=5)
    with orchestrator(siblings, tasks, RandomLatencyEngine(tokenizer, known, seed=1, solve_rate=1.0), learner,
                      tokenizer, pool, tmp_path / "siblings") as orch:
        train(orch, learner)
    by_id = {t.id: t for t in tasks}
    started = [json.loads(line) for line in (tmp_path / "siblings" / "groups.jsonl").read_text().splitlines()]
    for record in started:
        first, second = (by_id[i] for i in record["tasks"])
        assert record["task"] == first.id and first.metadata.extra["template"] == second.metadata.extra["template"]
    assert any(len(set(r["tasks"])) == 2 for r in started)
    trained = {json.loads(line)["trajectory"]["task_id"]
               for line in (tmp_path / "siblings" / "trajectories.jsonl").read_text().splitlines()}
    for batch in learner.batches:
        assert batch["advantages"] and all(a != 0 for a in batch["advantages"])  # a known task against its sibling
    assert trained - {t.id for t in known}  # the siblings ran too
    again, engine = RecordingLearner(), RandomLatencyEngine(tokenizer, known)
    resumed = orchestrator(siblings, tasks, engine, again, tokenizer, pool, tmp_path / "siblings")
    with resumed:
        # the groups started but not trained on
        assert resume(siblings, resumed, again, engine, RunFolder(tmp_path / "siblings")) and resumed._groups
        assert {g.id: [t.id for t in g.tasks] for g in resumed._groups.values()} == {
            r["group"]: r["tasks"] for r in started if r["group"] in resumed._groups}
    with pytest.raises(ValueError, match="multiple of tasks_per_group"):
        config(group_size=3, tasks_per_group=2)


def test_frontier_sampling_draws_the_tasks_whose_groups_differ_and_each_step_records_its_draw(tmp_path, tasks,
                                                                                               tokenizer, pool):
    """Two tasks the policy always solves, two it never does, two it solves some of the time.
    Shuffled, two thirds of the groups tie and are filtered after their rollouts; drawn by their
    measured pass rate, most groups go to the tasks sometimes solved once their outcomes are in.
    Every completed group is in its step's draw, with its passes and why it was filtered."""
    rates = dict(zip([t.id for t in tasks], [1.0, 1.0, 0.0, 0.0, 0.5, 0.5], strict=True))
    records = {}
    for sampling in ("shuffle", "frontier"):
        engine = RandomLatencyEngine(tokenizer, tasks, seed=7, solve_rates=rates)
        learner = RecordingLearner()
        cfg = config(max_steps=6, group_size=4, concurrency=16, task_sampling=sampling, zero_signal_patience=40)
        with orchestrator(cfg, tasks, engine, learner, tokenizer, pool, tmp_path / sampling) as orch:
            history = train(orch, learner)
            estimates = {rate: [orch.sampler.estimate(t) for t in tasks if rates[t.id] == rate] for rate in (0, 1)}
        assert min(estimates[1]) > 0.7 and max(estimates[0]) < 0.3  # whatever drew them
        records[sampling] = [d for m in history for d in m["draw"]]
        started = (tmp_path / sampling / "groups.jsonl").read_text().splitlines()
        assert sum(m["groups_completed"] for m in history) == len(records[sampling]) <= len(started)
        for d in records[sampling]:
            rate = rates[d["tasks"][0]]
            assert d["episodes"] == 4 and d["passed"] == {1.0: 4, 0.0: 0}.get(rate, d["passed"])
            if rate != 0.5 or not 0 < d["passed"] < 4:  # all alike: filtered, and why
                assert d["filtered"] == ("all passed" if d["passed"] == 4 else "all failed")
            else:
                assert d["filtered"] is None
        for m in history:
            mixed = [0 < d["passed"] < d["episodes"] for d in m["draw"]]
            if mixed:
                assert m["frontier_share"] == pytest.approx(sum(mixed) / len(mixed))
            else:  # the step trained on groups an earlier step completed
                assert math.isnan(m["frontier_share"])
            assert m["filtered_all_passed"] == sum(d["filtered"] == "all passed" for d in m["draw"])
    sometimes = {t for t, r in rates.items() if r == 0.5}
    share = {k: sum(d["tasks"][0] in sometimes for d in v[10:]) / len(v[10:]) for k, v in records.items()}
    assert share["frontier"] > share["shuffle"] + 0.2, share


def test_turn_credit_trains_tied_groups_on_their_broken_calls_only(tmp_path, tasks, tokenizer, pool):
    # Nobody solves, so outcomes are tied; some turns call a tool that does not exist.
    engine = RandomLatencyEngine(tokenizer, tasks, seed=3, solve_rate=0.0, broken_rate=0.5)
    learner = RecordingLearner()
    cfg = config(max_steps=2, advantages={"method": "dr_grpo", "broken_calls": "turn"}, zero_signal_patience=5)
    with orchestrator(cfg, tasks, engine, learner, tokenizer, pool, tmp_path) as orch:
        train(orch, learner)
    trained = [json.loads(line)["trajectory"] for line in (tmp_path / "trajectories.jsonl").read_text().splitlines()]
    by_group = {}
    for t in trained:
        by_group.setdefault(t["group_id"], []).append(t)
    advantages = [a for b in learner.batches for a in b["advantages"]]
    assert len(advantages) == 8 and any(isinstance(a, list) for a in advantages)
    for a in advantages:
        if isinstance(a, list):  # 0 on every token but the broken turns', which carry the -0.1 per call
            assert {round(x, 9) for x in a} in ({0.0, -0.1}, {-0.1})
        else:
            assert a == 0.0  # a tied outcome and no broken call: nothing to learn
    for b in learner.batches:  # every group trained on had a broken call in it
        assert all(any(t["broken_turns"] for t in by_group[g]) for g in b["groups"])


def test_a_stuck_engine_fails_loudly(tmp_path, tasks, tokenizer, pool):
    class SilentEngine(RandomLatencyEngine):
        def submit(self, prompt_ids, params: SamplingParams) -> Future:
            return Future()  # never answers

    cfg = config(max_steps=1, episode={"generation_timeout_s": 1.0})
    learner = RecordingLearner()
    with orchestrator(cfg, tasks, SilentEngine(tokenizer, tasks), learner, tokenizer, pool, tmp_path) as orch:
        with pytest.raises(OrchestratorStalled, match="did not answer turn 1"):
            train(orch, learner)


KILL_SCRIPT = '''
import sys, time
from pathlib import Path
from flywheel.env.families import generate
from flywheel.env.pool import PoolConfig, SandboxPool
from flywheel.model.tokenizer import train_tokenizer
from flywheel.rl.orchestrator import OrchestratorConfig
{fakes}
tasks = generate("bugfix", "train", 6, seed=11, difficulty=1)
corpus = [t.instruction for t in tasks] + [
    '<tool_call>\\n{{"name": "list_dir", "arguments": {{}}}}\\n</tool_call>'] * 20
tokenizer = train_tokenizer(corpus, vocab_size=600)
cfg = OrchestratorConfig(group_size=3, groups_per_step=2, concurrency=12, max_steps=1000, max_staleness=1,
                         episode={{"max_turns": 6}})
engine = RandomLatencyEngine(tokenizer, tasks, seed=7, mean_delay_s=0.05, max_turns=6)
with SandboxPool(PoolConfig(max_active=24)) as pool:
    learner = RecordingLearner(step_s=0.05)
    train(orchestrator(cfg, tasks, engine, learner, tokenizer, pool, Path(sys.argv[1])), learner)
'''


@pytest.mark.slow  # 24 s on the shared 2-core machine (load ~10)
def test_a_run_killed_mid_rollout_resumes_with_its_in_flight_episodes(tmp_path, tasks, tokenizer, pool):
    run = tmp_path / "run"
    script = tmp_path / "train.py"
    script.write_text(KILL_SCRIPT.format(fakes=FAKES))
    proc = subprocess.Popen([sys.executable, str(script), str(run)])
    deadline = time.monotonic() + 90
    try:
        while time.monotonic() < deadline:  # kill once a checkpoint exists and episodes are mid-flight
            if (run / "state" / "progress.json").exists() and len(list((run / "inflight").glob("*.json"))) >= 3:
                break
            time.sleep(0.05)
        else:
            pytest.fail("the training subprocess never reached a checkpoint with episodes in flight")
    finally:
        proc.kill()
        proc.wait()
    inflight = {p.stem.replace("_", "/", 1): json.loads(p.read_text()) for p in (run / "inflight").glob("*.json")}
    progress = json.loads((run / "state" / "progress.json").read_text())
    started = [json.loads(line)["group"] for line in (run / "groups.jsonl").read_text().splitlines()]
    open_groups = [g for g in started if g not in set(progress["consumed"])]
    assert inflight and open_groups

    learner = RecordingLearner()
    engine = RandomLatencyEngine(tokenizer, tasks, seed=8, mean_delay_s=0.01, max_turns=6)
    cfg = OrchestratorConfig(group_size=3, groups_per_step=2, concurrency=12, max_staleness=1, episode={"max_turns": 6})
    with orchestrator(cfg, tasks, engine, learner, tokenizer, pool, run) as orch:
        assert resume(cfg, orch, learner, engine, RunFolder(run))
        assert orch.step == progress["step"] and learner.version == progress["step"]
        train(orch, learner, orch.step + len(open_groups) // 2 + 2)
    finished = {}
    for line in (run / "trajectories.jsonl").read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # the line the kill cut
        finished[record["episode"]] = record["trajectory"]
    resumed = 0
    for episode_id, state in inflight.items():
        if episode_id.split("/")[0] in progress["consumed"]:
            continue
        traj = finished[episode_id]  # the in-flight episode was finished, not dropped
        if max(v for v, m in zip(state["versions"], state["loss_mask"], strict=True) if m) > progress["step"]:
            continue  # sampled by a policy the kill lost, whose checkpoint was not written: played again
        assert traj["tokens"][: len(state["tokens"])] == state["tokens"]  # ... continuing from where it was
        resumed += 1
    assert resumed >= 1 and orch._counts["resumed_episodes"] >= 1
    lost = set(open_groups) - set(orch._consumed) - set(orch._groups)
    assert not lost  # every group open at the kill was trained on, filtered, or is still running


def test_a_resume_at_an_older_checkpoint_plays_again_what_the_lost_policies_sampled(tmp_path, tasks, tokenizer,
                                                                                    pool):
    """The checkpoints of steps 2 and 3 are lost (a kill while they were written): the run resumes at
    policy 1, while its records hold tokens of policies 2 and 3, whose weights are gone. Every
    episode holding one plays again from its start, every group started under them starts again at
    policy 1, and the run then trains on to step 5 with every invariant of flywheel/rl/audit.py held."""
    run = tmp_path / "run"
    cfg = config(max_staleness=1, max_steps=5, filter_zero_signal=False)
    engine, learner = RandomLatencyEngine(tokenizer, tasks, seed=5, mean_delay_s=0.02), RecordingLearner(step_s=0.05)
    with orchestrator(cfg, tasks, engine, learner, tokenizer, pool, run) as orch:
        train(orch, learner, 1)
        shutil.copytree(run / "state", tmp_path / "step-1")
        train(orch, learner, 3)
    shutil.rmtree(run / "state")
    shutil.copytree(tmp_path / "step-1", run / "state")
    assert lost_samples(run).resumes_at == 1 and lost_samples(run).records > 0
    first_start = {}
    for r in map(json.loads, (run / "groups.jsonl").read_text().splitlines()):
        first_start.setdefault(r["group"], r["version"])

    learner, engine = RecordingLearner(), RandomLatencyEngine(tokenizer, tasks, seed=6, mean_delay_s=0.02)
    with orchestrator(cfg, tasks, engine, learner, tokenizer, pool, run) as orch:
        assert resume(cfg, orch, learner, engine, RunFolder(run)) and learner.version == 1
        with orch._cond:
            assert all(g.start_version <= 1 for g in orch._groups.values())
            assert all(newest_version(t) <= 1 for g in orch._groups.values() for t in g.results.values())
            restarted = {g for g, v in first_start.items() if v > 1 and g not in orch._consumed}
        assert restarted and orch.counts()["restarted_groups"] == len(restarted)
        assert orch.counts()["rewound_episodes"] >= len(restarted)
        records = [json.loads(line) for line in (run / "groups.jsonl").read_text().splitlines()]
        assert {r["group"] for r in records if r.get("restarted_from", 0) > 1 and r["version"] == 1} == restarted
        struck = [json.loads(line) for line in (run / "trajectories.jsonl").read_text().splitlines()]
        assert any("discarded" in r for r in struck)
        train(orch, learner, 5)
    assert audit(run, [], max_staleness=1, group_size=cfg.group_size) == []


def test_the_orchestrator_hands_out_batches_and_is_told_what_was_consumed_at_which_version(tmp_path, tasks,
                                                                                         tokenizer, pool):
    """The scheduler's whole contract, driven by hand: no Learner, a version getter, plain records."""
    version = [0]
    engine = RandomLatencyEngine(tokenizer, tasks, seed=6)
    with Orchestrator(config(max_staleness=0, filter_zero_signal=False), tasks, engine, tokenizer, pool, tmp_path,
                      version=lambda: version[0]) as orch:
        batch = orch.next_batch()
        assert len(batch.groups) == 2 and all(len(g.trajectories) == 2 and g.start_version == 0 for g in batch.groups)
        assert batch.rollout_episodes >= 4 and len(batch.trajectories()) == 4
        with pytest.raises(RuntimeError, match="not reported consumed"):
            orch.next_batch()
        with pytest.raises(ValueError, match="report exactly the group ids"):
            orch.consumed(["g99"], 1)
        version[0] = 1
        orch.consumed(batch.group_ids, 1)
        progress = orch.progress()
        assert progress["step"] == 1 and {g: progress["consumed"][g] for g in batch.group_ids} == dict.fromkeys(
            batch.group_ids, 1)
        started = [json.loads(line) for line in (tmp_path / "groups.jsonl").read_text().splitlines()]
        assert [r["version"] for r in started] == [0, 0, 1, 1]  # the next groups start at the new version
        assert orch.next_batch().groups[0].start_version == 1
