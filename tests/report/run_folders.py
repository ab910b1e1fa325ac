"""Small run folders as the simulated-RL trainer and the real-time cycle write them (the report tests share them)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from flywheel.live.cycle import CycleReport

T0 = 1_800_000_000.0  # the cycles' and monitors' clock: any fixed unix time


def write_training_run(folder: Path, steps: int = 6, torn_last_line: bool = False, draw: bool = True) -> Path:
    """metrics.jsonl with the Orchestrator's and the Learner's keys, eval.jsonl every 3 steps (train.py's rows);
    draw: with the draw's keys (train.py `draw_metrics`), which runs written before them lack."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "metrics.jsonl", "w") as f:
        for step in range(1, steps + 1):
            row = {"loss": 0.1, "step": step, "policy_version": step, "reward_mean": 0.1 * step,
                   "pass_rate": 0.05 * step, "tokens_per_s": 1000.0 + 10 * step, "staleness_max": step % 2,
                   "staleness_mean": 0.4, "train_s": 0.5, "wait_s": 0.1, "filtered_groups": 0,
                   "seconds": 0.48,  # the Learner's own (its train_step), beside the anatomy's time/<stage>
                   "time": T0 + step,
                   "staleness/0": 300.0, "staleness/1": 100.0 * (step % 2),
                   "kl": math.nan if step == 2 else 0.01,  # NaN as json.dumps writes it: NaN
                   # the step's anatomy (train.py `step_anatomy`)
                   "time/wait_rollouts": 0.08, "time/wait_staleness": 0.02 * (step % 2), "time/checkpoint": 0.01,
                   "time/learner_forward_backward": 0.3, "time/learner_optimizer": 0.1, "time/learner_other": 0.1,
                   "time/weight_push": 0.05, "time/loop_other": 0.0, "time/step": 0.64 + 0.02 * (step % 2),
                   "time/engine_prefill": 0.1, "time/engine_decode": 0.4, "time/engine_swap": 0.01,
                   "time/engine_idle": 0.15, "time/episode_tools": 1.5, "time/episode_grade": 2.0,
                   "time/episode_sandbox": 0.3, "time/episode_generate": 6.0,
                   "tokens/engine_prefill": 2000.0, "tokens/engine_decode": 1600.0 * step}
            if draw:  # step s: 0.1 s on the frontier, estimated 0.5 and measured 0.5 - 0.05 s
                row |= {"groups_completed": 5, "frontier_share": 0.1 * step, "signal_share": 0.1 * step + 0.05,
                        "draw_estimate": 0.5, "rollout_pass_rate": 0.5 - 0.05 * step, "filtered_all_passed": 1,
                        "filtered_all_failed": 0, "cpu_s": 10.0 * step,
                        "draw": [{"group": f"g{step}", "family": "bugfix", "tasks": ["bugfix/train/s0/d1/1"],
                                  "difficulty": 1, "version": step - 1, "passed": 1, "episodes": 2,
                                  "reward_mean": 0.6, "reward_spread": 1.2, "estimate": 0.5, "filtered": None}]}
            f.write(json.dumps(row) + "\n")
        if torn_last_line:
            f.write('{"step": 99, "rew')  # a line still being appended
    with open(folder / "eval.jsonl", "w") as f:
        for step in range(0, steps + 1, 3):
            rate = 0.2 + 0.05 * step
            f.write(json.dumps({
                "step": step, "policy_version": step, "time_s": 2.0 * step, "episodes": 20, "pass_rate": rate,
                "pass_rate_ci": [rate - 0.1, rate + 0.1], "valid_tool_call_rate": 0.9,
                "per_family": {"bugfix": {"episodes": 10, "pass_rate": rate + 0.05,
                                          "pass_rate_ci": [rate - 0.1, rate + 0.2], "mean_reward": 0.3},
                               "implement": {"episodes": 10, "pass_rate": rate - 0.05,
                                             "pass_rate_ci": [rate - 0.2, rate + 0.1], "mean_reward": 0.1}},
                "status_counts": {"finished": 20}}) + "\n")
    return folder


def cycle(number: int, promote: bool = True) -> CycleReport:
    """A cycle's record as flywheel/live/cycle.py writes it: gate, A/B metrics, alarms, monitor series."""
    start = T0 + 600 * (number - 1)
    production, candidate = number - 1, number
    series = [{"metric": metric, "version": v, "window_start": start + 60 * w,
               "window_end": start + 60 * w + 60, "value": value, "n": 40}
              for w in range(5) for v in (production, candidate)
              for metric, value in (("edit_rate", 0.6 - (0.3 if v == candidate and w >= 3 and not promote else 0)),
                                    ("response_length", 120.0 + 3 * w))]
    alarms = [] if promote else [{"metric": "edit_rate", "version": candidate, "window_start": start + 180,
                                  "window_end": start + 240, "value": 0.3, "baseline_value": 0.6, "n": 40,
                                  "baseline": f"version {production}", "baseline_n": 400, "score": -5.0,
                                  "severity": "critical", "blocks_promotion": True, "p_value": 1e-6}]
    check = {"n": 60, "reason": ""}
    checks = {"pass_rate": {**check, "diff": 0.01, "ci_low": -0.03, "ci_high": 0.05, "margin": 0.05,
                            "passed": True, "method": "tango"},
              "valid_tool_call_rate": {**check, "diff": -0.04, "ci_low": -0.07 if promote else -0.09,
                                       "ci_high": -0.01, "margin": 0.08, "passed": promote, "method": "t"}}
    comparison = {"method": "welch", "n_production": 40, "n_candidate": 40, "production_ci": None,
                  "candidate_ci": None}
    metrics = {"persistence": {**comparison, "name": "persistence", "production": 0.5, "candidate": 0.58,
                               "diff": 0.08, "ci_low": 0.02, "ci_high": 0.14, "verdict": "better",
                               "higher_is_better": True, "method": "newcombe"},
               "latency": {**comparison, "name": "latency", "production": 1.2, "candidate": 1.25,
                           "diff": 0.05, "ci_low": -0.1, "ci_high": 0.2, "verdict": "no_difference",
                           "higher_is_better": False}}
    decision = "promote" if promote else "rollback"
    gate = {"decision": {"passed": promote, "checks": checks}, "candidate_version": candidate,
            "production_version": production, "tasks": 60, "candidate": {}, "production": {}, "seconds": 5.0}
    ab = {"decision": decision, "reason": "", "confidence": 0.95, "closed": {}, "versions": {}, "outside": {},
          "metrics": metrics}
    return CycleReport.model_validate({
        "cycle": number, "trigger": "clock", "started_at": start, "finished_at": start + 95.0,
        "production": production, "candidate": candidate,
        "production_after": candidate if promote else production,
        "decision": decision, "reason": "", "batch": None, "served": {}, "train": None,
        "gate": gate, "ab": ab,
        "alarms": alarms, "blocking_alarms": alarms,
        "monitor": {"baseline_version": production, "tests": 20, "series": series},
        "timings": {"train_s": 30.0, "gate_s": 5.0, "ab_s": 60.0},
    })


def write_cycle(record: CycleReport, folder: Path) -> Path:
    """`folder/cycle-NNNN/report.json`, as the cycle writes it."""
    path = folder / f"cycle-{record.cycle:04d}" / "report.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(record.model_dump_json(indent=2, by_alias=True))
    return path


def write_demo_folder(root: Path, cycles: int = 2) -> Path:
    """runs/demo as the demo lays it out: train/ (simulated RL) and live/cycles/ (real-time RL)."""
    write_training_run(root / "train")
    for n in range(1, cycles + 1):
        write_cycle(cycle(n, promote=n % 2 == 1), root / "live" / "cycles")
    return root
