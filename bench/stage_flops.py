"""Each stage against the hardware: the engine's decode and prefill and the Learner's step, as FLOP/s
and as a fraction of this device's fp32 matmul rate, at large shapes and at each stage's own shapes,
all measured in the same run.

    python bench/stage_flops.py                     # CPU, 1 thread (a role's share of the demo's 2 cores)
    python bench/stage_flops.py --threads 2
    python bench/stage_flops.py --device cuda       # bench/gpu_check.sh runs this

Prints one JSON object on stdout; progress goes to stderr.

The model is the embedded default (`ModelConfig()`, `--vocab` tokens, random weights: speed does not
depend on them) or `--shape large` (bench/engine_costs.py's cluster-shaped MoE). FLOPs per token come
from the model config, counting the matmuls (2 FLOPs per multiply-add) and nothing else (norms,
RoPE, softmax, routing's top-k and the expert gather are extra work the rate does not credit):

    per layer, per token     projections  2 H (n_h d + 2 n_kv d) + 2 (n_h d) H     (q, k, v, o)
                             router       2 H E
                             experts      k (2 H 2I + 2 I H)                       (top-k of E, gate+up, down)
                             attention    4 n_h d c                                (QK^T and AV over c positions)
    output head              2 H V        per position whose logits are computed

    engine decode, context c:                 L (layer at c) + head
    engine prefill, prompt P:                 L (layer at (P + 1) / 2) + head / P   (logits of the last token only)
    Learner, sequence T, share s scored:      3 [L (layer at (T + 1) / 2) + s head] (backward = 2x forward)

with H hidden size, n_h / n_kv query / key-value heads of size d, E experts of which k are routed
to, I the expert intermediate size, L layers, V the vocabulary. On the embedded default (H 128, 2
layers, 8 heads of 16, 4 KV heads, 8 experts top-2, I 256, V 4,096) a decode token at context 700
is 2.75 MFLOP: 1.05 in the head, 0.79 in the experts, 0.72 in attention, 0.20 in the projections.

Each stage's own matmul rate times the same matmuls the stage runs (their shapes, from the config,
the batch and the context; a layer's set times `L`; for the Learner also the two backward matmuls of
each), back to back on preallocated tensors: the best a stage could do if it were only its matmuls.
Its achieved FLOP/s over that rate is the share lost to everything else (Python, dispatch, copies,
the small ops between the matmuls); over the large-shape rate, what its shapes cost on top.

Measured (`--threads 1`, the share of a role in the demo, and `--threads 2`) in the docs (docs/throughput.md).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch

from flywheel.agent.trajectory import Status, Trajectory
from flywheel.model.engine import EngineConfig, LocalEngine, SamplingParams
from flywheel.model.factory import ModelConfig, build_model, parameter_count
from flywheel.model.tokenizer import train_tokenizer
from flywheel.rl.learner import Learner, LearnerConfig

LARGE = ModelConfig(hidden_size=1024, num_layers=12, num_heads=16, num_kv_heads=4, head_dim=64, num_experts=32,
                    experts_per_token=4, moe_intermediate_size=512)  # as bench/engine_costs.py's


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---- FLOPs per token, from the config (module docstring)


def layer_flops(m: ModelConfig, context: float) -> float:
    """One layer's matmul FLOPs for one token attending to `context` positions."""
    h, q, kv = m.hidden_size, m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    projections = 2 * h * (q + 2 * kv) + 2 * q * h
    router = 2 * h * m.num_experts
    experts = m.experts_per_token * (2 * h * 2 * m.moe_intermediate_size + 2 * m.moe_intermediate_size * h)
    attention = 4 * q * context
    return projections + router + experts + attention


def head_flops(m: ModelConfig, vocab: int) -> float:
    return 2 * m.hidden_size * vocab


def decode_flops(m: ModelConfig, vocab: int, context: float) -> float:
    return m.num_layers * layer_flops(m, context) + head_flops(m, vocab)


def prefill_flops(m: ModelConfig, vocab: int, prompt: int) -> float:
    return m.num_layers * layer_flops(m, (prompt + 1) / 2) + head_flops(m, vocab) / prompt


def training_flops(m: ModelConfig, vocab: int, length: int, scored: float) -> float:
    return 3 * (m.num_layers * layer_flops(m, (length + 1) / 2) + scored * head_flops(m, vocab))


# ---- matmul rates


Shape = tuple[int, int, int, int]  # (batch, rows, inner, cols): [batch, rows, inner] @ [batch, inner, cols]


