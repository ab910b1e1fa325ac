#!/usr/bin/env bash
# The GPU checks, as one script for a machine with an NVIDIA GPU and a Python that has torch:
#   1. the GPU tests (skipped where there is no GPU): the engine, the learner, the lean decoder's
#      dense-expert path, and the FP8 / MXFP8 expert GEMMs and learner step, each against the CPU
#      model or bf16
#   2. bench/gpu_learner.py: one expert layer and the Learner's step in bf16, FP8 and MXFP8, and
#      the distributed Learner on nccl against the single-process one
#   3. bench/stage_flops.py: the engine's decode and prefill and the Learner's step as FLOP/s, against
#      the GPU's fp32 matmul rate at large shapes and at each stage's own shapes
#   4. bench/lora_rl.py: LoRA RL steps of Qwen2.5-0.5B's architecture (built from its config: this
#      machine reaches no network) with vLLM as the engine: rollout and learner tokens/s, the weight
#      update's seconds, and the engine-vs-learner logprob mismatch (its CPU path: --device cpu --quick)
#   5. with a REGISTRY: per-token costs of the embedded default and a cluster-shaped MoE
#      (bench/engine_costs.py), for `bench/async_rl.py --parts modeled --costs <out>/costs.json`
# Usage: bash bench/gpu_check.sh OUT_DIR [REGISTRY]     (REGISTRY holds the bootstrapped version 0)
set -uo pipefail
out=${1:?output folder}; registry=${2:-}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"
python3 -m pytest -q -p no:cacheprovider tests/model/test_engine.py tests/rl/test_learner.py tests/model/test_decode.py \
    tests/rl/test_mxfp8.py -k "gpu or fp8" -rs 2>&1 | tee "$out/pytest.log" | tail -15
python3 bench/gpu_learner.py > "$out/gpu_learner.json" 2> >(tee "$out/gpu_learner.err" >&2)
python3 bench/stage_flops.py --device cuda > "$out/stage_flops.json" 2> >(tee "$out/stage_flops.err" >&2)
python3 bench/lora_rl.py --steps 3 --group 16 --turns 2 --tokens 256 > "$out/lora_rl.json" \
    2> >(tee "$out/lora_rl.err" >&2)
if [ -n "$registry" ]; then
    python3 bench/engine_costs.py --registry "$registry" --checkpoint 0 --device cuda --shapes default,large \
        --batches 1,8,32,128 --repeats 5 --out "$out/costs.json" 2> >(tee "$out/costs.err" >&2) >/dev/null
fi
