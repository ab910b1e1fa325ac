"""How much simulated RL learns in a fixed CPU budget: the share of the start's pass@1 -> pass@k gap it closes.

    python bench/learning.py --registry runs/v0/registry                     # 4 seeds x 30 CPU-minutes
    python bench/learning.py --registry runs/v0/registry --seeds 1 --cpu-minutes 3 --samples 4 \\
        --tasks-per-family 8                                                 # a quick look

Prints one JSON object on stdout; progress goes to stderr; the learning curve is drawn in
`--out`/learning.svg and learning.html (flywheel/report/svg.py).

1. The start, `--checkpoint` of `--registry` (the demo's version 0; `flywheel demo` or
   bench/demo_headroom.py bootstraps it): greedy on the held-out tasks (`--tasks-per-family` a
   family, by default the demo's curve: `train.curve_tasks_per_family`), and `--samples` episodes a
   task at the training temperature, whose
   mean is pass@1 and whose best is pass@k: the gap between them is what a policy that made its own
   best samples its usual answers would gain, the most RL that reinforces what it samples can reach.
2. For each seed, the demo's simulated RL (`[train]` of `--config`, with `--set` overrides) from the
   start, with its orchestrator's, learner's and engine's seeds set to the seed, until its processes
   have used `--cpu-minutes` of CPU time (`TrainConfig.cpu_budget_s`: the training process, the
   engine's process, the sandboxes; a budget that the other jobs of a shared machine do not shrink,
   as they shrink a wall-clock one). No eval runs inside the budget; the policy is saved every
   `--snapshot-every` steps, and greedily evaluated after the run (the curve, by CPU minutes), the
   last also sampled `--samples` times a task.
3. Per seed and on average: `gap_closed` = (pass@1 at the end - pass@1 at the start) / (pass@k at
   the start - pass@1 at the start), and the held-out greedy change with its paired 95% interval
   (flywheel/agent/evaluate.py `paired_lift`); the mean greedy change over seeds with its t interval.
4. With `--practised N`: the start and the end greedy, paired, on up to N tasks a family of the
   run's own training set that it trained on (a group of theirs reached the Learner:
   `practised_lift`), and on up to N a family that it never drew (`undrawn_lift`; none once a long
   run has drawn the whole set). Whether the run learnt the tasks it practised, and how much of that
   carries over to tasks it did not see: an optimizer that does not improve the policy is told from
   a policy whose gains stay with the prompts they were earned on (docs/learning.md).

The goal the bench is held to (issue 48): at least half the gap closed on average over 4 seeds of
30 CPU-minutes each. A 30-CPU-minute seed takes about 20 minutes of wall time on an idle 2-core
machine (its processes use about 1.5 cores), plus about 4 minutes of evals (docs/learning.md).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from flywheel.agent.evaluate import evaluate, paired_lift
from flywheel.config import load_config
from flywheel.demo import DemoConfig
from flywheel.env.pool import SandboxPool
from flywheel.env.task import Task
from flywheel.model.engine import LocalEngine
from flywheel.model.registry import Registry
from flywheel.report.svg import PALETTE, RefLine, Series, line_chart
from flywheel.rl.train import TrainConfig, eval_tasks, train, train_tasks
from flywheel.stats import mean_interval
from flywheel.store.files import write_atomic


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def held_out(config: TrainConfig, registry_root: Path, version: int, samples: int,
             weights: Path | None = None,
             tasks: list[Task] | None = None) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Greedy on the held-out tasks (the demo's eval; or `tasks`), and with `samples` > 1 also
    `samples` episodes a task at the training temperature (None otherwise). `weights`: a saved
    policy (`TrainConfig.save_policy_every`) loaded over the registry version's model."""
    with Registry(registry_root) as registry:
        model, tokenizer = registry.load(version)
    if weights is not None:
        model.load_state_dict(torch.load(weights, weights_only=True))
    tasks = tasks if tasks is not None else eval_tasks(config)
    episode = config.orchestrator.episode
    with LocalEngine(model, config.engine) as engine, SandboxPool(config.pool) as pool:
        greedy, _ = evaluate(tasks, engine, tokenizer, pool, episode.model_copy(
            update={"temperature": config.eval_temperature}), progress=False)
        sampled = None
        if samples > 1:
            sampled, _ = evaluate(tasks, engine, tokenizer, pool, episode, progress=False, samples=samples)
    return greedy, sampled


