"""tinker-cookbook's supervised trainer, unmodified, on one of flywheel's task families through
`flywheel tinker serve`: does a Tinker recipe learn flywheel's tasks here?

    python bench/tinker_sl.py                          # bugfix, 48 train / 16 held-out demonstrations
    python bench/tinker_sl.py --family implement --epochs 3

The scripted expert plays the family's training tasks in sandboxes (the bootstrap's demonstrations);
its episodes, as chat conversations, are the cookbook's JSONL dataset (`FromConversationFileBuilder`,
the conversation format of its `example_data`), with a held-out split. A fresh embedded model (the
bootstrap's tokenizer and shape, untrained) is the Registry's v0; the cookbook's `supervised.train`
trains a LoRA adapter on it through the SDK, against a server on loopback, and scores the held-out
conversations with its own evaluator (`test/nll`) before the first step and after the last.

The baseline is the same run's step-0 score (the untrained adapter is the base): `held_out_nll_ratio`
(final over step 0) below 1 means the recipe learnt the family here. Also printed: the training NLL
per step. Prints one JSON object on stdout; the cookbook's own log goes to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from flywheel.api.http import RunningServer
from flywheel.env.pool import SandboxPool
from flywheel.model.chat import render_messages
from flywheel.model.factory import ModelConfig, build_model
from flywheel.model.registry import Registry
from flywheel.model.tokenizer import load_tokenizer, train_tokenizer
from flywheel.rl.bootstrap import BootstrapConfig, train_tasks
from flywheel.sim.expert import demonstrations
from flywheel.tinker.server import TinkerConfig, create_app
from flywheel.tinker.service import TinkerService

MODEL = "production"
RENDERER = "qwen3_disable_thinking"  # ChatML, as flywheel's tokenizer speaks


def as_cookbook_conversation(messages: list[dict]) -> dict:
    """A flywheel demonstration in the cookbook's conversation format: the assistant's tool calls
    written into its text as flywheel's format writes them, tool results as user turns."""
    out = []
    for m in messages:
        content = m["content"]
        for call in m.get("tool_calls") or []:
            arguments = call["function"]["arguments"]
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
            content += "\n<tool_call>\n" + json.dumps({"name": call["function"]["name"], "arguments": arguments}) + \
                "\n</tool_call>"
        out.append({"role": "user" if m["role"] == "tool" else m["role"], "content": content})
    return {"messages": out}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--family", default="bugfix")
    parser.add_argument("--train", type=int, default=48)
    parser.add_argument("--held-out", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(2)
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    os.environ["TINKER_API_KEY"] = "tml-bench"
    import tinker  # noqa: PLC0415
    from tinker_cookbook.supervised import train  # noqa: PLC0415  (the cookbook: a dev dependency)
    from tinker_cookbook.supervised.data import FromConversationFileBuilder  # noqa: PLC0415
    from tinker_cookbook.supervised.nll_evaluator import SamplerNLLEvaluator  # noqa: PLC0415
    from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig  # noqa: PLC0415
    from tinker_cookbook.tokenizer_utils import get_tokenizer, register_tokenizer  # noqa: PLC0415

    started = time.monotonic()
    config = BootstrapConfig(families=[args.family], train_tasks_per_family=args.train + args.held_out)
    with SandboxPool(config.pool) as pool:
        demos = demonstrations(train_tasks(config)[: args.train + args.held_out], pool, seed=config.seed)
    demos_s = time.monotonic() - started
    work = Path(tempfile.mkdtemp(prefix="tinker-bench-"))
    data = work / "conversations.jsonl"
    # held-out first: the builder shuffles, then holds out `test_size`; the split is the cookbook's own
    data.write_text("".join(json.dumps(as_cookbook_conversation(m)) + "\n" for m in demos))
    tokenizer = train_tokenizer([render_messages(m) for m in demos], vocab_size=config.vocab_size,
                                tools_in_prompt=False)
    registry = Registry(work / "registry")
    registry.register(build_model(ModelConfig(), tokenizer), tokenizer, aliases=[MODEL])
    register_tokenizer(MODEL, lambda: load_tokenizer(registry.get(MODEL).path))
    server_config = TinkerConfig(registry=registry.root, root=work / "tinker", keys={"tml-bench": ["training",
                                                                                                   "sampling"]})
    service = TinkerService(registry, server_config.root)
    common = ChatDatasetBuilderCommonConfig(model_name_for_tokenizer=MODEL, renderer_name=RENDERER, max_length=4096,
                                            batch_size=args.batch)
    steps_per_epoch = args.train // args.batch
    trained = time.monotonic()
    with RunningServer(create_app(service, server_config)) as running:
        recipe = train.Config(
            log_path=str(work / "sl"), model_name=MODEL, recipe_name="flywheel_bench", renderer_name=RENDERER,
            dataset_builder=FromConversationFileBuilder(common_config=common, file_path=str(data),
                                                        test_size=args.held_out),
            learning_rate=args.lr, lora_rank=args.rank, base_url=running.url, num_epochs=args.epochs,
            save_every=0, eval_every=steps_per_epoch * args.epochs, infrequent_eval_every=0)
        asyncio.run(train.main(recipe))  # scores the held-out split before step 0 (eval_every)
        train_s = time.monotonic() - trained
        # ... and the same evaluator of the cookbook on the final sampler weights the recipe saved
        final = json.loads((work / "sl" / "checkpoints.jsonl").read_text().splitlines()[-1])["sampler_path"]
        sampler = tinker.ServiceClient(base_url=running.url).create_sampling_client(model_path=final).result()
        _, held_out = recipe.dataset_builder()
        evaluator = SamplerNLLEvaluator.from_dataset(held_out, tokenizer=get_tokenizer(MODEL))
        final_nll = asyncio.run(evaluator(sampler))["test/nll"]
    service.close()
    rows = [json.loads(line) for line in (work / "sl" / "metrics.jsonl").read_text().splitlines()]
    held = [r["test/nll"] for r in rows if "test/nll" in r][:1] + [final_nll]
    print(json.dumps({
        "family": args.family, "train_conversations": args.train, "held_out_conversations": args.held_out,
        "steps": sum("train_mean_nll" in r for r in rows), "lora_rank": args.rank, "learning_rate": args.lr,
        "train_nll": [round(r["train_mean_nll"], 4) for r in rows if "train_mean_nll" in r],
        "held_out_nll_step0": round(held[0], 4), "held_out_nll_final": round(held[-1], 4),
        "held_out_nll_ratio": round(held[-1] / held[0], 4),
        "demonstrations_s": round(demos_s, 1), "train_s": round(train_s, 1),
        "registered_versions": [c.version for c in registry.list()],
    }, indent=1))
    registry.close()
    print(f"work folder: {work}", file=sys.stderr)


if __name__ == "__main__":
    main()
