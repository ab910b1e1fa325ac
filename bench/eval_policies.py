"""A run's saved policies on a held-out set of any size, each paired with its start: is the lift real?

    python bench/eval_policies.py --registry runs/v0/registry --tasks-per-family 96 \
        runs/learning/seed-0/run/policies/step-00005.pt runs/learning/seed-0/run/policies/step-00010.pt

The demo and `bench/learning.py` evaluate on 96 held-out tasks (24 a family), where a paired 95%
interval needs a change of about +0.06 to exclude zero. This evaluates the start (`--checkpoint`
of `--registry`) and each saved policy (`train.save_policy_every`, loaded over the start's model)
greedily on `--tasks-per-family` tasks a family (the 96 are a prefix of any larger set), with the
demo's episode settings (`--config`, `--set`), and prints one JSON line per policy: its pass rate,
its change from the start with the paired interval (`paired_lift`), tasks gained and lost, seconds.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `bench.learning` when run as a script
from bench.learning import held_out  # noqa: E402
from flywheel.agent.evaluate import paired_lift  # noqa: E402
from flywheel.config import load_config  # noqa: E402
from flywheel.demo import DemoConfig  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("policies", nargs="*", type=Path, help="saved policies (step-NNNNN.pt) of runs from the start")
    parser.add_argument("--registry", type=Path, required=True, help="the registry holding the start checkpoint")
    parser.add_argument("--checkpoint", type=int, default=0)
    parser.add_argument("--tasks-per-family", type=int, default=96)
    parser.add_argument("--config", default="configs/demo.toml", help="a demo config; its [train] sets the episodes")
    parser.add_argument("--set", action="append", default=[], help="a DemoConfig override, train.key=value")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = load_config(DemoConfig, args.config, [*args.set, f"train.eval_tasks_per_family={args.tasks_per_family}"])
    t0 = time.perf_counter()
    start, _ = held_out(config.train, args.registry, args.checkpoint, 1)
    print(json.dumps({"policy": f"v{args.checkpoint}", "tasks": len(start["per_task"]), "greedy": start["pass_rate"],
                      "seconds": round(time.perf_counter() - t0, 1)}), flush=True)
    for path in args.policies:
        t0 = time.perf_counter()
        after, _ = held_out(config.train, args.registry, args.checkpoint, 1, weights=path)
        print(json.dumps({"policy": str(path), "greedy": after["pass_rate"], "lift": paired_lift(start, after),
                          "seconds": round(time.perf_counter() - t0, 1)}, default=str), flush=True)


if __name__ == "__main__":
    main()
