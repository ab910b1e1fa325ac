"""MXFP8 expert GEMMs through torchao (the emulated kernel on a CPU): the quantization error of the
expert layer is within torchao's own test bounds, and a short training run tracks bfloat16's loss.

Bounds, from torchao 0.18's test_mxfp8_grouped_mm.py (test_mxfp8_grouped_gemm_with_dq_fwd_bwd):
SQNR >= 27 dB for the output, >= 25 dB for the input gradient, >= 24 dB for the weight gradient,
each against the same grouped GEMM in bfloat16: each of the expert layer's two grouped GEMMs meets
them (measured about 28 dB for all three). The whole expert layer chains two quantized GEMMs and the
product SiLU(gate) * up of two quantized outputs, so its errors add: measured 23.4 dB for the output
and every gradient; bounded at 21 dB.
"""

from __future__ import annotations

import pytest
import torch
from torchao.float8.float8_utils import compute_error
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from flywheel.model.factory import ModelConfig, build_model
from flywheel.model.tokenizer import train_tokenizer
from flywheel.rl.distributed import synthetic_batch
from flywheel.rl.expert_parallel import ExpertParallelMoE, LocalExperts, grouped_linear, use_grouped_experts
from flywheel.rl.learner import Learner, LearnerConfig

# hidden and expert width multiples of 32: MXFP8 scales blocks of 32 along each GEMM's inner dim
TINY = ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, num_experts=4,
                   experts_per_token=2, moe_intermediate_size=64)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def expert_pass(precision: str, x: torch.Tensor, experts: LocalExperts, counts: list[int], probe: torch.Tensor):
    experts.precision = precision
    experts.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    out = experts(x, counts)
    (out.float() * probe).sum().backward()
    return out.detach().float(), x.grad.float(), experts.gate_up_proj.grad.clone(), experts.down_proj.grad.clone()


def gemm_against_bf16(precision: str, device: str = "cpu") -> tuple[dict[str, float], torch.Tensor]:
    """One grouped GEMM forward and backward over uneven groups (one empty) in bf16 and in
    `precision`: the SQNR in dB of the output and both gradients, and the weight gradient."""
    g = torch.Generator().manual_seed(0)
    counts = [96, 0, 200, 40]  # uneven groups, one empty, none but the first a multiple of 16 or 32
    x = torch.randn(sum(counts), 128, generator=g).to(device)
    w = (torch.randn(4, 256, 128, generator=g) * 128 ** -0.5).to(device)  # [experts, out, in]
    probe = torch.randn(sum(counts), 256, generator=g).to(device)
    results = []
    for p in ("bf16", precision):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = grouped_linear(xi, wi, counts, p)
        (out.float() * probe).sum().backward()
        results.append((out.detach().float(), xi.grad, wi.grad))
    (ref_out, ref_dx, ref_dw), (out, dx, dw) = results
    assert out.shape == ref_out.shape
    return ({"output": float(compute_error(ref_out, out)), "input_grad": float(compute_error(ref_dx, dx)),
             "weight_grad": float(compute_error(ref_dw, dw))}, dw)


def test_mxfp8_grouped_gemm_error_is_within_torchao_bounds():
    sqnr, _ = gemm_against_bf16("mxfp8")
    assert sqnr["output"] >= 27.0 and sqnr["input_grad"] >= 25.0 and sqnr["weight_grad"] >= 24.0, sqnr
    assert sqnr["output"] < 60.0, sqnr  # it is quantized: not the bf16 path taken twice


def test_fp8_on_a_cpu_says_what_it_needs():
    x, w = torch.randn(32, 64), torch.randn(2, 64, 64)
    with pytest.raises(ValueError, match="needs a CUDA GPU of compute capability 8.9"):
        grouped_linear(x, w, [16, 16], "fp8")


FP8_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.skipif(not FP8_GPU, reason="needs a CUDA GPU with FP8 tensor cores (sm89+)")
def test_fp8_grouped_gemm_on_a_gpu_error_is_bounded():
    sqnr, dw = gemm_against_bf16("fp8", "cuda")
    # float8_e4m3 with a scale per row: about 3 significant bits fewer than bf16's 8
    assert min(sqnr.values()) >= 20.0, sqnr
    assert sqnr["output"] < 60.0, sqnr  # it is quantized: not the bf16 path taken twice
    assert float(dw[1].abs().max()) == 0.0  # the empty group's weight gets no gradient (padding adds none)


