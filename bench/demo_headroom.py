"""The demo's headroom: can its simulated RL show a significant held-out gain from the start
checkpoint, and can its real-time A/B arms detect a change at all?

    python bench/demo_headroom.py                              # configs/demo.toml's version 0 (cached or bootstrapped)
    python bench/demo_headroom.py --samples 8 --set train.orchestrator.episode.temperature=0.7
    python bench/demo_headroom.py --registry runs/demo/registry --checkpoint 0 --tasks-per-family 4
    python bench/demo_headroom.py --samples 8 --temperatures 0.5,0.7,1.0       # which temperature to train at

Prints one JSON object on stdout; progress goes to stderr.

Held-out headroom, on the tasks simulated RL evaluates (`train.eval_tasks_per_family` a family,
the episodes' turns and tokens):
- `greedy`: the start's pass rate at `train.eval_temperature`, the figure every later eval is
  compared with, and how many tasks it fails;
- `sampled`: `--samples` episodes a task at the training temperature: pass@1 (their mean) and
  pass@k (a task counts if any sample passed);
- `greedy_failed_solved_by_sampling`: tasks the greedy policy fails that a sample solves. GRPO
  reinforces what the policy already samples, so this is about the most a short run can turn into
  greedy passes;
- with `--temperatures`, the same sampled figures at each (`by_temperature`) and `signal`, the mean
  over tasks of 4 p (1 - p) with p a task's share of passing samples (1 where every group of a
  task would have mixed outcomes, 0 where none would; flywheel/rl/task_sampler.py weighs tasks by
  the same); `chosen_temperature` is the one whose samples solve the most greedy failures, ties to
  the more signal: the training temperature chosen from the measured headroom;
- `gain_needed`: how many tasks the paired interval needs gained (none lost) for a significant
  held-out gain on this many tasks (flywheel/agent/evaluate.py `gain_needed`); `significant_gain_reachable`
  compares the two. Both are upper bounds on what the demo shows, not predictions.

A/B: the smallest change the demo's arms detect (80% power at the A/B's confidence,
flywheel/demo.py `detectable_change`) for each success metric, at the arm sizes the last recorded
demo cycle had and at `live.ab.min_per_arm` answers, and the answers an arm would need for
`--effect`. The spreads come from that cycle's A/B (`run_dir/cycles/`); without one, a rate's
worst case (p = 0.5) stands in and a mean's is unknown. Persistence counts only answers that
edited, so its arms are smaller than `min_per_arm`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from flywheel.agent.evaluate import evaluate, gain_needed
from flywheel.config import load_config
from flywheel.demo import DemoConfig, _bootstrap_key, detectable_change, version_zero
from flywheel.env.pool import SandboxPool
from flywheel.live.abtest import MetricComparison
from flywheel.model.engine import LocalEngine
from flywheel.model.registry import Checkpoint, Registry
from flywheel.rl.train import eval_tasks

POWER = 0.8


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def start_checkpoint(config: DemoConfig, registry_root: Path | None, checkpoint: str) -> tuple[Path, Checkpoint]:
    """The checkpoint to measure: `checkpoint` of `registry_root`, else the demo's version 0, read as
    it is when the demo's cache holds it (the previous demo's run folders are left alone), bootstrapped
    like the demo does otherwise (`version_zero`, which clears the run folder's later stages: they
    belonged to another version 0)."""
    if registry_root is None:
        registry_root, marker = config.run_dir / "registry", config.run_dir / "bootstrap.key"
        if not (marker.is_file() and marker.read_text() == _bootstrap_key(config.bootstrap)):
            log(f"no cached version 0 for this bootstrap config in {config.run_dir}: bootstrapping it as the demo does")
            version_zero(config)
        checkpoint = "0"
    with Registry(registry_root) as registry:
        return registry_root, registry.get(int(checkpoint) if checkpoint.isdigit() else checkpoint)


def headroom(config: DemoConfig, registry_root: Path, checkpoint: Checkpoint, samples: int,
             tasks_per_family: int | None, temperatures: list[float] | None = None) -> dict[str, Any]:
    train = config.train
    if tasks_per_family is not None:
        train = train.model_copy(update={"eval_tasks_per_family": tasks_per_family})
    tasks = eval_tasks(train)
    episode = train.orchestrator.episode
    temperatures = temperatures or [episode.temperature]
    with Registry(registry_root) as registry:
        model, tokenizer = registry.load(checkpoint.version)
    by_temperature = {}
    with LocalEngine(model, version=checkpoint.version) as engine, SandboxPool() as pool:
        t0 = time.perf_counter()
        log(f"v{checkpoint.version}: {len(tasks)} held-out tasks greedily (T={train.eval_temperature})")
        greedy, _ = evaluate(tasks, engine, tokenizer, pool, episode.model_copy(update={"temperature":
                                                                                        train.eval_temperature}))
        greedy_s = time.perf_counter() - t0
        failed = {t for t, p in greedy["per_task"].items() if p == 0.0}
        for temperature in temperatures:
            log(f"{samples} samples a task at T={temperature}")
            t1 = time.perf_counter()
            sampled, trajectories = evaluate(tasks, engine, tokenizer, pool,
                                             episode.model_copy(update={"temperature": temperature}), samples=samples)
            by_temperature[temperature] = sampled_figures(temperature, sampled, trajectories, failed, samples,
                                                          time.perf_counter() - t1)
    chosen = max(temperatures, key=lambda t: (by_temperature[t]["greedy_failed_solved_by_sampling"],
                                              by_temperature[t]["signal"]))
    at_training = by_temperature.get(episode.temperature, by_temperature[chosen])
    reachable = at_training["greedy_failed_solved_by_sampling"]
    needed = gain_needed(0, len(tasks))
    return {"checkpoint": checkpoint.version, "tasks": len(tasks),
            "greedy": {"temperature": train.eval_temperature, "pass_rate": greedy["pass_rate"],
                       "passed": len(tasks) - len(failed), "failed": len(failed),
                       "per_family": {f: r["pass_rate"] for f, r in greedy["per_family"].items()},
                       "seconds": greedy_s},
            "sampled": at_training,
            "greedy_failed_solved_by_sampling": reachable,
            "greedy_passed_failed_by_every_sample": at_training["greedy_passed_failed_by_every_sample"],
            "gain_needed": needed,
            "significant_gain_reachable": needed is not None and reachable >= needed,
            **({"by_temperature": {str(t): f for t, f in by_temperature.items()}, "chosen_temperature": chosen}
               if len(temperatures) > 1 else {})}


def sampled_figures(temperature: float, sampled: dict[str, Any], trajectories: list[Any], greedy_failed: set[str],
                    samples: int, seconds: float) -> dict[str, Any]:
    """One temperature's sampled headroom: pass@1, pass@k, the greedy failures a sample solves, the
    greedy passes no sample repeats, and `signal` (the mean of 4 p (1 - p) over tasks)."""
    solved = {t.task_id for t in trajectories if t.all_passed}
    per_task = sampled["per_task"]
    return {"temperature": temperature, "samples_per_task": samples, "pass_at_1": sampled["pass_rate"],
            "pass_at_k": sampled["pass_at_k"],
            "per_family": {f: {"pass_at_1": r["pass_rate"], "pass_at_k": r["pass_at_k"]}
                           for f, r in sampled["per_family"].items()},
            "greedy_failed_solved_by_sampling": len(greedy_failed & solved),
            "greedy_passed_failed_by_every_sample": len(set(per_task) - greedy_failed - solved),
            "signal": sum(4 * p * (1 - p) for p in per_task.values()) / len(per_task),
            "seconds": seconds}


def last_ab(cycles_dir: Path) -> tuple[int, dict[str, MetricComparison]] | None:
    """The metrics of the last recorded cycle that ran an A/B, as its report.json holds them."""
    for path in sorted(cycles_dir.glob("cycle-*/report.json"), reverse=True):
        ab = json.loads(path.read_text()).get("ab") or {}
        if ab.get("metrics"):
            return (int(path.parent.name.split("-")[1]),
                    {k: MetricComparison.model_validate(v) for k, v in ab["metrics"].items()})
    return None


def ab_power(config: DemoConfig, effect: float) -> dict[str, Any]:
    ab = config.live.ab
    per_arm = ab.min_per_arm
    recorded = last_ab(config.run_dir / "cycles")
    out: dict[str, Any] = {"min_per_arm": per_arm, "confidence": ab.confidence, "power": POWER, "effect": effect,
                           "source": f"{config.run_dir / 'cycles'} cycle {recorded[0]}" if recorded else
                           "no recorded demo cycle: a rate's worst case (p = 0.5); a mean's spread unknown",
                           "metrics": {}}
    for name in ab.success_metrics:
        metric = recorded[1].get(name) if recorded else None
        if metric is None and name == "persistence":  # a rate: the worst case
            metric = SimpleNamespace(method="newcombe", production=0.5, candidate=0.5, production_ci=None,
                                     candidate_ci=None, n_production=per_arm, n_candidate=per_arm)
        one = detectable_change(metric, ab.confidence, POWER, per_arm=1) if metric is not None else None
        if one is None:
            out["metrics"][name] = {"detectable_at_min_per_arm": None}
            continue
        out["metrics"][name] = {
            "arms": [metric.n_production, metric.n_candidate],
            "detectable_at_those_arms": detectable_change(metric, ab.confidence, POWER),
            "detectable_at_min_per_arm": one / math.sqrt(per_arm),
            "per_arm_for_effect": math.ceil((one / effect) ** 2)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/demo.toml")
    parser.add_argument("--set", action="append", default=[], help="a DemoConfig override, key.sub=value")
    parser.add_argument("--registry", type=Path, default=None, help="measure a checkpoint of this registry instead")
    parser.add_argument("--checkpoint", default="0", help="with --registry: a version or an alias")
    parser.add_argument("--samples", type=int, default=4, help="episodes a task at the training temperature")
    parser.add_argument("--temperatures", default=None,
                        help="comma-separated sampling temperatures to compare (default: the training one)")
    parser.add_argument("--tasks-per-family", type=int, default=None, help="fewer held-out tasks, for a quick look")
    parser.add_argument("--effect", type=float, default=0.10, help="the A/B change to size the arms for")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if args.samples < 2:
        parser.error(f"--samples {args.samples}: pass@k needs at least 2 samples a task")
    torch.set_num_threads(args.threads)
    config = load_config(DemoConfig, args.config, args.set)
    start = time.perf_counter()
    registry_root, checkpoint = start_checkpoint(config, args.registry, args.checkpoint)
    result = {"config": args.config, "overrides": args.set,
              "held_out": headroom(config, registry_root, checkpoint, args.samples, args.tasks_per_family,
                                   [float(t) for t in args.temperatures.split(",")] if args.temperatures else None),
              "ab": ab_power(config, args.effect),
              "seconds": time.perf_counter() - start, "load_average": os.getloadavg()}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
