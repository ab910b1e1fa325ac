"""The Learner's low-precision expert GEMMs on a GPU: bf16 against rowwise FP8 and MXFP8, and the
distributed Learner on nccl, each against a baseline measured in the same run.

    python bench/gpu_learner.py                      # on a CUDA GPU: all parts, JSON on stdout
    python bench/gpu_learner.py --device cpu --quick # the same code on small shapes (a smoke run)

1. gemm: one expert layer (gate_up, SiLU * up, down: `LocalExperts`) of a cluster-shaped MoE,
   forward and backward, in bf16 (`torch._grouped_mm`), fp8 (torchao's rowwise FP8 grouped GEMM)
   and mxfp8 (torchao's MXFP8 grouped GEMM: native kernels on sm100, emulated elsewhere, which the
   JSON says). Per precision: milliseconds per forward + backward (CUDA events, after warm-up),
   TFLOP/s (18 rows x hidden x inter per pass), speed-up over bf16, and the SQNR in dB of the
   output and of the three gradients against a float32 computation of the same layer.
2. learner: the single-process Learner's step on a cluster-shaped MoE (`LARGE` below) with each
   precision's expert GEMMs (float32 master weights, AdamW): seconds per step, tokens/s, and the
   loss and gradient norm of each of `--steps` steps on one batch, with the largest gaps to bf16's.
3. dist: the same steps through `DistributedLearner` (FSDP2 on one GPU per process, launched by
   torchrun, backend nccl on a GPU and gloo on a CPU) against the single-process Learner's losses:
   the sharded code path on the GPU backend (with one GPU the collectives move nothing; the
   communication volume by mesh is bench/dist_train.py's).

Every part writes what failed in its place ("error") instead of stopping the run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from flywheel.model.factory import ModelConfig, build_model, parameter_count
from flywheel.model.tokenizer import train_tokenizer
from flywheel.rl.distributed import DistConfig, DistributedLearner, synthetic_batch
from flywheel.rl.expert_parallel import LocalExperts, mx_kernels, use_grouped_experts
from flywheel.rl.learner import Learner, LearnerConfig

PRECISIONS = ("bf16", "fp8", "mxfp8")
# A cluster-shaped MoE (bench/engine_costs.py's LARGE): 32 experts top-4, 12 layers of width 1024
LARGE = ModelConfig(hidden_size=1024, num_layers=12, num_heads=16, num_kv_heads=4, head_dim=64, num_experts=32,
                    experts_per_token=4, moe_intermediate_size=512)
QUICK = ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, num_experts=4,
                    experts_per_token=2, moe_intermediate_size=64)
LEARNER = LearnerConfig(lr=1e-5, micro_batch_tokens=8192)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, warmup: int, repeats: int) -> float:
    """Median seconds of fn() over `repeats` calls after `warmup` (CUDA events on a GPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end) / 1000)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def sqnr(ref: torch.Tensor, got: torch.Tensor) -> float:
    """Signal to quantization noise in dB (torchao's compute_error)."""
    ref, got = ref.float(), got.float()
    return float(20 * torch.log10(ref.norm() / (ref - got).norm().clamp_min(1e-30)))