def stage_shapes(m: ModelConfig, vocab: int, rows: int, head_rows: int, sequences: int, queries: int,
                 context: int, backward: bool) -> list[Shape]:
    """The matmuls of one forward (a layer's `num_layers` times, then the head) over `rows` tokens:
    `sequences` sequences of `queries` new tokens attending to `context` positions; with `backward`,
    each linear's two backward matmuls (input and weight gradients) too."""
    h, q, kv, i = m.hidden_size, m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim, m.moe_intermediate_size
    per_expert = max(1, round(rows * m.experts_per_token / m.num_experts))
    linears = [(rows, h, q), (rows, h, kv), (rows, h, kv), (rows, q, h), (rows, h, m.num_experts)]
    linears += [(per_expert, h, 2 * i), (per_expert, i, h)] * m.num_experts
    attention = [(sequences * m.num_heads, queries, m.head_dim, context),  # QK^T
                 (sequences * m.num_heads, queries, context, m.head_dim)]  # AV
    if backward:
        attention *= 3
    layer = [(1, n, k, o) for n, k, o in linears] + attention
    if backward:
        layer += [(1, n, o, k) for n, k, o in linears] + [(1, k, n, o) for n, k, o in linears]
    head = [(1, head_rows, h, vocab)] + ([(1, head_rows, vocab, h), (1, h, head_rows, vocab)] if backward else [])
    return layer * m.num_layers + head


def matmul_rate(shapes: list[Shape], device: torch.device, min_s: float) -> float:
    """FLOP/s of `shapes` run back to back on preallocated fp32 tensors, best of 3 timings."""
    pairs = [(torch.randn(b, n, k, device=device), torch.randn(b, k, o, device=device)) for b, n, k, o in shapes]
    flops = sum(2 * b * n * k * o for b, n, k, o in shapes)

    def run() -> None:
        for a, w in pairs:
            torch.matmul(a, w)

    run()  # warm-up
    sync(device)
    t0 = time.perf_counter()
    run()
    sync(device)
    reps = max(1, int(min_s / max(time.perf_counter() - t0, 1e-6)))
    best = float("inf")
    for _ in range(3):
        sync(device)
        t0 = time.perf_counter()
        for _ in range(reps):
            run()
        sync(device)
        best = min(best, (time.perf_counter() - t0) / reps)
    return flops / best


# ---- the stages


def timed_generate(engine: LocalEngine, prompts: list[list[int]], max_tokens: int, device: torch.device) -> float:
    sync(device)
    t0 = time.perf_counter()
    engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=max_tokens, stop_token_ids=()))
    sync(device)
    return time.perf_counter() - t0


def engine_rates(model, vocab: int, batch: int, prompt: int, threads: int | None,
                 device: torch.device) -> tuple[float, float]:
    """(decode tokens/s at `batch` rows around context `prompt` + 48, prefill tokens/s of `batch`
    fresh prompts of `prompt` tokens); decode from the difference of 80- and 16-token generations,
    so that the prefill cancels out."""
    gen = torch.Generator().manual_seed(0)
    config = EngineConfig(max_batch=batch, max_prefill_per_step=batch, threads=threads, prompt_cache=0)
    with LocalEngine(model, config) as engine:
        def prompts() -> list[list[int]]:
            return torch.randint(10, vocab, (batch, prompt), generator=gen).tolist()

        timed_generate(engine, prompts(), 4, device)  # warm-up
        decode = []
        for _ in range(2):
            short = timed_generate(engine, prompts(), 16, device)
            long = timed_generate(engine, prompts(), 80, device)
            decode.append((long - short) / 64)
        prefill = min(timed_generate(engine, prompts(), 1, device) for _ in range(3))
    return batch / min(decode), batch * prompt / prefill


def learner_rate(model, sequences: int, length: int, scored: float, micro_batch_tokens: int, threads: int | None,
                 repeats: int, device: torch.device) -> float:
    """Tokens/s of a Learner step on `sequences` trajectories of `length` tokens, `scored` of them
    generated (in turns after a prompt), the median of `repeats` after a warm-up."""
    g = torch.Generator().manual_seed(0)
    vocab = model.get_input_embeddings().num_embeddings
    prompt = int(length * (1 - scored))
    mask = [0] * prompt + [1] * (length - prompt)
    trajectories = [Trajectory(task_id=f"t{i}", family="f", tokens=torch.randint(10, vocab, (length,), generator=g)
                               .tolist(), loss_mask=mask, logprobs=[-1.0 if x else 0.0 for x in mask],
                               versions=[0 if x else -1 for x in mask], prompt_len=prompt, status=Status.FINISHED,
                               reward=0.0, reward_parts={}, turns=1, tool_calls=0, invalid_tool_calls=0,
                               asked_question=False, group_id="g") for i in range(sequences)]
    advantages = [0.5 - (i % 2) for i in range(sequences)]
    learner = Learner(model.train(), LearnerConfig(lr=1e-6, micro_batch_tokens=micro_batch_tokens, threads=threads))
    learner.train_step(trajectories, advantages)  # warm-up
    seconds = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        learner.train_step(trajectories, advantages)
        sync(device)
        seconds.append(time.perf_counter() - t0)
    model.eval()
    return sequences * length / statistics.median(seconds)


