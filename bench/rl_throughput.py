"""Episodes and tokens trained per minute on the demo's simulated-RL configuration, variants back to back.

    python bench/rl_throughput.py --registry runs/v0/registry --seconds 110 --repeats 3 \\
        --variant before: --variant after:learner.share_prefix=true

Prints one JSON object on stdout; progress goes to stderr.

Each run is the demo's `[train]` (configs/demo.toml: group size, batch, staleness bound, episode
limits, engine and learner settings) from `--checkpoint` of `--registry` (the demo's version 0:
`flywheel bootstrap --config configs/bootstrap.toml` makes it), wired as `flywheel.rl.train` wires
it (the Engine in its own process, the Learner, the sandbox pool, the Orchestrator) in a fresh run
folder, and `learning_step` repeated for `--seconds` of wall time (the demo's `time_budget_s`, 110 s),
without the held-out evals. A variant is a name and `--set`-style overrides of that config
(`name:key=value,key=value`); the variants alternate (A B B A A B ...) so that the load of a shared
machine falls on each alike, and each figure is the median over `--repeats` runs.

Figures per run: `episodes_per_min` and `tokens_per_min` trained (the batches' episodes and all their
tokens, prompts and tool output included: a smaller batch cannot inflate them as it would steps per
minute), the step's anatomy summed over the run (`time/*`, `tokens/*` of metrics.jsonl:
flywheel/rl/train.py `step_anatomy`), CPU seconds by role (the loop's thread, i.e. the Learner; the
process's other threads, i.e. the rollout workers; the engine's process; finished sandbox processes)
and what the rest of the machine used meanwhile (`others_cpu_s`: it is shared).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import torch

from flywheel.config import load_config, merge_override, parse_override
from flywheel.demo import DemoConfig
from flywheel.env.pool import SandboxPool
from flywheel.env.semantic import load_embedder
from flywheel.model.process_engine import start_engine
from flywheel.model.registry import Registry
from flywheel.rl.learner import Learner
from flywheel.rl.orchestrator import Orchestrator
from flywheel.rl.run_folder import RunFolder
from flywheel.rl.train import TrainConfig, learning_step, train_tasks


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def variant(text: str) -> tuple[str, list[str]]:
    """`name:key=value,key=value` -> (name, ["key=value", ...])."""
    name, _, overrides = text.partition(":")
    return name, [o for o in overrides.split(",") if o]


def with_overrides(config: TrainConfig, overrides: list[str]) -> TrainConfig:
    data = config.model_dump(mode="json")
    for item in overrides:
        merge_override(data, *parse_override(item))
    return TrainConfig.model_validate(data)


def cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def threads_cpu(process: psutil.Process) -> dict[str, float]:
    """CPU seconds of this process's live Python threads since they started, by name (digits dropped:
    `rollout_3` counts as `rollout_`)."""
    times = {t.id: t.user_time + t.system_time for t in process.threads()}
    out: dict[str, float] = {}
    for thread in threading.enumerate():
        name = thread.name.rstrip("0123456789")
        out[name] = round(out.get(name, 0.0) + times.get(thread.native_id, 0.0), 1)
    return out


def run_once(config: TrainConfig, registry: Registry, checkpoint: int, seconds: float,
             keep: Path | None = None) -> dict[str, Any]:
    """`learning_step` for `seconds` on `config`, as `flywheel.rl.train.train_once` runs it (no evals);
    `keep`: where to copy the run folder (metrics.jsonl, trajectories.jsonl) afterwards."""
    torch.set_num_threads(config.threads)
    engine_model, tokenizer = registry.load(checkpoint)
    learner_model, _ = registry.load(checkpoint)
    tasks = train_tasks(config)
    me = psutil.Process()
    with tempfile.TemporaryDirectory(prefix="rl-throughput-") as run_dir, \
            start_engine(engine_model, config.engine, checkpoint=registry.get(checkpoint).path) as engine, \
            SandboxPool(config.pool) as pool:
        learner = Learner(learner_model.train(), config.learner)
        engine_process = psutil.Process(engine.pid) if getattr(engine, "pid", None) else None  # a ProcessEngine
        run = RunFolder(run_dir)
        with Orchestrator(config.orchestrator, tasks, engine, tokenizer, pool, run_dir,
                          version=lambda: learner.version) as orchestrator:
            machine, process, children = psutil.cpu_times(), cpu_seconds(me), resource.getrusage(
                resource.RUSAGE_CHILDREN)
            engine_cpu = cpu_seconds(engine_process) if engine_process else 0.0
            thread_cpu = time.thread_time()
            start = time.perf_counter()
            history = []
            while time.perf_counter() - start < seconds:
                history.append(learning_step(config.orchestrator, orchestrator, learner, engine, run))
                m = history[-1]
                log(f"  step {m['step']}: {time.perf_counter() - start:.1f} s, {m['episodes_trained']} episodes, "
                    f"wait {m['wait_s']:.1f} s, train {m['train_s']:.1f} s")
            wall = time.perf_counter() - start
            loop_cpu = time.thread_time() - thread_cpu
            process_cpu = cpu_seconds(me) - process
            engine_cpu = cpu_seconds(engine_process) - engine_cpu if engine_process else float("nan")
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            sandbox_cpu = after.ru_utime + after.ru_stime - children.ru_utime - children.ru_stime
            by_thread = threads_cpu(me)
            used = psutil.cpu_times()
            machine_busy = sum(getattr(used, k) - getattr(machine, k) for k in ("user", "system", "nice", "irq",
                                                                                 "softirq"))
            run.wait_for_state()
            orchestrator.close()  # episodes stop at their next turn boundary, before the engine goes
        if keep is not None:
            shutil.copytree(run_dir, keep, ignore=shutil.ignore_patterns("state", "inflight"))
    episodes = sum(m["episodes_trained"] for m in history)
    tokens = sum(m.get("batch_tokens", 0.0) for m in history)
    anatomy = {k: round(sum(m.get(k, 0.0) for m in history), 2) for k in sorted({k for m in history for k in m})
               if k.startswith(("time/", "tokens/"))}
    cpu = {"loop_thread": loop_cpu, "rollout_threads": process_cpu - loop_cpu, "engine_process": engine_cpu,
           "sandboxes_finished": sandbox_cpu}
    ours = sum(v for v in cpu.values() if v == v)
    return {"steps": len(history), "wall_s": round(wall, 1), "episodes_trained": episodes,
            "tokens_trained": tokens, "episodes_per_min": round(episodes / wall * 60, 1),
            "tokens_per_min": round(tokens / wall * 60), "filtered_groups": history[-1]["filtered_groups"]
            if history else 0, "anatomy": anatomy, "cpu_s": {k: round(v, 1) for k, v in cpu.items()},
            "cpu_s_by_thread": by_thread,
            "others_cpu_s": round(max(0.0, machine_busy - ours), 1),
            "engine_logprob_mismatch_max": max((m.get("engine_logprob_mismatch_max", float("nan")) for m in history),
                                               default=float("nan"))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/demo.toml", help="a demo config; its [train] table is used")
    parser.add_argument("--registry", default="runs/v0/registry")
    parser.add_argument("--checkpoint", type=int, default=0)
    parser.add_argument("--seconds", type=float, default=110.0, help="wall time of each run (the demo's budget)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each variant, alternating")
    parser.add_argument("--variant", action="append", type=variant, default=None,
                        help="name:key=value,... (overrides of the [train] config); default: 'demo:' alone")
    parser.add_argument("--set", action="append", default=[], help="an override for every variant")
    parser.add_argument("--keep", type=Path, help="copy each run's folder here (<variant>-<repeat>/)")
    args = parser.parse_args()
    variants = args.variant or [("demo", [])]
    base = load_config(DemoConfig, args.config).train
    base = with_overrides(base, args.set)
    log("loading the search embedder")  # a process-wide lazy load: before any run is timed
    load_embedder()
    registry = Registry(args.registry)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in variants}
    load_start = os.getloadavg()[0]
    for r in range(args.repeats):
        order = variants if r % 2 == 0 else list(reversed(variants))
        for name, overrides in order:
            log(f"run {r + 1}/{args.repeats}: {name} {overrides}")
            keep = args.keep / f"{name}-{r}" if args.keep else None
            result = run_once(with_overrides(base, overrides), registry, args.checkpoint, args.seconds, keep)
            log(f"  {name}: {result['episodes_per_min']} episodes/min, {result['tokens_per_min']:,} tokens/min, "
                f"cpu {result['cpu_s']}, others {result['others_cpu_s']}")
            runs[name].append(result)
    registry.close()
    summary = {name: {key: statistics.median(r[key] for r in results)
                      for key in ("episodes_per_min", "tokens_per_min", "steps", "episodes_trained")}
               for name, results in runs.items()}
    first = variants[0][0]
    for name in runs:
        summary[name][f"episodes_per_min_vs_{first}"] = round(
            summary[name]["episodes_per_min"] / summary[first]["episodes_per_min"], 2)
    print(json.dumps({"config": args.config, "seconds": args.seconds, "repeats": args.repeats,
                      "variants": dict(variants), "median": summary, "runs": runs,
                      "load_average_1m": {"start": round(load_start, 1), "end": round(os.getloadavg()[0], 1)},
                      "cpus": os.cpu_count(), "torch": torch.__version__}, indent=2))


if __name__ == "__main__":
    main()
