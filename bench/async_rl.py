"""Async against sync GRPO: time to K learner steps, and held-out pass rate after the same budget.

    python bench/async_rl.py                          # all parts (~45 min on 2 cores)
    python bench/async_rl.py --parts modeled          # the modeled engine only (~5 min)
    python bench/async_rl.py --parts modeled,real --steps 4
    python bench/async_rl.py --parts modeled --costs-shape large --modeled-staleness 4

Prints one JSON object on stdout; progress goes to stderr. Both modes run the same Orchestrator,
seed, tasks and configuration; sync is `mode="sync"` (max_staleness 0: every batch waits for its
slowest episode, and the engine idles while the learner trains).

1. modeled: `ReplayEngine` is a continuous-batching server in which a decode step advances every
   sequence in it and costs the step time measured at that batch size (`StepCost`: on an H200 the
   embedded default's step took 4.2 ms at batch 1, 4.9 ms at 32 and 7.2 ms at 128), a prefill
   costs per prompt token, and each turn's length is drawn from a long-tailed distribution
   (lognormal, like real agent turns: most are short, a few are very long). Tools run for real in
   real sandboxes. `ModeledLearner` sleeps for the measured learner time per token, divided by
   `--learner-speedup`. Costs come from `--costs FILE`, written by `bench/engine_costs.py`: by
   default `bench/costs/h200.json`, measured on an H200 (the learner is not sped up). `--costs here`
   measures them on this machine with the real engine at batch 32 instead (one CPU core decoding;
   the learner is sped up 8x, as a cluster trains on more accelerators than one CPU). Sync runs
   once, async once per `--modeled-staleness` bound: `speedup_modeled_by_staleness`, and
   `speedup_async_vs_sync_modeled` at the largest bound (cluster frameworks run 2 to 8).
2. real: the bootstrapped checkpoint (`--checkpoint`, from `--registry`) in the real LocalEngine and
   Learner on this machine: `speedup_async_vs_sync`, total sync time over total async time across
   `--repeats` runs of each mode in alternating order (this machine's speed drifts). Two CPU
   cores are shared by sampling and training here, so overlap buys less than on a cluster;
   long-tailed episodes still leave the sync engine nearly idle at the end of each batch. Both
   modes decode `--engine-batch` rows at once (the CPU's best tokens/s; async's extra episodes
   queue, older groups first), keep in-flight KV across weight swaps (`--kv-on-update keep`; sync
   never swaps mid-rollout), and run the engine in a process of its own (`--engine-process`): in the
   learner's process the engine's decode loop waits on the GIL whenever the learner or a rollout
   thread holds it, and the two overlap little (`--no-engine-process` measures that). Episodes end
   at `--max-turns`, `--max-tokens-per-turn` and `--max-tokens` (8, 256, 4096 by default: the
   policy's episodes are then only mildly long-tailed, p99 about twice the median; 16, 1024 and 8192
   lengthen the tail). Each run reports its episodes' tail (`episodes`: wall seconds and generated
   tokens at p50, p90, p99 and max, and what the slowest episode spent its time on) and the
   learner's wait per step. The real tail is rare and large: an edit that makes the code hang costs
   each test run and the grading their whole 10 s timeout (one episode of 384 took 49 s). A sync
   step waits for it; an async one too once the learner is `--max-staleness` steps past the
   episode's group, so a single run's ratio depends on whether, and in which mode, such an episode
   was drawn. `--suite-seconds S` (0, off, by default) gives every task's test suites, visible and
   hidden, one more test that sleeps a lognormal time (median S, `--suite-sigma`, at most 8 s so
   that a run fits the sandbox's 10 s limit), the same for a task in every mode: the rest of a real
   project's suite, which takes seconds to run where these toy suites take milliseconds. Then an
   episode's wall time is long-tailed through its test runs and grading, as a production agent's is,
   and those seconds are waiting, not computing: sync's learner waits for the slowest episode of
   each batch while the CPU is idle, and async trains meanwhile. The default workload has little
   such waiting (its time is decoding and training, both on the 2 cores) except for a rare
   straggler, so what async gains there depends on `--max-staleness` and on whether a straggler was
   drawn. Measured on 2 cores (`--parts real --registry R --checkpoint 0 --steps 12 --eval-tasks 0`, the
   bootstrap at 0.199 held-out, two repeats each, run back to back; steady = s/step, steps 4 to 12):

       workload, staleness       sync s         async s        speedup             steady sync / async
       default, 1                81.0, 122.9    131.8, 116.0   0.82                6.9, 12.1 / 12.6, 10.7
       --suite-seconds 1, 1      159.9, 212.8   110.1, 123.8   1.59 (1.45, 1.72)   14.7, 20.0 / 9.1, 10.3
       default, 4                139.0, 98.2    73.1, 82.3     1.53 (1.90, 1.19)   14.0, 8.3 / 5.5, 6.2
       default, 4, 24 steps      251.8          181.0          1.39                steps 10-24: 8.6 / 5.2

   In three of the four default runs at 1, in one sync run of the next two rows and in both modes of
   the last, step 10 waited 37 to 63 s for one episode whose edit made the code hang (every test run
   and the grading hit their timeouts); async hides a straggler for `max_staleness` steps only, so
   at 4 it did and at 1 it did not (in the 24-step run async still waited 36.8 s: the straggler ran
   longer than 4 of its steps). Without it the default pair at 1 is about even (sync 6.7 s a step,
   async 7.1), the suite pair 1.45. At 4 async admits 160 episodes and ends 12 steps with more of
   them done or under way than sync (429 and 436 finished, sync 392): over a short run its total
   time flatters it, and the steady per-step times are the fairer reading.
3. budget: each mode trains for the same wall-clock budget (`--budget-s`), then both are
   evaluated on the same held-out tasks at temperature 0: `pass_rate_async`, `pass_rate_sync`,
   `pass_rate_start`; the async one is `pass_rate_after_budget`.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path

import torch
from engine_costs import decode_costs, learner_cost  # bench/engine_costs.py, beside this script

from flywheel.agent.evaluate import evaluate
from flywheel.env.families import held_out_tasks, task_set
from flywheel.env.pool import PoolConfig, SandboxPool
from flywheel.env.semantic import load_embedder
from flywheel.env.task import Task
from flywheel.model.engine import EngineConfig, Generation, LocalEngine, SamplingParams
from flywheel.model.process_engine import start_engine
from flywheel.model.registry import Registry
from flywheel.rl.learner import Learner, LearnerConfig, staleness_histogram
from flywheel.rl.orchestrator import Orchestrator, OrchestratorConfig
from flywheel.rl.run_folder import RunFolder
from flywheel.rl.train import learning_step

FAMILIES = ["bugfix", "implement", "crossfile", "ambiguous"]
COSTS = Path(__file__).resolve().parent / "costs" / "h200.json"  # bench/gpu_check.sh measured them


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class StepCost:
    """Seconds per decode step at any batch size, linear between the measured ones (constant below
    the smallest, extrapolated from the last two above the largest)."""

    def __init__(self, measured: Mapping[int | str, float]):
        self.points = sorted((int(batch), seconds) for batch, seconds in measured.items())
        if not self.points:
            raise ValueError("no measured decode step")

    def __call__(self, batch: int) -> float:
        points = self.points
        if len(points) == 1 or batch <= points[0][0]:
            return points[0][1]
        # the segment that holds `batch`, or the last one (extrapolated beyond it)
        i = next((i for i in range(1, len(points)) if batch <= points[i][0]), len(points) - 1)
        (b0, s0), (b1, s1) = points[i - 1], points[i]
        return max(min(s for _, s in points), s0 + (s1 - s0) * (batch - b0) / (b1 - b0))


class ReplayEngine:
    """The Engine interface over a modeled accelerator: each decode step advances every active
    sequence by one token and costs the measured step time at the batch's size (`StepCost`); a
    prefill costs per prompt token.

    Turns are `list_dir` calls padded with text to a lognormal length, and an episode ends (finish)
    with probability `finish_p` per turn, so both turn lengths and turn counts are long-tailed."""

    def __init__(self, tokenizer, step_cost: StepCost, prefill_s_per_token: float, seed: int, median_tokens: int = 60,
                 sigma: float = 1.0, finish_p: float = 0.3, max_tokens: int = 1024):
        self.tokenizer, self.step_cost, self.prefill_s = tokenizer, step_cost, prefill_s_per_token
        self.rng, self.median, self.sigma = random.Random(seed), median_tokens, sigma
        self.finish_p, self.cap = finish_p, max_tokens
        self._version, self._cond = 0, threading.Condition()
        self._active: list[list] = []  # [remaining steps, future, ids]
        self._stop = False
        self._call = tokenizer('<tool_call>\n{"name": "list_dir", "arguments": {}}\n</tool_call><|im_end|>',
                               add_special_tokens=False)["input_ids"]
        self._finish = tokenizer('<tool_call>\n{"name": "finish", "arguments": {}}\n</tool_call><|im_end|>',
                                 add_special_tokens=False)["input_ids"]
        self._pad = tokenizer(" ok", add_special_tokens=False)["input_ids"]
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    @property
    def version(self) -> int:
        return self._version

    def submit(self, prompt_ids, params: SamplingParams) -> Future:
        future: Future = Future()
        with self._cond:
            length = min(self.cap, params.max_tokens,
                         max(len(self._call), int(self.rng.lognormvariate(math.log(self.median), self.sigma))))
            body = self._finish if self.rng.random() < self.finish_p else self._call
            ids = (self._pad * length)[: max(0, length - len(body))] + body
            prefill_steps = math.ceil(len(prompt_ids) * self.prefill_s / self.step_cost(len(self._active) + 1))
            self._active.append([prefill_steps + len(ids), future, ids])
            self._cond.notify()
        return future

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._active and not self._stop:
                    self._cond.wait()
                if self._stop:
                    return
                batch = len(self._active)
            time.sleep(self.step_cost(batch))  # one decode step for every active sequence at once
            with self._cond:
                version = self._version
                for item in self._active:
                    item[0] -= 1
                done = [item for item in self._active if item[0] <= 0]
                self._active = [item for item in self._active if item[0] > 0]
            for _, future, ids in done:
                future.set_result(Generation(ids, [-1.0] * len(ids), [version] * len(ids), "stop"))

    def update_weights(self, weights, version: int, timeout_s: float = 60.0) -> None:
        with self._cond:
            self._version = version

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()


class ModeledLearner:
    """Counts versions like the Learner; a step costs `s_per_token` per trajectory token."""

    def __init__(self, s_per_token: float):
        self.version, self.s_per_token = 0, s_per_token

    def train_step(self, trajectories, advantages) -> dict[str, float]:
        staleness = staleness_histogram(trajectories, self.version)  # what the Learner reports
        tokens = sum(len(t.tokens) for t in trajectories)
        time.sleep(tokens * self.s_per_token)
        self.version += 1
        return {"tokens_per_s": 1.0 / self.s_per_token, "staleness_max": float(max(staleness, default=0))}

    def weights(self) -> dict:
        return {}

    def state(self) -> dict:
        return {"version": self.version}

    def load_state(self, state) -> None:
        self.version = state["version"]


def costs_from_file(path: Path, shape: str) -> tuple[dict, float]:
    """The decode and prefill costs and the learner's seconds per token that bench/engine_costs.py
    wrote for `shape`."""
    measured = json.loads(path.read_text())
    if shape not in measured["shapes"]:
        raise SystemExit(f"{path} has no shape {shape!r}; it has {', '.join(measured['shapes'])}")
    costs = measured["shapes"][shape]
    log(f"costs from {path} ({shape}, measured on {measured['device']})")
    return ({"decode_step_s": costs["decode_step_s"], "prefill_s_per_token": costs["prefill_s_per_token"]},
            costs["learner_s_per_token"])


def run_mode(mode: str, orch_config: OrchestratorConfig, tasks, engine, learner, tokenizer, pool, steps: int,
             budget_s: float | None) -> dict:
    config = orch_config.model_copy(update={"mode": mode})
    with tempfile.TemporaryDirectory() as run_dir, \
            Orchestrator(config, tasks, engine, tokenizer, pool, Path(run_dir),
                         version=lambda: learner.version) as orch:
        run = RunFolder(run_dir)
        t0 = time.perf_counter()
        history = []
        while orch.step < steps and (budget_s is None or time.perf_counter() - t0 < budget_s):
            history.append(learning_step(config, orch, learner, engine, run))
            m = history[-1]
            log(f"  {mode} step {m['step']}: {time.perf_counter() - t0:.1f} s, reward {m['reward_mean']:+.3f}, "
                f"staleness ≤{m['staleness_max']}, waited {m['wait_s']:.1f} s")
        seconds = time.perf_counter() - t0
        run.wait_for_state()
        orch.close()
        episodes = episode_tail(Path(run_dir) / "trajectories.jsonl")
    return {"seconds": seconds, "steps": len(history),
            "reward_by_step": [round(m["reward_mean"], 4) for m in history],
            "wait_s_by_step": [round(m["wait_s"], 2) for m in history],
            "staleness_max": max((m["staleness_max"] for m in history), default=0),
            "episodes": episodes}


def episode_tail(path: Path) -> dict:
    """How long-tailed the run's episodes were: wall seconds and generated tokens (p50, p90, p99,
    max), and what the slowest episode spent its time on."""
    trajectories = [json.loads(line)["trajectory"] for line in path.read_text().splitlines() if line.strip()]
    if not trajectories:
        return {"n": 0}

    def quantiles(values: list[float]) -> dict[str, float]:
        v = sorted(values)
        return {q: round(v[min(len(v) - 1, int(f * len(v)))], 2)
                for q, f in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))} | {
            "max": round(v[-1], 2)}

    slowest = max(trajectories, key=lambda t: t["timings"].get("total_s", 0.0))
    return {"n": len(trajectories),
            "seconds": quantiles([t["timings"].get("total_s", 0.0) for t in trajectories]),
            "generated_tokens": quantiles([sum(t["loss_mask"]) for t in trajectories]),
            "slowest": {"task_id": slowest["task_id"], "status": slowest["status"], "turns": slowest["turns"],
                        "generated_tokens": sum(slowest["loss_mask"]),
                        **{k: round(v, 2) for k, v in slowest["timings"].items()}}}


SUITE_WAIT_CAP_S = 8.0  # below the sandbox's 10 s command limit, with room for the real tests


def with_suite_time(tasks: Sequence[Task], median_s: float, sigma: float, seed: int) -> list[Task]:
    """`tasks` whose visible and hidden test suites each gain a test that sleeps for the task's
    suite time: lognormal (median `median_s`), drawn from the seed and the task id alone."""
    if median_s <= 0:
        return list(tasks)
    out = []
    for task in tasks:
        wait = min(SUITE_WAIT_CAP_S, random.Random(f"{seed}/{task.id}").lognormvariate(math.log(median_s), sigma))
        body = (f'"""The rest of the project\'s suite, which takes {wait:.2f} s to run."""\nimport time\n\n\n'
                f"def test_rest_of_suite():\n    time.sleep({wait:.3f})\n")
        out.append(task.model_copy(update={"files": {**task.files, "tests/test_rest_of_suite.py": body},
                                           "hidden_tests": {**task.hidden_tests,
                                                            "tests_hidden/test_rest_of_suite.py": body}}))
    return out


