"""Weight deltas against full pushes: after each of several real optimizer steps, an engine updated
by deltas holds bit-for-bit the weights of one updated by full state dicts (a real tiny Qwen3-MoE)."""

from __future__ import annotations

import copy

import pytest
import torch

from flywheel.model.engine import EngineConfig, LocalEngine
from flywheel.model.factory import ModelConfig, build_model
from flywheel.model.tokenizer import train_tokenizer
from flywheel.model.weight_delta import DeltaSender, _bits, diff_weights


def bitwise_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(_bits(a[k]), _bits(b[k])) for k in a)


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(["def add(a, b):\n    return a + b\n"] * 8, vocab_size=300)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engines_updated_by_deltas_hold_the_full_pushes_bits(tokenizer, dtype):
    """AdamW at a pretrained model's learning rate: in float32 every weight moves (the deltas send
    whole tensors), in bfloat16 most updates are below the weights' resolution (they send far less)."""
    policy = build_model(ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                                     num_experts=8, experts_per_token=2, moe_intermediate_size=32), tokenizer)
    policy = policy.to(dtype).train()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-5)
    full_engine = LocalEngine(copy.deepcopy(policy).eval(), EngineConfig())
    delta_engine = LocalEngine(copy.deepcopy(policy).eval(), EngineConfig())
    sender = DeltaSender(block=256)
    sender.delta(policy.state_dict(), 0)  # what both engines started from
    g = torch.Generator().manual_seed(0)
    try:
        sizes = []
        for version in (1, 2):
            ids = torch.randint(3, 40, (2, 12), generator=g)  # a few tokens: most embedding rows get no gradient
            optimizer.zero_grad()
            policy(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            weights = policy.state_dict()
            delta = sender.delta(weights, version)
            full_engine.update_weights(weights, version)
            delta_engine.update_weights(delta, version)
            assert bitwise_equal(delta_engine.model.state_dict(), full_engine.model.state_dict())
            assert bitwise_equal(delta_engine.model.state_dict(), weights)
            sizes.append(delta.nbytes / sum(t.numel() * t.element_size() for t in weights.values()))
            assert delta.blocks or delta.full
        # bits, not numbers, are compared: -0.0 after 0.0 is a change; one changed element sends its block only
        zero = torch.zeros(1000, dtype=dtype)
        signed = zero.clone()
        signed[700] = -0.0
        flipped = diff_weights({"w": zero}, {"w": signed}, version=1, base_version=0, block=100)
        assert list(flipped.blocks) == ["w"] and flipped.blocks["w"][1].tolist() == [700]  # one element, indexed
        applied = {"w": zero.clone()}
        flipped.apply(applied)
        assert torch.equal(_bits(applied["w"]), _bits(signed))
        if dtype == torch.bfloat16:
            assert max(sizes) < 0.5, sizes
        # a delta against other weights than the engine's is refused, and nothing is applied
        stale = diff_weights(weights, weights, version=5, base_version=1)
        with pytest.raises(ValueError, match="against version 1"):
            delta_engine.update_weights(stale, 5)
        assert delta_engine.version == 2
    finally:
        full_engine.close()
        delta_engine.close()
