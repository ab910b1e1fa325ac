"""The training loop on Ray: a multi-node cluster simulated on this machine, never mocks.

One `ray.cluster_utils.Cluster` per module: a head node (the learner's, custom resource
`learner`) and three rollout nodes (custom resource `rollout`), each a raylet of its own with one
CPU, a 100 MB object store, loopback only, usage reporting off. Rollout workers and the learner are
real actors placed by placement groups; episodes run the real engine (a tiny SFT'd model that
talks for a few turns, so every episode has turn boundaries to resume from), real bwrap
sandboxes and real grading. The faults are real too: `ray.kill` of a worker or the learner,
`Cluster.remove_node` of a whole node, SIGSTOP of a worker's process for a hang.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import ray

from flywheel.agent.episode import EpisodeConfig
from flywheel.env.families import task_set
from flywheel.env.pool import PoolConfig
from flywheel.model.engine import EngineConfig, SamplingParams
from flywheel.model.registry import Registry
from flywheel.model.weight_delta import diff_weights, weights_digest
from flywheel.report import build_report_data, render_report
from flywheel.rl.audit import LostSamples, audit, trained_steps
from flywheel.rl.cluster import ClusterConfig
from flywheel.rl.orchestrator import OrchestratorStalled
from flywheel.rl.ray_backend import ActorHung, RayRollouts
from flywheel.rl.ray_engine import RayEngine, start_engine_actor
from flywheel.rl.run_folder import RunFolder
from flywheel.rl.train import TrainConfig, train
from tests.rl.fault_injection import ActorFaults, KilledRun, fault_seed, named_actors
from tests.rl.question_policy import register_question_policy
from tests.rl.ray_cluster import rollout_node, simulated_cluster


@pytest.fixture(scope="module")
def cluster():
    """The head (the learner's) and three rollout nodes of one CPU each (tests/rl/ray_cluster.py)."""
    with simulated_cluster({f"rollout-{i}": rollout_node() for i in range(3)}) as (c, _):
        yield c


@pytest.fixture(scope="module")
def registry_root(tmp_path_factory) -> Path:
    """A tiny policy that answers every turn with a question (tests/rl/question_policy.py)."""
    return register_question_policy(tmp_path_factory.mktemp("ray") / "registry")


def run_config(registry_root: Path, run_dir: Path, backend: str = "ray", steps: int = 4, checkpoint_every: int = 1,
               **cluster) -> TrainConfig:
    cluster_keys = {"backend": backend}
    if backend == "ray":
        cluster_keys.update(rollout_workers=2, placement="STRICT_SPREAD", worker_cpus=0.2, learner_cpus=0.2,
                            worker_resources={"rollout": 0.5}, learner_resources={"learner": 0.5},
                            episodes_per_worker=16, actor_timeout_s=60.0, sandboxes_per_cpu=6)
    cluster_keys.update(cluster)
    return TrainConfig.model_validate({
        "registry_root": str(registry_root), "run_dir": str(run_dir), "families": ["bugfix"],
        "train_tasks_per_family": 2, "eval_tasks_per_family": 1, "eval_at_start": False, "threads": 1,
        "register_checkpoint": False,
        "orchestrator": {"group_size": 4, "groups_per_step": 2, "max_staleness": 1, "concurrency": 16,
                         "max_steps": steps, "filter_zero_signal": False, "checkpoint_every": checkpoint_every,
                         "episode": {"max_turns": 4, "max_tokens_per_turn": 24, "temperature": 0.5}},
        "learner": {"lr": 1e-4, "temperature": 0.5},
        "engine": {"threads": 1},
        "pool": {"warm": 0},
        "cluster": cluster_keys,
    })


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def check_run(run_dir: Path, steps: int, staleness: int = 1, lost: Sequence[LostSamples] = ()) -> list[dict]:
    """What every run must show: each step once, at the policy it made, within the staleness bound,
    and every invariant of flywheel/rl/audit.py (`lost`: the samples of the policies its kills lost)."""
    metrics = [row for _, row in sorted(trained_steps(RunFolder(run_dir)).items())]
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    assert [m["policy_version"] for m in metrics] == list(range(1, steps + 1))
    assert max(m["staleness_max"] for m in metrics) <= staleness
    assert audit(run_dir, lost, max_staleness=staleness, group_size=4) == []
    return metrics


def when_inflight(run_dir: Path, n: int, then, timeout_s: float = 400.0) -> threading.Thread:
    """Call `then()` once at least `n` episodes of the run have a saved in-flight state (the run's
    actors start first: 20-30 s on 2 shared cores, minutes when other test suites load them)."""
    def watch() -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            inflight = run_dir / "inflight"
            if inflight.exists() and sum(1 for _ in inflight.rglob("*.json")) >= n:
                then()
                return
            time.sleep(0.05)
    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


@pytest.mark.slow  # 152 s on the shared 2-core machine (load ~10)
def test_a_run_on_ray_records_what_the_local_run_does_through_a_killed_worker_and_a_lost_node(
        cluster, registry_root, tmp_path):
    """One run for all (each run starts its actors, 20-30 s on 2 shared cores): three rollout
    workers, one per rollout node; one is killed, then the third's engine, then the second's node is
    removed. The dead workers and engines are replaced while the others go on, every engine takes
    every weight update, and the records must be the local run's, no episode lost or trained twice."""
    run_dir, logs, faults = tmp_path / "ray", [], []

    def kill_a_worker_then_a_node() -> None:
        workers = named_actors("rollout-")
        where = [ray.get(w.where.remote()) for w in workers]
        # the victim is a worker playing an episode past its first turn, so that one resumes mid-episode:
        # still past it a moment later, so that the turn's state has streamed to the driver (a worker
        # counts a turn before the driver holds its state; killed in between, it resumes from turn 0)
        deadline, victim = time.monotonic() + 60, None
        while victim is None and time.monotonic() < deadline:
            playing = ray.get([w.playing.remote() for w in workers])
            victim = next((i for i, turns in enumerate(playing) if turns and turns[0] >= 1), None)
            if victim is not None:
                time.sleep(0.3)
                turns = ray.get(workers[victim].playing.remote())
                victim = victim if turns and turns[0] >= 1 else None
            time.sleep(0.02)
        victim = 0 if victim is None else victim  # (then the mid-episode assertion below says so)
        engine_of, node_of = [i for i in range(3) if i != victim]
        ray.kill(workers[victim])
        faults.append(("killed", where[victim]["name"]))
        ray.kill(named_actors(f"engine-{engine_of}-")[0])
        faults.append(("killed the engine of", where[engine_of]["name"]))
        time.sleep(1.0)  # the survivors take the killed worker's episodes, then lose another node
        node = next(n for n in cluster.list_all_nodes() if n.node_id == where[node_of]["node_id"])
        cluster.remove_node(node)
        faults.append(("removed node of", where[node_of]["name"]))

    watcher = when_inflight(run_dir, 4, kill_a_worker_then_a_node)
    try:
        _, summary = train(run_config(registry_root, run_dir, steps=5, rollout_workers=3), log=logs.append)
    finally:
        watcher.join(timeout=60)
        if faults and faults[-1][0] == "removed node of":  # back to the module cluster's three rollout nodes
            cluster.add_node(**rollout_node())
            cluster.wait_for_nodes()
    assert summary["steps"] == 5
    assert [f[0] for f in faults] == ["killed", "killed the engine of", "removed node of"], faults
    ray_metrics = check_run(run_dir, 5)

    # The workers sat one per rollout node (STRICT_SPREAD over the nodes offering `rollout`) and
    # sized their pools from their node: 1 CPU x 6 sandboxes per CPU.
    sizing = [line for line in logs if line.startswith("rollout worker") and " sandboxes = " in line
              and " replaces " not in line]
    assert len(sizing) == 3 and all(": 6 sandboxes = min(1 CPU" in line for line in sizing), sizing
    assert len({line.split(" on node ")[1].split()[0] for line in sizing}) == 3
    fleet = rows(run_dir / "fleet.jsonl")
    assert [row["step"] for row in fleet] == [1, 2, 3, 4, 5]  # written off the step's path, in step order
    assert all(n["peak"] <= 6 and n["created_per_s"] > 0 for row in fleet for n in row["nodes"].values())
    drawn = build_report_data([run_dir])["training"][0]["fleet"]  # the run's report reads the fleet as written
    assert [{node: n["live_sandboxes"] for node, n in p["nodes"].items()} for p in drawn] == \
        [{node: n["live_sandboxes"] for node, n in row["nodes"].items()} for row in fleet]
    assert "Live sandboxes per node (Ray)" in render_report(run_dir).read_text()
    # Every live engine holds the policy of the step just taken: each update reached each engine,
    # the replacements included (started with the latest weights, then kept up to date).
    assert all(e["version"] == row["step"] for row in fleet for e in row["engines"].values()), fleet

    # Faults: the dead workers' in-flight episodes moved, some from a saved mid-episode state.
    moved = [line for line in logs if "continues on another worker from turn" in line]
    assert ray_metrics[-1]["failover_episodes"] == len(moved) >= 2, moved
    assert any(not line.split("from turn ")[1].startswith("0:") for line in moved), moved
    # The killed engine's requests were finished by another engine (the records above hold them,
    # each token with its version); replacements are tested on their own, below.
    assert ray_metrics[-1]["engine_resubmits"] >= 1, ray_metrics[-1]
    _, progress = RunFolder(run_dir).load_state()
    by_group: dict[str, int] = {}
    for r in rows(run_dir / "trajectories.jsonl"):
        by_group[r["episode"].split("/")[0]] = by_group.get(r["episode"].split("/")[0], 0) + 1
    assert progress["consumed"] and all(by_group.get(g) == 4 for g in progress["consumed"])  # none lost

    # The same records as the local backend's.
    train(run_config(registry_root, tmp_path / "local", backend="local"), log=lambda _: None)
    local_metrics = check_run(tmp_path / "local", 4)
    ray_records, local_records = rows(run_dir / "trajectories.jsonl"), rows(tmp_path / "local" / "trajectories.jsonl")
    assert set(ray_records[0]) == set(local_records[0])
    assert set(ray_records[0]["trajectory"]) == set(local_records[0]["trajectory"])
    # the step's anatomy counts the engine's tokens and seconds where it runs here (LocalEngine.counters)
    assert set(local_metrics[0]) - set(ray_metrics[0]) == {"time/engine_prefill", "time/engine_decode",
                                                           "time/engine_swap", "time/engine_idle",
                                                           "tokens/engine_prefill", "tokens/engine_decode",
                                                           "engine_decode_steps"}
    assert set(ray_metrics[0]) - set(local_metrics[0]) == {"failover_episodes", "engine_restarts", "engine_resubmits",
                                                           "workers_replaced"}
    turns = [t["trajectory"]["turns"] for t in ray_records]
    assert sum(turns) / len(turns) >= 2, turns  # the episodes really had turn boundaries to resume from


@pytest.mark.slow  # 65-75 s on the shared 2-core machine
def test_kills_at_random_moments_keep_every_version_invariant(cluster, registry_root, tmp_path):
    """The learner actor and one of a node's sandbox pool, a worker, an engine or a whole node, killed
    in a random order at random moments of one run (tests/rl/fault_injection.py): the learner once the
    engines sample a policy whose checkpoint is not written yet (checkpoint_every = 2 makes that a
    whole step), so its resume must forget what that policy sampled. The learner's death restarts
    the run from its checkpoint, the rest heal in place, and every invariant of flywheel/rl/audit.py
    holds on the records. Weights go out as deltas (`weight_deltas`), so a replaced engine or a
    restarted run's engines start from the driver's copy of the last weights pushed."""
    seed = fault_seed()
    rng = random.Random(seed)
    # two per run, so both land within its steps on a loaded machine; over runs, every kind and order
    kinds = ["learner", rng.choice(["pool", "worker", "engine", "node"])]
    rng.shuffle(kinds)
    run_dir = tmp_path / "run"
    faults = ActorFaults(run_dir, cluster, rng)
    dealer = faults.start(kinds)
    try:
        config = run_config(registry_root, run_dir, steps=8, checkpoint_every=2, learner_restarts=1,
                            rollout_workers=2)
        _, summary = train(config.model_copy(update={"weight_deltas": True}), log=faults.log)
    finally:
        faults.stop(dealer)
        for _ in range(faults.removed):
            cluster.add_node(**rollout_node())
        cluster.wait_for_nodes()
    said = f"seed {seed}, faults {faults.faults}, errors {faults.errors}"
    assert not faults.errors and [f.kind for f in faults.faults] == kinds, said
    assert summary["steps"] == 8 and any(line.startswith(f"resumed {run_dir} at step") for line in faults.logs), said
    assert len(faults.lost) == 1 and faults.lost[0].records > 0, said  # tokens of a lost policy to forget
    metrics = check_run(run_dir, 8, lost=faults.lost)
    assert all("weight_update_bytes" in m for m in metrics), said  # pushed as deltas from the driver's copy


@pytest.mark.slow  # 33 s on the shared 2-core machine (load ~10)
def test_a_hung_worker_is_named_within_the_timeout(cluster, registry_root, tmp_path):
    run_dir, stopped = tmp_path / "run", []

    def hang_a_worker() -> None:
        where = ray.get(named_actors("rollout-")[0].where.remote())
        os.kill(where["pid"], signal.SIGSTOP)  # alive to Ray, answering nothing
        stopped.append((where["pid"], time.monotonic()))

    watcher = when_inflight(run_dir, 2, hang_a_worker)
    try:
        with pytest.raises((OrchestratorStalled, ActorHung)) as raised:
            train(run_config(registry_root, run_dir, steps=20, actor_timeout_s=4.0, rollout_workers=1),
                  log=lambda _: None)
        detected = time.monotonic()
    finally:
        watcher.join(timeout=60)
        for pid, _ in stopped:
            os.kill(pid, signal.SIGCONT)
    assert stopped, "the run ended before a worker could be stopped"
    pid, since = stopped[0]
    assert f"pid {pid}" in str(raised.value) and "rollout worker rollout-" in str(raised.value)
    assert detected - since < 4.0 + 30.0  # the timeout, plus closing the run


def engine_pair(registry_root: Path, cluster_config: ClusterConfig, versions: tuple[int, int]):
    """Two real EngineActors of the tiny policy on two rollout nodes (versions as given), and the
    RayEngine a worker would use, with engine 0 as its home."""
    model, tokenizer = Registry(registry_root).load("production")
    engines = [start_engine_actor({"resources": {"rollout": 0.1}, "scheduling_strategy": "SPREAD"},
                                  f"engine-test-{v}-{time.monotonic_ns()}", type(model), model.config,
                                  ray.put(model.state_dict()), EngineConfig(threads=1), v, tokenizer, None,
                                  cluster_config)
               for v in versions]
    where = ray.get([e.where.remote() for e in engines], timeout=120)
    return engines, where, RayEngine(engines, where, 0, cluster_config)


@pytest.mark.slow  # 13 s on the shared 2-core machine (load ~10)
def test_a_killed_engine_s_request_continues_on_another_with_its_tokens_and_their_versions(cluster, registry_root):
    """Engine 0 (policy 0) is killed once it has streamed some tokens of a long request; engine 1
    (policy 7) finishes it from prompt + those tokens: the first tokens keep version 0 and their
    logprobs, the rest are version 7, and the request is counted as resubmitted."""
    config = ClusterConfig(backend="ray", rollout_workers=2, engine_cpus=0.1, token_stream_s=0.05,
                           actor_timeout_s=60)
    engines, where, engine = engine_pair(registry_root, config, (0, 7))
    streamed: list[tuple[int, float]] = []
    first = threading.Event()

    def on_token(token: int, logprob: float) -> None:
        streamed.append((token, logprob))
        first.set()

    try:
        future = engine.submit([1, 2, 3], SamplingParams(temperature=1.0, max_tokens=400, on_token=on_token))
        assert first.wait(60), "engine 0 streamed no token"
        ray.kill(engines[0])
        before = len(streamed)
        gen = future.result(timeout=120)
    finally:
        engine.close()
        for e in engines:
            ray.kill(e)
    assert len(gen.token_ids) == len(gen.logprobs) == len(gen.versions) == 400
    assert gen.finish_reason == "length" and engine.resubmits == 1
    kept = gen.versions.count(0)
    assert before <= kept < 400 and gen.versions == [0] * kept + [7] * (400 - kept), gen.versions
    assert [t for t, _ in streamed] == gen.token_ids  # each token reported once, in order
    assert [lp for _, lp in streamed[:kept]] == gen.logprobs[:kept]
    assert where[0]["node_id"] != where[1]["node_id"]


@pytest.mark.slow  # 20 s on the shared 2-core machine (load ~10)
def test_a_hung_engine_is_named_within_its_timeout(cluster, registry_root):
    config = ClusterConfig(backend="ray", rollout_workers=2, engine_cpus=0.1, token_stream_s=0.05,
                           actor_timeout_s=60, engine_timeout_s=3)
    engines, where, engine = engine_pair(registry_root, config, (0, 0))
    first = threading.Event()
    try:
        future = engine.submit([1, 2, 3], SamplingParams(max_tokens=400, on_token=lambda *_: first.set()))
        assert first.wait(60), "engine 0 streamed no token"
        os.kill(where[0]["pid"], signal.SIGSTOP)  # alive to Ray, answering nothing
        since = time.monotonic()
        try:
            with pytest.raises(ActorHung) as raised:
                future.result(timeout=60)
            detected = time.monotonic()
        finally:
            os.kill(where[0]["pid"], signal.SIGCONT)
    finally:
        engine.close()
        for e in engines:
            ray.kill(e)
    assert f"pid {where[0]['pid']}" in str(raised.value) and where[0]["node_id"][:8] in str(raised.value)
    assert "cluster.engine_timeout_s" in str(raised.value)
    assert 3.0 - 0.5 <= detected - since < 3.0 + 5.0


@pytest.mark.slow  # 45 s on the shared 2-core machine (load ~10)
def test_a_dead_worker_and_a_dead_engine_are_replaced_and_take_the_next_weights_as_deltas(cluster, registry_root):
    """Two idle workers, pushed weight deltas; worker 0 and engine 1 killed. Both deaths are noticed
    with no episode sent (each actor's held-open `alive` call fails): a new worker takes worker 0's
    place and a new engine engine 1's, nothing fails over, the fleet is whole again, and the next
    weight update reaches both engines: episodes after it carry only the new version. The deltas:
    engines at the last version get only the changed tensors (one object in the store), the
    replacement starts from the driver's copy (start weights plus a delta), an engine whose version
    moved behind the driver's back refuses the delta and gets the whole weights, and every engine
    ends bit-identical to a full push. (Episodes failing over from a worker that dies under them:
    the run test above.)"""
    model, tokenizer = Registry(registry_root).load("production")
    config = ClusterConfig(backend="ray", rollout_workers=2, placement="STRICT_SPREAD", worker_cpus=0.2,
                           engine_cpus=0.1, worker_resources={"rollout": 0.5}, actor_timeout_s=60)
    task = task_set(["bugfix"], "train", 1, seed=100, difficulty=1)[0]
    episode = EpisodeConfig(max_turns=2, max_tokens_per_turn=8)
    logs: list[str] = []
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    full_bytes = sum(t.numel() * t.element_size() for t in start.values())
    # a few tensors change per step (not the tied embedding, whose two names are one tensor)
    w1 = {k: v + 0.01 if i % 3 == 0 and "embed" not in k and "lm_head" not in k else v for i, (k, v) in
          enumerate(start.items())}
    w2 = {k: v * 1.5 if i % 4 == 1 and "embed" not in k and "lm_head" not in k else v for i, (k, v) in
          enumerate(w1.items())}
    rollouts = RayRollouts(config, model, tokenizer, EngineConfig(threads=1), PoolConfig(warm=0), 0, log=logs.append,
                           weight_deltas=True)
    try:
        old_worker, old_engine = rollouts.where[0], rollouts.engine_where[1]
        first = rollouts(task, episode, "g0", None, lambda _: None, 0)
        rollouts.update_weights(w1, 1)  # both engines hold the start weights: the changes only
        assert rollouts.last_update_bytes == 2 * diff_weights(start, w1, 1, 0).nbytes < full_bytes / 2
        ray.kill(rollouts.workers[0])
        ray.kill(rollouts.engines[1])
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            counts = rollouts.counts()
            if counts["workers_replaced"] == 1 and counts["engine_restarts"] == 1:
                break
            time.sleep(0.5)
        assert any("rollout-0 " in line and "is gone" in line for line in logs), logs
        assert counts["failover_episodes"] == 0 and counts["workers_replaced"] == 1, (counts, logs)
        assert counts["engine_restarts"] == 1, (counts, logs)
        assert rollouts.where[0]["pid"] != old_worker["pid"] and rollouts.engine_where[1]["pid"] != old_engine["pid"]
        assert ray.get(rollouts.engines[1].weights_digest.remote()) == weights_digest(w1)  # the driver's copy
        ray.get(rollouts.engines[0].update_weights.remote(ray.put(start), 7, 60.0))  # behind the driver's back
        rollouts.update_weights(ray.put(w2), 2)  # a reference, as the learner actor's weights
        assert rollouts.last_update_bytes == diff_weights(w1, w2, 2, 1).nbytes + full_bytes  # engine 0: refused
        assert ray.get([e.weights_digest.remote() for e in rollouts.engines]) == [weights_digest(w2)] * 2
        stats = rollouts.stats()
        assert stats["live_workers"] == 2, stats
        assert sorted(e["version"] for e in stats["engines"].values()) == [2, 2], stats
        assert old_engine["name"] not in stats["engines"], stats
        with ThreadPoolExecutor(2) as threads:  # one episode on each worker (the least loaded first)
            after = list(threads.map(lambda g: rollouts(task, episode, g, None, lambda _: None, 0), ["g1", "g2"]))
    finally:
        rollouts.close()
    assert set(first.versions[i] for i, m in enumerate(first.loss_mask) if m) == {0}
    for t in after:
        assert {v for v, m in zip(t.versions, t.loss_mask, strict=True) if m} == {2}


@pytest.mark.slow  # 43 s on the shared 2-core machine
def test_a_lost_node_s_worker_and_engine_are_replaced_where_there_is_room_and_on_a_node_that_joins(
        cluster, registry_root):
    """Two workers, one per rollout node (STRICT_SPREAD, each bundle taking its node's whole `rollout`).
    Worker 0's node is removed: Ray places its bundle again on the free third rollout node, where a new
    worker and engine start. That node is removed in turn: no node is free, so the replacement waits,
    and starts on a node added afterwards. Each replacement is reported with the seconds it took, as
    metrics.jsonl's `replacements` records them, and the fleet plays episodes at the end."""
    model, tokenizer = Registry(registry_root).load("production")
    config = ClusterConfig(backend="ray", rollout_workers=2, placement="STRICT_SPREAD", worker_cpus=0.2,
                           engine_cpus=0.1, worker_resources={"rollout": 1}, actor_timeout_s=60, start_timeout_s=90)
    task = task_set(["bugfix"], "train", 1, seed=100, difficulty=1)[0]
    logs: list[str] = []
    removed = 0

    def remove_node_of(node_id: str) -> None:
        nonlocal removed
        cluster.remove_node(next(n for n in cluster.list_all_nodes() if n.node_id == node_id))
        removed += 1

    def replaced(n: int, timeout_s: float = 150) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            counts = rollouts.counts()
            if counts["workers_replaced"] == n and counts["engine_restarts"] == n:
                return counts
            time.sleep(0.5)
        raise AssertionError(f"not replaced {n} times: {rollouts.counts()}; {logs}")

    rollouts = RayRollouts(config, model, tokenizer, EngineConfig(threads=1), PoolConfig(warm=0), 0, log=logs.append)
    try:
        first = [w["node_id"] for w in rollouts.where]
        remove_node_of(first[0])
        replaced(1)
        spare = rollouts.where[0]["node_id"]
        assert spare not in first and rollouts.engine_where[0]["node_id"] == spare
        reports = rollouts.replacements()
        assert sorted(r["actor"] for r in reports) == ["inference engine 0", "rollout worker 0"], reports
        assert all(r["node"] == spare[:8] and 0 < r["seconds"] < 150 for r in reports), reports
        assert rollouts.replacements() == []  # each reported once

        remove_node_of(spare)  # now no rollout node is free of the run's bundles
        time.sleep(5)
        assert rollouts.counts()["workers_replaced"] == 1  # no room: the replacement waits for its bundle
        joined = cluster.add_node(**rollout_node())
        cluster.wait_for_nodes()
        removed -= 1
        replaced(2)
        assert rollouts.where[0]["node_id"] == rollouts.engine_where[0]["node_id"] == joined.node_id
        reports = rollouts.replacements()
        assert sorted(r["actor"] for r in reports) == ["inference engine 0", "rollout worker 0"], reports
        assert all(r["seconds"] >= 5 for r in reports), reports  # from the death, not from the node's arrival
        with ThreadPoolExecutor(2) as threads:  # one episode on each worker
            played = list(threads.map(lambda g: rollouts(task, EpisodeConfig(max_turns=1, max_tokens_per_turn=8), g,
                                                         None, lambda _: None, 0), ["g1", "g2"]))
        assert all(t.generated_tokens for t in played) and rollouts.stats()["live_workers"] == 2
    finally:
        rollouts.close()
        for _ in range(removed):
            cluster.add_node(**rollout_node())
        cluster.wait_for_nodes()


@pytest.mark.slow  # 36-47 s on the shared 2-core machine
def test_a_run_that_lost_a_node_mid_turn_exits_0(cluster, registry_root, tmp_path):
    """`flywheel train` (the CLI, a process of its own, joined to the cluster) loses a rollout node
    while episodes are mid-turn, and its replacement is still waiting for room when the run ends
    (no node is free of the run's bundles). The run finishes, prints its summary and exits 0: the
    replacement still starting is stopped and the driver's threads are done before Ray shuts down."""
    run_dir = tmp_path / "run"
    config = run_config(registry_root, run_dir, steps=4, rollout_workers=3, address=cluster.address,
                        worker_resources={"rollout": 1})
    killed = KilledRun(config, random.Random(0))
    proc = killed.start()
    removed = False
    try:
        deadline = time.monotonic() + 180
        while not ((run_dir / "inflight").exists() and len(list((run_dir / "inflight").glob("*.json"))) >= 4):
            assert proc.poll() is None and time.monotonic() < deadline, killed._log().read_text()[-3000:]
            time.sleep(0.05)
        worker = named_actors("rollout-")[0]
        node_id = ray.get(worker.where.remote(), timeout=30)["node_id"]
        cluster.remove_node(next(n for n in cluster.list_all_nodes() if n.node_id == node_id))
        removed = True
        returncode = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
        if removed:
            cluster.add_node(**rollout_node())
            cluster.wait_for_nodes()
    output = killed._log().read_text()
    assert returncode == 0, output[-3000:]
    assert '"steps": 4' in output and "is gone" in output, output[-3000:]
    check_run(run_dir, 4)