def gemm_part(device: torch.device, quick: bool) -> dict[str, Any]:
    """One expert layer's forward + backward per precision, against float32 and bf16."""
    experts, hidden, inter, rows = (4, 64, 64, 512) if quick else (32, 2048, 1024, 32768)
    g = torch.Generator().manual_seed(0)
    # uneven routing, as a real batch has: group sizes drawn around rows / experts, none a multiple of 16
    weights = torch.rand(experts, generator=g) + 0.5
    counts = (weights / weights.sum() * rows).floor().long()
    counts[0] += rows - int(counts.sum())
    counts = [int(c) | 1 for c in counts]  # odd sizes: the padding path
    rows = sum(counts)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g) * hidden ** -0.5).to(device)
    down = (torch.randn(experts, hidden, inter, generator=g) * inter ** -0.5).to(device)
    x = torch.randn(rows, hidden, generator=g).to(device)
    probe = torch.randn(rows, hidden, generator=g).to(device)

    def layer(precision: str) -> LocalExperts:
        return LocalExperts(gate_up, down, torch.nn.SiLU(), precision).to(device)

    def run(module: LocalExperts) -> tuple[torch.Tensor, ...]:
        module.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        out = module(xi, counts)
        (out.float() * probe).sum().backward()
        return out.detach(), xi.grad, module.gate_up_proj.grad, module.down_proj.grad

    reference = run(layer("native"))  # float32, one GEMM per expert
    flops = 18 * rows * hidden * inter  # forward 6 rows H I (gate_up 4, down 2), backward twice that
    result: dict[str, Any] = {"experts": experts, "hidden": hidden, "inter": inter, "rows": rows,
                              "flops_per_pass": flops, "mx_native_kernels": mx_kernels(device)}
    warmup, repeats = (1, 3) if quick else (3, 10)
    for precision in PRECISIONS:
        try:
            module = layer(precision)
            got = run(module)
            seconds = timed(lambda m=module: run(m), device, warmup, repeats)
            result[precision] = {
                "ms": seconds * 1000, "tflops": flops / seconds / 1e12,
                "sqnr_db": {name: sqnr(r, o) for name, r, o in
                            zip(("output", "input_grad", "gate_up_grad", "down_grad"), reference, got, strict=True)}}
        except Exception as exc:  # noqa: BLE001 - a precision this device lacks is a result, not a crash
            result[precision] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        log(f"gemm {precision}: {result[precision]}")
    base = result["bf16"].get("ms")
    for precision in PRECISIONS:
        if base and "ms" in result[precision]:
            result[precision]["speedup_over_bf16"] = base / result[precision]["ms"]
    return result