def every_admitted_episode(args, max_staleness: int | None = None) -> int:
    """Concurrency for every episode the admission limit lets start (G x B x (1 + max_staleness))."""
    return args.group_size * args.groups * (1 + (args.max_staleness if max_staleness is None else max_staleness))


def modeled(args, tokenizer, costs: dict, learner_s_per_token: float, tasks, pool) -> dict:
    """Sync once, then async at each of `--modeled-staleness` (sync never lets a token lag, so its
    time does not depend on the bound)."""
    step_cost = StepCost(costs["decode_step_s"])
    out: dict = {"async_by_staleness": {}}
    for mode, staleness in [("sync", 0)] + [("async", k) for k in args.modeled_staleness]:
        slots = every_admitted_episode(args, staleness)
        config = OrchestratorConfig(group_size=args.group_size, groups_per_step=args.groups, max_staleness=staleness,
                                    concurrency=slots,
                                    filter_zero_signal=False,
                                    episode={"max_turns": 8, "max_tokens_per_turn": 1024, "max_tokens": 16384})
        engine = ReplayEngine(tokenizer, step_cost, costs["prefill_s_per_token"], seed=args.seed)
        learner = ModeledLearner(learner_s_per_token / args.learner_speedup)
        log(f"modeled {mode} (max_staleness {staleness}): decode step {step_cost(32) * 1e3:.1f} ms at batch 32, "
            f"{step_cost(slots) * 1e3:.1f} ms at {slots}; learner {learner.s_per_token * 1e6:.1f} µs/token")
        run = run_mode(mode, config, tasks, engine, learner, tokenizer, pool, args.steps, None)
        engine.close()
        if mode == "sync":
            out["sync"] = run
        else:
            out["async_by_staleness"][str(staleness)] = run
    return out


