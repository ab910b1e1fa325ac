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
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import ray
import torch

from flywheel.agent.episode import EpisodeConfig, initial_prompt, opening
from flywheel.env.families import task_set
from flywheel.env.pool import PoolConfig
from flywheel.model.chat import IM_END
from flywheel.model.conversation import ConversationEncoder
from flywheel.model.engine import EngineConfig, SamplingParams
from flywheel.model.factory import ModelConfig, build_model
from flywheel.model.registry import Registry
from flywheel.model.tokenizer import train_tokenizer
from flywheel.report import build_report_data, render_report
from flywheel.rl.cluster import ClusterConfig
from flywheel.rl.orchestrator import OrchestratorStalled
from flywheel.rl.ray_backend import ActorHung, RayRollouts
from flywheel.rl.ray_engine import RayEngine, start_engine_actor
from flywheel.rl.run_folder import RunFolder
from flywheel.rl.sft import SFTConfig, train_sft
from flywheel.rl.train import TrainConfig, train
from tests.rl.ray_cluster import rollout_node, simulated_cluster

SAY = "Which file?"


@pytest.fixture(scope="module")
def cluster():
    """The head (the learner's) and three rollout nodes of one CPU each (tests/rl/ray_cluster.py)."""
    with simulated_cluster({f"rollout-{i}": rollout_node() for i in range(3)}) as (c, _):
        yield c


@pytest.fixture(scope="module")
def registry_root(tmp_path_factory) -> Path:
    """A tiny policy that answers every turn with a question (no tool call), so an episode is
    `max_turns` turns with a saved state after each, then graded."""
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("ray") / "registry"
    tasks = task_set(["bugfix"], "train", 2, seed=100, difficulty=1)
    tokenizer = train_tokenizer([initial_prompt(t) + SAY for t in tasks] * 4, vocab_size=300)
    model = build_model(ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                                    num_experts=4, experts_per_token=2, moe_intermediate_size=32), tokenizer)
    encoder = ConversationEncoder(tokenizer)
    say = tokenizer(SAY + IM_END, add_special_tokens=False)["input_ids"]
    examples = []
    for task in tasks:  # four turns of the same question, each answered by the simulated user
        tokens = encoder.encode(opening(task), encoder.tools)
        mask = [0] * len(tokens)
        for _ in range(4):
            reply = encoder.user_reply(task.answer_question(SAY))
            tokens, mask = tokens + say + reply, mask + [1] * len(say) + [0] * len(reply)
        examples.append((tokens, mask))
    train_sft(model, examples, SFTConfig(epochs=25, lr=3e-2, warmup_steps=1, batch_tokens=100_000),
              tokenizer.pad_token_id)
    with Registry(root) as registry:
        registry.register(model, tokenizer, parent=None, aliases=["production"], note="asks questions")
    return root