def practised_tasks(config: TrainConfig, steps: list[dict[str, Any]],
                    per_family: int) -> tuple[list[Task], list[Task]]:
    """Up to `per_family` tasks a family of the run's training set (`train_tasks`) that it trained on,
    by the draws its steps recorded (metrics.jsonl `draw`: a group not filtered reached the Learner),
    and up to `per_family` a family that no group drew."""
    drawn, trained = set(), set()
    for step in steps:
        for group in step.get("draw", []):
            drawn.update(group["tasks"])
            if group["filtered"] is None:
                trained.update(group["tasks"])
    trained_on: list[Task] = []
    undrawn: list[Task] = []
    for task in train_tasks(config):
        kind = trained_on if task.id in trained else undrawn if task.id not in drawn else None
        if kind is not None and sum(t.family == task.family for t in kind) < per_family:
            kind.append(task)
    return trained_on, undrawn


def greedy_change(config: TrainConfig, registry_root: Path, before: int, after: int,
                  tasks: list[Task]) -> dict[str, Any] | None:
    """Version `after` against version `before`, greedy on `tasks`, paired (None without tasks)."""
    if not tasks:
        return None
    return paired_lift(held_out(config, registry_root, before, 1, tasks=tasks)[0],
                       held_out(config, registry_root, after, 1, tasks=tasks)[0])


