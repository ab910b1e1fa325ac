"""tinker-cookbook's RL trainer, unmodified, playing flywheel's own episodes through `flywheel tinker serve`:
does the cookbook's RL loop raise flywheel's reward on a task family?

    flywheel bootstrap                                      # v0: the default config (runs/registry)
    python bench/tinker_rl.py --v0 runs/registry            # bugfix, 24 steps of 4 groups x 8 episodes
    python bench/tinker_rl.py --v0 runs/registry --family crossfile --steps 20

The policy starts from a bootstrapped version 0 (`--v0`: a Registry whose `production` is what
`flywheel bootstrap` registers; it is copied into this run's own Registry as v0), because RL moves a
policy that already acts: an earlier version of this bench started from random weights, where the
reward (the share of reply tokens copied from the instruction) sat at its chance level, 0.011
(a few dozen instruction tokens out of a 4,096-token vocabulary) with almost no spread inside a group,
and 12 steps left it at 0.009: nothing for group-relative advantages to rank.

The environment is flywheel's episode itself (flywheel/agent/episode.py: its sandbox, its tools,
its turns, its hidden-test grading and its reward with the invalid-call penalty), not a stand-in:
each cookbook Env runs `run_episode` on a thread whose Engine is a bridge, `TurnBridge`, that hands
the episode's prompt for each turn to the cookbook (its next observation) and the tokens the
cookbook sampled through the Tinker server back to the episode. The last step's reward is the
episode's reward. The cookbook samples, computes GRPO-style advantages per group of one task and
trains the LoRA adapter with importance sampling through the SDK.

Baseline from the same run: the cookbook's evaluator plays the held-out tasks (`--eval-tasks` of
the family's eval split, `--eval-group-size` episodes each, T=1) before the first step, when the
adapter is still zero and the sampler is v0 itself, then every `--eval-every` steps and at the end.
A training step's own mean reward depends mostly on which 4 tasks it drew (it spans 0.35-0.83
from step to step at any point of a run), so the held-out numbers are the ones to compare.
Printed: held-out reward, share of episodes whose hidden tests all pass, tests-passed fraction and
invalid calls per episode at each evaluation; per training step the mean reward and all-passed
share, the first and last three steps' means, the cookbook's sampler-vs-trainer KL; seconds. One
JSON object on stdout; the curves (training reward and all-passed share per step, the held-out
evaluations) drawn in `--out`/tinker_rl.svg.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `bench.draw_trend` when run as a script
from bench.draw_trend import trend  # noqa: E402
from flywheel.agent.episode import EpisodeConfig, run_episode
from flywheel.api.http import RunningServer
from flywheel.env.families import held_out_tasks, task_set
from flywheel.env.pool import SandboxPool
from flywheel.model.chat import IM_END
from flywheel.model.engine import Generation, SamplingParams
from flywheel.model.registry import Registry
from flywheel.report.svg import Series, line_chart
from flywheel.store.files import write_atomic
from flywheel.tinker.server import TinkerConfig, create_app
from flywheel.tinker.service import TinkerService

MODEL = "production"
RENDERER = "qwen3_disable_thinking"  # ChatML, as flywheel's tokenizer speaks (only the cookbook's logging uses it)


class TurnBridge:
    """An Engine for `run_episode` whose generations come from outside: each `submit` (one turn)
    posts the prompt to the Env's event loop and waits for the tokens the Env is handed."""

    version = 0

    def __init__(self, loop: asyncio.AbstractEventLoop, inbox: asyncio.Queue):
        self.loop, self.inbox = loop, inbox

    def submit(self, prompt_ids, params: SamplingParams) -> Future[Generation]:
        turn: Future[Generation] = Future()
        self.loop.call_soon_threadsafe(self.inbox.put_nowait, ("turn", list(prompt_ids), turn))
        return turn

    def update_weights(self, weights, version: int, timeout_s: float = 60.0) -> None:
        raise NotImplementedError("the cookbook's sampler holds the weights")

    def close(self) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--v0", type=Path, required=True,
                        help="a Registry folder whose `production` is a bootstrapped v0")
    parser.add_argument("--family", default="bugfix")
    parser.add_argument("--difficulty", type=int, default=1)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=256, help="per turn")
    parser.add_argument("--max-turns", type=int, default=8)
    # 2e-3 drifted: invalid tool calls per episode rose from 0.1 to 0.5-0.9 in 20 steps, the reward did not rise
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train-tasks", type=int, default=0,
                        help="replay this many training tasks every step (0: fresh tasks each step); with --groups "
                             "equal to it, every step plays the same tasks and its reward is comparable step to step")
    parser.add_argument("--temperature", type=float, default=1.0,
                        help="the cookbook's sampling temperature (its trainer scores at T=1 whatever this is)")
    parser.add_argument("--eval-tasks", type=int, default=32, help="held-out tasks the cookbook's evaluator plays")
    parser.add_argument("--eval-group-size", type=int, default=2, help="episodes per held-out task")
    parser.add_argument("--eval-every", type=int, default=12)
    parser.add_argument("--out", type=Path, default=Path("runs/tinker_rl"), help="where the curve is drawn")
    args = parser.parse_args()
    torch.set_num_threads(2)
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    os.environ["TINKER_API_KEY"] = "tml-bench"
    import chz  # noqa: PLC0415  (the SDK, the cookbook and its config library: dev dependencies)
    import tinker  # noqa: PLC0415
    from tinker_cookbook.rl import train  # noqa: PLC0415
    from tinker_cookbook.rl.types import Env, EnvGroupBuilder, RLDataset, RLDatasetBuilder, StepResult  # noqa: PLC0415
    from tinker_cookbook.tokenizer_utils import register_tokenizer  # noqa: PLC0415

    work = Path(tempfile.mkdtemp(prefix="tinker-rl-bench-"))
    with Registry(args.v0) as source:
        start = source.get(MODEL)
        model, tokenizer = source.load(MODEL)
    registry = Registry(work / "registry")
    registry.register(model, tokenizer, aliases=[MODEL], note=f"v{start.version} of {args.v0}",
                      metrics=dict(start.metrics))
    del model
    register_tokenizer(MODEL, lambda: tokenizer)
    stop = tokenizer.convert_tokens_to_ids(IM_END)
    # --train-tasks: a fixed set, replayed (groups cycle through it step after step); else one task a group
    drawn = task_set([args.family], "train", args.train_tasks or args.groups * args.steps, seed=args.seed,
                     difficulty=args.difficulty)
    tasks = [drawn[i % len(drawn)] for i in range(args.groups * args.steps)]
    held_out = held_out_tasks([args.family], args.eval_tasks, args.difficulty)
    episode = EpisodeConfig(temperature=1.0, max_turns=args.max_turns, max_tokens_per_turn=args.max_tokens)
    pool = SandboxPool()

    class EpisodeEnv(Env):
        """One flywheel episode of `task`, a turn per cookbook step."""

        def __init__(self, task):
            self.task = task
            self.turn: Future[Generation] | None = None

        async def initial_observation(self):
            self.inbox: asyncio.Queue = asyncio.Queue()
            bridge = TurnBridge(asyncio.get_running_loop(), self.inbox)
            loop = asyncio.get_running_loop()

            def play() -> None:
                try:
                    result: tuple[str, Any] = ("done", run_episode(self.task, bridge, tokenizer, pool, episode))
                except BaseException as exc:  # noqa: BLE001 -- handed to the Env, which raises it
                    result = ("error", exc)
                loop.call_soon_threadsafe(self.inbox.put_nowait, (*result, None))

            threading.Thread(target=play, daemon=True, name=f"episode-{self.task.id}").start()
            kind, prompt, self.turn = await self.inbox.get()
            if kind != "turn":
                raise RuntimeError(f"the episode ended before its first turn: {prompt!r}")
            return tinker.ModelInput.from_ints(prompt), [stop]

        async def step(self, action, *, extra=None):
            tokens = list(action)
            reason = "stop" if tokens and tokens[-1] == stop else "length"
            self.turn.set_result(Generation(tokens, [0.0] * len(tokens), [0] * len(tokens), reason))
            kind, payload, self.turn = await self.inbox.get()
            if kind == "turn":
                return StepResult(reward=0.0, episode_done=False, next_observation=tinker.ModelInput.from_ints(payload),
                                  next_stop_condition=[stop])
            if kind == "error":
                raise payload
            outcome = payload.outcome
            return StepResult(reward=payload.reward, episode_done=True, next_observation=tinker.ModelInput.empty(),
                              next_stop_condition=[stop],
                              metrics={"all_passed": float(bool(outcome and outcome.all_passed)),
                                       "tests_passed_frac": outcome.tests_passed_frac if outcome else 0.0,
                                       "turns": payload.turns, "invalid_tool_calls": payload.invalid_tool_calls})

    class Group(EnvGroupBuilder):
        def __init__(self, task, size: int):
            self.task, self.size = task, size

        async def make_envs(self):
            return [EpisodeEnv(self.task) for _ in range(self.size)]

        def logging_tags(self) -> list[str]:
            return [args.family]

    class Tasks(RLDataset):
        def __init__(self, items: list, per_batch: int, size: int):
            self.items, self.per_batch, self.size = items, per_batch, size

        def get_batch(self, index: int):
            return [Group(t, self.size) for t in self.items[index * self.per_batch:(index + 1) * self.per_batch]]

        def __len__(self) -> int:
            return len(self.items) // self.per_batch

    @chz.chz
    class TasksBuilder(RLDatasetBuilder):
        async def __call__(self):  # training batches, and the held-out set the cookbook's evaluator plays
            return Tasks(tasks, args.groups, args.group_size), Tasks(held_out, len(held_out), args.eval_group_size)

    config = TinkerConfig(registry=registry.root, root=work / "tinker", keys={"tml-bench": ["training", "sampling"]})
    service = TinkerService(registry, config.root)
    started = time.monotonic()
    with RunningServer(create_app(service, config)) as running:
        recipe = train.Config(learning_rate=args.lr, dataset_builder=TasksBuilder(), model_name=MODEL,
                              recipe_name="flywheel_bench", max_tokens=args.max_tokens, log_path=str(work / "rl"),
                              eval_every=args.eval_every, save_every=0, lora_rank=args.rank, base_url=running.url,
                              renderer_name=RENDERER, num_groups_to_log=0, temperature=args.temperature)
        asyncio.run(train.main(recipe))
    seconds = time.monotonic() - started
    service.close()
    pool.close()
    rows = [json.loads(line) for line in (work / "rl" / "metrics.jsonl").read_text().splitlines()]
    evals = [{"step": r["step"], **{k: round(r[f"test/env/all/{m}"], 4) for k, m in (
        ("reward", "reward/total"), ("all_passed", "all_passed"), ("tests_passed_frac", "tests_passed_frac"),
        ("invalid_tool_calls", "invalid_tool_calls"))}} for r in rows if "test/env/all/reward/total" in r]
    rows = [r for r in rows if "env/all/reward/total" in r]
    rewards = [round(r["env/all/reward/total"], 4) for r in rows]
    passed = [round(r.get("env/all/all_passed", float("nan")), 4) for r in rows]

    def mean(xs: list[float]) -> float:
        return round(sum(xs) / len(xs), 4)

    tasks_said = f"{args.train_tasks} tasks replayed" if args.train_tasks else "fresh tasks each step"
    svg = line_chart(f"Tinker cookbook RL on flywheel's {args.family} episodes ({tasks_said}, lr {args.lr:g}, "
                     f"T {args.temperature:g})",
                     [Series("training reward", list(enumerate(rewards))),
                      Series("training all tests pass", list(enumerate(passed)), dashed=True),
                      Series("held-out reward", [(e["step"], e["reward"]) for e in evals]),
                      Series("held-out all tests pass", [(e["step"], e["all_passed"]) for e in evals], dashed=True)],
                     x_label="step", y_label="per episode", y_range=(0, 1), width=720, height=360)
    args.out.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out / "tinker_rl.svg", svg)

    print(json.dumps({
        "family": args.family, "difficulty": args.difficulty, "v0": str(args.v0), "v0_metrics": start.metrics,
        "steps": len(rows), "episodes_per_step": args.groups * args.group_size, "lora_rank": args.rank,
        "learning_rate": args.lr, "temperature": args.temperature, "train_tasks": args.train_tasks or None,
        "reward_per_step": rewards, "all_passed_per_step": passed,
        "reward_first3": mean(rewards[:3]), "reward_last3": mean(rewards[-3:]),
        # least squares over the steps, 95% interval: with --train-tasks every step plays the same tasks
        "reward_trend": trend(list(range(len(rewards))), rewards) if len(rewards) > 2 else None,
        "all_passed_first3": mean(passed[:3]), "all_passed_last3": mean(passed[-3:]),
        "held_out": {"tasks": len(held_out), "episodes": len(held_out) * args.eval_group_size, "by_step": evals},
        "kl_sample_train_v1": [round(r.get("optim/kl_sample_train_v1", float("nan")), 5) for r in rows],
        "seconds": round(seconds, 1), "work": str(work), "curve": str(args.out / "tinker_rl.svg"),
    }, indent=1))
    registry.close()


if __name__ == "__main__":
    main()
