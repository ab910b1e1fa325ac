"""`flywheel demo`: the whole flywheel on the embedded default, in one command.

    make demo        # = flywheel demo --config configs/demo.toml

    1. bootstrap    version 0: tokenizer, tiny MoE, SFT on scripted demonstrations (cached: a second
                    run with the same bootstrap config reuses it, unless it passed no held-out task)
    2. simulated RL async GRPO from production for `train.time_budget_s`; the result is promoted
    3. real-time RL the server in this process, simulated users in background threads sending
                    requests and feedback over HTTP, and `live.cycles` cycles of the real loop
                    (gather -> train -> gate -> A/B -> promote or roll back)
    4. report       run_dir/report.html (static, offline) and a summary table on the terminal

Only the CLI imports this module (it drives `sim/`, which the core never imports). Everything it
writes stays under `run_dir`.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from flywheel.agent.evaluate import gain_needed
from flywheel.env.pool import PoolConfig, SandboxPool
from flywheel.live.cycle import LiveConfig, LiveCycle, ServerControl
from flywheel.live.server import LiveServer, ServeConfig, serve_in_thread
from flywheel.live.settings import LoopConfig, StoreConfig
from flywheel.model.registry import Checkpoint, Registry
from flywheel.report.render import render_report
from flywheel.rl.bootstrap import BootstrapConfig, bootstrap
from flywheel.rl.train import TrainConfig, train
from flywheel.rl.train import eval_tasks as train_eval_tasks
from flywheel.sim.expert import bootstrap_demonstrations
from flywheel.sim.users import Population, run_population
from flywheel.stats import t_quantile, z_quantile

DEMO_KEY = "demo-local-key"  # the in-process server's only key; it listens on loopback only


class DemoConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    run_dir: Path = Path("runs/demo")
    reuse_bootstrap: bool = True
    bootstrap: BootstrapConfig = Field(default_factory=BootstrapConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    # The live loop's settings the server (its dashboard) and the cycles share; its store and Registry
    # are the demo's own, under run_dir.
    loop: LoopConfig = Field(default_factory=LoopConfig)
    live: LiveConfig = Field(default_factory=LiveConfig)
    population: Population = Field(default_factory=Population)
    serve: ServeConfig = Field(default_factory=ServeConfig)
    sessions_per_round: int = 32  # users' sessions between checks that the cycles still need traffic
    # True: each round draws new users and tasks (the population's seed + the round); False: every
    # round replays the same sessions' plan, so the cycles train and A/B test on a few tasks only.
    fresh_rounds: bool = True
    pool: PoolConfig = Field(default_factory=lambda: PoolConfig(max_active=16, warm=2))

    @model_validator(mode="after")
    def _one_loop(self) -> DemoConfig:
        """One [loop] for the server and the cycles, so they cannot disagree; the store is run_dir's."""
        for part, config in (("serve", self.serve), ("live", self.live)):
            if config.loop_file is not None or config.loop not in (LoopConfig(), self.loop):
                raise ValueError(f"the demo's server and cycles share one [loop]: move {part}.loop to loop")
        if self.loop.store != StoreConfig():
            raise ValueError("the demo keeps its store and Registry under run_dir; set run_dir, not loop.store")
        # What runs, for the resolved config (run_demo puts the store under run_dir).
        self.serve = self.serve.model_copy(update={"loop": self.loop})
        self.live = self.live.model_copy(update={"loop": self.loop})
        return self


def _bootstrap_key(config: BootstrapConfig) -> str:
    return hashlib.sha256(config.model_dump_json(exclude={"run_dir", "registry_root"}).encode()).hexdigest()[:16]


def cache_refusal(metrics: dict[str, float]) -> str | None:
    """Why a fresh version 0 must not be reused by later runs, or None if it may be.

    A version 0 that passes no held-out task gives RL nothing to reinforce, and cached it would
    spoil every later run. The usual cause is SFT starved of CPU: another job on the same cores
    (each with its own OpenMP threads) once cut SFT from ~6,000 to ~300 tokens/s, and the
    time-budgeted SFT then ended before the policy had learnt its tools."""
    if metrics.get("eval_pass_rate", 0.0) > 0.0:
        return None
    return (f"version 0 passed no held-out task (SFT: {metrics.get('sft_tokens_per_s', 0.0):,.0f} tokens/s for "
            f"{metrics.get('sft_seconds', 0.0):.0f} s; was another job using these cores?)")


