"""The demo's real-time stage alone, repeated: how often does a fresh `make demo` promote a candidate,
where does a cycle's time go, and what do its A/B arms see?

    python bench/demo_live.py --registry runs/demo/registry --trials 4
    python bench/demo_live.py --registry runs/demo/registry --trials 2 --set population.concurrency=16

Prints one JSON object on stdout; progress goes to stderr.

Each trial is the demo's stage 3 (`flywheel.demo.real_time_rl`, configs/demo.toml with `--set`
overrides) on a private copy of `--registry` with `--checkpoint` as production (the version the
stage starts from in `make demo`: simulated RL's result, or version 0), its users drawn with their
own seed (population.seed + 1000 x trial), nothing else of the demo run. Per trial: the phase's
seconds and each cycle's stages, the answers served per second, how full the engines' batches ran
(decode tokens per decode step) and how busy they were, each cycle's candidate training metrics and
its A/B: per metric the arms' sizes and values, candidate - production with its interval, and the
smallest change arms of that size detect (80% power, `flywheel.demo.detectable_change`).
`promote_rate`: the share of trials in which some cycle promoted, with its Wilson 95% interval:
the estimate of P(a fresh demo run promotes) at this configuration.

The machine's load changes every figure: say what else ran beside it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from flywheel.config import load_config
from flywheel.demo import DemoConfig, detectable_change, real_time_rl
from flywheel.live.server import LiveServer
from flywheel.model.registry import CANDIDATE, PRODUCTION, CheckpointNotFound, Registry
from flywheel.stats import wilson_interval, z_quantile

REPO = Path(__file__).resolve().parents[1]


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class EngineSampler:
    """Polls the served engines' cumulative counters; sums each engine's last reading, so engines
    retired mid-run (a candidate rolled back) still count."""

    def __init__(self, every_s: float = 2.0):
        self.every_s = every_s
        self.last: dict[int, dict[str, float]] = {}  # id(engine) -> its latest counters
        self.busy_samples: list[int] = []  # requests in the engines at each sample

    def __call__(self, server: LiveServer, stop: threading.Event) -> None:
        while not stop.wait(self.every_s):
            router = server.router
            for version in router.served_versions():
                try:
                    engine = router.engine(version)
                    self.last[id(engine)] = engine.counters()
                except Exception as exc:  # noqa: BLE001  (retired between the listing and the read: skip it)
                    log(f"sampler: v{version}: {type(exc).__name__}: {exc}")

    def totals(self) -> dict[str, float]:
        keys = ("prefill_s", "prefill_tokens", "decode_s", "decode_tokens", "decode_steps")
        out = {k: sum(c.get(k, 0.0) for c in self.last.values()) for k in keys}
        out["rows_per_decode_step"] = out["decode_tokens"] / max(out["decode_steps"], 1.0)
        return out


def private_registry(source: Path, dest: Path, checkpoint: str) -> int:
    """Copy `source` to `dest` and make `checkpoint` (a version or an alias) production there."""
    shutil.copytree(source, dest)
    with Registry(dest) as registry:
        version = registry.get(int(checkpoint) if checkpoint.isdigit() else checkpoint).version
        registry.set_alias(PRODUCTION, version)
        try:
            registry.remove_alias(CANDIDATE)
        except CheckpointNotFound:
            pass
    return version


def ab_figures(ab: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"decision": ab.decision, "closed": ab.closed}
    for name, m in ab.metrics.items():
        fig: dict[str, Any] = {"n": [m.n_production, m.n_candidate], "production": m.production,
                               "candidate": m.candidate, "diff": m.diff, "ci": [m.ci_low, m.ci_high],
                               "verdict": m.verdict}
        detectable = detectable_change(m, ab.confidence)
        if detectable is not None:
            fig["detectable"] = detectable
        out[name] = fig
    return out


def trial(config: DemoConfig, registry: Path, checkpoint: str, work: Path, index: int) -> dict[str, Any]:
    run = work / f"trial-{index}"
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir(parents=True)
    production = private_registry(registry, run / "registry", checkpoint)
    population = config.population.model_copy(update={"seed": config.population.seed + 1000 * index})
    config = config.model_copy(update={"population": population})
    sampler = EngineSampler()
    started = time.perf_counter()
    with contextlib.redirect_stdout(sys.stderr):  # the demo's progress lines: stdout is the JSON's
        reports, traffic = real_time_rl(config, run, watch=sampler)
    seconds = time.perf_counter() - started
    cycles = []
    for r in reports:
        served = r.served.get("reward")
        cycle: dict[str, Any] = {"cycle": r.cycle, "decision": r.decision, "reason": r.reason,
                                 "timings": {k: round(v, 1) for k, v in r.timings.items()},
                                 "batch": {k: r.batch.get(k) for k in ("completions", "reward_mean", "sessions")}
                                 if r.batch else None,
                                 "served_reward": served.model_dump() if served else None}
        if r.train:
            cycle["train"] = {k: r.train.get(k) for k in ("loss", "kl", "entropy", "grad_norm", "optimizer_steps",
                                                            "clip_low_frac", "clip_high_frac", "seconds")}
        if r.gate is not None:
            cycle["gate"] = {name: {"diff": c.diff, "ci": [c.ci_low, c.ci_high], "n": c.n, "passed": c.passed}
                             for name, c in r.gate.decision.checks.items()}
        if r.ab is not None:
            cycle["ab"] = ab_figures(r.ab)
        cycles.append(cycle)
    out = {"trial": index, "production": production, "seconds": round(seconds, 1), "traffic": traffic,
           "completions_per_s": traffic["completions"] / seconds, "engines": sampler.totals(),
           "engine_busy_share": (sampler.totals()["decode_s"] + sampler.totals()["prefill_s"]) / seconds,
           "promoted": any(r.decision == "promote" for r in reports), "cycles": cycles}
    log(json.dumps({k: out[k] for k in ("trial", "seconds", "completions_per_s", "promoted")})
        + " " + " / ".join(f"{c['decision']}: {c['reason'][:160]}" for c in cycles))
    (work / f"trial-{index}.json").write_text(json.dumps(out, indent=1, default=str))  # kept if a later trial dies
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(REPO / "configs/demo.toml"))
    parser.add_argument("--set", action="append", default=[], help="config override, as `flywheel demo --set`")
    parser.add_argument("--registry", required=True, type=Path, help="a demo run's registry (copied per trial)")
    parser.add_argument("--checkpoint", default="production", help="the version (or alias) the stage starts from")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--first-trial", type=int, default=0, help="the first trial's index (its users' seed)")
    parser.add_argument("--work", type=Path, default=None,
                        help="where the trials' run folders and trial-N.json go (default: a temp dir)")
    args = parser.parse_args()

    config = load_config(DemoConfig, args.config, args.set)
    work = args.work or Path(tempfile.mkdtemp(prefix="demo-live-"))
    trials = [trial(config, args.registry, args.checkpoint, work, i)
              for i in range(args.first_trial, args.first_trial + args.trials)]
    promoted = sum(t["promoted"] for t in trials)
    low, high = wilson_interval(promoted, len(trials), z_quantile(0.975))
    print(json.dumps({
        "config": args.config, "set": args.set, "load_avg_1m": os.getloadavg()[0],
        "promote_rate": promoted / len(trials), "promote_rate_ci95": [low, high], "trials_promoted": promoted,
        "phase_seconds_mean": statistics.fmean(t["seconds"] for t in trials),
        "completions_per_s_mean": statistics.fmean(t["completions_per_s"] for t in trials),
        "trials": trials}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