def train_steps(learner: Learner, batch, advantages, steps: int, device: torch.device) -> dict[str, Any]:
    """`steps` Learner steps on one batch: each step's loss and gradient norm, the first step's
    seconds and the median of the others' (`step_s`)."""
    losses, norms, times = [], [], []
    for _ in range(steps):
        sync(device)
        t0 = time.perf_counter()
        metrics = learner.train_step(batch, advantages)
        sync(device)
        times.append(time.perf_counter() - t0)
        losses.append(metrics["loss"])
        norms.append(metrics["grad_norm"])
    later = sorted(times[1:]) or times
    return {"losses": losses, "grad_norms": norms, "step_s": later[len(later) // 2], "first_step_s": times[0]}


def model_and_batch(quick: bool):
    config = QUICK if quick else LARGE
    tokenizer = train_tokenizer(["def add(a, b):\n    return a + b\n", "for x in items:\n    print(x)\n"] * 50,
                                vocab_size=300 if quick else 1000)
    batch = synthetic_batch(len(tokenizer), 4 if quick else 16, 48 if quick else 1024)
    advantages = [1.0 if i % 2 else -1.0 for i in range(len(batch))]
    return config, tokenizer, batch, advantages


def learner_part(device: torch.device, quick: bool, steps: int) -> dict[str, Any]:
    config, tokenizer, batch, advantages = model_and_batch(quick)
    tokens = sum(len(t.tokens) for t in batch)
    result: dict[str, Any] = {"tokens_per_step": tokens}
    for precision in PRECISIONS:
        try:
            torch.manual_seed(0)
            model = use_grouped_experts(build_model(config, tokenizer), precision).to(device)
            result.setdefault("parameters", parameter_count(model))
            learner = Learner(model, LEARNER)
            result[precision] = row = train_steps(learner, batch, advantages, steps, device)
            row["tokens_per_s"] = tokens / row["step_s"]
            if device.type == "cuda":
                result[precision]["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
                torch.cuda.reset_peak_memory_stats(device)
            del learner, model
        except Exception as exc:  # noqa: BLE001
            result[precision] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        log(f"learner {precision}: {result[precision]}")
    base = result["bf16"].get("losses")
    for precision in PRECISIONS:
        row = result[precision]
        if base and "losses" in row:
            row["max_loss_gap_to_bf16"] = max(abs(a - b) for a, b in zip(row["losses"], base, strict=True))
            row["max_grad_norm_rel_gap_to_bf16"] = max(
                abs(a - b) / abs(b) for a, b in zip(row["grad_norms"], result["bf16"]["grad_norms"], strict=True))
            row["speedup_over_bf16"] = result["bf16"]["step_s"] / row["step_s"]
    return result


def dist_worker(out: Path, quick: bool, steps: int, backend: str) -> None:
    """Under torchrun: DistributedLearner's steps per precision; rank 0 writes them to `out`."""
    config, tokenizer, batch, advantages = model_and_batch(quick)
    result: dict[str, Any] = {"backend": backend, "world": int(os.environ["WORLD_SIZE"])}
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if backend == "nccl" else "cpu")
    for precision in PRECISIONS:
        try:
            torch.manual_seed(0)
            model = build_model(config, tokenizer).to(device)
            dist_config = DistConfig(dp_shard=result["world"], expert_precision=precision, backend=backend)
            learner = DistributedLearner(model, LEARNER, dist_config)
            result[precision] = train_steps(learner, batch, advantages, steps, device)
            del learner, model
        except Exception as exc:  # noqa: BLE001
            result[precision] = {"error": f"{type(exc).__name__}: {exc}"[:500],
                                 "where": traceback.format_exc()[-1500:]}
    if int(os.environ["RANK"]) == 0:
        out.write_text(json.dumps(result))
    torch.distributed.destroy_process_group()


def dist_part(device: torch.device, quick: bool, steps: int, single: dict[str, Any]) -> dict[str, Any]:
    backend = "nccl" if device.type == "cuda" else "gloo"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "dist.json"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                   __file__, "--dist-worker", str(out), "--steps", str(steps), "--backend", backend]
        if quick:
            command.append("--quick")
        run = subprocess.run(command, capture_output=True, text=True, timeout=900)
        if not out.exists():
            return {"backend": backend, "error": f"torchrun exited {run.returncode}", "stderr": run.stderr[-3000:]}
        result = json.loads(out.read_text())
    for precision in PRECISIONS:
        row, base = result.get(precision, {}), single.get(precision, {})
        if "losses" in row and "losses" in base:
            row["max_loss_gap_to_single_process"] = max(
                abs(a - b) for a, b in zip(row["losses"], base["losses"], strict=True))
            row["max_grad_norm_rel_gap_to_single_process"] = max(
                abs(a - b) / abs(b) for a, b in zip(row["grad_norms"], base["grad_norms"], strict=True))
            row["step_s_over_single_process"] = row["step_s"] / base["step_s"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="small shapes (a smoke run on a CPU)")
    parser.add_argument("--parts", default="gemm,learner,dist")
    parser.add_argument("--steps", type=int, default=4, help="Learner steps per precision")
    parser.add_argument("--dist-worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--backend", default="gloo", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.dist_worker:
        dist_worker(args.dist_worker, args.quick, args.steps, args.backend)
        return
    device = torch.device(args.device)
    parts = set(args.parts.split(","))
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                              "torch": torch.__version__, "quick": args.quick}
    if device.type == "cuda":
        result["capability"] = "sm{}{}".format(*torch.cuda.get_device_capability(device))
    try:
        import torchao  # noqa: PLC0415

        result["torchao"] = torchao.__version__
    except ImportError as exc:
        result["torchao"] = f"missing: {exc}"
    for name, part in (("gemm", lambda: gemm_part(device, args.quick)),
                       ("learner", lambda: learner_part(device, args.quick, args.steps))):
        if name in parts:
            t0 = time.perf_counter()
            try:
                result[name] = part()
            except Exception as exc:  # noqa: BLE001
                result[name] = {"error": f"{type(exc).__name__}: {exc}", "where": traceback.format_exc()[-1500:]}
            log(f"{name}: {time.perf_counter() - t0:.0f} s")
    if "dist" in parts:
        t0 = time.perf_counter()
        result["dist"] = dist_part(device, args.quick, args.steps, result.get("learner", {}))
        log(f"dist: {time.perf_counter() - t0:.0f} s")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
