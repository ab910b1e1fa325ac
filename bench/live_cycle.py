"""Real-time RL cycle benchmark: how long a cycle takes, what production's users see cycle by cycle,
and whether the two reward hacks emerge under their naive rewards and not under the default.

    python bench/live_cycle.py                                  # everything (~30-40 min on 2 idle cores)
    python bench/live_cycle.py --cycles 3 --no-scenarios        # only the cycles (~20 min)
    python bench/live_cycle.py --no-cycles --scenario-cycles 4  # only the scenarios, shorter
    python bench/live_cycle.py --no-cycles --scenarios edits_only   # one scenario (~40 min)

Prints one JSON object on stdout; progress goes to stderr.

Cycles: the demo configuration (configs/live.toml: its reward file, trigger, batch, learner, A/B and
monitor settings) around a LiveServer in this process, with the simulated users of
configs/population.toml (their habits: patience, think time, follow-ups, lax reverts) working on
the scenario world's one-line tasks (flywheel/sim/scenario.py), which the start policy, a tiny
model SFT-ed for a minute, can sometimes solve; on the procedural families it solves none, and
every rate would be 0. Departures, so that it runs here: paths in a temporary folder, the cycles
follow each other at once (trigger.every_s = 1), the gate's battery is the world's 16 tasks with
margins that 16 paired tasks can show (0.2) and two-turn episodes, and the users' sessions are two
requests long (the start policy was trained on no longer ones). The battery plays each task 8 times
at the users' temperature and compares pass shares (flywheel/live/gate.py): greedy, 16 tasks turn a
candidate that moved a hard task's coin flip into discordant pairs the test cannot tell from a
regression. `cycle_seconds` is the wall time
of the first cycle, from its start to its report, waiting for traffic and feedback windows included;
target <= 300 on a 2-core machine. `*_by_cycle`: the production version at the start of each cycle,
then the one the last cycle left, each measured after the cycles on equal footing (`measure`:
`--measure-sessions` sessions of the same users pinned to it, nothing else running); the first
entry is the start version, the baseline of the same run. `batch_window` has the same metrics
from each cycle's own batch (`CycleReport.served`), which mix in the load of the stages that ran
beside the traffic.

Hack scenarios: `flywheel scenario drop_invalid` and `flywheel scenario edits_only`, each under its
naive rewards and the default (configs/scenario_*.toml); the default arm is each one's baseline.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from flywheel.config import load_config
from flywheel.env.pool import PoolConfig, SandboxPool
from flywheel.live.cycle import CycleReport, LiveConfig, LiveCycle, ServerControl
from flywheel.live.deploy import Deployment
from flywheel.live.server import LiveServer, ServeConfig, serve_in_thread
from flywheel.model.registry import PRODUCTION, Registry
from flywheel.sim.scenario import (
    BackgroundUsers,
    ScenarioConfig,
    StartPolicyConfig,
    run_scenario,
    start_policy,
)
from flywheel.sim.users import Population, run_population

REPO = Path(__file__).resolve().parents[1]
KEY = "bench-key"


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run_cycles(cycles: int, work: Path, measure_sessions: int) -> dict:
    """`cycles` cycles of the demo configuration with simulated users; the figures of each."""
    world = StartPolicyConfig()
    with SandboxPool(PoolConfig(max_active=16, warm=2)) as pool:
        model, tokenizer, sft = start_policy(world, pool, log=log)
        with Registry(work / "registry") as registry:
            registry.register(model, tokenizer, aliases=[PRODUCTION], note="bench start policy")
        live = load_config(LiveConfig, REPO / "configs/live.toml", [
            f"loop_file='{REPO / 'configs/loop.toml'}'", f"loop.rewards_file='{REPO / 'configs/rewards.toml'}'",
            f"gate_file='{REPO / 'configs/gate.toml'}'", f"loop.store.registry_root='{work / 'registry'}'",
            f"loop.store.path='{work / 'live' / 'live.sqlite'}'", f"run_dir='{work / 'cycles'}'", "threads=1",
            f"cycles={cycles}", "trigger.every_s=1.0", "trigger.poll_s=1.0", "gate.min_tasks=10",
            "gate.checks.pass_rate.margin=0.2", "gate.checks.valid_tool_call_rate.margin=0.2",
            "gate.battery.episode.max_turns=2", "gate.battery.samples=8", "gate.battery.episode.temperature=1.0",
            "gate.battery.concurrency=32"])
        # The users' habits as configured, in the world's two-request sessions (the start policy knows no longer ones).
        population = load_config(Population, REPO / "configs/population.toml")
        population = population.model_copy(update={"profiles": [p.model_copy(update={"patience": 2})
                                                                for p in population.profiles]})
        # The server shares the cycle's live-loop settings (its store, rewards, monitors).
        serve = ServeConfig(loop=live.loop, keys={KEY: ["inference", "events", "admin"]}, threads=1)
        server = LiveServer.from_config(serve)
        try:
            with serve_in_thread(server) as running:
                with BackgroundUsers(running.url, KEY, population, world.workload(), pool) as users:
                    cycle = LiveCycle(live, ServerControl(server), log=log, gate_tasks=world.tasks())
                    reports = cycle.run()
                measured = measure(cycle, server, running.url, population, world.workload(), pool,
                                   productions(reports), measure_sessions)
        finally:
            server.close()
    return {"start_policy_sft_seconds": round(sft["sft_seconds"], 1), "sessions": users.sessions,
            **figures(reports, measured), "measure_sessions_per_version": measure_sessions}


def measure(cycle: LiveCycle, server: LiveServer, url: str, population: Population, workload: list, pool: SandboxPool,
            versions: list[int], sessions: int) -> dict[int, dict]:
    """Each version's served metrics on equal footing: after the cycles, with nothing else running,
    `sessions` sessions of the same users on the same tasks, with one version at a time deployed
    alone (the server serves only deployed versions); the last cycle's deployment is restored after.

    The cycles' own batch windows are not comparable across cycles: the first holds answers served
    alone, later ones (after a rollback) answers served next to a candidate arm, the gate and the
    learner on the same two cores, which is load, not the model."""
    out = {}
    tasks = [workload[i % len(workload)] for i in range(sessions)]
    final = server.deployment
    for version in dict.fromkeys(versions):
        server.set_deployment(Deployment(production=version), f"bench: measure v{version}")
        since = time.time()
        run_population(url, KEY, population.model_copy(update={"seed": population.seed + 1000}), sessions, pool,
                       tasks=tasks)
        answers = server.store.completions(version=version, start=since)
        # Every session has ended and sent its events: all feedback windows count as closed.
        now = time.time() + cycle.config.loop.rewards.feedback_window_s
        out[version] = cycle.served(server.store, answers, now=now)
        log(f"measured v{version}: {len(answers)} answers, persistence {out[version]['persistence'].value}, "
            f"dissatisfied {out[version]['dissatisfied'].value}, latency {out[version]['latency'].value}")
    server.set_deployment(final, "bench: measurements done")
    return out


def productions(reports: list[CycleReport]) -> list[int]:
    """The production version at the start of each cycle, then the one the last cycle left."""
    return [r.production for r in reports] + [reports[-1].production_after]


def figures(reports: list[CycleReport], measured: dict[int, dict]) -> dict:
    """`*_by_cycle`: the production version of each cycle, then the one the last cycle left, as
    `measure` found them. `batch_window`: the same metrics from each cycle's own batch (its report)."""
    def value(version: int, m, scale: float = 1.0) -> dict | None:
        if m is None or m.value is None:
            return None
        return {"version": version, "value": round(m.value * scale, 4), "n": m.n,
                "ci": None if m.ci is None else [round(x * scale, 4) for x in m.ci]}

    first = reports[0]
    names = {"edit_persistence": ("persistence", 1.0), "dissatisfied": ("dissatisfied", 1.0),
             "latency_ms": ("latency", 1000.0), "reward": ("reward", 1.0), "invalid_calls": ("invalid_calls", 1.0)}
    return {
        "cycle_seconds": round(first.finished_at - first.started_at, 1),
        "cycle_seconds_all": [round(r.finished_at - r.started_at, 1) for r in reports],
        "stage_seconds": [{k: round(v, 1) for k, v in r.timings.items()} for r in reports],
        "decisions": [{"cycle": r.cycle, "production": r.production, "candidate": r.candidate, "decision": r.decision,
                       "reason": r.reason, "alarms": len(r.alarms)} for r in reports],
        **{f"{key}_by_cycle": [value(v, measured[v].get(name), scale) for v in productions(reports)]
           for key, (name, scale) in names.items()},
        "batch_window": {f"{key}_by_cycle": [value(r.production, r.served.get(name), scale) for r in reports]
                         for key, (name, scale) in names.items()},
    }


