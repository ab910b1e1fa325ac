"""bench/lora_rl.py (the GPU check's LoRA RL part) on a tiny model of the same architecture on a CPU:
the script a GPU session runs once must not have broken since, and what it reports must hold here:
rollouts and Learner steps measured, and an engine that scores its tokens as the Learner does."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "lora_rl.py"


@pytest.mark.slow  # 20 s on the shared 2-core machine (load ~5)
def test_the_lora_rl_bench_runs_its_steps_and_the_engine_agrees_with_the_learner():
    run = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--steps", "2", "--group", "2",
                          "--turns", "1", "--tokens", "8", "--rank", "4"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout)
    assert "error" not in result, result.get("traceback")
    assert result["engine"] == "local" and len(result["steps"]) == 2
    assert 0 < result["trainable_parameters"] < result["parameters"] / 10
    for step in result["steps"]:
        assert step["generated_tokens"] > 0 and step["rollout_tokens_per_s"] > 0 and step["learner_tokens_per_s"] > 0
    # Step 2's tokens were sampled by the merged weights of step 1: the engine got base + delta right.
    assert result["engine_logprob_mismatch_max"] < 1e-4
