"""The Ray backend's costs and scaling, on simulated nodes of one machine.

    python bench/ray_scale.py                                  # all parts (~11 min on 2 shared cores)
    python bench/ray_scale.py --parts overhead --steps 6
    python bench/ray_scale.py --parts overhead --steps 12 --repeat 3 --existing-cluster [--workers 2]
    python bench/ray_scale.py --parts scaling,burst,recovery --nodes 1,2,4

Prints one JSON object on stdout; progress goes to stderr. Every Ray cluster here is on loopback,
with usage reporting off, fractional CPU requests and a 100 MB object store per node.

1. overhead: `flywheel train` on the same tiny workload (a random tiny policy, real engine, real
   sandboxes and grading, real Learner) with `cluster.backend = "local"` and `"ray"` (a one-node
   cluster started by the run, `--workers` rollout workers, by default 1 as the local run has one
   engine, each with an engine actor, and a learner actor).
   Time to K steps is measured from the first step's end to the K-th's (`steady_s`, and per step
   `steady_step_s`: startup excluded, each backend's own); start-up (`startup_s`: to the first
   step's end, less one steady step) and whole-run wall time apart; target: Ray within 15% of
   local on steady_s. `--existing-cluster` joins a cluster started before timing (`ray start
   --head`), so `to_k_s` (call to K-th step, actors' start-up included) compares too; `--repeat`
   alternates the backends and compares medians, and `to_k_within_15pct_from_k` is the run length
   from which the Ray run's time to K steps, start-up included, is within 15% of the local one's.
2. scaling: N = 1, 2, 4, 8 simulated nodes (`ray.cluster_utils.Cluster`, one raylet each, 1 CPU of
   Ray's accounting), one rollout worker per node whose engine (the node's engine actor) is
   bench/async_rl.py's modeled accelerator (`ReplayEngine`: measured per-step decode costs,
   bench/costs/h200.json) and whose tools, sandboxes and grading are real; the learner is
   modeled (`ModeledLearner`, the measured seconds per token). Weak scaling: B = 2 N groups of
   G = 4 per step, so each node has the same load; time to K steps, episodes per second, and
   efficiency against N times one node's.
   All N nodes share this machine's 2 cores, so the real sandboxes bound it: the figure is the
   backend's overhead at N, not a cluster's throughput.
3. burst: every node's pool asked for 32 sandboxes at once (more than it holds: they queue);
   sandboxes created per second per node, alone and with all nodes at once.
4. recovery: during a scaling run at the largest N ≤ 4, one node is removed after the first step;
   seconds from the removal to the next completed learner step, against the median step.
5. pool_recovery: the same, but only one node's sandbox pool actor is killed (`ray.kill`; its worker
   and node live on): the episodes that held its sandboxes resume from their saved state on the
   node's next pool; seconds to the next step, and how many episodes resumed.
6. memory: what one sandbox costs the host (MemAvailable before and after, /proc/meminfo), held
   idle with a task's workspace, and running a Python test process (the heaviest thing an
   episode's tools do), over 32 at once; the 100,000-sandbox arithmetic in docs/ARCHITECTURE.md
   rests on it and on the burst's creation rate.
"""