def run_config(registry_root: Path, run_dir: Path, backend: str = "ray", steps: int = 4, **cluster) -> TrainConfig:
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
                         "max_steps": steps, "filter_zero_signal": False,
                         "episode": {"max_turns": 4, "max_tokens_per_turn": 24, "temperature": 0.5}},
        "learner": {"lr": 0.01, "temperature": 0.5},
        "engine": {"threads": 1},
        "pool": {"warm": 0},
        "cluster": cluster_keys,
    })


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def check_run(run_dir: Path, steps: int, staleness: int = 1) -> list[dict]:
    """What every run must show: each step once, versions per generated token within the bound,
    each episode recorded once, each trained group trained once and complete."""
    metrics = rows(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    assert [m["policy_version"] for m in metrics] == list(range(1, steps + 1))
    assert max(m["staleness_max"] for m in metrics) <= staleness
    records = rows(run_dir / "trajectories.jsonl")
    episodes = [r["episode"] for r in records]
    assert len(episodes) == len(set(episodes)), "an episode was recorded twice"
    groups = {}
    for r in records:
        groups.setdefault(r["episode"].split("/")[0], []).append(r["trajectory"])
        t = r["trajectory"]
        generated = [v for v, m in zip(t["versions"], t["loss_mask"], strict=True) if m]
        assert generated and min(generated) >= 0 and max(generated) <= steps
        assert generated == sorted(generated), "a token's version went back in time"
    started = rows(run_dir / "groups.jsonl")
    for g in started:
        if g["group"] in groups and len(groups[g["group"]]) == 4:
            oldest = min(v for t in groups[g["group"]] for v, m in zip(t["versions"], t["loss_mask"], strict=True) if m)
            assert oldest >= g["version"]
    return metrics


def named_actors(prefix: str) -> list:
    """The live actors whose name starts with `prefix` ("rollout-", "learner-"), by name."""
    found = ray.util.list_named_actors(all_namespaces=True)
    return [ray.get_actor(a["name"], namespace=a["namespace"]) for a in sorted(found, key=lambda a: a["name"])
            if a["name"].startswith(prefix)]


def when_inflight(run_dir: Path, n: int, then, timeout_s: float = 120.0) -> threading.Thread:
    """Call `then()` once at least `n` episodes of the run have a saved in-flight state."""
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
        # the victim is a worker playing an episode past its first turn, so that one resumes mid-episode
        deadline, victim = time.monotonic() + 60, None
        while victim is None and time.monotonic() < deadline:
            playing = ray.get([w.playing.remote() for w in workers])
            victim = next((i for i, turns in enumerate(playing) if turns and turns[0] >= 1), None)
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


def test_a_killed_learner_resumes_from_its_last_checkpoint(cluster, registry_root, tmp_path):
    run_dir, logs = tmp_path / "run", []

    def kill_the_learner() -> None:
        deadline = time.monotonic() + 120
        while len(rows(run_dir / "metrics.jsonl")) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        ray.kill(named_actors("learner-")[0])

    watcher = threading.Thread(target=kill_the_learner, daemon=True)
    watcher.start()
    _, summary = train(run_config(registry_root, run_dir, steps=3, learner_restarts=1, rollout_workers=1),
                       log=logs.append)
    watcher.join(timeout=10)
    assert any("the learner actor died" in line and "restarting from" in line for line in logs), logs
    assert any(line.startswith(f"resumed {run_dir} at step") for line in logs), logs
    check_run(run_dir, 3)  # each step once: the one the dead learner was on is trained by the new one
    assert summary["steps"] == 3


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


def test_a_dead_worker_and_a_dead_engine_are_replaced_and_take_the_next_weights(cluster, registry_root):
    """Two idle workers; worker 0 and engine 1 killed. Both deaths are noticed with no episode sent
    (each actor's held-open `alive` call fails): a new worker takes worker 0's place and a new engine
    engine 1's, nothing fails over, the fleet is whole again, and the next weight update reaches both
    engines: episodes after it carry only the new version. (Episodes failing over from a worker
    that dies under them: the run test above.)"""
    model, tokenizer = Registry(registry_root).load("production")
    config = ClusterConfig(backend="ray", rollout_workers=2, placement="STRICT_SPREAD", worker_cpus=0.2,
                           engine_cpus=0.1, worker_resources={"rollout": 0.5}, actor_timeout_s=60)
    task = task_set(["bugfix"], "train", 1, seed=100, difficulty=1)[0]
    episode = EpisodeConfig(max_turns=2, max_tokens_per_turn=8)
    logs: list[str] = []
    rollouts = RayRollouts(config, model, tokenizer, EngineConfig(threads=1), PoolConfig(warm=0), 0, log=logs.append)
    try:
        old_worker, old_engine = rollouts.where[0], rollouts.engine_where[1]
        first = rollouts(task, episode, "g0", None, lambda _: None, 0)
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
        rollouts.update_weights({k: v + 0.01 for k, v in model.state_dict().items()}, 1)
        stats = rollouts.stats()
        assert stats["live_workers"] == 2, stats
        assert sorted(e["version"] for e in stats["engines"].values()) == [1, 1], stats
        assert old_engine["name"] not in stats["engines"], stats
        with ThreadPoolExecutor(2) as threads:  # one episode on each worker (the least loaded first)
            after = list(threads.map(lambda g: rollouts(task, episode, g, None, lambda _: None, 0), ["g1", "g2"]))
    finally:
        rollouts.close()
    assert set(first.versions[i] for i, m in enumerate(first.loss_mask) if m) == {0}
    for t in after:
        assert {v for v, m in zip(t.versions, t.loss_mask, strict=True) if m} == {1}
