"""Harder draw or worse policy? A simulated-RL run's per-step draws (metrics.jsonl `draw`) read as a trend.

    python bench/draw_trend.py runs/demo/train                  # a run folder holding metrics.jsonl
    python bench/draw_trend.py runs/learning/seed-0/run --first 13

A step's training reward moves with what it drew as much as with the policy: in a 47-step run of
the demo's [train] its standard deviation over steps was 0.14 with no trend at all (docs/learning.md).
This prints, for each series below, its least-squares slope per step with a 95% interval and its
means over the run's thirds:

- `reward_mean`, `rollout_pass_rate`: what the run's log shows;
- `draw_expected`: the pass rate the step's draw would have at the run's average policy, each group
  counted at the mean pass rate of its (family, difficulty) cell over the whole run: the draw's
  difficulty alone;
- `pass_minus_expected`: the rollout pass rate less `draw_expected`, the policy's change with the
  draw's difficulty taken out. A policy getting worse on its own training tasks shows as a negative
  slope here; a harder draw shows in `draw_expected` instead.

Prints one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

Z95 = 1.959964


def trend(xs: list[float], ys: list[float]) -> dict[str, Any]:
    """Least-squares slope of ys on xs with its 95% normal interval, and the means over thirds."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    residuals = [y - my - slope * (x - mx) for x, y in zip(xs, ys, strict=True)]
    se = (sum(r * r for r in residuals) / (len(xs) - 2) / sxx) ** 0.5
    k = len(ys) // 3
    return {"slope_per_step": slope, "ci": [slope - Z95 * se, slope + Z95 * se],
            "thirds": [statistics.fmean(ys[:k]), statistics.fmean(ys[k:2 * k]), statistics.fmean(ys[2 * k:])]}


def draw_trend(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """The trends of a run's steps (module docstring); steps without a draw record are left out."""
    cells: dict[tuple[str, object], list[int]] = defaultdict(lambda: [0, 0])  # [passes, episodes]
    for step in steps:
        for group in step.get("draw", []):
            cell = cells[group["family"], group.get("difficulty")]
            cell[0] += group["passed"]
            cell[1] += group["episodes"]
    rows = []
    for step in steps:
        draw = step.get("draw") or []
        episodes = sum(g["episodes"] for g in draw)
        if not episodes:
            continue
        passed = sum(g["passed"] for g in draw) / episodes
        expected = sum(cells[g["family"], g.get("difficulty")][0] / cells[g["family"], g.get("difficulty")][1]
                       * g["episodes"] for g in draw) / episodes
        rows.append((step["step"], step["reward_mean"], passed, expected))
    if len(rows) < 3:
        raise SystemExit(f"{len(rows)} steps with a draw record: a trend needs at least 3")
    xs = [float(r[0]) for r in rows]
    return {"steps": len(rows), **{name: trend(xs, [r[i] for r in rows]) for i, name in
                                   ((1, "reward_mean"), (2, "rollout_pass_rate"), (3, "draw_expected"))},
            "pass_minus_expected": trend(xs, [r[2] - r[3] for r in rows])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path, help="a simulated-RL run folder (its metrics.jsonl)")
    parser.add_argument("--first", type=int, default=None, help="only the first N steps (a demo-sized window)")
    args = parser.parse_args()
    steps = [json.loads(line) for line in (args.run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    print(json.dumps({"run": str(args.run_dir), **draw_trend(steps[:args.first])}, indent=2))


if __name__ == "__main__":
    main()
