"""What sampling and training cost per token, on this machine's CPU or on a GPU: the costs
`bench/async_rl.py --costs FILE` replays in its modeled engine and learner.

    python bench/engine_costs.py                                  # CPU, the embedded default model
    python bench/engine_costs.py --device cuda --shapes default,large --out costs.json

For each model shape (`default`: the checkpoint's own model; `large`: a wider, deeper MoE of the
same family, built with random weights, closer to what a cluster serves), with the real
LocalEngine and Learner:

- `decode_step_s`: seconds per decode step at each batch size, from the difference of two
  generations (80 and 16 new tokens) of the same prompts, so the prefill cancels out. The modeled
  engine assumes a step costs the same at any batch size up to its slots; this shows how far that
  holds on the device measured.
- `prefill_s_per_token`: one prefill of `batch` prompts of `--prompt-tokens` tokens, per token.
- `learner_s_per_token`: one train step on 8 trajectories of 1,200 tokens (300 generated), per
  token; the median of `--repeats` steps after a warm-up step.

Prints one JSON object on stdout (and writes it to `--out`); progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from flywheel.agent.trajectory import Status, Trajectory
from flywheel.model.engine import EngineConfig, LocalEngine, SamplingParams
from flywheel.model.factory import ModelConfig, build_model, parameter_count
from flywheel.model.registry import Registry
from flywheel.rl.learner import Learner, LearnerConfig

# A cluster-shaped MoE of the same family: 8x the embedded default's width, 6x its depth, 32 experts
# top-4 (parameter counts are printed).
LARGE = ModelConfig(hidden_size=1024, num_layers=12, num_heads=16, num_kv_heads=4, head_dim=64, num_experts=32,
                    experts_per_token=4, moe_intermediate_size=512)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_generate(engine: LocalEngine, prompts: list[list[int]], max_tokens: int, device: torch.device) -> float:
    sync(device)
    t0 = time.perf_counter()
    # no stop tokens, so every row runs to max_tokens
    engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=max_tokens, stop_token_ids=()))
    sync(device)
    return time.perf_counter() - t0


def decode_costs(model, vocab: int, batches: list[int], prompt_tokens: int, device: torch.device) -> dict:
    """Decode step seconds per batch size, and prefill seconds per token at the largest batch."""
    gen = torch.Generator().manual_seed(0)
    out: dict = {"decode_step_s": {}, "tokens_per_s": {}}
    with LocalEngine(model, EngineConfig(max_batch=max(batches), max_prefill_per_step=max(batches))) as engine:
        for batch in batches:
            prompts = torch.randint(10, vocab, (batch, prompt_tokens), generator=gen).tolist()
            timed_generate(engine, prompts, 4, device)  # warm-up: allocator, kernels, first-call paths
            short = timed_generate(engine, prompts, 16, device)
            long = timed_generate(engine, prompts, 80, device)
            step = (long - short) / 64
            out["decode_step_s"][str(batch)] = step
            out["tokens_per_s"][str(batch)] = batch / step
            log(f"  batch {batch:>3}: decode step {step * 1e3:.2f} ms, {batch / step:,.0f} tokens/s")
        batch = max(batches)
        prompts = torch.randint(10, vocab, (batch, prompt_tokens), generator=gen).tolist()
        out["prefill_s_per_token"] = timed_generate(engine, prompts, 1, device) / (batch * prompt_tokens)
        log(f"  prefill {out['prefill_s_per_token'] * 1e6:.2f} µs/token (batch {batch} x {prompt_tokens})")
    return out


def learner_cost(model, repeats: int, device: torch.device) -> float:
    """Seconds per trajectory token of one train step (8 trajectories, 900 prompt + 300 generated)."""
    trajs = [Trajectory(task_id="t", family="f", tokens=[5 + i] * 1200, loss_mask=[0] * 900 + [1] * 300,
                        logprobs=[0.0] * 900 + [-1.0] * 300, versions=[-1] * 900 + [0] * 300, prompt_len=900,
                        status=Status.FINISHED, reward=0.0, reward_parts={}, turns=1, tool_calls=0,
                        invalid_tool_calls=0, asked_question=False, group_id="g") for i in range(8)]
    learner = Learner(model.train(), LearnerConfig(lr=1e-6))
    advantages = [0.1 * (i % 2) for i in range(8)]
    learner.train_step(trajs, advantages)  # warm-up
    seconds = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        learner.train_step(trajs, advantages)
        sync(device)
        seconds.append(time.perf_counter() - t0)
    model.eval()
    return statistics.median(seconds) / sum(len(t.tokens) for t in trajs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--registry", default="runs/registry")
    parser.add_argument("--checkpoint", default="production", help="the default shape's model and every tokenizer")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shapes", default="default", help="comma-separated: default, large")
    parser.add_argument("--batches", default="1,8,32", help="decode batch sizes")
    parser.add_argument("--prompt-tokens", type=int, default=700)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="CPU intra-op threads")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    with Registry(args.registry) as registry:
        checkpoint = registry.get(args.checkpoint)
        default, tokenizer = registry.load(checkpoint.version)
    result: dict = {"device": (torch.cuda.get_device_name(device) if device.type == "cuda"
                               else platform.processor() or "cpu"),
                    "torch": torch.__version__, "checkpoint": checkpoint.version, "shapes": {}}
    batches = [int(b) for b in args.batches.split(",")]
    for shape in args.shapes.split(","):
        if shape not in ("default", "large"):
            raise SystemExit(f"unknown shape {shape!r}: use default or large")
        model = (default if shape == "default" else build_model(LARGE, tokenizer)).to(device)
        log(f"{shape}: {parameter_count(model) / 1e6:.1f}M parameters on {device}")
        costs = decode_costs(model, len(tokenizer), batches, args.prompt_tokens, device)
        costs["learner_s_per_token"] = learner_cost(model, args.repeats, device)
        log(f"  learner {costs['learner_s_per_token'] * 1e6:.2f} µs/token")
        costs["parameters"] = parameter_count(model)
        result["shapes"][shape] = costs
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