@pytest.mark.skipif(not FP8_GPU, reason="needs a CUDA GPU with FP8 tensor cores (sm89+)")
def test_a_gpu_learner_step_in_fp8_and_mxfp8_tracks_bf16():
    tok = train_tokenizer(["def add(a, b):\n    return a + b\n"] * 10, vocab_size=300)
    batch, advantages = synthetic_batch(len(tok), 4, 48), [1.0, -1.0, 1.0, -1.0]
    first = {}
    for precision in ("bf16", "fp8", "mxfp8"):
        model = use_grouped_experts(build_model(TINY, tok), precision).cuda()
        metrics = Learner(model, LearnerConfig(lr=3e-3)).train_step(batch, advantages)
        first[precision] = (metrics["loss"], metrics["grad_norm"])
    (loss, norm) = first["bf16"]
    assert norm > 0.01, first  # a step that moves something, so tracking it means something
    for precision in ("fp8", "mxfp8"):
        assert abs(first[precision][0] - loss) < 1e-3, first
        assert abs(first[precision][1] - norm) < 0.05 * norm, first  # the gradient, within 5%


def test_mxfp8_expert_layer_error_is_bounded():
    g = torch.Generator().manual_seed(0)
    hidden, inter, n_experts = 128, 64, 4
    experts = LocalExperts(torch.randn(n_experts, 2 * inter, hidden, generator=g) * hidden ** -0.5,
                           torch.randn(n_experts, hidden, inter, generator=g) * inter ** -0.5, torch.nn.SiLU())
    counts = [96, 0, 200, 40]  # uneven groups, one empty, none a multiple of 32 but the first
    x = torch.randn(sum(counts), hidden, generator=g)
    probe = torch.randn(sum(counts), hidden, generator=g)
    ref = expert_pass("bf16", x, experts, counts, probe)
    mx = expert_pass("mxfp8", x, experts, counts, probe)
    sqnr = {name: float(compute_error(r, m)) for name, r, m in
            zip(("output", "input_grad", "gate_up_grad", "down_grad"), ref, mx, strict=True)}
    assert min(sqnr.values()) >= 21.0, sqnr


def test_grouped_experts_equal_the_dense_block():
    tok = train_tokenizer(["def add(a, b):\n    return a + b\n"] * 10, vocab_size=300)
    model = build_model(TINY, tok)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    block = model.model.layers[0].mlp
    assert isinstance(block, Qwen3MoeSparseMoeBlock)
    grouped = ExpertParallelMoE(block, None, 0, 1, "native")
    x = torch.randn(2, 9, TINY.hidden_size)
    torch.testing.assert_close(grouped(x), block(x), rtol=1e-5, atol=1e-6)
    assert set(grouped.state_dict()) == set(block.state_dict())  # loads 1:1


def losses(precision: str, steps: int) -> list[float]:
    tok = train_tokenizer(["def add(a, b):\n    return a + b\n"] * 10, vocab_size=300)
    model = use_grouped_experts(build_model(TINY, tok), precision)
    learner = Learner(model, LearnerConfig(lr=3e-3))
    batch = synthetic_batch(len(tok), 4, 48)
    advantages = [1.0, -1.0, 1.0, -1.0]
    return [learner.train_step(batch, advantages)["loss"] for _ in range(steps)]


def test_short_mxfp8_training_run_tracks_bf16():
    bf16, mx = losses("bf16", 8), losses("mxfp8", 8)
    assert bf16[-1] < bf16[0] - 0.05  # the run learns, so tracking it means something
    gaps = [abs(a - b) for a, b in zip(bf16, mx, strict=True)]
    # measured: the loss falls by 0.067 over 8 steps and the two runs stay within 1e-4 (0.15% of it)
    assert max(gaps) < 0.02 * (bf16[0] - bf16[-1]), (bf16, mx)
