"""bench/gpu_learner.py (the GPU check's measurements) on small shapes on a CPU: the script a GPU
session runs once must not have broken since, and off a GPU it reports fp8 as refused, not crashed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_learner.py"


@pytest.mark.slow  # 38 s on the shared 2-core machine (load ~10)
def test_the_gpu_learner_bench_runs_on_small_shapes_and_names_what_this_device_lacks():
    run = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--parts", "gemm,learner",
                          "--steps", "2"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout)
    gemm, learner = result["gemm"], result["learner"]
    assert gemm["mx_native_kernels"] is False  # a CPU: MXFP8 emulated
    for precision in ("bf16", "mxfp8"):
        assert gemm[precision]["ms"] > 0
        assert min(gemm[precision]["sqnr_db"].values()) > 20.0, gemm[precision]  # against float32
        assert len(learner[precision]["losses"]) == 2
    assert gemm["bf16"]["sqnr_db"]["output"] > gemm["mxfp8"]["sqnr_db"]["output"]  # MXFP8 is the coarser
    assert learner["mxfp8"]["max_grad_norm_rel_gap_to_bf16"] < 0.05, learner["mxfp8"]
    assert "needs a CUDA GPU" in gemm["fp8"]["error"] and "needs a CUDA GPU" in learner["fp8"]["error"]