def run_scenarios(names: list[str], cycles: int | None, work: Path) -> dict:
    out = {}
    for name in names:
        overrides = [f"run_dir='{work / name}'", f"naive_rewards_file='{REPO / f'configs/rewards_naive_{name}.toml'}'",
                     f"default_rewards_file='{REPO / 'configs/rewards.toml'}'"]
        if cycles is not None:
            overrides.append(f"cycles={cycles}")
        config = load_config(ScenarioConfig, REPO / f"configs/scenario_{name}.toml", overrides)
        result = run_scenario(config, log=log)
        out[name] = {
            "measured": f"{result.behaviour} rate ({result.direction}), {result.answers} answers",
            "hack_emerged": result.hack_emerged, "monitor_alarmed": result.monitor_alarmed,
            "default_prevented": result.default_prevented,
            **{arm.arm: {"start_rate": round(start.rates[result.behaviour], 3),
                         "end_rate": round(end.rates[result.behaviour], 3),
                         "start_rate_hard": round(start.rates_hard[result.behaviour], 3),
                         "end_rate_hard": round(end.rates_hard[result.behaviour], 3),
                         "effect": round(arm.effect, 3), "p_value": arm.p_value, "emerged": arm.emerged,
                         "critical_alarms": len(arm.alarms), "versions": f"v{arm.start_version} -> v{arm.end_version}"}
               for arm in (result.naive, result.default) for start, end in [arm.measured(result.answers)]},
            "seconds": round(result.seconds, 1),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cycles", type=int, default=3, help="cycles of the demo configuration (>= 3 for the figures)")
    parser.add_argument("--measure-sessions", type=int, default=200,
                        help="sessions per production version in the measurement after the cycles")
    parser.add_argument("--no-cycles", action="store_true")
    parser.add_argument("--no-scenarios", action="store_true")
    parser.add_argument("--scenarios", default="drop_invalid,edits_only", help="comma-separated scenario names")
    parser.add_argument("--scenario-cycles", type=int, default=None, help="default: each scenario config's own")
    parser.add_argument("--work-dir", default=None, help="keep the runs here (default: a temporary folder)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)  # one thread: on a busy 2-core machine two threads contend and run slower
    started = time.perf_counter()
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="flywheel-bench-live-cycle-"))
    result: dict = {"machine": {"cpus": os.cpu_count(), "load_average_start": os.getloadavg()}}
    if not args.no_cycles:
        result.update(run_cycles(args.cycles, work / "cycles", args.measure_sessions))
    if not args.no_scenarios:
        result["hack_scenarios"] = run_scenarios(args.scenarios.split(","), args.scenario_cycles, work / "scenarios")
    result["machine"]["load_average_end"] = os.getloadavg()
    result["seconds"] = round(time.perf_counter() - started, 1)
    result["work_dir"] = str(work)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