def against(name: str, tokens_per_s: float, flops_per_token: float, own: float, large: float) -> dict:
    achieved = tokens_per_s * flops_per_token
    log(f"{name}: {tokens_per_s:,.0f} tokens/s x {flops_per_token / 1e6:.2f} MFLOP = {achieved / 1e9:.2f} GFLOP/s; "
        f"{achieved / own:.0%} of its shapes' matmul rate ({own / 1e9:.1f}), {achieved / large:.0%} of the large "
        f"shapes' ({large / 1e9:.1f})")
    return {"tokens_per_s": round(tokens_per_s, 1), "mflop_per_token": round(flops_per_token / 1e6, 3),
            "achieved_gflop_s": round(achieved / 1e9, 2), "own_shapes_matmul_gflop_s": round(own / 1e9, 2),
            "fraction_of_own_shapes": round(achieved / own, 3), "fraction_of_large_shapes": round(achieved / large, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="CPU intra-op threads of every stage and matmul")
    parser.add_argument("--shape", choices=["default", "large"], default="default")
    parser.add_argument("--vocab", type=int, default=4096, help="the bootstrapped policy's vocabulary size")
    parser.add_argument("--batch", type=int, default=32, help="engine rows (the demo's concurrency)")
    parser.add_argument("--prompt", type=int, default=700, help="engine context: prompt tokens per row")
    parser.add_argument("--sequences", type=int, default=32, help="Learner batch (the demo's 4 groups of 8)")
    parser.add_argument("--length", type=int, default=700, help="tokens per Learner sequence")
    parser.add_argument("--scored", type=float, default=0.35, help="share of a sequence that is generated")
    parser.add_argument("--micro-batch-tokens", type=int, default=1024)
    parser.add_argument("--large-n", type=int, default=None,
                        help="the large matmul's size (default 2048 on a CPU, 8192 on a GPU)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--min-s", type=float, default=0.3, help="least seconds of each matmul-rate timing")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    m = LARGE if args.shape == "large" else ModelConfig()
    words = [f"w{i}" for i in range(args.vocab * 2)]
    tokenizer = train_tokenizer([" ".join(words[i::7]) for i in range(7)] * 3, vocab_size=args.vocab)
    vocab = len(tokenizer)
    model = build_model(m, tokenizer).to(device)
    log(f"{args.shape}: {parameter_count(model) / 1e6:.2f}M parameters, vocab {vocab}, on {device}, "
        f"{args.threads} thread(s)")

    large_n = args.large_n or (8192 if device.type == "cuda" else 2048)
    rate: Callable[[list[Shape]], float] = lambda shapes: matmul_rate(shapes, device, args.min_s)  # noqa: E731
    large = rate([(1, large_n, large_n, large_n)])
    log(f"fp32 matmul {large_n}^3: {large / 1e9:.1f} GFLOP/s")

    batch, prompt = args.batch, args.prompt
    decode_tps, prefill_tps = engine_rates(model, vocab, batch, prompt, args.threads if device.type == "cpu" else None,
                                           device)
    context = prompt + 48  # the mean context of the timed decode steps (16 to 80 tokens past the prompt)
    decode_own = rate(stage_shapes(m, vocab, batch, batch, batch, 1, context, backward=False))
    prefill_own = rate(stage_shapes(m, vocab, batch * prompt, batch, batch, prompt, prompt, backward=False))
    learner_tps = learner_rate(model, args.sequences, args.length, args.scored, args.micro_batch_tokens,
                               args.threads if device.type == "cpu" else None, args.repeats, device)
    rows = max(args.length, args.micro_batch_tokens // args.length * args.length)  # one micro-batch's tokens
    learner_own = rate(stage_shapes(m, vocab, rows, int(rows * args.scored), rows // args.length, args.length,
                                    args.length, backward=True))
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "threads": args.threads, "torch": torch.__version__, "shape": args.shape, "model": m.model_dump(),
        "vocab": vocab, "parameters": parameter_count(model),
        "large_matmul": {"n": large_n, "gflop_s": round(large / 1e9, 2)},
        "engine_decode": against("engine decode", decode_tps, decode_flops(m, vocab, context), decode_own, large)
        | {"batch": batch, "context": context},
        "engine_prefill": against("engine prefill", prefill_tps, prefill_flops(m, vocab, prompt), prefill_own, large)
        | {"batch": batch, "prompt": prompt},
        "learner_step": against("Learner step", learner_tps, training_flops(m, vocab, args.length, args.scored),
                                learner_own, large)
        | {"sequences": args.sequences, "length": args.length, "scored": args.scored,
           "micro_batch_tokens": args.micro_batch_tokens},
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
