"""Learner step time by micro-batch size: one GRPO batch of agent-length trajectories, trained at each
`--micro-batch-tokens` on `--threads` cores.

    python bench/learner.py                                   # ~2 min on 2 cores
    python bench/learner.py --threads 1,2 --micro-batch-tokens 512,1024,8192

Prints one JSON object on stdout; progress goes to stderr.

The batch is `--trajectories` episodes of the embedded default model, their lengths drawn from a
lognormal like the bootstrapped policy's rollouts (median 650 tokens, a third of them generated).
`micro_batch_tokens` does not change the gradient (the Learner's tests check that); it only decides
how many padded tokens each forward and backward holds. `speedup_vs_<baseline>` is each setting's
time against `--baseline` (the previous default, 8192) on the same batch, thread count and process,
best of `--repeats` in alternating order.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time

import torch

from flywheel.agent.trajectory import Status, Trajectory
from flywheel.model.factory import ModelConfig, build_model
from flywheel.model.tokenizer import train_tokenizer
from flywheel.rl.learner import Learner, LearnerConfig


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def batch(vocab: int, n: int, rng: random.Random) -> list[Trajectory]:
    """Episodes with a prompt, then generated turns and tool results alternating; behaviour logprobs
    of a plausible size (their values change the loss, not the work)."""
    out = []
    for i in range(n):
        length = min(4096, max(64, int(rng.lognormvariate(math.log(650), 0.35))))
        prompt = length // 3
        mask = [0] * prompt
        while len(mask) < length:
            mask += [1] * min(rng.randint(30, 90), length - len(mask))  # an assistant turn
            mask += [0] * min(rng.randint(20, 120), length - len(mask))  # its tool result
        tokens = [rng.randrange(vocab) for _ in range(length)]
        out.append(Trajectory(task_id=f"t{i}", family="bench", tokens=tokens, loss_mask=mask,
                              logprobs=[-1.5 if m else 0.0 for m in mask], versions=[0 if m else -1 for m in mask],
                              prompt_len=prompt, status=Status.FINISHED, reward=float(i % 2),
                              reward_parts={"all_passed_bonus": float(i % 2)},
                              turns=4, tool_calls=3, invalid_tool_calls=0, asked_question=False, group_id=f"g{i // 8}"))
    return out


def step_seconds(model_state: dict, make_model, trajectories, advantages, threads: int, micro: int) -> float:
    model = make_model()
    model.load_state_dict(model_state)
    learner = Learner(model.train(), LearnerConfig(lr=1e-6, threads=threads, micro_batch_tokens=micro))
    t0 = time.perf_counter()
    learner.train_step(trajectories, advantages)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", default="1,2", help="comma-separated intra-op thread counts")
    parser.add_argument("--micro-batch-tokens", default="512,1024,2048,4096,8192")
    parser.add_argument("--baseline", type=int, default=8192)
    parser.add_argument("--trajectories", type=int, default=32, help="one learner batch (groups_per_step x group_size)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--vocab", type=int, default=2927, help="the bootstrapped policy's vocabulary size")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    micros = sorted({int(m) for m in args.micro_batch_tokens.split(",")} | {args.baseline})
    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz_") for _ in range(rng.randint(3, 12))) for _ in range(4000)]
    tokenizer = train_tokenizer([" ".join(rng.sample(words, 200)) for _ in range(400)], vocab_size=args.vocab)

    def make_model():
        return build_model(ModelConfig(), tokenizer)

    state = make_model().state_dict()
    trajectories = batch(len(tokenizer), args.trajectories, rng)
    advantages = [t.reward - 0.5 for t in trajectories]
    tokens = sum(len(t.tokens) for t in trajectories)
    log(f"{len(trajectories)} trajectories, {tokens} tokens")
    step_seconds(state, make_model, trajectories[:4], advantages[:4], threads[0], 1024)  # warm-up
    result: dict = {"trajectories": len(trajectories), "tokens": tokens, "vocab": len(tokenizer),
                    "baseline_micro_batch_tokens": args.baseline,
                    "repeats": args.repeats, "torch": torch.__version__, "threads": {}}
    for n in threads:
        runs: dict[int, list[float]] = {m: [] for m in micros}
        for r in range(args.repeats):
            for m in micros if r % 2 == 0 else reversed(micros):
                runs[m].append(step_seconds(state, make_model, trajectories, advantages, n, m))
        best = {m: min(s) for m, s in runs.items()}
        result["threads"][str(n)] = {
            "seconds": {str(m): round(s, 3) for m, s in best.items()},
            "tokens_per_s": {str(m): round(tokens / s) for m, s in best.items()},
            f"speedup_vs_{args.baseline}": {str(m): round(best[args.baseline] / s, 2) for m, s in best.items()},
        }
        log(f"threads {n}: " + ", ".join(f"{m}: {s:.2f} s" for m, s in best.items()))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
