"""The real-time RL cycle: the on-policy batch, the gate on real checkpoints, a whole cycle, a killed cycle.

Real parts throughout: a tiny policy SFT-ed to edit, ask or break its calls (cycle_world.py), the
Registry, the live server over HTTP with simulated users in their own sandboxes, the Learner, the
eval gate playing real episodes, the A/B analysis and the monitors. The kill test runs `flywheel
live` as a subprocess against a server in this process and SIGKILLs it at random moments of its
stages (three trials), then reruns it to the end.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
from cycle_world import KEY, POLICY, POPULATION, REPO, live_world, make_registry, start_checkpoint
from test_sessions import policy_sessions
from tiny_serving import KEYS, stored_completion
from tiny_serving import make_registry as tiny_registry

from flywheel.agent.episode import EpisodeConfig
from flywheel.api.events import Event, EventType
from flywheel.config import ConfigError, load_config
from flywheel.env.pool import PoolConfig, SandboxPool
from flywheel.live.batch import DEFAULT_FAMILY, completion_trajectory, on_policy_batch
from flywheel.live.cycle import CycleReport, CycleState, LiveConfig, LiveCycle, ServerControl, load_report
from flywheel.live.deploy import PINNED, Deployment
from flywheel.live.gate import Contender, EvalBattery, Gate, GateConfig, NonInferiorityCheck
from flywheel.live.records import CompletionToolCall
from flywheel.live.rewards import RewardConfig, RewardDistiller, RewardStatus
from flywheel.live.server import DashboardConfig, LiveServer, ServeConfig, serve_in_thread
from flywheel.live.sessions import SessionMonitorConfig
from flywheel.live.settings import LoopConfig
from flywheel.live.store import LiveStore
from flywheel.model.chat import SYSTEM_PROMPT, tool_schemas
from flywheel.model.engine import LocalEngine
from flywheel.model.registry import CANDIDATE, PRODUCTION, CheckpointNotFound, Registry
from tests.rl.fault_injection import fault_seed

torch.set_num_threads(1)


# ---- the on-policy batch


def test_completion_becomes_a_trajectory_with_exactly_the_served_tokens():
    c = stored_completion("c1", "s1", version=3).model_copy(update={
        "prompt_ids": [5, 6, 7], "completion_ids": [8, 9], "logprobs": [-0.5, -0.25], "finish_reason": "length",
        "request_meta": {"family": "bugfix"}})
    (reward,) = RewardDistiller(RewardConfig(feedback_window_s=1.0)).distill([c], [], now=2000.0)
    t = completion_trajectory(c, reward, "bugfix")
    assert t.tokens == [5, 6, 7, 8, 9] and t.loss_mask == [0, 0, 0, 1, 1]
    assert t.logprobs == [0.0, 0.0, 0.0, -0.5, -0.25]
    assert t.versions == [-1, -1, -1, 0, 0]  # policy 0: v3 itself, the weights the cycle trains from
    assert t.prompt_len == 3 and t.status == "truncated" and t.reward == reward.reward and t.family == "bugfix"


def test_batch_holds_only_trainable_on_policy_user_traffic():
    config = RewardConfig(feedback_window_s=10.0, drop_invalid=True)
    broken = CompletionToolCall(name="edit_file", arguments={}, valid=False, error="missing new")
    completions = [
        stored_completion("ok", "s1").model_copy(update={"request_meta": {"family": "a"}}),
        stored_completion("ok2", "s2").model_copy(update={"request_meta": {"family": "a"}}),
        stored_completion("lone", "s3"),  # no family: the default one
        stored_completion("old-version", "s4", version=1),
        stored_completion("pinned", "s5").model_copy(update={"arm": PINNED}),
        stored_completion("open", "s6").model_copy(update={"created_at": 1995.0}),  # window still open
        stored_completion("broken", "s7").model_copy(update={"tool_calls": [broken]}),  # dropped by the naive config
    ]
    events = [Event(id="e1", type=EventType.FOLLOWUP, session_id="s1", completion_id="ok", time=1001.0,
                    payload={"dissatisfied": True})]
    rewards = RewardDistiller(config).distill(completions, events, now=2000.0)
    batch = on_policy_batch(completions, rewards, version=0)
    assert [c.id for c in batch.completions] == ["ok", "ok2", "lone"]
    assert batch.excluded == {"other_version": 1, "pinned": 1, RewardStatus.PENDING.value: 1,
                              RewardStatus.DROPPED.value: 1}
    assert batch.families == ["a", "a", DEFAULT_FAMILY]
    # family_loo: each compared with the other completion of its family; a family of one gets 0.
    assert batch.advantages() == pytest.approx([-0.5, 0.5, 0.0])


def test_baseline_groups_by_several_request_keys():
    meta = [{"family": "bugfix", "difficulty": 1}, {"family": "bugfix", "difficulty": 1},
            {"family": "bugfix", "difficulty": 3}, {"family": "bugfix", "difficulty": 3}, {"difficulty": 3}, {}]
    completions = [stored_completion(f"c{i}", f"s{i}").model_copy(update={"request_meta": m})
                   for i, m in enumerate(meta)]
    events = [Event(id=f"e{i}", type=EventType.EDIT_PERSISTED if kept else EventType.EDIT_REVERTED, session_id=f"s{i}",
                    completion_id=f"c{i}", time=1001.0) for i, kept in enumerate([True, True, True, False])]
    for c in completions[:4]:  # the edit the events speak of
        c.tool_calls.append(CompletionToolCall(name="edit_file", arguments={"path": "a.py", "old": "x", "new": "y"}))
    rewards = RewardDistiller(RewardConfig(feedback_window_s=10.0)).distill(completions, events, now=2000.0)
    by_family = on_policy_batch(completions, rewards, version=0)
    by_both = on_policy_batch(completions, rewards, version=0, family_key=["family", "difficulty"])
    assert by_family.families == ["bugfix"] * 4 + [DEFAULT_FAMILY] * 2
    assert by_both.families == ["bugfix/1", "bugfix/1", "bugfix/3", "bugfix/3", "3", DEFAULT_FAMILY]
    # The kept edit of the hard pair is compared with its revert alone, not with the easy pair's kept edits too.
    r = [t.reward for t in by_both.trajectories]
    assert by_both.advantages()[2] == pytest.approx(r[2] - r[3])
    assert by_family.advantages()[2] == pytest.approx(r[2] - (r[0] + r[1] + r[3]) / 3)


def test_gather_cuts_the_batch_by_time_so_nothing_is_trained_twice(tmp_path):
    store = LiveStore(tmp_path / "live.sqlite")
    for i in range(10):
        store.add_completion(stored_completion(f"c{i}", f"s{i}").model_copy(update={"created_at": 1000.0 + i}))
    Registry(tmp_path / "registry").close()
    config = LiveConfig(loop=LoopConfig.at(tmp_path / "live.sqlite", tmp_path / "registry",
                                           rewards=RewardConfig(feedback_window_s=1.0)),
                        run_dir=tmp_path / "run", batch={"min_completions": 3, "max_completions": 4})
    cycle = LiveCycle(config, _FixedControl(Deployment(production=0)), log=lambda m: None)
    state = CycleState(cycle=1, trigger="test", started_at=0.0, production=0, first_production=0, since=0.0,
                       events_at_start=0)
    batch, served = cycle._gather(state, store)
    assert [c.id for c in batch.completions] == ["c0", "c1", "c2", "c3"] and state.cutoff == 1004.0
    assert served["latency"].n == 4 and served["latency"].ci is not None
    following = state.model_copy(update={"since": state.cutoff, "cutoff": None})
    batch, _ = cycle._gather(following, store)
    assert [c.id for c in batch.completions] == ["c4", "c5", "c6", "c7"]
    store.close()


class _FixedControl:
    def __init__(self, deployment: Deployment):
        self.deployment = deployment

    def current(self) -> Deployment:
        return self.deployment

    def apply(self, deployment: Deployment, note: str) -> None:
        self.deployment = deployment

    def loop(self) -> None:
        return None  # no server whose live-loop settings the cycle must match


# ---- configuration


def test_live_config_reads_reward_and_gate_files_with_overrides_on_top(tmp_path):
    config = load_config(LiveConfig, REPO / "configs/live.toml",
                         [f"loop_file='{REPO / 'configs/loop.toml'}'",
                          f"loop.rewards_file='{REPO / 'configs/rewards_naive_drop_invalid.toml'}'",
                          f"gate_file='{REPO / 'configs/gate.toml'}'", "loop.rewards.feedback_window_s=7.0"])
    assert config.loop.rewards.drop_invalid and config.loop.rewards.feedback_window_s == 7.0
    assert set(config.gate.checks) == {"pass_rate", "valid_tool_call_rate", "clarify_on_clear"}
    assert config.gate.checks["pass_rate"].margin == 0.1 and config.gate.battery.tasks_per_family == 8
    with pytest.raises(ConfigError, match="rewards_file .* not found"):
        load_config(LiveConfig, None, [f"loop.rewards_file='{tmp_path / 'nope.toml'}'"])
    with pytest.raises(ConfigError, match="raise the first or lower the second"):
        load_config(LiveConfig, None, ["batch.min_completions=10", "batch.max_completions=5"])
    assert len(EvalBattery(families=["bugfix"], tasks_per_family=2, humaneval_tasks=2).tasks()) == 4


# ---- the gate on real checkpoints


@pytest.mark.slow  # 37 s on the shared 2-core machine (load ~10)
def test_gate_blocks_a_degraded_candidate_and_passes_an_identical_one(tmp_path):
    registry = make_registry(tmp_path / "registry")
    model, tokenizer = registry.load(0)
    registry.register(model, tokenizer, parent=0, note="identical")  # v1: the same weights
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():  # v2: every weight perturbed by its own scale
            p.add_(torch.randn(p.shape, generator=generator) * p.std().clamp(min=1e-3))
    registry.register(model, tokenizer, parent=0, note="degraded")
    episode = EpisodeConfig(temperature=0.0, max_turns=2, max_tokens_per_turn=64)
    gate = Gate(GateConfig(min_tasks=8, battery=EvalBattery(episode=episode, concurrency=10), checks={
        "pass_rate": NonInferiorityCheck(metric="passed", margin=0.3)}))
    tasks = POLICY.tasks()  # the tasks the policy can do: 4 easy, 2 hard ones x 3 variants

    def contender(version: int) -> Contender:
        m, t = registry.load(version)
        return Contender(LocalEngine(m, version=version), t, version)

    with SandboxPool(PoolConfig(max_active=8, warm=2)) as pool:
        production, identical, degraded = contender(0), contender(1), contender(2)
        try:
            same = gate.run(identical, production, pool, tasks)
            worse = gate.run(degraded, production, pool, tasks)
        finally:
            for c in (production, identical, degraded):
                c.engine.close()
    assert same.production["pass_rate"] >= 0.3, "the start policy should solve some tasks, or the test says nothing"
    assert same.decision.passed, same.decision.checks
    assert not worse.decision.passed and worse.decision.failed == ["pass_rate"]
    check = worse.decision.checks["pass_rate"]
    assert check.ci_low < -0.3 and check.margin == 0.3 and check.n == len(tasks)
    registry.close()


# ---- whole cycles


def _cycle_config(root: Path, loop: LoopConfig, **update) -> LiveConfig:
    """A cycle against the server whose live-loop settings are `loop` (the world's: `world_loop`)."""
    data = {
        "loop": loop.model_dump(mode="json"), "run_dir": str(root / "cycles"), "threads": 1,
        "batch": {"min_completions": 24, "max_completions": 200, "max_wait_s": 120.0, "poll_s": 0.5},
        "learner": {"lr": 1e-5},  # a candidate close to production: the gate passes it and the A/B test runs
        "gate": {"min_tasks": 8, "checks": {"pass_rate": {"metric": "passed", "margin": 0.35}},
                 "battery": {"families": ["bugfix"], "tasks_per_family": 8, "concurrency": 8,
                             "episode": {"temperature": 0.0, "max_turns": 2, "max_tokens_per_turn": 48}}},
        "deploy": {"candidate_fraction": 0.5, "max_wait_s": 120.0, "poll_s": 0.5},
        "ab": {"min_per_arm": 8},
        "pool": {"max_active": 8, "warm": 1},
    }
    data.update(update)
    return LiveConfig.model_validate(data)


@pytest.mark.slow  # 18 s on the shared 2-core machine (load ~10)
def test_one_full_cycle_with_simulated_users(tmp_path):
    start_checkpoint()
    with live_world(tmp_path) as world:
        # with hinted self-distillation on: the users' follow-ups say what went wrong (flywheel/live/hints.py);
        # the floor at 1: this small batch distils whatever passes the rule
        distill = {"weight": 0.5, "min_gain": 0.0, "min_kept": 1}
        config = _cycle_config(tmp_path, world.serve.loop, learner={"lr": 1e-5, "loss": {"distill": distill}},
                               replay={"alarm_p": 1e-3, "max_tokens": 64})
        cycle = LiveCycle(config, ServerControl(world.server), log=lambda m: None, gate_tasks=POLICY.tasks())
        (report,) = cycle.run(1)
        deployment = world.server.deployment
    assert report.decision in ("promote", "rollback"), report.reason
    train = report.train
    dropped = sum(v for k, v in train.items() if k.startswith("distill_dropped/"))
    assert train["distill_followups"] >= 1 and train["distill_kept"] + dropped == train["distill_followups"]
    assert train["distill_dropped_share"] == pytest.approx(1 - train["distill_kept"] / train["distill_followups"])
    assert (train.get("distill_tokens", 0) > 0) == (train["distill_kept"] > 0)
    # the distilled requests replayed by both versions after the gate (flywheel/live/replay.py)
    assert (report.replay is not None) == (train["distill_kept"] > 0)
    if report.replay is not None:
        assert report.replay.requests == train["distill_kept"] and not report.replay.blocking
        assert set(report.replay.metrics) == {"tool_use_rate", "invalid_call_rate", "edit_rate"}
    assert report.production == 0 and report.candidate == 1 and report.batch["completions"] >= 24
    assert report.gate.decision.passed and report.gate.decision.checks["pass_rate"].ci_low is not None
    assert {"persistence", "dissatisfied", "latency", "reward"} <= set(report.ab.metrics)
    for metric in report.ab.metrics.values():  # every A/B metric with intervals per arm and for the difference
        assert metric.verdict == "insufficient" or None not in (metric.production_ci, metric.candidate_ci,
                                                                metric.ci_low)
    assert report.served["latency"].ci is not None and report.monitor.series
    assert {"gather_s", "train_s", "gate_s", "deploy_s", "ab_s", "apply_s", "total_s"} <= set(report.timings)
    # What the cycle decided is what serves, and what the Registry says.
    assert deployment == Deployment(production=report.production_after)
    with Registry(world.registry_root) as registry:
        assert registry.get(PRODUCTION).version == report.production_after == (1 if report.decision == "promote" else 0)
        with pytest.raises(CheckpointNotFound):
            registry.get(CANDIDATE)
    folder = tmp_path / "cycles" / "cycle-0001"
    assert load_report(folder / "report.json") == report
    assert json.loads((folder / "report.json").read_text())["schema"] == "flywheel.cycle/1"
    assert "Cycle 1" in (folder / "report.html").read_text()
    assert CycleState.model_validate_json((folder / "state.json").read_text()).stage == "done"


@pytest.mark.slow  # 25 s on the shared 2-core machine (load ~4)
def test_a_lora_cycle_trains_an_adapter_of_production_that_the_gate_and_the_server_load_merged(tmp_path):
    start_checkpoint()
    with live_world(tmp_path) as world:
        config = _cycle_config(tmp_path, world.serve.loop, lora={"rank": 4}, learner={"lr": 1e-4})
        cycle = LiveCycle(config, ServerControl(world.server), log=lambda m: None, gate_tasks=POLICY.tasks())
        (report,) = cycle.run(1)
        served = world.server.router.checkout("probe-session")
        world.server.router.release(served)
    assert report.decision in ("promote", "rollback"), report.reason
    assert report.gate.decision.passed and report.train["optimizer_steps"] == 1
    with Registry(world.registry_root) as registry:
        candidate = registry.get(report.candidate)
        assert candidate.base == 0 and candidate.parent == 0 and candidate.org_id == ""
        assert (candidate.path / "adapter_config.json").is_file()
        assert registry.get(PRODUCTION).version == report.production_after
    assert served.version == report.production_after  # a promoted adapter serves, merged onto its base


# The stages a cycle's state.json records (flywheel/live/cycle.py), each with the longest delay a
# kill aimed at it is drawn up to: the moment it is written, then that far into the work of the
# next stage. After "decided", applying the decision and writing the report take about a tenth of a
# second, so that kill comes at once (the state polled every millisecond).
KILL_STAGES = {"started": 1.5, "trained": 1.5, "gated": 1.5, "deployed": 1.5, "decided": 0.0}


@pytest.mark.slow  # 3 trials, 35-45 s each on the shared 2-core machine
def test_cycles_killed_at_random_moments_leave_production_serving_and_their_reruns_complete(tmp_path):
    """`flywheel live` (a subprocess against a server in this process, simulated users running)
    SIGKILLed at random moments of its cycle, three trials with a new world each: the kill's stage
    drawn from KILL_STAGES without repeats, then a drawn delay into the next stage's work. After the kill,
    production still answers, and the Registry's production is the server's (aliases move only
    through the server). The rerun finishes that same cycle (no second one): its report's decision is
    what the server serves and the Registry names, and no version but production and the cycle's
    candidate was ever served (a candidate registered just before a kill stays unserved, with no
    alias). Set FLYWHEEL_FAULT_SEED to replay a failure's draw."""
    seed = fault_seed()
    rng = random.Random(seed)
    start_checkpoint()
    for trial, stage in enumerate(rng.sample(sorted(KILL_STAGES), 3)):
        killed_cycle_trial(tmp_path / f"trial-{trial}", stage, rng.uniform(0.0, KILL_STAGES[stage]), seed)


def killed_cycle_trial(root: Path, stage: str, delay_s: float, seed: int) -> None:
    said = f"seed {seed}, killed {delay_s:.2f} s after stage {stage!r}"
    with live_world(root) as world:
        config = _cycle_config(root, world.serve.loop, server_url=world.url, admin_key=KEY)
        path = root / "live.toml"
        path.write_text(_toml(json.loads(config.model_dump_json(exclude={"loop_file", "gate_file"}))))
        command = [sys.executable, "-m", "flywheel.cli", "live", "--config", str(path)]
        state_file = root / "cycles" / "cycle-0001" / "state.json"
        first = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.monotonic() + 180
            order = (*KILL_STAGES, "done")  # in order; one may be skipped (a rejected candidate is never deployed)
            while (now := _stage(state_file)) is None or order.index(now) < order.index(stage):
                assert first.poll() is None, f"{said}: the cycle ended first: {first.communicate()[0][-3000:]}"
                assert time.monotonic() < deadline, f"{said}: not there after 180 s; state: {now}"
                time.sleep(0.001 if stage == "decided" else 0.05)
            time.sleep(delay_s)
        finally:
            os.kill(first.pid, signal.SIGKILL)
            first.wait()
        killed_at = _stage(state_file)
        said += f" (state then: {killed_at})"
        # Only the kill aimed after "decided" can come late (its stage takes about 0.1 s and the
        # server is in this process): then the cycle finished, and is checked as the reruns are.
        assert killed_at != "done" or stage == "decided", f"{said}: the cycle finished before the kill"
        print(said)
        # Killed: production still answers, and the Registry names what the server serves.
        with Registry(world.registry_root) as registry:
            assert registry.get(PRODUCTION).version == world.server.deployment.production, said
        api = openai.OpenAI(base_url=f"{world.url}/v1", api_key=KEY, max_retries=0, timeout=60)
        answer = api.chat.completions.create(model="flywheel", max_tokens=8, tools=tool_schemas(), messages=[
            {"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": POLICY.tasks()[0].instruction}])
        assert answer.model_extra["flywheel"]["version"] in world.server.deployment.versions, said
        if killed_at == "deployed":  # killed in its A/B test: the candidate's arm stays up for the rerun
            assert world.server.deployment.candidate is not None, said
        if killed_at != "done":
            rerun = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=240)
            assert rerun.returncode == 0, f"{said}: " + rerun.stdout[-3000:] + rerun.stderr[-3000:]
            assert f"resuming after stage {killed_at!r}" in rerun.stdout, f"{said}: {rerun.stdout[-2000:]}"
        deployment = world.server.deployment
        with Registry(world.registry_root) as registry:
            checkpoints = registry.list()
            production = registry.get(PRODUCTION).version
        with LiveStore(world.serve.loop.store.path) as store:
            served = {c.version for c in store.completions()}
    report = CycleReport.model_validate_json((root / "cycles" / "cycle-0001" / "report.json").read_text())
    assert report.cycle == 1 and report.decision in ("promote", "rollback", "rejected"), (said, report.reason)
    assert deployment == Deployment(production=report.production_after) and production == report.production_after, said
    assert not (root / "cycles" / "cycle-0002").exists(), said  # resumed, not started over
    cycle_versions = {0} | ({report.candidate} if report.candidate is not None else set())
    assert served <= cycle_versions, (said, served, report.candidate)
    orphans = [c for c in checkpoints if c.version not in cycle_versions]
    assert all(not c.aliases for c in orphans), (said, orphans)  # registered before a kill, never served


