"""bench/learning.py in its quick mode: a tiny policy, a CPU budget of seconds, two seeds. What is
under test is the bench's plumbing (the CPU budget stops each run, saved policies become the curve,
the figures are computed from the evals it ran), not how much a tiny random policy learns."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from flywheel.model.factory import ModelConfig, build_model
from flywheel.model.registry import Registry
from flywheel.model.tokenizer import train_tokenizer

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "learning.py"


@pytest.mark.slow  # about a minute on the shared 2-core machine
def test_the_learning_bench_runs_each_seed_to_its_cpu_budget_and_draws_the_curve(tmp_path):
    tokenizer = train_tokenizer(["def add(a, b):\n    return a + b\n"] * 8, vocab_size=300)
    model = build_model(ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                                    num_experts=4, experts_per_token=2, moe_intermediate_size=32), tokenizer)
    with Registry(tmp_path / "registry") as registry:
        registry.register(model, tokenizer, parent=None, aliases=["production"])
    overrides = ['train.families=["bugfix"]', "train.train_tasks_per_family=2", "train.threads=1",
                 "train.orchestrator.group_size=2", "train.orchestrator.tasks_per_group=1",
                 "train.orchestrator.groups_per_step=1", "train.orchestrator.filter_zero_signal=false",
                 "train.orchestrator.episode.max_turns=1", "train.orchestrator.episode.max_tokens_per_turn=8",
                 "train.engine.separate_process=false"]

    def bench(*args: str) -> subprocess.CompletedProcess[str]:
        run = subprocess.run([sys.executable, str(SCRIPT), "--registry", str(tmp_path / "registry"),
                              "--cpu-minutes", "0.1", "--samples", "2", "--snapshot-every", "1",
                              "--tasks-per-family", "2", "--threads", "1", "--out", str(tmp_path / "out"),
                              *args, *[a for o in overrides for a in ("--set", o)]],
                             capture_output=True, text=True, timeout=600, cwd=SCRIPT.parents[1])
        assert run.returncode == 0, run.stderr[-3000:]
        return run

    # seed 0 also plays its start and its end greedily on the tasks of its set it trained on and on
    # those it never drew (of its two), each paired
    first = json.loads(bench("--seeds", "1", "--practised", "2").stdout)["seeds"][0]
    metrics = [json.loads(line) for line in
               (tmp_path / "out" / "seed-0" / "run" / "metrics.jsonl").read_text().splitlines()]
    drawn = {task for m in metrics for group in m["draw"] for task in group["tasks"]}
    assert drawn and [first["practised_lift"]["tasks"], (first["undrawn_lift"] or {"tasks": 0})["tasks"]] == [
        len(drawn), 2 - len(drawn)]
    practised = first["practised_lift"]
    assert practised["diff"] == pytest.approx(practised["after"] - practised["before"])
    # a second bench on the same out: the start's evals and seed 0 are read, only seed 1 runs
    run = bench("--seeds", "2", "--reuse-seeds")
    assert "the start's evals from" in run.stderr and "seed 0: from" in run.stderr
    assert "seed 1: 0.1 CPU-minutes" in run.stderr and "seed 0: 0.1 CPU-minutes" not in run.stderr
    result = json.loads(run.stdout)
    assert result["seeds"][0] == first and result["seeds"][1]["practised_lift"] is None
    # a third sums up the saved seeds only: seed 2 has none and is left out, not run
    summed = bench("--seeds", "3", "--reuse-seeds", "--saved-only")
    assert "seed 2: no saved figures, left out" in summed.stderr
    assert json.loads(summed.stdout)["gap_closed"] == result["gap_closed"]
    assert result["cpu_minutes_per_seed"] == 0.1 and result["start"]["tasks"] == 2
    assert [s["seed"] for s in result["seeds"]] == [0, 1]
    for seed in result["seeds"]:
        assert seed["steps"] >= 1
        # Only the budget ends a run (max_steps is out of reach): a step starts while the run's CPU
        # seconds are within it, so every step's reading but the last one's is (that step may end past it)
        metrics = [json.loads(line) for line in
                   (tmp_path / "out" / f"seed-{seed['seed']}" / "run" / "metrics.jsonl").read_text().splitlines()]
        assert len(metrics) == seed["steps"] and all(0 < m["cpu_s"] <= 6.0 for m in metrics[:-1])
        assert [m["cpu_s"] for m in metrics] == sorted(m["cpu_s"] for m in metrics)
        # every saved policy is a point of the curve, after the start's and before the end's
        assert [p["step"] for p in seed["curve"]] == [0, *range(1, seed["steps"] + 1), seed["steps"]]
        assert seed["greedy_lift"]["tasks"] == 2 and seed["pass_at_1_end"] is not None
    start = result["start"]
    expected = [None if s["pass_at_1_end"] is None or start["pass_at_k"] <= start["pass_at_1"]
                else (s["pass_at_1_end"] - start["pass_at_1"]) / (start["pass_at_k"] - start["pass_at_1"])
                for s in result["seeds"]]
    assert result["gap_closed"]["per_seed"] == [e for e in expected if e is not None]
    svg = (tmp_path / "out" / "learning.svg").read_text()
    assert svg.startswith("<svg") and "seed 0 greedy" in svg and "seed 1 greedy" in svg

    # bench/eval_policies.py scores the start and saved policies again, paired, on a set of any size:
    # on the bench's own tasks it finds the bench's figures (greedy is deterministic)
    policies = sorted((tmp_path / "out" / "seed-0" / "run" / "policies").glob("step-*.pt"))
    run = subprocess.run([sys.executable, str(SCRIPT.parent / "eval_policies.py"), "--registry",
                          str(tmp_path / "registry"), "--tasks-per-family", "2", "--threads", "1",
                          *[a for o in overrides for a in ("--set", o)], *map(str, policies[:1])],
                         capture_output=True, text=True, timeout=600, cwd=SCRIPT.parents[1])
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [json.loads(line) for line in run.stdout.splitlines()]
    assert rows[0]["greedy"] == start["greedy"] and rows[0]["tasks"] == 2
    step = int(policies[0].stem.split("-")[1])
    assert rows[1]["greedy"] == next(p["greedy"] for p in result["seeds"][0]["curve"] if p["step"] == step)
    lift = rows[1]["lift"]
    assert lift["tasks"] == 2 and lift["diff"] == pytest.approx(rows[1]["greedy"] - rows[0]["greedy"])
