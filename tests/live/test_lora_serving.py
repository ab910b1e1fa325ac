"""The live server serves a LoRA version (an adapter on an imported-style model) merged onto its
base: what it samples scores, under a forward pass of base + adapter, the logprobs it reported;
and `dtype` serves the weights in bfloat16."""

from __future__ import annotations

import httpx
import pytest
import torch

from flywheel.live.server import LiveServer, ServeConfig, serve_in_thread
from flywheel.live.settings import LoopConfig
from flywheel.model.adapters import LoraConfig, load_adapted, lora_model
from flywheel.model.chat import SYSTEM_PROMPT, tool_schemas
from flywheel.model.formats import format_of
from flywheel.model.registry import Registry
from flywheel.rl.learner import token_logprobs
from tests.model.families import family_tokenizer, tiny_model

MESSAGES = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "Fix the failing test."}]


@pytest.fixture(scope="module")
def registry_root(tmp_path_factory):
    """v0: a tiny Qwen3-architecture model in Qwen3's format; v1: a LoRA adapter of it, production."""
    root = tmp_path_factory.mktemp("registry")
    tokenizer = family_tokenizer("qwen3")
    format_of(tokenizer)
    with Registry(root) as registry:
        registry.register(tiny_model(tokenizer, "qwen3"), tokenizer)
        base, _ = registry.load(0)
        adapter = lora_model(base, LoraConfig(rank=4))
        with torch.no_grad():
            for name, p in adapter.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 2.0)
        registry.register(adapter, tokenizer, parent=0, base=0, aliases=["production"])
    return root


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_lora_version_serves_merged_onto_its_base(registry_root, tmp_path, dtype):
    config = ServeConfig(loop=LoopConfig.at(tmp_path / "live.sqlite", registry_root), keys={"k": ["inference"]},
                         candidate_fraction=0.0, threads=1, dtype=dtype)
    server = LiveServer.from_config(config)
    with server, serve_in_thread(server) as running, httpx.Client(
            base_url=running.url, headers={"authorization": "Bearer k"}, timeout=120) as http:
        reply = http.post("/v1/chat/completions", json={"model": "flywheel", "messages": MESSAGES,
                                                        "tools": tool_schemas(), "max_tokens": 12, "temperature": 1.0,
                                                        "seed": 5, "logprobs": True}).json()
        stored = server.store.completion(reply["id"])
    assert stored.version == 1 and reply["flywheel"]["version"] == 1
    with Registry(registry_root) as registry:
        adapter, _ = load_adapted(registry, 1)
        base, _ = registry.load(0)
    ids = torch.tensor([stored.prompt_ids + stored.completion_ids])
    served = torch.tensor(stored.logprobs)
    with torch.no_grad():
        adapted = token_logprobs(adapter.get_base_model(), ids, torch.ones_like(ids))[0][0, len(stored.prompt_ids):]
        plain = token_logprobs(base, ids, torch.ones_like(ids))[0][0, len(stored.prompt_ids):]
    tolerance = 1e-4 if dtype == "float32" else 0.1  # bfloat16 weights: about 3 significant digits
    assert torch.allclose(served, adapted, atol=tolerance)
    # the adapter, not the base, served: far nearer the one than the other
    assert (served - adapted).abs().mean() * 3 < (served - plain).abs().mean()
