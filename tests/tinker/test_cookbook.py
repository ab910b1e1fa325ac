"""tinker-cookbook's training loops, unmodified, against `flywheel tinker serve` (conftest.py): its
supervised trainer on its own example conversations, and its RL trainer on a ProblemEnv, both on the
tiny model. What only a working server gives: the supervised NLL falls; the RL loop's own check of
sampler against trainer (`optim/kl_sample_train_v1`, the KL between the logprobs the sampler
returned and those the trainer computes for the same tokens) is ~0 on its first, on-policy step.

The model's name is a Registry ref ("production"); the cookbook loads tokenizers by name from the
Hub, so the test registers the Registry version's tokenizer under it (`register_tokenizer`, the
cookbook's hook for custom models; docs/tinker.md)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from installed import installed  # noqa: E402  (this folder's: skip with the install line, fail in CI)

cookbook = installed("tinker_cookbook")
chz = installed("chz")

from tinker_cookbook import renderers  # noqa: E402
from tinker_cookbook.rl import train as rl_train  # noqa: E402
from tinker_cookbook.rl.problem_env import ProblemEnv, ProblemGroupBuilder  # noqa: E402
from tinker_cookbook.rl.types import RLDataset, RLDatasetBuilder  # noqa: E402
from tinker_cookbook.supervised import train as sl_train  # noqa: E402
from tinker_cookbook.supervised.data import FromConversationFileBuilder  # noqa: E402
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig  # noqa: E402
from tinker_cookbook.tokenizer_utils import get_tokenizer, register_tokenizer  # noqa: E402

from flywheel.model.tokenizer import load_tokenizer  # noqa: E402

MODEL = "production"
RENDERER = "qwen3_disable_thinking"  # ChatML, as flywheel's tokenizer speaks; stops on <|im_end|>


@pytest.fixture
def cookbook_env(server, monkeypatch):
    url, registry = server
    monkeypatch.setenv("TINKER_API_KEY", "tml-alice")
    register_tokenizer(MODEL, lambda: load_tokenizer(registry.get(MODEL).path))
    return url


def metrics(log_path: Path) -> list[dict]:
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]


def test_the_cookbooks_supervised_trainer_runs_against_flywheel(cookbook_env, tmp_path):
    data = Path(cookbook.__file__).parent / "example_data" / "conversations.jsonl"
    common = ChatDatasetBuilderCommonConfig(model_name_for_tokenizer=MODEL, renderer_name=RENDERER, max_length=128,
                                            batch_size=64)
    config = sl_train.Config(log_path=str(tmp_path / "sl"), model_name=MODEL, recipe_name="flywheel_test",
                             renderer_name=RENDERER,
                             dataset_builder=FromConversationFileBuilder(common_config=common, file_path=str(data)),
                             learning_rate=1e-2, lora_rank=4, base_url=cookbook_env, num_epochs=2, save_every=0,
                             eval_every=0, infrequent_eval_every=0)
    asyncio.run(sl_train.main(config))
    rows = metrics(tmp_path / "sl")
    assert len(rows) == 4 and all(r["optim/skipped"] == 0.0 for r in rows)
    assert rows[-1]["train_mean_nll"] < rows[0]["train_mean_nll"] - 0.05
    saved = json.loads((tmp_path / "sl" / "checkpoints.jsonl").read_text().splitlines()[-1])
    assert saved["sampler_path"].startswith("tinker://") and saved["state_path"].startswith("tinker://")


class Completes(ProblemEnv):
    """Reward 1 when the answer writes `return` (the tiny model's corpus has it), else 0."""

    def get_question(self) -> str:
        return "Fix the failing test."

    def check_answer(self, sample_str: str) -> bool:
        return "return" in sample_str

    def check_format(self, sample_str: str) -> bool:
        return True

    def get_reference_answer(self) -> str:
        return "return a + b"


class Problems(RLDataset):
    def __init__(self, renderer):
        self.renderer = renderer

    def get_batch(self, index: int):
        return [ProblemGroupBuilder(lambda: Completes(self.renderer), num_envs=4) for _ in range(2)]

    def __len__(self) -> int:
        return 3


@chz.chz
class ProblemsBuilder(RLDatasetBuilder):
    async def __call__(self):
        return Problems(renderers.get_renderer(RENDERER, get_tokenizer(MODEL))), None


def test_the_cookbooks_rl_trainer_runs_against_flywheel(cookbook_env, tmp_path):
    config = rl_train.Config(learning_rate=1e-2, dataset_builder=ProblemsBuilder(), model_name=MODEL,
                             recipe_name="flywheel_test", max_tokens=16, log_path=str(tmp_path / "rl"), eval_every=0,
                             save_every=0, lora_rank=4, base_url=cookbook_env, renderer_name=RENDERER,
                             num_groups_to_log=0)
    asyncio.run(rl_train.main(config))
    rows = [r for r in metrics(tmp_path / "rl") if "optim/grad_norm" in r]
    assert len(rows) == 3 and all(r["env/all/total_episodes"] == 8 for r in rows)
    assert abs(rows[0]["optim/kl_sample_train_v1"]) < 1e-3  # sampler and trainer score tokens alike
    assert any(r["optim/grad_norm"] > 0 for r in rows)  # a group whose rewards all tie has no gradient
