"""LeanDecoder against the `transformers` forward of real tiny Qwen3 models (CPU, float32).

Each check builds a left-padded cache of rows of different lengths with the model's own forward,
then feeds the same next tokens through both and compares the logits step after step."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from flywheel.model.decode import LeanDecoder
from flywheel.model.engine import EngineConfig, LocalEngine, SamplingParams
from flywheel.model.factory import ModelConfig, build_model
from flywheel.model.tokenizer import train_tokenizer

VOCAB = 300
# A wrong position, mask, head grouping or expert is off by 0.1 or more; summation order, 1e-5.
ATOL = 1e-4


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(["def add(a, b):\n    return a + b\n", "import os\nprint(os.getcwd())\n"] * 8,
                           vocab_size=VOCAB)


def spread(model):
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)  # larger logits: a wrong computation cannot hide under the tolerance
    return model.eval()


def moe_model(tokenizer, seed: int = 0):
    return spread(build_model(ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                                          num_experts=8, experts_per_token=2, moe_intermediate_size=32, seed=seed),
                              tokenizer))


def dense_model():
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
    return spread(Qwen3ForCausalLM(config))


def compare(model, lean: LeanDecoder, steps: int = 6) -> float:
    """Largest logit difference between the two forwards over `steps` decode steps of 5 rows."""
    engine = LocalEngine(model, EngineConfig(lean_decode=False))
    try:
        generator, vocab = torch.Generator().manual_seed(0), model.get_input_embeddings().num_embeddings
        rows = [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in (7, 1, 19, 4, 12)]
        device = next(model.parameters()).device
        worst = 0.0
        with torch.inference_mode():
            _, cache = engine._prefill(rows)
            for _ in range(steps):
                ids = torch.randint(3, vocab, (len(rows),), generator=generator).to(device)
                cache.reserve(1)
                width, positions = cache.width, cache.positions.clone()
                mask = cache.mask[:, : width + 1].clone()
                mask[:, width] = 1
                got = lean.step(ids, cache.layers, mask, positions, width)  # writes column `width`
                want = engine._forward(ids.unsqueeze(1), cache, positions.unsqueeze(1))  # overwrites it, then advances
                worst = max(worst, float((got - want).abs().max()))
        return worst
    finally:
        engine.close()


@pytest.mark.parametrize("dense_experts", [False, True])
def test_lean_moe_decode_equals_the_transformers_forward(tokenizer, dense_experts):
    model = moe_model(tokenizer)
    assert compare(model, LeanDecoder(model, dense_experts=dense_experts)) < ATOL


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_lean_decode_on_a_gpu_takes_the_dense_expert_path_and_equals_the_transformers_forward(tokenizer):
    model = moe_model(tokenizer).to("cuda")
    lean = LeanDecoder(model)
    assert lean.dense_experts  # on an accelerator: every row through all experts, no host sync
    # float32 on the GPU sums in other orders than on a CPU (cuBLAS, SDPA): 1e-3, still far below a
    # wrong expert or position (0.1)
    assert compare(model, lean) < 1e-3


def test_lean_dense_qwen3_decode_equals_the_transformers_forward():
    model = dense_model()
    assert compare(model, LeanDecoder(model)) < ATOL


def test_fused_weights_follow_a_swap_only_after_refresh(tokenizer):
    model, other = moe_model(tokenizer, seed=0), moe_model(tokenizer, seed=1)
    lean = LeanDecoder(model)
    model.load_state_dict(other.state_dict())
    assert compare(model, lean) > 0.1  # the fused q/k/v and expert weights are copies of the old ones
    lean.refresh()
    assert compare(model, lean) < ATOL


def test_other_architectures_decode_with_the_transformers_forward(tokenizer):
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2)).eval()
    assert not LeanDecoder.supports(llama)
    with pytest.raises(ValueError, match="Qwen3"):
        LeanDecoder(llama)
    with LocalEngine(llama) as engine:
        assert engine._lean is None
        gen = engine.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4))[0]
    assert len(gen.token_ids) == 4
