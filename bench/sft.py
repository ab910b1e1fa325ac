"""SFT recipe benchmark: which prompt, loss weights, model shape and batch size learn the most in a
fixed time on 2 cores.

    python bench/sft.py                                 # the bootstrap's recipe against the others, 100 s each
    python bench/sft.py --seconds 60 --variants base,previous_recipe

Every variant trains a fresh model for the same wall-clock budget on the same demonstrations
(the scripted expert on level-1 training tasks, the bootstrap's defaults) and is scored on held-out
demonstrations it never saw:

- `held_loss`: next-token loss per assistant token (what SFT minimizes);
- `copy_loss`: the same on the assistant tokens that must be copied from the context: tokens found
  in fewer than a tenth of the training demonstrations (package, module and function names, paths)
  that already appeared earlier in the demonstration. A policy that cannot copy cannot pass a task,
  whatever its loss on the rest: before the bootstrap's recipe, the copy loss stayed near the
  entropy of a uniform guess among the names, and no held-out task was solved.

Variants that put the tool schemas in the prompt get their own tokenizer (trained the same way,
on the same demonstrations rendered with the schemas); losses are per token of each.

Prints one JSON object on stdout, each variant with `vs_base` (its loss over the base's: below 1
is better); progress goes to stderr. Run it on a quiet machine: the budget is wall-clock time.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

import torch

from flywheel.env.pool import SandboxPool
from flywheel.model.chat import render_messages, tool_schemas
from flywheel.model.conversation import ConversationEncoder
from flywheel.model.factory import ModelConfig, build_model, parameter_count
from flywheel.model.tokenizer import train_tokenizer
from flywheel.rl.bootstrap import BootstrapConfig, train_tasks
from flywheel.rl.sft import (
    SFTConfig,
    masked_ce_loss,
    rare_tokens,
    repeats_rare,
    train_sft,
)
from flywheel.sim.expert import demonstrations

OLD_SHAPE = {"num_layers": 4, "num_heads": 4, "num_kv_heads": 2, "head_dim": 32}
NO_WEIGHTS = {"context_loss_weight": 0.0, "copy_weight": 1.0}
# name -> (model overrides, sft overrides, tool schemas in the prompt)
VARIANTS: dict[str, tuple[dict, dict, bool | None]] = {
    "base": ({}, {}, None),  # the bootstrap's defaults
    "tools_in_prompt": ({}, {}, True),
    "no_copy_weight": ({}, {"copy_weight": 1.0}, None),
    "no_context_loss": ({}, {"context_loss_weight": 0.0}, None),
    "previous_recipe": ({}, NO_WEIGHTS, True),  # the bootstrap's recipe before prompt and weights changed
    "batch8192": ({}, {"batch_tokens": 8192}, None),
    "four_layers": (OLD_SHAPE, {}, None),
    "old_recipe": (OLD_SHAPE, {**NO_WEIGHTS, "batch_tokens": 8192}, True),
}


def copied_mask(tokens: list[int], mask: list[int], rare: set[int]) -> list[int]:
    """1 on assistant tokens that repeat a rare token from earlier in the sequence."""
    return [int(bool(m) and copied) for m, copied in zip(mask, repeats_rare(tokens, rare), strict=True)]


def held_out_losses(model, examples, rare: set[int]) -> dict[str, float]:
    totals = {"held_loss": [0.0, 0], "copy_loss": [0.0, 0]}
    with torch.no_grad():
        for tokens, mask in examples:
            ids, attn = torch.tensor([tokens]), torch.ones(1, len(tokens), dtype=torch.long)
            for key, weights in (("held_loss", mask), ("copy_loss", copied_mask(tokens, mask, rare))):
                loss, n = masked_ce_loss(model, ids, torch.tensor([weights]), attn)
                totals[key][0] += loss.item()
                totals[key][1] += int(n)
    return {k: round(s / max(n, 1), 4) for k, (s, n) in totals.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=100.0, help="SFT wall-clock budget per variant")
    parser.add_argument("--variants", default="base,tools_in_prompt,no_copy_weight,no_context_loss,previous_recipe")
    parser.add_argument("--held-out", type=int, default=24, help="demonstrations kept out of training")
    args = parser.parse_args()
    names = args.variants.split(",")
    if "base" not in names or any(n not in VARIANTS for n in names):
        sys.exit(f"--variants must include base; known: {', '.join(VARIANTS)}")
    torch.set_num_threads(2)
    config = BootstrapConfig()
    start = time.perf_counter()
    with SandboxPool(config.pool) as pool:
        demos = demonstrations(train_tasks(config), pool, mistake_rate=config.demo_mistake_rate, seed=config.seed)
    random.Random(0).shuffle(demos)
    train, held = demos[: -args.held_out], demos[-args.held_out:]
    print(f"demonstrations: {len(demos)} in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    encoded: dict[bool, tuple] = {}  # tools in prompt -> (tokenizer, train examples, held-out examples, rare tokens)

    def encode(with_tools: bool) -> tuple:
        if with_tools not in encoded:
            schemas = tool_schemas() if with_tools else None
            tokenizer = train_tokenizer([render_messages(m, schemas) for m in train], vocab_size=config.vocab_size,
                                        tools_in_prompt=with_tools)
            encoder = ConversationEncoder(tokenizer)
            train_examples = [encoder.conversation(m) for m in train]
            encoded[with_tools] = (tokenizer, train_examples, [encoder.conversation(m) for m in held],
                                   rare_tokens(train_examples, config.sft.copy_rare_share))
        return encoded[with_tools]

    results = {}
    for name in names:
        model_over, sft_over, with_tools = VARIANTS[name]
        with_tools = config.tools_in_prompt if with_tools is None else with_tools
        tokenizer, train_examples, held_examples, rare = encode(with_tools)
        model = build_model(ModelConfig(**{**config.model.model_dump(), **model_over}), tokenizer)
        sft = SFTConfig(**{**config.sft.model_dump(), **sft_over})
        print(f"{name}: training {args.seconds:.0f} s", file=sys.stderr)
        metrics = train_sft(model, train_examples, sft, tokenizer.pad_token_id, time_budget_s=args.seconds)
        results[name] = {**held_out_losses(model, held_examples, rare), "steps": int(metrics["sft_steps"]),
                         "tokens_per_s": round(metrics["sft_tokens_per_s"]), "tools_in_prompt": with_tools,
                         "parameters": parameter_count(model), "model": model_over, "sft": sft_over}
        print(f"{name}: {results[name]}", file=sys.stderr)
    for r in results.values():
        r["vs_base"] = {k: round(r[k] / results["base"][k], 3) for k in ("held_loss", "copy_loss")}
    print(json.dumps({"seconds_per_variant": args.seconds, "train_demonstrations": len(train),
                      "held_out_demonstrations": len(held), "variants": results}, indent=2))


if __name__ == "__main__":
    main()