def real(args, registry: Registry, ref: str, tasks, pool, budget_s: float | None, steps: int,
         modes: Sequence[str] = ("sync", "async")) -> dict:
    out = {}
    for mode in modes:
        checkpoint = registry.get(ref)
        engine_model, tokenizer = registry.load(checkpoint.version)
        learner_model, _ = registry.load(checkpoint.version)
        # Async: the engine decodes while the learner trains, so the learner gets the cores the engine
        # does not use; sync: the engine is idle while the learner trains, which takes them all.
        threads = args.async_learner_threads if mode == "async" else None
        learner = Learner(learner_model.train(), LearnerConfig(lr=args.lr, temperature=1.0, threads=threads))
        config = OrchestratorConfig(group_size=args.group_size, groups_per_step=args.groups,
                                    max_staleness=args.max_staleness,
                                    concurrency=every_admitted_episode(args),
                                    episode={"max_turns": args.max_turns,
                                             "max_tokens_per_turn": args.max_tokens_per_turn,
                                             "max_tokens": args.max_tokens,
                                             "temperature": 1.0})
        torch.manual_seed(args.seed)
        engine_config = EngineConfig(max_batch=args.engine_batch, kv_on_update=args.kv_on_update,
                                     separate_process=args.engine_process)
        with start_engine(engine_model, engine_config) as engine:
            log(f"real {mode}: v{checkpoint.version}, {steps} steps" + (f" or {budget_s:.0f} s" if budget_s else ""))
            result = run_mode(mode, config, tasks, engine, learner, tokenizer, pool, steps, budget_s)
            if args.eval_tasks:
                eval_set = held_out_tasks(FAMILIES, args.eval_tasks, difficulty=1)
                report, _ = evaluate(eval_set, engine, tokenizer, pool,
                                     config.episode.model_copy(update={"temperature": 0.0}), progress=False)
                result["pass_rate"] = report["pass_rate"]
                result["pass_rate_ci"] = report["pass_rate_ci"]
        out[mode] = result
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", default="modeled,real,budget")
    parser.add_argument("--registry", default="runs/registry")
    parser.add_argument("--checkpoint", default="production")
    parser.add_argument("--steps", type=int, default=16,
                        help="K: learner steps to time (async's start-up and its groups left in flight weigh less over "
                             "more)")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--max-staleness", type=int, default=4, help="as configs/train.toml")
    parser.add_argument("--learner-speedup", type=float,
                        help="modeled learner: measured seconds per token divided by this (a cluster trainer); "
                             "default 8 for costs measured here, 1 for costs from --costs")
    parser.add_argument("--modeled-staleness", type=lambda v: [int(k) for k in v.split(",")], default=[1, 2, 4],
                        help="modeled: the max_staleness bounds async runs with (comma-separated); the headline "
                             "speedup is at the largest")
    parser.add_argument("--costs", type=Path, default=COSTS,
                        help="modeled: per-token costs from bench/engine_costs.py --out (default: those measured on "
                             "an H200); 'here' measures them on this machine")
    parser.add_argument("--costs-shape", default="default", help="modeled: which model shape of --costs")
    parser.add_argument("--max-turns", type=int, default=8, help="real: an episode's turn limit")
    parser.add_argument("--max-tokens-per-turn", type=int, default=256, help="real: an answer's token limit")
    parser.add_argument("--max-tokens", type=int, default=4096, help="real: an episode's token limit, prompt included")
    parser.add_argument("--suite-seconds", type=float, default=0.0,
                        help="median seconds each task's test suites sleep (lognormal; 0: off; docstring)")
    parser.add_argument("--suite-sigma", type=float, default=1.0, help="sigma of the suite time's lognormal")
    parser.add_argument("--budget-s", type=float, default=600.0)
    parser.add_argument("--eval-tasks", type=int, default=24, help="held-out tasks per family (0: no eval)")
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--async-learner-threads", type=int, default=1,
                        help="real async: the learner's intra-op threads (the engine decodes on 1 at the same time)")
    parser.add_argument("--engine-batch", type=int, default=32,
                        help="real engine: rows decoded together (episodes beyond it queue, older groups first)")
    parser.add_argument("--kv-on-update", choices=["recompute", "keep"], default="keep",
                        help="real engine: rebuild in-flight KV on a weight swap, or keep it "
                             "(EngineConfig.kv_on_update)")
    parser.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                        help="real engine: decode in a process of its own (EngineConfig.separate_process), "
                             "as configs/train.toml does; --no-engine-process keeps it in this one")
    parser.add_argument("--repeats", type=int, default=2,
                        help="real: runs of each mode, in alternating order (sync, async, async, sync, ...)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    torch.set_num_threads(2)
    registry = Registry(args.registry)
    checkpoint = registry.get(args.checkpoint)
    model, tokenizer = registry.load(checkpoint.version)
    tasks = with_suite_time(task_set(FAMILIES, "train", 32, seed=100, difficulty=1), args.suite_seconds,
                            args.suite_sigma,
                            args.seed)
    result: dict = {"checkpoint": checkpoint.version, "group_size": args.group_size, "groups_per_step": args.groups,
                    "max_staleness": args.max_staleness, "steps": args.steps,
                    "async_learner_threads": args.async_learner_threads, "engine_process": args.engine_process,
                    "repeats": args.repeats, "suite_seconds": args.suite_seconds, "suite_sigma": args.suite_sigma}
    # Process-wide lazy loads happen before anything is timed: the first semantic_search loads the
    # sentence embedder (~10 s on 2 cores), which would otherwise be charged to whichever mode ran first.
    log("loading the search embedder")
    load_embedder()
    with SandboxPool(PoolConfig(max_active=64)) as pool:
        if "modeled" in parts:
            if str(args.costs) != "here":
                costs, per_token = costs_from_file(args.costs, args.costs_shape)
                result["costs_from"] = f"{args.costs} ({args.costs_shape})"
            else:
                costs = decode_costs(model, len(tokenizer), [32], 700, torch.device("cpu"))
                per_token = learner_cost(model, repeats=1, device=torch.device("cpu"))
            if args.learner_speedup is None:
                args.learner_speedup = 8.0 if str(args.costs) == "here" else 1.0
            result["measured_costs"] = {**costs, "learner_s_per_token": per_token}
            result["learner_speedup"] = args.learner_speedup
            m = modeled(args, tokenizer, costs, per_token, tasks, pool)
            result["modeled"] = m
            by_staleness = {k: m["sync"]["seconds"] / r["seconds"] for k, r in m["async_by_staleness"].items()}
            result["speedup_modeled_by_staleness"] = by_staleness
            # The headline figure at the largest bound tried (cluster frameworks run 2 to 8: AReaL's
            # 2.77x is async with such a bound against sync on the same GPUs).
            result["modeled_max_staleness"] = max(args.modeled_staleness)
            result["speedup_async_vs_sync_modeled"] = by_staleness[str(max(args.modeled_staleness))]
            log("modeled speedup by max_staleness: " + ", ".join(f"{k}: {v:.2f}" for k, v in by_staleness.items()))
        if "real" in parts:
            # This machine's speed drifts by tens of percent over minutes (shared cores), so the modes
            # alternate (sync, async, async, sync, ...): a drift that is linear in time cancels out.
            runs: dict[str, list[dict]] = {"sync": [], "async": []}
            for i in range(args.repeats):
                for mode, r in real(args, registry, args.checkpoint, tasks, pool, None, args.steps,
                                    ("sync", "async") if i % 2 == 0 else ("async", "sync")).items():
                    runs[mode].append(r)
            seconds = {mode: [r["seconds"] for r in rs] for mode, rs in runs.items()}
            result["real"] = runs
            result["speedup_async_vs_sync"] = sum(seconds["sync"]) / sum(seconds["async"])
            result["speedup_async_vs_sync_per_repeat"] = [s / a
                                                          for s, a in zip(seconds["sync"], seconds["async"],
                                                                          strict=True)]
            log(f"real speedup {result['speedup_async_vs_sync']:.2f} (sync {seconds['sync']}, async "
                f"{seconds['async']})")
        if "budget" in parts:
            eval_set = held_out_tasks(FAMILIES, args.eval_tasks, difficulty=1)
            with LocalEngine(model, EngineConfig(max_batch=32)) as engine:
                from flywheel.agent.episode import EpisodeConfig  # noqa: PLC0415

                start, _ = evaluate(eval_set, engine, tokenizer, pool, EpisodeConfig(temperature=0.0), progress=False)
            b = real(args, registry, args.checkpoint, tasks, pool, args.budget_s, 10_000)
            result["budget"] = b
            result["budget_s"] = args.budget_s
            result["pass_rate_start"] = start["pass_rate"]
            result["pass_rate_async"] = b["async"].get("pass_rate")
            result["pass_rate_sync"] = b["sync"].get("pass_rate")
            result["pass_rate_after_budget"] = b["async"].get("pass_rate")
    registry.close()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