from __future__ import annotations

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # on Linux: loopback addresses (read at import)
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# --existing-cluster starts its head without Ray's token authentication, and this driver matches it
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
BENCH = os.path.dirname(os.path.abspath(__file__))
# The workers unpickle the modeled engine from bench/async_rl.py: raylets started here pass this on.
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (BENCH, os.environ.get("PYTHONPATH", "")) if p)

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import ray  # noqa: E402
import torch  # noqa: E402
from async_rl import COSTS, ModeledLearner, ReplayEngine, StepCost, costs_from_file  # noqa: E402
from fleet_sim import measure_memory  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from flywheel.agent.episode import initial_prompt  # noqa: E402
from flywheel.env.families import task_set  # noqa: E402
from flywheel.env.pool import PoolConfig, SandboxPool  # noqa: E402
from flywheel.model.engine import EngineConfig  # noqa: E402
from flywheel.model.factory import ModelConfig, build_model  # noqa: E402
from flywheel.model.registry import Registry  # noqa: E402
from flywheel.model.tokenizer import train_tokenizer  # noqa: E402
from flywheel.rl.cluster import ClusterConfig  # noqa: E402
from flywheel.rl.orchestrator import Orchestrator, OrchestratorConfig  # noqa: E402
from flywheel.rl.ray_backend import RayRollouts  # noqa: E402
from flywheel.rl.run_folder import RunFolder  # noqa: E402
from flywheel.rl.train import TrainConfig, learning_step, train  # noqa: E402

STORE = 100 * 2**20


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def tiny_registry(root: Path) -> tuple[Path, object, object]:
    torch.manual_seed(0)
    tasks = task_set(["bugfix"], "train", 4, seed=100, difficulty=1)
    tokenizer = train_tokenizer([initial_prompt(t) for t in tasks] * 4, vocab_size=300)
    model = build_model(ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                                    num_experts=4, experts_per_token=2, moe_intermediate_size=32), tokenizer)
    with Registry(root) as registry:
        registry.register(model, tokenizer, parent=None, aliases=["production"], note="random tiny policy")
    return root, model, tokenizer


def overhead_run(args, registry: Path, run_dir: Path, backend: str, address: str) -> dict:
    """One `flywheel train` of the overhead workload; its figures from its metrics.jsonl."""
    cluster = {"backend": backend}
    if backend == "ray":
        cluster.update(rollout_workers=args.workers, worker_cpus=0.2, learner_cpus=0.2)
        cluster.update(address=address) if address else cluster.update(num_cpus=2, object_store_mb=100)
    config = TrainConfig.model_validate({
        "registry_root": str(registry), "run_dir": str(run_dir), "families": ["bugfix"],
        "train_tasks_per_family": 4, "eval_tasks_per_family": 1, "eval_at_start": False, "threads": 1,
        "register_checkpoint": False,
        "orchestrator": {"group_size": 4, "groups_per_step": 2, "max_staleness": 1, "concurrency": 16,
                         "max_steps": args.steps, "filter_zero_signal": False,
                         "episode": {"max_turns": 2, "max_tokens_per_turn": 32, "temperature": 1.0}},
        "learner": {"temperature": 1.0}, "engine": {"threads": 1}, "pool": {"warm": 0}, "cluster": cluster})
    t0, start = time.perf_counter(), time.time()
    train(config, log=lambda line: log(f"  {backend}: {line}"))
    wall = time.perf_counter() - t0
    metrics = RunFolder(run_dir).read("metrics.jsonl")
    times = [m["time"] for m in metrics]
    # where a steady step goes (steps 2..K): waiting for a batch, the learner step, the weights to the engines
    parts = {f"{key}_median_s": statistics.median(m[key] for m in metrics[1:])
             for key in ("wait_s", "train_s", "weight_update_s")}
    steady = times[-1] - times[0]
    step = steady / (len(times) - 1)
    # start-up: from the call to the first step's end, less one steady step (what the first step
    # would have cost once everything was started: cluster, actors, imports, first sandboxes);
    # to_k_s: from the call to the K-th step's end, start-up included
    return {"wall_s": wall, "steady_s": steady, "steady_step_s": step, "steps": len(times),
            "startup_s": times[0] - start - step, "to_k_s": times[-1] - start, **parts}


