"""LoRA training of a pretrained-architecture model through the same Learner and loop: only the
adapter moves, the engine gets base + delta as plain weights that score exactly like the adapter,
a run checkpoints and resumes the adapter, `flywheel train` and `flywheel bootstrap` register an
adapter version that the Registry loads merged, and `flywheel model export` writes it as a plain
HF folder. Real tiny models of the Llama architecture built from config (tests/model/families.py)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from flywheel.cli import main
from flywheel.model.adapters import LoraConfig, lora_model
from flywheel.model.chat import SYSTEM_PROMPT
from flywheel.model.formats import format_of
from flywheel.model.registry import Registry
from flywheel.rl.bootstrap import BootstrapConfig, bootstrap
from flywheel.rl.learner import LearnerConfig, token_logprobs
from flywheel.rl.lora import LoraLearner
from flywheel.rl.train import TrainConfig, train
from tests.model.families import family_tokenizer, tiny_model
from tests.rl.test_learner import trajectory

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tokenizer():
    return family_tokenizer("llama3")


def scores(model, ids: list[int]) -> torch.Tensor:
    tensor = torch.tensor([ids])
    with torch.no_grad():
        return token_logprobs(model, tensor, torch.ones_like(tensor))[0]


def test_a_step_moves_only_the_adapter_and_the_engine_s_weights_score_as_it_does(tokenizer):
    base = tiny_model(tokenizer, "llama")
    adapter = lora_model(base, LoraConfig(rank=4))
    frozen = {n: p.detach().clone() for n, p in adapter.named_parameters() if not p.requires_grad}
    learner = LoraLearner(adapter, LearnerConfig(lr=1e-2))
    batch = [trajectory(base, 40, seed) for seed in range(4)]
    metrics = learner.train_step(batch, [1.0, -1.0, 0.5, -0.5])
    assert metrics["optimizer_steps"] == 1 and learner.version == 1
    assert metrics["engine_logprob_mismatch_max"] < 1e-5  # step 0's tokens: the base scored them (B = 0)
    assert all(torch.equal(p, frozen[n]) for n, p in adapter.named_parameters() if not p.requires_grad)
    assert any(not torch.equal(p, torch.zeros_like(p)) for n, p in adapter.named_parameters() if "lora_B" in n)
    # The engine's weights: a plain model of the base's architecture, strictly loadable, scoring as the adapter.
    engine_model = tiny_model(tokenizer, "llama", seed=9)
    engine_model.load_state_dict(learner.weights(), strict=True)
    ids = batch[0].tokens
    assert torch.allclose(scores(engine_model, ids), scores(learner.model.eval(), ids), atol=1e-5)
    assert not torch.allclose(scores(engine_model, ids), scores(base, ids), atol=1e-3)


def test_the_state_holds_the_adapter_and_resumes_it(tokenizer):
    base = tiny_model(tokenizer, "llama")
    learner = LoraLearner(lora_model(base, LoraConfig(rank=4)), LearnerConfig(lr=1e-2))
    batch = [trajectory(base, 40, seed) for seed in range(2)]
    learner.train_step(batch, [1.0, -1.0])
    state = learner.state()
    assert set(state["adapter"]) and all("lora_" in k for k in state["adapter"])  # no frozen base in it
    resumed = LoraLearner(lora_model(base, LoraConfig(rank=4)), LearnerConfig(lr=1e-2))
    resumed.load_state(state)
    assert resumed.version == 1 and resumed.optimizer_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(resumed.weights().values(), learner.weights().values(), strict=True))
    again = resumed.train_step(batch, [1.0, -1.0])["loss"]
    assert again == pytest.approx(learner.train_step(batch, [1.0, -1.0])["loss"])
    with pytest.raises(ValueError, match="checkpointed without lora"):
        resumed.load_state({k: v for k, v in state.items() if k != "adapter"} | {"weights": {}})


def registered_base(tmp_path, tokenizer) -> None:
    with Registry(tmp_path / "registry") as registry:
        format_of(tokenizer)  # recorded on it, as an import does
        registry.register(tiny_model(tokenizer, "llama"), tokenizer, aliases=["production"], note="imported")


def random_adapter(tmp_path, tokenizer) -> int:
    """A general adapter version on v0 whose delta is not zero (LoRA B starts at zero)."""
    with Registry(tmp_path / "registry") as registry:
        base, _ = registry.load(0)
        adapter = lora_model(base, LoraConfig(rank=4))
        gen = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for name, p in adapter.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        return registry.register(adapter, tokenizer, parent=0, base=0, aliases=["production"]).version


def test_simulated_rl_with_lora_registers_an_adapter_the_registry_loads_merged_and_exports(tmp_path, tokenizer):
    registered_base(tmp_path, tokenizer)
    start = random_adapter(tmp_path, tokenizer)  # training continues an adapter version
    config = TrainConfig.model_validate({
        "registry_root": tmp_path / "registry", "run_dir": tmp_path / "run", "families": ["bugfix"],
        "train_tasks_per_family": 1, "eval_tasks_per_family": 1, "threads": 1, "eval_at_start": False,
        "lora": {"rank": 4}, "learner": {"lr": 1e-2},
        "orchestrator": {"group_size": 2, "groups_per_step": 1, "max_steps": 2, "filter_zero_signal": False,
                         "max_staleness": 0,
                         "episode": {"max_turns": 1, "max_tokens_per_turn": 8, "temperature": 1.0}}})
    checkpoint, summary = train(config, log=lambda line: None)
    assert summary["steps"] == 2 and checkpoint.base == 0 and checkpoint.parent == start and checkpoint.org_id == ""
    assert (checkpoint.path / "adapter_model.safetensors").is_file()
    assert not (checkpoint.path / "model.safetensors").exists()
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [s["policy_version"] for s in steps] == [1, 2]
    # Step 2 trained on tokens the engine sampled under step 1's merged weights: they agree with the Learner's.
    assert steps[1]["engine_logprob_mismatch_max"] < 1e-4
    with Registry(tmp_path / "registry") as registry:
        merged, _ = registry.load(checkpoint.version)
        base, _ = registry.load(0)
    ids = tokenizer("def clamp(x, lo, hi):", add_special_tokens=False)["input_ids"]
    assert not torch.allclose(scores(merged, ids), scores(base, ids), atol=1e-4)
    # Exported: a plain folder any tool loads, the same model.
    assert main(["model", "export", f"v{checkpoint.version}", "--out", str(tmp_path / "export"),
                 "--root", str(tmp_path / "registry")]) == 0
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    assert torch.allclose(scores(exported, ids), scores(merged, ids), atol=1e-5)
    assert (tmp_path / "export" / "tokenizer_config.json").is_file()
    # From full weights: a fresh adapter on them.
    fresh, _ = train(config.model_copy(update={"checkpoint": "v0", "run_dir": tmp_path / "run2"}), log=lambda _: None)
    assert fresh.base == 0 and fresh.parent == 0


def test_sft_of_a_registered_model_with_lora_registers_an_adapter(tmp_path, tokenizer):
    registered_base(tmp_path, tokenizer)
    demo = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "Fix the failing test."},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "read_file", "arguments": {"path": "a.py"}}}]},
            {"role": "tool", "content": "def f():\n    return 1\n"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "d", "type": "function", "function": {"name": "finish", "arguments": {}}}]}]
    config = BootstrapConfig.model_validate({
        "registry_root": tmp_path / "registry", "run_dir": tmp_path / "boot", "start": "production",
        "lora": {"rank": 4}, "alias": "candidate", "families": ["bugfix"], "eval_tasks_per_family": 1, "threads": 1,
        "sft": {"steps": 2, "lr": 1e-2, "warmup_steps": 0, "batch_tokens": 4096},
        "episode": {"max_turns": 1, "max_tokens_per_turn": 8, "temperature": 0.0}})
    checkpoint = bootstrap(config, [demo, demo], log=lambda line: None)
    assert checkpoint.base == 0 and checkpoint.parent == 0 and checkpoint.aliases == ["candidate"]
    assert checkpoint.metrics["sft_steps"] == 2
    with Registry(tmp_path / "registry") as registry:
        assert registry.get("production").version == 0  # the start keeps serving until promoted
        merged, _ = registry.load("candidate")
        base, _ = registry.load(0)
    assert set(merged_weights_keys := merged.state_dict()) == set(base.state_dict()) and merged_weights_keys