def _stage(state_file: Path) -> str | None:
    try:
        return json.loads(state_file.read_text())["stage"]
    except (FileNotFoundError, json.JSONDecodeError):  # not written yet, or caught mid-replace
        return None


def _toml(data: dict, prefix: str = "") -> str:
    """A config dict as TOML (tables after values), enough for LiveConfig's plain types."""
    lines, tables = [], []
    for key, value in data.items():
        if value is None:
            continue
        if isinstance(value, dict):
            tables.append((key, value))
        else:
            lines.append(f"{json.dumps(key)} = {json.dumps(value)}")
    for key, value in tables:
        name = f"{prefix}.{json.dumps(key)}" if prefix else json.dumps(key)
        lines.append(f"\n[{name}]\n" + _toml(value, name))
    return "\n".join(lines) + "\n"


def test_the_cycle_report_and_the_dashboard_show_the_same_session_monitors(tmp_path):
    """One window for both (`sessions.watch`): a candidate that declares "done" early on hard tasks
    shows in the cycle's monitor series and in /dashboard's as the same session-level points, and
    its critical done-without-edit alarm blocks its promotion in the cycle."""
    hour, start = 3600.0, time.time() - 30 * 3600.0
    rng = random.Random(0)
    honest, honest_events = policy_sessions(0, "honest", 60, start, rng)
    hacked, hacked_events = policy_sessions(1, "early_done", 60, start, rng)
    tiny_registry(tmp_path / "registry").close()
    store_path = tmp_path / "live" / "live.sqlite"
    with LiveStore(store_path) as store:
        for c in honest + hacked:
            store.add_completion(c)
        store.add_events(honest_events + hacked_events)
    sessions = SessionMonitorConfig(window_s=48 * hour)
    serve = ServeConfig(loop=LoopConfig.at(tmp_path / "live" / "live.sqlite", tmp_path / "registry",
                                           session_monitor=sessions),
                        keys=KEYS, threads=1, dashboard=DashboardConfig(horizon_s=48 * hour, refresh_s=0.5))
    server = LiveServer.from_config(serve)
    with serve_in_thread(server) as running:
        r = httpx.get(f"{running.url}/dashboard/data", headers={"authorization": "Bearer admin-key"}, timeout=60)
        assert r.status_code == 200, r.text
        reply = r.json()
        config = _cycle_config(tmp_path, serve.loop, monitor_lookback_s=48 * hour)
        cycle = LiveCycle(config, ServerControl(server), log=lambda m: None)
        state = CycleState(cycle=1, trigger="manual", started_at=time.time(), production=0, first_production=0,
                           since=0.0, events_at_start=0, candidate=1)
        with LiveStore(store_path) as store:
            cycle._watch(state, store)
    server.close()

    def session_points(series) -> set[tuple]:
        return {(p["metric"], p["version"], p["window_start"], p["n"], round(p["value"], 9)) for p in series
                if p["metric"] in ("session_length", "turns_before_edit", "positive_outcome_rate",
                                   "done_without_edit_rate")}

    dashboard = reply["data"]["monitors"]
    cycle_series = [p.model_dump() for p in state.monitor.series]
    assert session_points(cycle_series) and session_points(dashboard["series"]) == session_points(cycle_series)
    assert {p[0] for p in session_points(cycle_series)} == {"session_length", "turns_before_edit",
                                                            "positive_outcome_rate", "done_without_edit_rate"}
    assert "120 background sessions" in dashboard["source"]
    blocking = {(a.metric, a.version) for a in state.blocking_alarms}
    assert ("done_without_edit_rate", 1) in blocking
    assert any(a["metric"] == "done_without_edit_rate" and a["version"] == 1 for a in dashboard["alarms"])



