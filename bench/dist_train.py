"""The distributed Learner by mesh shape: step time, tokens/s and communication per step, measured
against the analytic volume, next to the single-process Learner on the same batch.

    python bench/dist_train.py            # 4 CPU processes under torchrun (gloo); prints JSON
    python bench/dist_train.py --model    # the modeled table for 8, 64 and 1,024 GPUs (no processes)

A correctness-scale measurement: 4 processes share this machine's cores (2 here), so step times
say what the sharding costs in overhead, not what it buys; no GPU was used (the GPU check is owed).
The communication volume does not depend on the hardware: each rank's bytes are counted in the
collectives FSDP2 calls (all_gather_single, reduce_scatter_single, all_reduce, hooked in this
process) and in the expert all-to-alls (`ExpertParallelMoE.sent_bytes`, forward; the backward sends
as much again), as bytes each rank sends under bandwidth-optimal algorithms:

    all-gather / reduce-scatter of N bytes over n ranks    N (n-1)/n
    all-reduce of N bytes over n ranks                     2 N (n-1)/n
    all-to-all                                             the rows sent to other ranks

Analytic volume per rank and step (P: a unit's parameter bytes; s shard ranks, r replicas):
    FSDP layer unit    3 P (s-1)/s    (all-gather forward, again in backward, reduce-scatter)
    FSDP root unit     2 P (s-1)/s    (the root stays unsharded between forward and backward)
    HSDP adds          2 (P/s) (r-1)/r per unit (all-reduce of the gradient shard across replicas)
    experts            the same over their mesh (r, s/ep) with P = the layer's experts / ep
    EP all-to-all      4 rows k hidden bytes (ep-1)/ep per MoE layer (dispatch + combine, forward
                       and backward; uniform routing)
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist

from flywheel.model.factory import ModelConfig, build_model, parameter_count
from flywheel.model.tokenizer import train_tokenizer
from flywheel.rl.distributed import DistConfig, DistributedLearner, synthetic_batch
from flywheel.rl.learner import Learner, LearnerConfig

SHAPES = [(1, 4, 1), (2, 2, 1), (4, 1, 1), (1, 4, 4), (2, 2, 2)]  # (dp_replicate, dp_shard, ep)
BATCH, TOKENS, STEPS = 8, 256, 2
LEARNER = LearnerConfig(lr=1e-4, micro_batch_tokens=1024)


class CommCounter:
    """Bytes this rank sends in FSDP2's collectives (see the module doc), by collective."""

    def __init__(self) -> None:
        self.bytes: dict[str, float] = defaultdict(float)
        self.on = False
        for name, factor in (("all_gather_single", 1.0), ("reduce_scatter_single", 1.0), ("all_reduce", 2.0)):
            setattr(dist, name, self._wrap(getattr(dist, name), name, factor))

    def _wrap(self, fn, name: str, factor: float):
        signature = inspect.signature(fn)
        # the full-size tensor: all_gather_single's output, reduce_scatter_single's input, all_reduce's only
        full = {"all_gather_single": "output_tensor", "reduce_scatter_single": "input", "all_reduce": "tensor"}[name]

        def counted(*args, **kwargs):
            if self.on:
                bound = signature.bind(*args, **kwargs).arguments
                n = dist.get_world_size(bound.get("group"))
                tensor = bound[full]
                self.bytes[name] += factor * tensor.numel() * tensor.element_size() * (n - 1) / n
            return fn(*args, **kwargs)
        return counted


def unit_bytes(model) -> dict[str, float]:
    """Parameter bytes of the FSDP units: decoder layers without experts, experts, the root."""
    layers = experts = 0.0
    for layer in model.model.layers:
        for name, p in layer.named_parameters():
            if name.startswith("mlp.experts."):
                experts += p.numel() * 4
            else:
                layers += p.numel() * 4
    root = sum(p.numel() * 4 for n, p in model.named_parameters() if not n.startswith("model.layers."))
    return {"layers": layers, "experts": experts, "root": root}