def overhead(args, registry: Path, work: Path) -> dict:
    """Local and Ray alternated `--repeat` times (a shared machine's load drifts between runs); the
    medians compared. With `--existing-cluster` the Ray runs join a cluster started before timing
    (`ray start --head`, as a user with a cluster does), so time to K steps includes placing and
    starting the actors but not starting Ray itself."""
    address, head = "", None
    if args.existing_cluster:
        port = free_port()
        head = subprocess.run([RAY, "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1",
                               "--num-cpus=2", f"--object-store-memory={100 << 20}", "--include-dashboard=false",
                               "--disable-usage-stats"], capture_output=True, text=True, timeout=180,
                              env={**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"})
        if head.returncode != 0:
            raise RuntimeError(f"ray start --head failed: {head.stderr[-2000:]}")
        address = f"127.0.0.1:{port}"
        log(f"overhead: joining the cluster at {address}")
    runs: dict[str, list[dict]] = {"local": [], "ray": []}
    try:
        for r in range(args.repeat):
            for backend in ("local", "ray"):
                row = overhead_run(args, registry, work / f"{backend}-{r}", backend, address)
                runs[backend].append(row)
                log(f"overhead {backend} #{r + 1}: {row}")
    finally:
        if head is not None:
            subprocess.run([RAY, "stop", "--force"], capture_output=True, timeout=120)
    out: dict = {"repeat": args.repeat, "existing_cluster": bool(address)}
    for backend, rows in runs.items():
        out[backend] = {key: statistics.median(row[key] for row in rows) for key in rows[0]}
        out[backend]["runs"] = rows
    for key in ("steady", "to_k", "wall"):
        out[f"ray_over_local_{key}"] = out["ray"][f"{key}_s"] / out["local"][f"{key}_s"]
    out["ray_startup_minus_local_s"] = out["ray"]["startup_s"] - out["local"]["startup_s"]
    # the figure: time to K steps within 15%; start-up counts only against an existing cluster
    # (starting Ray itself, ~15 s here, is no per-run cost on a cluster a team keeps)
    out["target_met"] = out["ray_over_local_steady"] <= 1.15
    if address:
        out["target_met_to_k"] = out["ray_over_local_to_k"] <= 1.15
        # a run's time to K steps is start-up + K steady steps on either backend: the K from which the
        # Ray run's is within 15% of the local one's (its actors' start-up spread over the steps)
        local, ray_ = out["local"], out["ray"]
        margin = 1.15 * local["steady_step_s"] - ray_["steady_step_s"]
        out["to_k_within_15pct_from_k"] = (
            max(args.steps, math.ceil((ray_["startup_s"] - 1.15 * local["startup_s"]) / margin))
            if margin > 0 else None)  # None: the steady step alone is over 15%, no K reaches it
    return out


RAY = str(Path(sys.executable).parent / "ray")  # the CLI of this interpreter's Ray


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def modeled_factory(costs: dict, seed: int):
    step_cost = StepCost(costs["decode_step_s"])

    def make(tokenizer, version: int):
        return ReplayEngine(tokenizer, step_cost, costs["prefill_s_per_token"], seed=seed, median_tokens=40)
    return make


def scaled_run(n: int, model, tokenizer, tasks, costs: dict, learner_s: float, steps: int, pool: SandboxPool,
               kill=None) -> dict:
    """K learner steps with n rollout workers (one per rollout node) on the modeled engine."""
    cluster = ClusterConfig(backend="ray", rollout_workers=n, placement="STRICT_SPREAD", worker_cpus=0.1,
                            worker_resources={"rollout": 1}, episodes_per_worker=16, actor_timeout_s=120)
    config = OrchestratorConfig(group_size=4, groups_per_step=2 * n, max_staleness=1, concurrency=16 * n,
                                filter_zero_signal=False,
                                episode={"max_turns": 4, "max_tokens_per_turn": 256, "max_tokens": 4096})
    learner = ModeledLearner(learner_s)
    rollouts = RayRollouts(cluster, model, tokenizer, EngineConfig(), PoolConfig(warm=0), 0, log=lambda _: None,
                           engine_factory=modeled_factory(costs, seed=n))
    try:
        with tempfile.TemporaryDirectory() as run_dir, \
                Orchestrator(config, tasks, rollouts, tokenizer, pool, run_dir, version=lambda: learner.version,
                             runner=rollouts) as orch:
            run = RunFolder(run_dir)
            t0 = time.perf_counter()
            ends, killed_at = [], None
            while orch.step < steps:
                m = learning_step(config, orch, learner, rollouts, run)
                ends.append(time.perf_counter() - t0)
                log(f"  {n} nodes: step {m['step']} at {ends[-1]:.1f} s, {m['rollout_episodes']} episodes")
                if kill is not None and killed_at is None:
                    killed_at = time.perf_counter() - t0
                    kill(rollouts)
            seconds = time.perf_counter() - t0
            run.wait_for_state()
            episodes = orch.counts()["episodes"]
            failovers = rollouts.counts()["failover_episodes"]
            resumed = sum(node["resumed_episodes"] for node in rollouts.stats()["nodes"].values())
            orch.close(wait=False)
    finally:
        rollouts.close()
    # steady: from the first step's end to the last's, the first (warm-up: first sandboxes, first
    # admission) left out; episodes per second over the whole run.
    out = {"nodes": n, "seconds": seconds, "steady_s": ends[-1] - ends[0], "steps": steps, "episodes": episodes,
           "episodes_per_s": episodes / seconds, "step_ends_s": [round(e, 2) for e in ends],
           "failover_episodes": failovers, "pool_resumed_episodes": resumed}
    if killed_at is not None:
        after = [e for e in ends if e > killed_at]
        gaps = [b - a for a, b in zip(ends, ends[1:], strict=False)]
        out["recovery_s"] = after[0] - killed_at if after else None
        out["median_step_s"] = statistics.median(gaps) if gaps else None
    return out


def memory(n: int = 32) -> dict:
    """Host memory per sandbox, idle (workspace held) and running a Python process: bench/fleet_sim.py's
    measurement, the one the 100,000-sandbox figures rest on."""
    task = task_set(["bugfix"], "train", 1, seed=100, difficulty=1)[0]
    measured = measure_memory(task.files, n)
    out = {"sandboxes": n, "idle_mb_per_sandbox": measured["idle_mb"],
           "running_python_mb_per_sandbox": measured["running_mb"],
           "workspace_kb": sum(len(v) for v in task.files.values()) / 1024}
    log(f"memory: {out}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", default="overhead,scaling,burst,recovery,pool_recovery,memory")
    parser.add_argument("--steps", type=int, default=5, help="K: learner steps per run")
    parser.add_argument("--nodes", type=lambda v: [int(k) for k in v.split(",")], default=[1, 2, 4, 8])
    parser.add_argument("--costs", type=Path, default=COSTS)
    parser.add_argument("--burst", type=int, default=32, help="sandboxes asked for at once per node")
    parser.add_argument("--repeat", type=int, default=1, help="overhead: local/Ray pairs run, medians compared")
    parser.add_argument("--workers", type=int, default=1,
                        help="overhead: the Ray run's rollout workers, one engine each (1: the local run's one engine)")
    parser.add_argument("--existing-cluster", action="store_true",
                        help="overhead: the Ray runs join a cluster started before timing (ray start --head)")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    result: dict = {"steps": args.steps}
    # Ray prints its actors' lines on the driver's stdout: they go to stderr, and stdout holds only the JSON
    stdout, sys.stdout = sys.stdout, sys.stderr
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        registry, model, tokenizer = tiny_registry(work / "registry")
        if "memory" in parts:
            result["memory"] = memory()
        if "overhead" in parts:
            result["overhead"] = overhead(args, registry, work)
        if parts & {"scaling", "burst", "recovery", "pool_recovery"}:
            costs, learner_s = costs_from_file(args.costs, "default")
            tasks = task_set(["bugfix", "implement"], "train", 16, seed=100, difficulty=1)
            cluster = Cluster(initialize_head=True, head_node_args={
                "num_cpus": 1, "object_store_memory": STORE, "node_ip_address": "127.0.0.1",
                "include_dashboard": False,
                "_system_config": {"health_check_period_ms": 500, "health_check_failure_threshold": 4}})
            try:
                ray.init(address=cluster.address)
                nodes = []
                with SandboxPool(PoolConfig(warm=0)) as pool:
                    if "scaling" in parts:
                        rows = []
                        for n in args.nodes:
                            while len(nodes) < n:
                                nodes.append(cluster.add_node(num_cpus=1, resources={"rollout": 1},
                                                              object_store_memory=STORE, node_ip_address="127.0.0.1"))
                            cluster.wait_for_nodes()
                            rows.append(scaled_run(n, model, tokenizer, tasks, costs, learner_s, args.steps, pool))
                            base = rows[0]["episodes_per_s"] / rows[0]["nodes"]
                            rows[-1]["efficiency_vs_linear"] = rows[-1]["episodes_per_s"] / (base * n)
                            log(f"scaling {n}: {rows[-1]}")
                        result["scaling"] = rows
                    while len(nodes) < 2:
                        nodes.append(cluster.add_node(num_cpus=1, resources={"rollout": 1},
                                                      object_store_memory=STORE, node_ip_address="127.0.0.1"))
                    cluster.wait_for_nodes()
                    if "burst" in parts:
                        result["burst"] = burst(args, model, tokenizer, len(nodes))
                    if "pool_recovery" in parts:
                        result["pool_recovery"] = scaled_run(2, model, tokenizer, tasks, costs, learner_s,
                                                             max(args.steps, 4), pool, kill=kill_a_pool)
                        log(f"pool recovery: {result['pool_recovery']}")
                    if "recovery" in parts:
                        n = max(k for k in [2, 4] if k <= len(nodes))

                        def remove_one(rollouts: RayRollouts) -> None:
                            node_id = rollouts.where[-1]["node_id"]
                            node = next(x for x in nodes if x.node_id == node_id)
                            threading.Thread(target=cluster.remove_node, args=(node,), daemon=True).start()
                            nodes.remove(node)

                        result["recovery"] = scaled_run(n, model, tokenizer, tasks, costs, learner_s,
                                                        max(args.steps, 4), pool, kill=remove_one)
                        log(f"recovery: {result['recovery']}")
            finally:
                ray.shutdown()
                cluster.shutdown()
    print(json.dumps(result, indent=2), file=stdout)


def kill_a_pool(rollouts: RayRollouts) -> None:
    """Kill one node's sandbox pool actor alone (flywheel.rl.ray_fleet), not its worker or node."""
    found = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("sandbox-fleet-")]
    victim = sorted(found, key=lambda a: a["name"])[0]
    ray.kill(ray.get_actor(victim["name"], namespace=victim["namespace"]))


def burst(args, model, tokenizer, n: int) -> dict:
    cluster = ClusterConfig(backend="ray", rollout_workers=n, placement="STRICT_SPREAD", worker_cpus=0.1,
                            worker_resources={"rollout": 1})
    rollouts = RayRollouts(cluster, model, tokenizer, EngineConfig(), PoolConfig(warm=0), 0, log=lambda _: None,
                           engine_factory=modeled_factory({"decode_step_s": {1: 0.004}, "prefill_s_per_token": 0.0}, 0))
    try:
        ray.get([w.burst.remote(4) for w in rollouts.workers])  # warm-up: each node's first sandboxes, imports
        alone = ray.get(rollouts.workers[0].burst.remote(args.burst))
        together = ray.get([w.burst.remote(args.burst) for w in rollouts.workers])
    finally:
        rollouts.close()
    out = {"one_node_alone": alone, "all_nodes_at_once": together,
           "created_per_s_per_node_together": statistics.mean(t["created_per_s"] for t in together)}
    log(f"burst: {out}")
    return out


if __name__ == "__main__":
    main()
