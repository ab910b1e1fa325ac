#!/usr/bin/env bash
# The GPU checks, as one script for a machine with an NVIDIA GPU and a Python that has torch:
#   1. the engine and the learner on CUDA against the CPU model (tests skipped where there is no GPU)
#   2. per-token costs of the embedded default and a cluster-shaped MoE (bench/engine_costs.py), for
#      `bench/async_rl.py --parts modeled --costs <out>/costs.json`
# Usage: bash bench/gpu_check.sh REGISTRY OUT_DIR     (REGISTRY holds the bootstrapped version 0)
set -uo pipefail
registry=${1:?registry folder}; out=${2:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"
python3 -m pytest -q -p no:cacheprovider tests/model/test_engine.py tests/rl/test_learner.py -k gpu -rs 2>&1 \
    | tee "$out/pytest.log" | tail -5
python3 bench/engine_costs.py --registry "$registry" --checkpoint 0 --device cuda --shapes default,large \
    --batches 1,8,32,128 --repeats 5 --out "$out/costs.json" 2> >(tee "$out/costs.err" >&2) >/dev/null