def _start_report(path: Path, boot: BootstrapConfig, train_config: TrainConfig) -> tuple[dict | None, str]:
    """The bootstrap's held-out eval when it is the eval simulated RL would play at its start (the same
    tasks, the same episode settings), so the run's eval.jsonl starts at version 0 without playing the
    same 96 episodes twice; otherwise (None, why not)."""
    if not path.exists():
        return None, f"{path} is missing"
    report = json.loads(path.read_text())
    ids = {t.id for t in train_eval_tasks(train_config)}
    if set(report.get("per_task", {})) != ids:
        return None, f"{path} is not an eval of simulated RL's {len(ids)} held-out tasks"
    episode = train_config.orchestrator.episode.model_copy(update={"temperature": train_config.eval_temperature})
    if episode != boot.episode:
        return None, "the bootstrap's eval episodes differ from simulated RL's (temperature, turns or tokens)"
    return report, ""


def _cached_bootstrap(registry_root: Path, marker: Path, key: str) -> Checkpoint | None:
    """Version 0 from an earlier run with the same bootstrap config, reset to be production again;
    None if there is none or it may not be reused (`cache_refusal`)."""
    if not (marker.is_file() and marker.read_text() == key and (registry_root / "registry.sqlite").is_file()):
        return None
    with Registry(registry_root) as registry:
        v0 = registry.get(0)
        refusal = cache_refusal(v0.metrics)
        if refusal:
            print(f"not reusing the cached bootstrap: {refusal}")
            return None
        registry.set_alias("production", 0)  # every run starts the flywheel from version 0
        if any("candidate" in c.aliases for c in registry.list()):
            registry.remove_alias("candidate")
    return v0


def version_zero(config: DemoConfig) -> Checkpoint:
    """The demo's start, version 0: the cached bootstrap when `reuse_bootstrap` and its config match
    (`_cached_bootstrap`), else a fresh bootstrap, cached for the next run unless `cache_refusal`
    says it passes nothing. Either way everything downstream of version 0 in `run_dir` is cleared.
    bench/demo_headroom.py measures the same version 0."""
    run = config.run_dir
    registry_root = run / "registry"
    key = _bootstrap_key(config.bootstrap)
    marker = run / "bootstrap.key"
    v0 = _cached_bootstrap(registry_root, marker, key) if config.reuse_bootstrap else None
    if v0 is not None:
        for stale in ("train", "live", "cycles"):
            shutil.rmtree(run / stale, ignore_errors=True)
        print(f"reusing bootstrap v0 from {registry_root} (same bootstrap config); delete {marker} to redo it")
    else:
        for stale in ("registry", "train", "live", "cycles"):  # everything downstream of version 0
            shutil.rmtree(run / stale, ignore_errors=True)
        marker.unlink(missing_ok=True)
        boot = config.bootstrap.model_copy(update={"run_dir": run / "bootstrap", "registry_root": registry_root})
        with SandboxPool(boot.pool) as pool:
            demos = bootstrap_demonstrations(boot, pool)
        v0 = bootstrap(boot, demos)
        refusal = cache_refusal(v0.metrics)
        if refusal:
            print(f"WARNING: {refusal}; the next run bootstraps again instead of reusing it", flush=True)
        else:
            marker.write_text(key)
    return v0


def _step(title: str) -> None:
    print(f"\n=== {title} ===", flush=True)