@pytest.mark.slow  # 24 s on the shared 2-core machine (load ~10)
def test_a_cycle_specializes_an_organization_on_its_own_traffic_and_decides_for_it_alone(tmp_path):
    """Half the simulated users belong to acme (their requests name it): after the shared model's
    decision the cycle trains acme's LoRA adapter on acme's on-policy completions only, gates it on
    acme's battery and the general one, A/B tests it within acme's traffic through the server, and
    promotes or rolls back acme alone; report.json records it."""
    start_checkpoint()
    acme_dev = POPULATION.profiles[0].model_copy(update={"name": "acme-dev", "org_id": "acme"})
    population = POPULATION.model_copy(update={"profiles": [POPULATION.profiles[0], acme_dev]})
    with live_world(tmp_path, population=population) as world:
        config = _cycle_config(
            tmp_path, world.serve.loop,
            deploy={"candidate_fraction": 0.5, "max_wait_s": 180.0, "poll_s": 0.5, "promote_when": "gate"},
            orgs={"enabled": True, "adapter": {"min_completions": 6, "rank": 4}, "candidate_fraction": 0.5},
            ab={"min_per_arm": 6})
        cycle = LiveCycle(config, ServerControl(world.server), log=lambda m: None, gate_tasks=POLICY.tasks(),
                          org_gate_tasks={"acme": POLICY.tasks()})
        (report,) = cycle.run(1)
        acme_after = world.server.org_deployment("acme")
        shared_after = world.server.deployment
        store = world.server.store
        acme_batch = [c for c in store.completions(version=0, start=report.batch["since"], end=report.batch["cutoff"])
                      if c.org_id == "acme"]
    acme = report.orgs["acme"]
    assert list(report.orgs) == ["acme"] and acme.decision in ("promote", "rollback"), acme.reason
    assert (acme.served_version, acme.base) == (0, 0) and 6 <= acme.completions <= len(acme_batch)
    assert acme.train["optimizer_steps"] > 0 and acme.gate.passed, acme.reason
    assert acme.org_gate.tasks == acme.general_gate.tasks == len(POLICY.tasks())
    # The A/B test ran within acme's traffic: the base against the adapter, nobody else's answers.
    assert acme.ab.versions == {"production": [0], "candidate": [acme.candidate]}
    assert acme.ab.closed["production"] >= 6 and acme.ab.closed["candidate"] >= 6 or acme.ab.decision == "wait"
    assert acme_after == acme.deployment_after
    assert acme_after == (Deployment(production=acme.candidate) if acme.decision == "promote" else None)
    assert shared_after == Deployment(production=report.production_after)  # the shared decision stands
    with Registry(world.registry_root) as registry:
        adapter = registry.get(acme.candidate)
        assert (adapter.base, adapter.org_id, adapter.parent) == (0, "acme", 0)
        if acme.decision == "promote":
            assert registry.get("production-acme").version == acme.candidate
        else:
            with pytest.raises(CheckpointNotFound):
                registry.get("production-acme")
    saved = json.loads((tmp_path / "cycles" / "cycle-0001" / "report.json").read_text())
    assert saved["orgs"]["acme"]["decision"] == acme.decision and "orgs_s" in report.timings
