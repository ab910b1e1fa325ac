"""Hinted self-distillation against reward-only cycles: the same simulated users, several seeds, paired.

    python bench/feedback_distill.py                          # 3 seeds x 2 cycles (~35 min on 2 busy cores)
    python bench/feedback_distill.py --seeds 2 --cycles 3 --weight 0.5

Prints one JSON object on stdout; progress goes to stderr.

The world is the scenario world (flywheel/sim/scenario.py, configs/scenario_hostile_hints.toml for
the cycle, gate and monitor settings) with honest users: every dissatisfied follow-up says what went
wrong in the users' words, vague or wrong in the default shares (flywheel/sim/feedback.py), none
hostile. For each seed, one start policy (SFT-ed from that seed) and two arms from it in fresh
stores: "distill" (learner.loss.distill.weight = --weight, the shipped drop rule) and "reward" (the
reward alone), each running --cycles cycles with continuous deployment (promote_when = "gate"),
then measured on --measure-sessions sessions of the final production.

Reported per cycle k (the production of cycle k's batch window: k = 1 is the start policy in both
arms; "end" is the final production's measurement): each arm's dissatisfied-follow-up rate,
persistence and latency (ms) per seed, and the paired difference distill - reward with its 95 % t
interval over seeds (`flywheel.stats.mean_interval`; seeds are the pairs, so it needs >= 2). A
difference is significant at this traffic when its interval excludes 0. Also the arms' distillation
figures per cycle (hints, kept, dropped share, distill_loss).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from flywheel.config import load_config
from flywheel.env.pool import SandboxPool
from flywheel.rl.loss import DistillConfig
from flywheel.sim.scenario import ScenarioConfig, run_arm, start_policy
from flywheel.stats import mean_interval

METRICS = ("dissatisfied", "persistence", "latency")
CONFIG = Path("configs/scenario_hostile_hints.toml")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def seed_config(args: argparse.Namespace, seed: int, root: Path) -> ScenarioConfig:
    base = load_config(ScenarioConfig, CONFIG, [])
    honest = base.population.profiles[0].model_copy(update={"name": "dev", "followup_hostile_share": 0.0})
    start = base.start.model_copy(update={"seed": seed, "corrections": args.corrections, "told": args.told,
                                          "sft": base.start.sft.model_copy(update={"steps": args.sft_steps})})
    return base.model_copy(update={
        "name": f"feedback_distill/s{seed}", "cycles": args.cycles, "measure_sessions": args.measure_sessions,
        "run_dir": root / f"s{seed}", "start": start,
        "population": base.population.model_copy(update={"seed": seed, "profiles": [honest]}),
        "naive_distill": DistillConfig(weight=args.weight, min_gain=args.min_gain, max_call_drop=args.max_call_drop,
                                       hint_at=args.hint_at, min_kept=args.min_kept),
        "live": base.live.model_copy(update={"seed": seed}),
    })


def paired(by_seed: list[dict[str, dict]], cycles: int) -> dict[str, dict]:
    """Per cycle and metric: each arm's values by seed and distill - reward with its t interval."""
    out: dict[str, dict] = {}
    for k in [*[str(i) for i in range(1, cycles + 1)], "end"]:
        row = {}
        for metric in METRICS:
            d = [s["distill"][k].get(metric) for s in by_seed]
            r = [s["reward"][k].get(metric) for s in by_seed]
            diffs = [a - b for a, b in zip(d, r, strict=True) if a is not None and b is not None]
            entry = {"distill": d, "reward": r, "difference": None, "ci": None, "significant": None}
            if len(diffs) >= 2:
                est, low, high = mean_interval(diffs)
                entry |= {"difference": est, "ci": [low, high], "significant": low > 0 or high < 0}
            row[metric] = entry
        out[k] = row
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--cycles", type=int, default=2)
    parser.add_argument("--weight", type=float, default=1.0)
    parser.add_argument("--min-gain", type=float, default=DistillConfig().min_gain)
    parser.add_argument("--max-call-drop", type=float, default=DistillConfig().max_call_drop,
                        help="the tool-use guard (DistillConfig.max_call_drop); a large value turns it off")
    parser.add_argument("--min-kept", type=int, default=DistillConfig().min_kept,
                        help="the floor (DistillConfig.min_kept): fewer hints through the rule in a batch distil none")
    parser.add_argument("--measure-sessions", type=int, default=64)
    parser.add_argument("--sft-steps", type=int, default=500)
    parser.add_argument("--hint-at", choices=("answer", "turn"), default=DistillConfig().hint_at,
                        help="DistillConfig.hint_at: the answer a follow-up is tied to, or its whole turn")
    parser.add_argument("--told", type=float, default=0.0,
                        help="StartPolicyConfig.told: edit demonstrations after a second user message saying what "
                             "the file should say")
    parser.add_argument("--corrections", type=float, default=0.0,
                        help="share of the start policy's edit demonstrations that correct a wrong edit after "
                             "the user's follow-up (StartPolicyConfig.corrections): a start policy that acts on "
                             "what users say")
    args = parser.parse_args()
    torch.set_num_threads(1)
    started = time.perf_counter()
    root = Path(tempfile.mkdtemp(prefix="flywheel-feedback-distill-"))
    by_seed, distill_figures = [], []
    try:
        for seed in range(args.seeds):
            config = seed_config(args, seed, root)
            with SandboxPool(config.live.pool) as pool:
                model, tokenizer, _ = start_policy(config.start, pool, log=lambda m, s=seed: log(f"[s{s}] {m}"))
                arms = {name: run_arm(config, arm, model, tokenizer, pool, log=log)
                        for name, arm in (("distill", "naive"), ("reward", "default"))}
            by_seed.append({name: {**{str(c["cycle"]): c["served"] for c in a.cycles}, "end": a.end_served}
                            for name, a in arms.items()})
            distill_figures.append([c["distill"] for c in arms["distill"].cycles])
            log(f"[s{seed}] done at {time.perf_counter() - started:.0f} s: "
                + json.dumps({n: by_seed[-1][n]["end"] for n in arms}))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result = {"seeds": args.seeds, "cycles": args.cycles, "weight": args.weight, "min_gain": args.min_gain,
              "max_call_drop": args.max_call_drop,
              "measure_sessions": args.measure_sessions, "sft_steps": args.sft_steps, "corrections": args.corrections,
              "told": args.told, "hint_at": args.hint_at,
              "by_cycle": paired(by_seed, args.cycles), "distill_by_seed": distill_figures,
              "seconds": time.perf_counter() - started}
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
