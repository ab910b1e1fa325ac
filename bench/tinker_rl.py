"""tinker-cookbook's RL trainer, unmodified, on prompts of one of flywheel's task families through
`flywheel tinker serve`: does the cookbook's RL loop raise a reward here?

    python bench/tinker_rl.py                         # bugfix instructions, 12 steps of 8 groups x 8
    python bench/tinker_rl.py --family crossfile --steps 20

The environment is single-turn: the prompt is a task's instruction (flywheel's family, rendered by
the cookbook's ChatML renderer), and the reward is the share of the reply's tokens that occur in the
instruction: copying names and paths from the context is the first thing flywheel's own SFT has to
teach a fresh model (docs/ARCHITECTURE.md, "tools_in_prompt"). It is not the family's graded reward
(that needs the multi-turn sandbox episode, which no cookbook Env here runs). The policy is a LoRA
adapter on a fresh embedded model (the bootstrap's shape, untrained, as v0); the cookbook's
`rl.train` samples groups, computes GRPO-style advantages and trains with importance sampling
through the SDK.

Baseline from the same run: the first step's mean reward (the untrained adapter is the base).
Printed: the mean reward per step, the first and last three steps' means, and the cookbook's own
sampler-vs-trainer KL (`optim/kl_sample_train_v1`) per step. One JSON object on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from flywheel.api.http import RunningServer
from flywheel.env.families import task_set
from flywheel.model.factory import ModelConfig, build_model
from flywheel.model.registry import Registry
from flywheel.model.tokenizer import load_tokenizer, train_tokenizer
from flywheel.tinker.server import TinkerConfig, create_app
from flywheel.tinker.service import TinkerService

MODEL = "production"
RENDERER = "qwen3_disable_thinking"  # ChatML, as flywheel's tokenizer speaks


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--family", default="bugfix")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(2)
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    os.environ["TINKER_API_KEY"] = "tml-bench"
    import chz  # noqa: PLC0415  (the SDK, the cookbook and its config library: dev dependencies)
    import tinker  # noqa: PLC0415
    from tinker_cookbook import renderers  # noqa: PLC0415
    from tinker_cookbook.rl import train  # noqa: PLC0415
    from tinker_cookbook.rl.types import Env, EnvGroupBuilder, RLDataset, RLDatasetBuilder, StepResult  # noqa: PLC0415
    from tinker_cookbook.tokenizer_utils import get_tokenizer, register_tokenizer  # noqa: PLC0415

    tasks = task_set([args.family], "train", args.groups * args.steps, seed=0)
    instructions = [t.instruction for t in tasks]
    work = Path(tempfile.mkdtemp(prefix="tinker-rl-bench-"))
    tokenizer = train_tokenizer(instructions + [text for t in tasks for text in t.files.values()], vocab_size=4096,
                                tools_in_prompt=False)
    registry = Registry(work / "registry")
    registry.register(build_model(ModelConfig(), tokenizer), tokenizer, aliases=[MODEL])
    register_tokenizer(MODEL, lambda: load_tokenizer(registry.get(MODEL).path))

    class CopyEnv(Env):
        def __init__(self, renderer, instruction: str):
            self.renderer, self.instruction = renderer, instruction
            self.context = set(get_tokenizer(MODEL).encode(instruction))

        async def initial_observation(self):
            prompt = self.renderer.build_generation_prompt([{"role": "user", "content": self.instruction}])
            return prompt, self.renderer.get_stop_sequences()

        async def step(self, action, *, extra=None):
            reply = [t for t in action if t not in self.renderer.get_stop_sequences()]
            copied = sum(t in self.context for t in reply) / max(len(reply), 1)
            return StepResult(reward=copied, episode_done=True, next_observation=tinker.ModelInput.empty(),
                              next_stop_condition=self.renderer.get_stop_sequences(), metrics={"copied": copied})

    class Group(EnvGroupBuilder):
        def __init__(self, renderer, instruction: str, size: int):
            self.renderer, self.instruction, self.size = renderer, instruction, size

        async def make_envs(self):
            return [CopyEnv(self.renderer, self.instruction) for _ in range(self.size)]

    class Prompts(RLDataset):
        def __init__(self, renderer):
            self.renderer = renderer

        def get_batch(self, index: int):
            chunk = instructions[index * args.groups:(index + 1) * args.groups]
            return [Group(self.renderer, i, args.group_size) for i in chunk]

        def __len__(self) -> int:
            return args.steps

    @chz.chz
    class PromptsBuilder(RLDatasetBuilder):
        async def __call__(self):
            return Prompts(renderers.get_renderer(RENDERER, get_tokenizer(MODEL))), None

    config = TinkerConfig(registry=registry.root, root=work / "tinker", keys={"tml-bench": ["training", "sampling"]})
    service = TinkerService(registry, config.root)
    started = time.monotonic()
    with RunningServer(create_app(service, config)) as running:
        recipe = train.Config(learning_rate=args.lr, dataset_builder=PromptsBuilder(), model_name=MODEL,
                              recipe_name="flywheel_bench", max_tokens=args.max_tokens, log_path=str(work / "rl"),
                              eval_every=0, save_every=0, lora_rank=args.rank, base_url=running.url,
                              renderer_name=RENDERER, num_groups_to_log=0)
        asyncio.run(train.main(recipe))
    seconds = time.monotonic() - started
    service.close()
    rows = [json.loads(line) for line in (work / "rl" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "env/all/reward/total" in r]
    rewards = [round(r["env/all/reward/total"], 4) for r in rows]
    print(json.dumps({
        "family": args.family, "steps": len(rows), "episodes_per_step": args.groups * args.group_size,
        "lora_rank": args.rank, "learning_rate": args.lr, "reward_per_step": rewards,
        "reward_first3": round(sum(rewards[:3]) / 3, 4), "reward_last3": round(sum(rewards[-3:]) / 3, 4),
        "kl_sample_train_v1": [round(r.get("optim/kl_sample_train_v1", float("nan")), 5) for r in rows],
        "seconds": round(seconds, 1),
    }, indent=1))
    registry.close()


if __name__ == "__main__":
    main()