def run_demo(config: DemoConfig) -> dict[str, Any]:
    start = time.perf_counter()
    run = config.run_dir
    registry_root = run / "registry"
    timings: dict[str, float] = {}

    # 1. bootstrap (cached by its config)
    _step("1. bootstrap: version 0 from scripted demonstrations")
    t0 = time.perf_counter()
    v0 = version_zero(config)
    timings["bootstrap_s"] = time.perf_counter() - t0
    start_pass = v0.metrics.get("eval_pass_rate", float("nan"))

    # 2. simulated RL, then promoted to production
    _step("2. simulated RL: async GRPO with partial rollouts")
    t0 = time.perf_counter()
    train_config = config.train.model_copy(update={"registry_root": registry_root, "run_dir": run / "train",
                                                   "checkpoint": "production"})
    (run / "train").mkdir(parents=True, exist_ok=True)
    start_report, why = _start_report(run / "bootstrap" / "eval.json", config.bootstrap, train_config)
    if start_report is None:
        print(f"evaluating v{v0.version} again at the start of simulated RL: {why}")
        train_config = train_config.model_copy(update={"eval_at_start": True})
    rl_checkpoint, rl_summary = train(train_config, start_report=start_report)
    with Registry(registry_root) as registry:
        if rl_checkpoint is not None:
            registry.set_alias("production", rl_checkpoint.version)
            print(f"production -> v{rl_checkpoint.version} (simulated RL)")
    timings["simulated_rl_s"] = time.perf_counter() - t0

    # 3. real-time RL: server + users + cycles
    _step("3. real-time RL: served to simulated users, cycles of gather -> train -> gate -> A/B")
    t0 = time.perf_counter()
    reports, traffic = real_time_rl(config, run)
    timings["real_time_rl_s"] = time.perf_counter() - t0

    # 4. report
    _step("4. report")
    report_path = render_report(run)
    with Registry(registry_root) as registry:
        final = registry.get("production")
    summary = {
        "pass_rate_bootstrap": start_pass,
        "pass_rate_after_simulated_rl": rl_summary.get("pass_rate_end"),
        "simulated_rl_lift": rl_summary.get("lift"),
        "simulated_rl_steps": rl_summary.get("steps"),
        "simulated_rl_evals": rl_summary.get("evals", []),  # the held-out curve, version 0 first
        "simulated_rl_anatomy": rl_summary.get("anatomy", {}),  # where its steps' time went, summed
        "cycles": [{"cycle": r.cycle, "decision": r.decision, "reason": r.reason,
                    "production": r.production, "production_after": r.production_after,
                    "candidate": r.candidate}
                   for r in reports],
        "production_version": final.version,
        "traffic": traffic,
        "report": str(report_path),
        "timings": {**timings, "total_s": time.perf_counter() - start},
    }
    summary["outcome"] = outcome_line(summary, reports)
    (run / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    print_summary(summary, reports)
    return summary


def real_time_rl(config: DemoConfig, run: Path, watch: Callable[[LiveServer, threading.Event], None] | None = None,
                 ) -> tuple[list[Any], dict[str, int]]:
    """The demo's third stage: the server in this process on `run`'s Registry (its production as
    it stands), simulated users in a background thread, and `live.cycles` cycles; the cycles'
    reports and the traffic served. `watch`, if given, runs in a thread of its own beside the
    users, given the server and an event set when the cycles end (bench/demo_live.py samples the
    engines with it)."""
    registry_root = run / "registry"
    loop = config.loop.model_copy(update={"store": StoreConfig(path=run / "live" / "live.sqlite",
                                                               registry_root=registry_root)})
    serve = config.serve.model_copy(update={"loop": loop,
                                            "keys": {DEMO_KEY: ["inference", "events", "admin", "dashboard"]}})
    server = LiveServer.from_config(serve)
    live = config.live.model_copy(update={"loop": loop, "run_dir": run / "cycles"})
    stop = threading.Event()
    traffic: dict[str, int] = {"sessions": 0, "completions": 0}
    reports: list[Any] = []
    with serve_in_thread(server) as running, SandboxPool(config.pool) as pool:
        print(f"server on {running.url} (dashboard: {running.url}/dashboard?key={DEMO_KEY})")

        def users() -> None:
            rounds = 0
            while not stop.is_set():
                # The plan is a function of the seed: a new seed each round draws new users and tasks.
                seed = config.population.seed + (rounds if config.fresh_rounds else 0)
                population = config.population.model_copy(update={"seed": seed})
                stats = run_population(running.url, DEMO_KEY, population, config.sessions_per_round, pool)
                traffic["sessions"] += stats.sessions
                traffic["completions"] += stats.completions
                rounds += 1

        threads = [threading.Thread(target=users, name="simulated-users", daemon=True)]
        if watch is not None:
            threads.append(threading.Thread(target=lambda: watch(server, stop), name="demo-watch", daemon=True))
        for thread in threads:
            thread.start()
        try:
            cycle = LiveCycle(live, ServerControl(server))
            reports = cycle.run(live.cycles)
        finally:
            stop.set()
            for thread in threads:
                thread.join(timeout=600)
    server.close()
    return reports, traffic


def print_summary(summary: dict[str, Any], reports: list[Any]) -> None:
    print("\n=== summary ===")
    print(f"held-out pass rate: bootstrap {summary['pass_rate_bootstrap']:.3f} -> after simulated RL "
          f"{summary['pass_rate_after_simulated_rl']:.3f} ({summary['simulated_rl_steps']} steps)")
    if summary.get("simulated_rl_evals"):
        print(held_out_curve_line(summary["simulated_rl_evals"]))
    if summary.get("simulated_rl_anatomy"):
        print(anatomy_line(summary["simulated_rl_anatomy"]))
    print(f"{'cycle':>5}  {'decision':<12} {'production':>10}  {'candidate':>9}  reason")
    for r in reports:
        print(f"{r.cycle:>5}  {r.decision:<12} {f'v{r.production}->v{r.production_after}':>10}  "
              f"{'' if r.candidate is None else f'v{r.candidate}':>9}  {r.reason}")
    print(f"traffic: {summary['traffic']['sessions']} sessions, {summary['traffic']['completions']} completions")
    print(f"report: {summary['report']}   ({summary['timings']['total_s']:.0f} s in all)")
    print(summary["outcome"])


def held_out_curve_line(evals: list[dict[str, Any]]) -> str:
    """Simulated RL's held-out evals in step order (`train.eval_every`), version 0 first: each pass
    rate with its 95% Wilson interval, and after the start its paired change from it."""
    points = []
    for e in evals:
        low, high = e.get("pass_rate_ci") or (float("nan"), float("nan"))
        label = "v0" if e["step"] == 0 else f"step {e['step']}"
        point = f"{label} {e['pass_rate']:.3f} [{low:.2f}, {high:.2f}]"
        if lift := e.get("lift"):
            point += f" ({lift['diff']:+.3f} [{lift['ci'][0]:+.3f}, {lift['ci'][1]:+.3f}])"
        points.append(point)
    return "held-out pass rate over simulated RL (95% interval; paired change from v0): " + " -> ".join(points)


def anatomy_line(a: dict[str, float]) -> str:
    """Simulated RL's steps summed (flywheel/rl/train.py `anatomy_totals`): what they trained per
    minute, where the loop's wall time went, the engine's work behind it and the episodes' tool calls,
    grading and sandboxes (seconds summed over episodes, which run at once)."""
    def s(stage: str) -> float:
        return a.get(f"time/{stage}", 0.0)

    learner = s("learner_forward_backward") + s("learner_optimizer") + s("learner_other")
    line = (f"simulated RL trained {a.get('episodes_trained', 0):.0f} episodes "
            f"({a.get('episodes_per_min', 0):.0f}/min), "
            f"{a.get('tokens_trained', 0):,.0f} tokens ({a.get('tokens_per_min', 0):,.0f}/min); its steps' "
            f"{s('step'):.0f} s: waiting for rollouts {s('wait_rollouts'):.0f} s, on the staleness bound "
            f"{s('wait_staleness'):.0f} s, Learner {learner:.0f} s (forward+backward "
            f"{s('learner_forward_backward'):.0f}, optimizer {s('learner_optimizer'):.0f}), weight push "
            f"{s('weight_push'):.0f} s, checkpoint {s('checkpoint'):.0f} s")
    if "tokens/engine_decode" in a:
        decode, prefill = a["tokens/engine_decode"], a["tokens/engine_prefill"]
        line += (f"; the engine: decode {decode:,.0f} tokens in {s('engine_decode'):.0f} s "
                 f"({decode / max(s('engine_decode'), 1e-9):,.0f}/s), prefill {prefill:,.0f} in "
                 f"{s('engine_prefill'):.0f} s, idle {s('engine_idle'):.0f} s")
    return (line + f"; episodes (summed): tool calls {s('episode_tools'):.0f} s, grading {s('episode_grade'):.0f} s, "
            f"sandbox creation {s('episode_sandbox'):.0f} s")


def outcome_line(summary: dict[str, Any], reports: list[Any]) -> str:
    """The summary's last line, for a newcomer: what improved, by how much, with its interval, and
    where nothing did, what the run showed instead and why (how much the eval or the A/B arms could
    detect), never a bare "rollback"."""
    return f"In one line: {simulated_rl_outcome(summary)}; {real_time_outcome(reports)}."


def simulated_rl_outcome(summary: dict[str, Any]) -> str:
    """Simulated RL's held-out change with its paired interval; if it is not significant, how many
    tasks it would have had to gain on this eval (`gain_needed`)."""
    lift = summary.get("simulated_rl_lift")
    if not lift:
        return (f"simulated RL: held-out pass rate {summary['pass_rate_bootstrap']:.3f} -> "
                f"{summary['pass_rate_after_simulated_rl']:.3f} (no paired start eval to give an interval)")
    change = (f"{lift['before']:.3f} -> {lift['after']:.3f} ({lift['diff']:+.3f}, 95% CI [{lift['ci'][0]:+.3f}, "
              f"{lift['ci'][1]:+.3f}], {lift['gained']} of {lift['tasks']} held-out tasks gained, {lift['lost']} lost)")
    if lift["significant"]:
        verb = "raised" if lift["diff"] > 0 else "lowered"
        return f"simulated RL {verb} the held-out pass rate {change}"
    needed = gain_needed(lift["lost"], lift["tasks"])
    why = (f"with {lift['lost']} lost, {lift['tasks']} tasks show a gain only from {needed} gained"
           if needed is not None else f"{lift['tasks']} tasks cannot show a gain with {lift['lost']} lost")
    return f"simulated RL left the held-out pass rate within noise, {change}: {why}"


def real_time_outcome(reports: list[Any]) -> str:
    """What the real-time cycles did: the promotion and the metrics that earned it, or why nothing
    was promoted: the gate's reason, or the last A/B's differences next to the smallest change arms
    of its size detect (`detectable_change`)."""
    promoted = [r for r in reports if r.decision == "promote"]
    if promoted:
        r = promoted[-1]
        better = [f"{name} {m.diff:+.3f} [{m.ci_low:+.3f}, {m.ci_high:+.3f}]"
                  for name, m in (r.ab.metrics.items() if r.ab else []) if m.verdict == "better"]
        return (f"real-time RL promoted v{r.candidate} in cycle {r.cycle}"
                + (f" on {', '.join(better)} (candidate - production, 95% CI)" if better else f": {r.reason}"))
    if not reports:
        return "real-time RL ran no cycle"
    kept = f"real-time RL kept v{reports[0].production} through {len(reports)} cycle(s)"
    tested = [r for r in reports if r.ab is not None and r.ab.metrics]
    if not tested:
        return f"{kept}: no candidate reached an A/B test (last cycle: {reports[-1].decision}, {reports[-1].reason})"
    r = tested[-1]
    rejected = sum(c.decision == "rejected" for c in reports)
    if rejected:
        kept += f" ({rejected} candidate(s) rejected by the gate)"
    worse = [f"{name} {m.diff:+.3f} [{m.ci_low:+.3f}, {m.ci_high:+.3f}]" for name, m in r.ab.metrics.items()
             if m.verdict == "worse"]
    if worse:
        return (f"{kept}: the last A/B (cycle {r.cycle}) found the candidate significantly worse on "
                f"{', '.join(worse)} (candidate - production, 95% CI)")
    parts = []
    for name, m in r.ab.metrics.items():
        if m.diff is None or m.ci_low is None or m.ci_high is None or not (m.n_production and m.n_candidate):
            continue
        seen = f"{name} {m.diff:+.3f} [{m.ci_low:+.3f}, {m.ci_high:+.3f}] on {m.n_production}/{m.n_candidate} answers"
        detectable = detectable_change(m, r.ab.confidence)
        parts.append(seen + (f" (detectable: ±{detectable:.2f})" if detectable is not None else ""))
    shown = "; ".join(parts[:2]) if parts else "no metric had answers in both arms"
    return (f"{kept}: the last A/B (cycle {r.cycle}) found no significant gain, {shown}: arms this small "
            f"detect only changes of those sizes (80% power)")


def detectable_change(metric: Any, confidence: float = 0.95, power: float = 0.8,
                      per_arm: int | None = None) -> float | None:
    """The smallest true difference between the arms that an A/B of this metric's spread finds
    significant with probability `power` (normal approximation, each arm's own spread: a rate's
    sqrt(p (1 - p)), a mean's from its t interval), at the metric's own arm sizes or at `per_arm`
    answers an arm. None without both arms' figures.

    Why it is in the summary: a demo-sized A/B (tens of answers an arm) can only see large changes,
    and a rollback there says as much about the arm size as about the candidate."""
    spreads = []
    for value, ci, n in ((metric.production, metric.production_ci, metric.n_production),
                         (metric.candidate, metric.candidate_ci, metric.n_candidate)):
        if value is None or not n or n < 2:
            return None
        if metric.method == "newcombe":  # a rate: its binomial spread (a rate of 0 or 1 has none yet: 0.5)
            sd = math.sqrt(value * (1 - value)) or 0.5
        elif ci is not None:  # a mean: its t interval is mean ± t sd / sqrt(n)
            sd = (ci[1] - ci[0]) / 2 * math.sqrt(n) / t_quantile(0.5 + confidence / 2, n - 1)
        else:
            return None
        spreads.append(sd * sd / (per_arm or n))
    return (z_quantile(0.5 + confidence / 2) + z_quantile(power)) * math.sqrt(sum(spreads))