def start_evals(config: TrainConfig, registry_root: Path, version: int, samples: int,
                out: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The start's greedy and sampled held-out evals, kept in `out`/start.json and read from there
    by a later run of the bench on the same checkpoint, tasks and episode settings."""
    key = {"registry": str(registry_root.resolve()), "version": version, "samples": samples,
           "tasks": [t.id for t in eval_tasks(config)],
           "episode": config.orchestrator.episode.model_dump(mode="json"), "eval_temperature": config.eval_temperature}
    path = out / "start.json"
    if path.is_file() and (saved := json.loads(path.read_text()))["key"] == key:
        log(f"the start's evals from {path}")
        return saved["greedy"], saved["sampled"]
    log(f"the start: v{version} of {registry_root}, greedy and {samples} samples a task")
    greedy, sampled = held_out(config, registry_root, version, samples)
    write_atomic(path, json.dumps({"key": key, "greedy": greedy, "sampled": sampled}))
    return greedy, sampled


def seeded(config: TrainConfig, seed: int, registry_root: Path, run_dir: Path, cpu_s: float,
           snapshot_every: int) -> TrainConfig:
    """The run of one seed: the demo's training, its seeds set, a CPU budget instead of a wall-clock one."""
    data = config.model_dump(mode="json")
    data.update({"registry_root": str(registry_root), "run_dir": str(run_dir), "checkpoint": "0",
                 "time_budget_s": None, "cpu_budget_s": cpu_s, "eval_every": 0, "eval_at_start": False,
                 "save_policy_every": snapshot_every, "register_checkpoint": True, "alias": None})
    data["orchestrator"].update({"seed": seed, "max_steps": 100_000})
    data["learner"]["seed"] = seed
    data["engine"]["seed"] = seed
    return TrainConfig.model_validate(data)


def run_seed(config: TrainConfig, seed: int, start_registry: Path, start_version: int, start: dict[str, Any],
             out: Path, cpu_s: float, snapshot_every: int, samples: int, practised: int = 0) -> dict[str, Any]:
    """One seed's run (in a copy of the start's registry), then its saved policies' evals; with
    `practised` > 0 also the start and the end on tasks of its training set (`practised_tasks`)."""
    folder = out / f"seed-{seed}"
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(start_registry, folder / "registry")
    run_config = seeded(config, seed, folder / "registry", folder / "run", cpu_s, snapshot_every)
    with Registry(folder / "registry") as registry:
        registry.set_alias("production", start_version)
    t0 = time.perf_counter()
    checkpoint, summary = train(run_config.model_copy(update={"checkpoint": str(start_version)}), log=log,
                                start_report=start)
    wall = time.perf_counter() - t0
    steps = [json.loads(line) for line in (folder / "run" / "metrics.jsonl").read_text().splitlines()]
    cpu_at = {s["step"]: s["cpu_s"] for s in steps}
    curve = [{"step": 0, "cpu_minutes": 0.0, "greedy": start["pass_rate"]}]
    for path in sorted((folder / "run" / "policies").glob("step-*.pt")):
        step = int(path.stem.split("-")[1])
        log(f"seed {seed}: greedy eval of the policy after step {step}")
        greedy, _ = held_out(run_config, folder / "registry", start_version, 1, weights=path)
        curve.append({"step": step, "cpu_minutes": cpu_at[step] / 60, "greedy": greedy["pass_rate"]})
    end_greedy, end_sampled = None, None
    if checkpoint is not None:
        log(f"seed {seed}: the end's policy sampled ({samples} a task)")
        _, end_sampled = held_out(run_config, folder / "registry", checkpoint.version, samples)
        curve.append({"step": summary["steps"], "cpu_minutes": steps[-1]["cpu_s"] / 60 if steps else 0.0,
                      "greedy": summary["pass_rate_end"]})
        end_greedy = summary["lift"]
    practised_lift = undrawn_lift = None
    if practised and checkpoint is not None:
        trained_on, undrawn = practised_tasks(run_config, steps, practised)
        log(f"seed {seed}: the start and the end greedy on {len(trained_on)} tasks it trained on and "
            f"{len(undrawn)} of its set it never drew")
        practised_lift, undrawn_lift = (greedy_change(run_config, folder / "registry", start_version,
                                                      checkpoint.version, tasks) for tasks in (trained_on, undrawn))
    return {"seed": seed, "steps": summary["steps"], "wall_s": round(wall, 1),
            "cpu_minutes": round(steps[-1]["cpu_s"] / 60, 2) if steps else 0.0,
            "episodes_trained": sum(s["episodes_trained"] for s in steps),
            "frontier_share": _mean([s["frontier_share"] for s in steps]),
            "greedy_lift": end_greedy, "pass_at_1_end": end_sampled["pass_rate"] if end_sampled else None,
            "pass_at_k_end": end_sampled.get("pass_at_k") if end_sampled else None,
            "practised_lift": practised_lift, "undrawn_lift": undrawn_lift, "curve": curve}


def _mean(values: list[float]) -> float | None:
    finite = [v for v in values if isinstance(v, int | float) and math.isfinite(v)]
    return sum(finite) / len(finite) if finite else None


def gap_closed(start_pass_at_1: float, start_pass_at_k: float, end_pass_at_1: float | None) -> float | None:
    """(pass@1 end - pass@1 start) / (pass@k start - pass@1 start); None without an end or a gap."""
    gap = start_pass_at_k - start_pass_at_1
    if end_pass_at_1 is None or gap <= 0:
        return None
    return (end_pass_at_1 - start_pass_at_1) / gap


def curve_chart(seeds: list[dict[str, Any]], start: dict[str, Any], cpu_minutes: float) -> str:
    series = [Series(f"seed {r['seed']} greedy", [(p["cpu_minutes"], p["greedy"]) for p in r["curve"]],
                     color=PALETTE[i % len(PALETTE)]) for i, r in enumerate(seeds)]
    series += [Series(f"seed {r['seed']} pass@1 (sampled) at the end",
                      [(r["curve"][-1]["cpu_minutes"], r["pass_at_1_end"])], color=PALETTE[i % len(PALETTE)],
                      dashed=True) for i, r in enumerate(seeds) if r["pass_at_1_end"] is not None]
    k = start["samples_per_task"]
    refs = [RefLine(start["greedy"], "start greedy"), RefLine(start["pass_at_1"], "start pass@1"),
            RefLine(start["pass_at_k"], f"start pass@{k}")]
    return line_chart(f"Held-out pass rate over {cpu_minutes:g} CPU-minutes of simulated RL, per seed", series,
                      ref_lines=refs, x_label="CPU minutes of the run's processes", y_label="pass rate",
                      y_range=(0, 1), width=720, height=360)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/demo.toml", help="a demo config; its [train] is what runs")
    parser.add_argument("--set", action="append", default=[], help="a DemoConfig override, train.key=value")
    parser.add_argument("--registry", type=Path, required=True, help="the registry holding the start checkpoint")
    parser.add_argument("--checkpoint", type=int, default=0)
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--first-seed", type=int, default=0, help="seeds run from this one on")
    parser.add_argument("--reuse-seeds", action="store_true",
                        help="a seed whose seed-N.json is in --out is read from it, not run again (a bench cut off "
                             "goes on at its next seed; seeds run by processes of their own are summed up)")
    parser.add_argument("--saved-only", action="store_true",
                        help="with --reuse-seeds: leave out the seeds without saved figures instead of running them")
    parser.add_argument("--cpu-minutes", type=float, default=30.0, help="CPU budget of each seed's run")
    parser.add_argument("--samples", type=int, default=8, help="episodes a task for pass@1 and pass@k")
    parser.add_argument("--snapshot-every", type=int, default=10, help="learner steps between saved policies")
    parser.add_argument("--tasks-per-family", type=int, default=None,
                        help="held-out tasks a family (default: the demo's curve, train.curve_tasks_per_family)")
    parser.add_argument("--practised", type=int, default=0,
                        help="also the greedy change on up to this many tasks a family of the run's training set "
                             "that it trained on, and as many that it never drew")
    parser.add_argument("--out", type=Path, default=Path("runs/learning"))
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if args.saved_only and not args.reuse_seeds:
        parser.error("--saved-only reads saved seeds: add --reuse-seeds")
    if args.samples < 2:
        parser.error(f"--samples {args.samples}: pass@k needs at least 2 samples a task")
    torch.set_num_threads(args.threads)
    config = load_config(DemoConfig, args.config, args.set).train
    # the held-out tasks: --tasks-per-family, else the demo's curve (its evals during RL), else its whole set
    per_family = args.tasks_per_family or config.curve_per_family
    config = config.model_copy(update={"eval_tasks_per_family": per_family, "curve_tasks_per_family": None})
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    greedy, sampled = start_evals(config, args.registry, args.checkpoint, args.samples, args.out)
    start = {"greedy": greedy["pass_rate"], "pass_at_1": sampled["pass_rate"], "pass_at_k": sampled["pass_at_k"],
             "samples_per_task": args.samples, "tasks": len(greedy["per_task"]),
             "temperature": config.orchestrator.episode.temperature}
    seeds = []
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        if args.reuse_seeds and (saved := args.out / f"seed-{seed}.json").is_file():
            log(f"seed {seed}: from {saved}")
            seeds.append(json.loads(saved.read_text()))
            continue
        if args.saved_only:
            log(f"seed {seed}: no saved figures, left out (--saved-only)")
            continue
        log(f"seed {seed}: {args.cpu_minutes:g} CPU-minutes of simulated RL")
        result = run_seed(config, seed, args.registry, args.checkpoint, greedy, args.out, args.cpu_minutes * 60,
                          args.snapshot_every, args.samples, args.practised)
        result["gap_closed"] = gap_closed(start["pass_at_1"], start["pass_at_k"], result["pass_at_1_end"])
        write_atomic(args.out / f"seed-{seed}.json", json.dumps(result, indent=2))  # kept if a later seed is cut off
        seeds.append(result)
    closed = [r["gap_closed"] for r in seeds if r["gap_closed"] is not None]
    diffs = [r["greedy_lift"]["diff"] for r in seeds if r["greedy_lift"]]
    mean_diff = None
    if len(diffs) >= 2:
        interval = mean_interval(diffs)
        mean_diff = {"diff": statistics.fmean(diffs), "ci": [interval.low, interval.high], "seeds": len(diffs)}
    svg = curve_chart(seeds, start, args.cpu_minutes)
    write_atomic(args.out / "learning.svg", svg)
    write_atomic(args.out / "learning.html", f"<!doctype html><meta charset=utf-8><body>{svg}</body>")
    result = {"config": args.config, "overrides": args.set, "registry": str(args.registry),
              "checkpoint": args.checkpoint, "cpu_minutes_per_seed": args.cpu_minutes, "start": start,
              "gap_closed": {"mean": statistics.fmean(closed) if closed else None, "per_seed": closed,
                             "goal": 0.5},
              "greedy_gain": {"per_seed": [r["greedy_lift"] for r in seeds], "mean_over_seeds": mean_diff},
              "seeds": seeds, "curve": str(args.out / "learning.svg"),
              "seconds": round(time.perf_counter() - t0, 1), "load_average": os.getloadavg()}
    write_atomic(args.out / "result.json", json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