def analytic(units: dict[str, float], r: int, s: int, ep: int, rows: float, k: int, hidden: int,
             moe_layers: int, activation_bytes: int = 4) -> dict[str, float]:
    def fsdp(p: float, shard: int, replicas: int, passes: int) -> tuple[float, float]:
        gather_scatter = passes * p * (shard - 1) / shard
        return gather_scatter, 2 * (p / shard) * (replicas - 1) / replicas
    layers_gs, layers_ar = fsdp(units["layers"], s, r, 3)
    root_gs, root_ar = fsdp(units["root"], s, r, 2)
    experts_gs, experts_ar = fsdp(units["experts"] / ep, s // ep, r, 3)
    a2a = 4 * rows * k * hidden * activation_bytes * (ep - 1) / ep * moe_layers
    return {"fsdp_gather_scatter": layers_gs + root_gs + experts_gs,
            "hsdp_all_reduce": layers_ar + root_ar + experts_ar, "ep_all_to_all": a2a}


def worker(out: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tok = train_tokenizer(["def add(a, b):\n    return a + b\n"] * 20, vocab_size=512)
    config = ModelConfig()
    batch = synthetic_batch(len(tok), BATCH, TOKENS)
    advantages = [t.reward - 0.5 for t in batch]
    results: dict[str, object] = {}
    if rank == 0:  # the baseline: the single-process Learner on the same batch, on one core
        learner = Learner(build_model(config, tok), LEARNER)
        learner.train_step(batch, advantages)
        start = time.perf_counter()
        for _ in range(STEPS):
            learner.train_step(batch, advantages)
        step = (time.perf_counter() - start) / STEPS
        results["single_process"] = {"step_s": step, "tokens_per_s": BATCH * TOKENS / step,
                                     "parameters": parameter_count(learner.model)}
    dist.barrier()
    counter = CommCounter()
    for r, s, ep in SHAPES:
        model = build_model(config, tok)
        units = unit_bytes(model)
        learner = DistributedLearner(model, LEARNER, DistConfig(dp_replicate=r, dp_shard=s, ep=ep))
        learner.train_step(batch, advantages)  # warm-up: first-call allocations, gloo connections
        counter.bytes.clear()
        for m in learner.moe_layers():
            m.sent_bytes = 0
        dist.barrier()
        start = time.perf_counter()
        counter.on = True
        for _ in range(STEPS):
            learner.train_step(batch, advantages)
        counter.on = False
        step = (time.perf_counter() - start) / STEPS
        a2a = 2 * sum(m.sent_bytes for m in learner.moe_layers()) / STEPS  # forward counted, backward as much
        rows = torch.tensor([float(sum(len(batch[i].tokens) for i in learner.shard(len(batch))))])
        dist.all_reduce(rows)
        measured = {k: v / STEPS for k, v in counter.bytes.items()}
        expected = analytic(units, r, s, ep, float(rows) / dist.get_world_size(), config.experts_per_token,
                            config.hidden_size, config.num_layers)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, {"measured": measured, "a2a": a2a})
        if rank == 0:
            mean = {key: sum(g["measured"].get(key, 0.0) for g in gathered) / len(gathered)
                    for key in ("all_gather_single", "reduce_scatter_single", "all_reduce")}
            fsdp_measured = mean["all_gather_single"] + mean["reduce_scatter_single"]
            a2a_measured = sum(g["a2a"] for g in gathered) / len(gathered)
            results[f"{r}x{s}ep{ep}"] = {
                "step_s": step, "tokens_per_s": BATCH * TOKENS / step,
                "mb_per_rank_step": {
                    "fsdp_gather_scatter": {"measured": fsdp_measured / 1e6,
                                            "analytic": expected["fsdp_gather_scatter"] / 1e6},
                    "all_reduce": {"measured": mean["all_reduce"] / 1e6,
                                   "analytic_hsdp": expected["hsdp_all_reduce"] / 1e6},
                    "ep_all_to_all": {"measured": a2a_measured / 1e6,
                                      "analytic_uniform": expected["ep_all_to_all"] / 1e6},
                },
            }
        del learner
    if rank == 0:
        results["note"] = ("4 gloo processes on this machine's CPU cores: correctness-scale; the GPU check is owed. "
                           "all_reduce measured includes the learner's scalar reductions (bytes).")
        out.write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


# ---- the modeled scaling table (python bench/dist_train.py --model): docs/ARCHITECTURE.md prints it

# Qwen3-30B-A3B's shape (config.json of the HF release): the formulas above, checked to the byte on
# the tiny model by the measurement, applied to a production-size MoE.
BIG = {"layers": 48, "hidden": 2048, "q_heads": 32, "kv_heads": 4, "head_dim": 128, "experts": 128, "top_k": 8,
       "moe_inter": 768, "vocab": 151936}
NVLINK_GBS = 450.0  # per GPU, one direction, within a node (H100 SXM NVLink 4: 900 GB/s both ways)
IB_GBS = 50.0  # per GPU across nodes (one 400 Gb/s NDR NIC per GPU)
GPUS_PER_NODE = 8
TOKENS_PER_GPU = 16384  # per step
EFFECTIVE_TFLOPS = 400.0  # bf16 per GPU: ~40% of H100's 989 dense peak


def modeled(gpus: int) -> dict[str, dict[str, float]]:
    b = BIG
    attn = b["hidden"] * b["head_dim"] * (2 * b["q_heads"] + 2 * b["kv_heads"]) + b["hidden"] * 2 + b["head_dim"] * 2
    layer = attn + b["experts"] * b["hidden"] + 2 * b["hidden"]  # + router + norms
    experts = b["experts"] * 3 * b["hidden"] * b["moe_inter"]
    root = 2 * b["vocab"] * b["hidden"] + b["hidden"]
    params = b["layers"] * (layer + experts) + root
    active = b["layers"] * (layer + b["top_k"] * 3 * b["hidden"] * b["moe_inter"]) + root
    compute_s = 6 * active * TOKENS_PER_GPU / (EFFECTIVE_TFLOPS * 1e12)
    bf16 = 2
    units = {"layers": b["layers"] * layer * bf16, "experts": b["layers"] * experts * bf16, "root": root * bf16}
    node = min(gpus, GPUS_PER_NODE)
    plans = {"FSDP": (1, gpus, 1), "HSDP": (gpus // node, node, 1), "HSDP+EP": (gpus // node, node, node)}
    out = {}
    for plan, (r, s, ep) in plans.items():
        v = analytic(units, r, s, ep, TOKENS_PER_GPU, b["top_k"], b["hidden"], b["layers"], activation_bytes=bf16)
        # which link carries what: a shard or EP group inside a node rides NVLink, across nodes IB
        gather_link = NVLINK_GBS if s <= GPUS_PER_NODE else IB_GBS
        cross_node_gb = (v["fsdp_gather_scatter"] if s > GPUS_PER_NODE else 0.0) + v["hsdp_all_reduce"]
        intra_node_gb = (v["fsdp_gather_scatter"] if s <= GPUS_PER_NODE else 0.0) + v["ep_all_to_all"]
        comm_s = (v["fsdp_gather_scatter"] / gather_link + v["hsdp_all_reduce"] / IB_GBS * (r > 1)
                  + v["ep_all_to_all"] / NVLINK_GBS) / 1e9
        # fp32 master weights + grads + Adam moments: 16 bytes per parameter, sharded over s (experts over s x ep)
        state_gb = 16 * (b["layers"] * layer + root) / s / 1e9 + 16 * b["layers"] * experts / s / 1e9
        out[plan] = {"mesh": f"{r}x{s} ep{ep}", "cross_node_gb": cross_node_gb / 1e9,
                     "intra_node_gb": intra_node_gb / 1e9,
                     "comm_s_unoverlapped": comm_s, "compute_s": compute_s, "state_gb_per_gpu": state_gb,
                     "params_b": params / 1e9, "active_b": active / 1e9}
    return out


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--model":
        print(json.dumps({str(n): modeled(n) for n in (8, 64, 1024)}, indent=1))
        return
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        worker(Path(sys.argv[2]))
        return
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"dist_train_{os.getpid()}.json"
    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{repo}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    print(f"torchrun: 4 processes, meshes {SHAPES} (dp_replicate, dp_shard, ep) ...", file=sys.stderr, flush=True)
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                    __file__, "--worker", str(out)], env=env, check=True, timeout=600)
    print(out.read_text())
    out.unlink()


if __name__ == "__main__":
    main()
