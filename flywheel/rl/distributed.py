"""The Learner sharded over processes: FSDP2 (HSDP) for the dense parts, expert parallelism for the MoE.

Launch (one process per device; gloo on CPUs, nccl on GPUs):

    torchrun --nproc-per-node 4 -m flywheel.rl.distributed --set dist.dp_replicate=2 --set dist.dp_shard=2 \
        --set dist.ep=2 --steps 3

The mesh (PyTorch's DeviceMesh) has three dimensions, named as torchtitan names them:

    world = dp_replicate x dp_shard            every rank trains on its own slice of the batch
    dp_shard = dp_shard_mod_ep x ep            ep borrows ranks from the shard dimension

    dense parameters (attention, norms, router, embeddings)   FSDP2 on [dp_replicate, dp_shard]:
        sharded over dp_shard, replicated over dp_replicate (HSDP: the all-gathers stay in a shard
        group, e.g. one node; only the gradient all-reduce crosses dp_replicate)
    expert parameters                                         E / ep experts per rank (`ExpertParallelMoE`),
        and FSDP2 on [dp_replicate, dp_shard_mod_ep] over the ranks that hold the same experts

One step (`DistributedLearner.train_step`, the single-optimizer-step path of `Learner`):

    every rank gets the whole batch and keeps the contiguous slice `rank` of `world`
    micro-batches packed as the Learner packs them; the count is made equal on all ranks (max,
        padded with an empty micro-batch) because every forward is a collective (FSDP all-gathers,
        EP all-to-alls) that all ranks must enter
    loss denominator all-reduced: each rank's loss is its tokens' share of the global mean, so the
        sum of the ranks' gradients is the single-process gradient; FSDP reduces with a divide
        factor of 1 (a sum), not the default mean
    grad norm: per mesh (dense, experts), the experts' summed over the EP group; clip as
        `torch.nn.utils.clip_grad_norm_` does; non-finite -> the step is skipped on every rank
    AdamW on the sharded parameters (DTensors), two parameter groups so no foreach op mixes meshes

Numerics: one step equals the single-process Learner's up to float32 summation order (tested for
meshes 1, 2x1, 1x2, 2x2, 2x2 with ep 2 and 1x4 with ep 4; tests/rl/test_distributed.py states the
tolerance). Only ppo_epochs = minibatches = 1 is supported (the Learner's default, where the
proximal policy is the training forward's own logprobs); kl_coef > 0 (a reference model) is not.

Checkpoints (`save_checkpoint` / `load_checkpoint`): torch.distributed.checkpoint (DCP), sharded,
every rank writes its shards. Dense tensors are saved as FSDP's DTensors; an expert tensor (and its
Adam moments) as a DTensor sharded over the EP dimension with the experts' global shape, so a
checkpoint loads under any other mesh shape (DCP reshards on load). `full_state_dict` gathers the
HF state dict on rank 0 (`export_hf` writes it as a safetensors folder for the Registry and
`AutoModelForCausalLM`): the simple path for the in-process engine; docs/ARCHITECTURE.md says what
each scale needs instead.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from transformers import PreTrainedModel
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from flywheel.agent.trajectory import Trajectory
from flywheel.rl.expert_parallel import ExpertParallelMoE, ExpertPrecision
from flywheel.rl.learner import (
    Advantage,
    Learner,
    LearnerConfig,
    MicroBatch,
    make_micro_batches,
    merge_stats,
    staleness_histogram,
    token_logprobs,
)
from flywheel.rl.loss import loss_denominator, policy_loss
from flywheel.rl.training import warmup_factor


class DistConfig(BaseModel):
    """The mesh and the expert GEMMs' precision; world size = dp_replicate x dp_shard."""
    model_config = ConfigDict(extra="forbid")
    # Replicas of the sharded model. Across nodes: HSDP keeps parameter all-gathers inside a node
    # and sends only the gradient all-reduce over the slower links (the modeled table in
    # docs/ARCHITECTURE.md); more replicas = more memory per rank.
    dp_replicate: int = Field(default=1, ge=1)
    dp_shard: int = Field(default=1, ge=1)  # ranks one copy of the dense weights is sharded over
    # Ranks the experts of a layer are spread over (a divisor of dp_shard and of the expert count).
    # Higher = fewer expert weights per rank, more all-to-all traffic per token.
    ep: int = Field(default=1, ge=1)
    # native: the weights' dtype (float32 here); mxfp8: torchao's MXFP8 grouped GEMMs (emulated on a CPU)
    expert_precision: ExpertPrecision = "native"
    backend: Literal["gloo", "nccl"] = "gloo"

    @model_validator(mode="after")
    def _ep_divides_shard(self) -> DistConfig:
        if self.dp_shard % self.ep:
            raise ValueError(f"ep={self.ep} must divide dp_shard={self.dp_shard}: expert parallelism borrows "
                             "ranks from the shard dimension; set dist.ep to a divisor of dist.dp_shard")
        return self

    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard


@dataclass
class ParallelMesh:
    """The meshes one rank needs: dense parameters, expert parameters, and the EP group."""
    world: DeviceMesh  # [dp_replicate, dp_shard_mod_ep, ep]
    dense: DeviceMesh  # [dp_replicate, dp_shard]
    experts: DeviceMesh  # [dp_replicate, dp_shard_mod_ep]
    ep: DeviceMesh  # [ep]

    @property
    def ep_rank(self) -> int:
        return self.ep.get_local_rank()

    @property
    def ep_size(self) -> int:
        return self.ep.size()


def init_distributed(config: DistConfig) -> None:
    """The default process group from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, ...)."""
    if dist.is_initialized():
        return
    if "RANK" not in os.environ:
        raise RuntimeError("no torchrun environment (RANK, WORLD_SIZE); launch with `torchrun --nproc-per-node "
                           f"{config.world} -m flywheel.rl.distributed ...`")
    dist.init_process_group(config.backend)


def build_mesh(config: DistConfig) -> ParallelMesh:
    if dist.get_world_size() != config.world:
        raise ValueError(f"dist.dp_replicate x dist.dp_shard = {config.world} but {dist.get_world_size()} processes "
                         f"were launched; give torchrun --nproc-per-node {config.world} or change the mesh")
    device = "cuda" if config.backend == "nccl" else "cpu"
    world = init_device_mesh(device, (config.dp_replicate, config.dp_shard // config.ep, config.ep),
                             mesh_dim_names=("dp_replicate", "dp_shard_mod_ep", "ep"))
    # The same ranks as `world` with its last two dims flattened (row-major: rank = r * dp_shard + s)
    dense = init_device_mesh(device, (config.dp_replicate, config.dp_shard), mesh_dim_names=("dp_replicate",
                                                                                             "dp_shard"))
    return ParallelMesh(world=world, dense=dense,
                        experts=world["dp_replicate", "dp_shard_mod_ep"], ep=world["ep"])


class ScoredPolicy(nn.Module):
    """The FSDP root: its forward is `token_logprobs`, so the root's unshard (embeddings, the tied
    output head, the final norm) runs around the whole scored forward, which calls
    `model.base_model` and the head separately."""

    def __init__(self, policy: PreTrainedModel):
        super().__init__()
        self.policy = policy

    def forward(self, ids: torch.Tensor, attention: torch.Tensor, scored: torch.Tensor, temperature: float,
                entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        return token_logprobs(self.policy, ids, attention, temperature, entropy=entropy, scored=scored)


def parallelize(model: PreTrainedModel, mesh: ParallelMesh, precision: ExpertPrecision = "native") -> ScoredPolicy:
    """Swap every MoE block for `ExpertParallelMoE` and wrap with FSDP2; the model changes in place.

    Units: each decoder layer's experts (expert mesh), each decoder layer (dense mesh), the root."""
    ep_group = mesh.ep.get_group() if mesh.ep_size > 1 else None
    for layer in model.model.layers:
        if isinstance(layer.mlp, Qwen3MoeSparseMoeBlock):
            layer.mlp = ExpertParallelMoE(layer.mlp, ep_group, mesh.ep_rank, mesh.ep_size, precision)
            fully_shard(layer.mlp.experts, mesh=mesh.experts)
        fully_shard(layer, mesh=mesh.dense)
    root = ScoredPolicy(model)
    fully_shard(root, mesh=mesh.dense)
    for module in root.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # a sum: each rank's loss is already its share of the mean
            # SUM, not PREMUL_SUM(1.0), which gloo lacks ("Cannot use ReduceOp.PREMUL_SUM with Gloo")
            module.set_force_sum_reduction_for_comms(True)
    return root


def is_expert(name: str) -> bool:
    return ".mlp.experts." in name


def _strip(name: str) -> str:
    return name.removeprefix("policy.")


class DistributedLearner:
    """`Learner`'s single-optimizer-step train_step on a sharded model (see the module doc)."""

    def __init__(self, model: PreTrainedModel, config: LearnerConfig, dist_config: DistConfig,
                 mesh: ParallelMesh | None = None, version: int = 0):
        if config.ppo_epochs != 1 or config.minibatches != 1:
            raise ValueError("the distributed learner takes one optimizer step per batch; set learner.ppo_epochs=1 "
                             "and learner.minibatches=1")
        if config.loss.kl_coef > 0:
            raise ValueError("the distributed learner has no reference model; set learner.loss.kl_coef=0")
        init_distributed(dist_config)
        self.config = config
        self.dist_config = dist_config
        self.mesh = mesh or build_mesh(dist_config)
        self.hf_config = model.config
        self.root = parallelize(model, self.mesh, dist_config.expert_precision)
        self.model = model
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        named = list(self.root.named_parameters())
        dense = [p for n, p in named if not is_expert(n)]
        experts = [p for n, p in named if is_expert(n)]
        self.params = {_strip(n): p for n, p in named}
        self.optimizer = torch.optim.AdamW([{"params": dense}, {"params": experts}], lr=config.lr,
                                           betas=config.betas, weight_decay=config.weight_decay)
        self.version = version
        self.optimizer_steps = 0
        self.skipped_steps = 0
        self._rng = random.Random(config.seed)

    # ---- one step

    loss_mask = Learner.loss_mask  # the `truncated` policy, one place (it reads only self.config)

    def shard(self, n: int) -> range:
        """The trajectories of a batch of n this rank trains on: a contiguous slice, like minibatches."""
        return range(self.rank * n // self.world, (self.rank + 1) * n // self.world)

    def train_step(self, trajectories: Sequence[Trajectory], advantages: Sequence[Advantage]) -> dict[str, float]:
        """Learn from one batch (the same on every rank); returns its metrics, the same on every rank:
        those of `Learner.train_step` that apply (token statistics summed over ranks), plus
        moe_load_max_over_mean (the busiest expert's routed rows over the mean, all layers and
        ranks) and world. `LearnerConfig.threads` is not applied: set OMP_NUM_THREADS per process."""
        if not trajectories or len(advantages) != len(trajectories):
            raise ValueError(f"{len(trajectories)} trajectories and {len(advantages)} advantages; give a non-empty "
                             "batch with one advantage per trajectory")
        start = time.perf_counter()
        config = self.config
        staleness = staleness_histogram(trajectories, self.version)
        mine = self.shard(len(trajectories))
        masks = [self.loss_mask(trajectories[i]) for i in mine]
        batches = make_micro_batches([trajectories[i] for i in mine], [advantages[i] for i in mine], masks,
                                     config.micro_batch_tokens, self._rng) if len(mine) else []
        count = torch.tensor([len(batches)])
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        while len(batches) < int(count):
            batches.append(empty_micro_batch())  # every forward is a collective: all ranks run as many

        denominator = sum((loss_denominator(b.mask, config.loss) for b in batches), torch.zeros(()))
        dist.all_reduce(denominator)
        self.root.train()
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros(())
        stats: dict[str, torch.Tensor] = {}
        load = torch.zeros(self.hf_config.num_experts, dtype=torch.long)
        for b in batches:
            logp, ent = self.root(b.ids, b.attention, b.mask, config.temperature, True)
            b.logp_prox = logp.detach()  # one step per batch: the proximal policy is these weights
            loss, s = policy_loss(logp, b.logp_prox, b.logp_behaviour, b.advantages, b.mask, config.loss,
                                  None, denominator)
            loss.backward()
            total += loss.detach()
            merge_stats(stats, s)
            merge_stats(stats, {"entropy_sum": torch.where(b.mask > 0, ent, 0.0).sum()})
            load += sum(m.tokens_per_expert for m in self.moe_layers())
        grad_norm = self.grad_norm()
        taken = self._clip_and_step(total, grad_norm)
        summed = torch.stack([total, stats["tokens"], stats["entropy_sum"], stats["is_weight_sum"],
                              stats["clipped_low"], stats["clipped_high"]])
        dist.all_reduce(summed)
        dist.all_reduce(load)
        elapsed = time.perf_counter() - start
        loss_tokens = float(summed[1])
        batch_tokens = sum(len(t.tokens) for t in trajectories)
        nan = float("nan")
        stale_tokens = sum(staleness.values())
        load_f = load.float()
        metrics = {
            "loss": float(summed[0]) if taken else nan,
            "entropy": float(summed[2]) / loss_tokens if loss_tokens else nan,
            "is_weight_mean": float(summed[3]) / loss_tokens if loss_tokens else nan,
            "clip_low_frac": float(summed[4]) / loss_tokens if loss_tokens else nan,
            "clip_high_frac": float(summed[5]) / loss_tokens if loss_tokens else nan,
            "grad_norm": float(grad_norm),
            "lr": self.optimizer.param_groups[0]["lr"],
            "optimizer_steps": float(taken),
            "skipped_steps": float(1 - taken),
            "skipped_steps_total": float(self.skipped_steps),
            "policy_version": float(self.version),
            "sequences": float(len(trajectories)),
            "loss_tokens": loss_tokens,
            "tokens_per_s": batch_tokens / max(elapsed, 1e-9),
            "seconds": elapsed,
            "staleness_mean": sum(s * c for s, c in staleness.items()) / stale_tokens if stale_tokens else nan,
            "moe_load_max_over_mean": float(load_f.max() / load_f.mean()) if load_f.sum() else nan,
            "world": float(self.world),
        }
        return metrics

    def moe_layers(self) -> Iterator[ExpertParallelMoE]:
        return (m for m in self.root.modules() if isinstance(m, ExpertParallelMoE))

    def grad_norm(self) -> torch.Tensor:
        """The global L2 norm of the gradients, as clip_grad_norm_ of the whole unsharded model computes it."""
        squares = []
        for group in self.optimizer.param_groups:
            grads = [p.grad for p in group["params"] if p.grad is not None]
            sq = torch.zeros(())
            for g in grads:
                norm = torch.linalg.vector_norm(g, dtype=torch.float32)
                norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
                sq = sq + norm * norm
            squares.append(sq)
        dense, experts = squares
        if self.mesh.ep_size > 1:
            dist.all_reduce(experts, group=self.mesh.ep.get_group())  # each EP rank holds other experts
        return (dense + experts).sqrt()

    def _clip_and_step(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> int:
        finite = torch.isfinite(loss).float()
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)  # a rank's NaN loss skips the step everywhere
        if not (bool(finite) and bool(torch.isfinite(grad_norm))):
            self.skipped_steps += 1
            self.optimizer.zero_grad(set_to_none=True)
            return 0
        coef = min(1.0, self.config.grad_clip / (float(grad_norm) + 1e-6))  # clip_grad_norm_'s formula
        for p in self.params.values():
            if p.grad is not None:
                p.grad.mul_(coef)
        lr = self.config.lr * warmup_factor(self.optimizer_steps, self.config.warmup_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer_steps += 1
        self.version += 1
        return 1

    # ---- weights out

    def full_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The unsharded tensor (collective on every rank): experts gathered over the EP group too."""
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.detach()
        if is_expert(name) and self.mesh.ep_size > 1:
            pieces = [torch.empty_like(full) for _ in range(self.mesh.ep_size)]
            dist.all_gather(pieces, full.contiguous(), group=self.mesh.ep.get_group())
            full = torch.cat(pieces)
        return full

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The HF state dict (names and shapes of the unsharded `Qwen3MoeForCausalLM`) on rank 0, None
        elsewhere; every rank must call it. Tied tensors stay one tensor."""
        out: dict[str, torch.Tensor] = {}
        done: dict[int, torch.Tensor] = {}
        for name, tensor in self.root.state_dict().items():
            name = _strip(name)
            key = id(tensor) if not isinstance(tensor, DTensor) else id(tensor._local_tensor)
            if key not in done:
                done[key] = self.full_tensor(name, tensor)
            out[name] = done[key]
        return out if self.rank == 0 else None

    def weights(self) -> dict[str, torch.Tensor] | None:
        """What `Learner.weights` is for the in-process engine, on rank 0 (None elsewhere; collective):
        rank 0 then calls `engine.update_weights(weights, learner.version)`."""
        return self.full_state_dict()

    def export_hf(self, path: str | Path, tokenizer: Any = None) -> Path | None:
        """Write the unsharded model as an HF safetensors folder on rank 0 (collective); its path there."""
        state = self.full_state_dict()
        if state is None:
            return None
        from transformers import AutoModelForCausalLM  # noqa: PLC0415  (rank 0 only)

        model = AutoModelForCausalLM.from_config(self.hf_config, dtype=torch.float32)
        model.load_state_dict(state, strict=True)
        path = Path(path)
        model.save_pretrained(path)
        if tokenizer is not None:
            tokenizer.save_pretrained(path)
        return path

    # ---- checkpoints (DCP)

    def _expert_global(self, tensor: torch.Tensor) -> DTensor:
        """An expert tensor (FSDP DTensor of this rank's experts) as a DTensor of all experts over EP."""
        local = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.detach()
        return DTensor.from_local(local, device_mesh=self.mesh.ep, placements=[Shard(0)], run_check=False)

    def _ensure_optimizer_state(self) -> None:
        for p in self.params.values():
            state = self.optimizer.state[p]
            if not state:  # AdamW's own lazy initialisation, done ahead so a checkpoint can load into it
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def _checkpoint_state(self) -> tuple[dict[str, Any], list[tuple[str, torch.Tensor, DTensor]]]:
        """The dict DCP saves or loads into, and the expert tensors to copy back after a load."""
        self._ensure_optimizer_state()
        state: dict[str, Any] = {"counters": torch.tensor([self.version, self.optimizer_steps, self.skipped_steps])}
        experts: list[tuple[str, torch.Tensor, DTensor]] = []
        for name, p in self.params.items():
            tensors = {f"model/{name}": p}
            opt = self.optimizer.state[p]
            tensors.update({f"optim/{name}/{k}": opt[k] for k in ("exp_avg", "exp_avg_sq")})
            state[f"optim/{name}/step"] = opt["step"]
            for key, tensor in tensors.items():
                if is_expert(name):
                    global_ = self._expert_global(tensor)
                    experts.append((key, tensor, global_))
                    state[key] = global_
                else:
                    state[key] = tensor
        return state, experts

    def save_checkpoint(self, path: str | Path) -> None:
        """A sharded DCP checkpoint of weights, Adam moments and counters (collective)."""
        state, _ = self._checkpoint_state()
        dcp.save(state, checkpoint_id=str(path))

    def load_checkpoint(self, path: str | Path) -> None:
        """Resume from `save_checkpoint`'s folder, written under this or any other mesh shape (collective)."""
        if not (Path(path) / ".metadata").is_file():
            raise FileNotFoundError(f"{path} holds no DCP checkpoint (.metadata missing); give the folder "
                                    "save_checkpoint wrote")
        state, experts = self._checkpoint_state()
        dcp.load(state, checkpoint_id=str(path))  # dense DTensors and plain tensors load in place
        with torch.no_grad():
            for _, target, loaded in experts:
                local = loaded.to_local()  # this rank's experts, unsharded over the expert mesh
                if isinstance(target, DTensor):
                    local = distribute_tensor(local, target.device_mesh, target.placements).to_local()
                    target = target.to_local()
                target.copy_(local)
        version, steps, skipped = (int(x) for x in state["counters"])
        self.version, self.optimizer_steps, self.skipped_steps = version, steps, skipped


def empty_micro_batch() -> MicroBatch:
    """One row of two padding tokens with no loss: a forward and backward that change nothing."""
    zeros = torch.zeros((1, 2))
    return MicroBatch(ids=torch.zeros((1, 2), dtype=torch.long), attention=torch.ones((1, 2), dtype=torch.long),
                      mask=zeros, logp_behaviour=zeros.clone(), advantages=zeros.clone())


# ---- the command: torchrun --nproc-per-node N -m flywheel.rl.distributed


class DistTrainConfig(BaseModel):
    """`python -m flywheel.rl.distributed`: the tiny policy, a synthetic batch, `steps` sharded steps."""
    model_config = ConfigDict(extra="forbid")
    dist: DistConfig = Field(default_factory=DistConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    batch: int = Field(default=8, ge=1)  # trajectories per step
    tokens: int = Field(default=256, ge=16)  # per trajectory
    vocab: int = Field(default=512, ge=64)


def synthetic_batch(vocab: int, batch: int, tokens: int, seed: int = 0) -> list[Trajectory]:
    """Random tokens, a 5-token prompt, everything after it generated, behaviour logprob -2."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(batch):
        ids = torch.randint(0, vocab, (tokens,), generator=g).tolist()
        mask = [0] * 5 + [1] * (tokens - 5)
        out.append(Trajectory(task_id=f"s{i}", family="synthetic", tokens=ids, loss_mask=mask,
                              logprobs=[-2.0 * m for m in mask], versions=[0 if m else -1 for m in mask],
                              prompt_len=5, status="finished", reward=float(i % 2),
                              reward_parts={"pass_frac": float(i % 2)}, turns=1, tool_calls=0,
                              invalid_tool_calls=0, asked_question=False, group_id="g"))
    return out


def main(argv: Sequence[str] | None = None) -> None:
    from flywheel.config import load_config  # noqa: PLC0415  (the command only)
    from flywheel.model.factory import ModelConfig, build_model  # noqa: PLC0415
    from flywheel.model.tokenizer import train_tokenizer  # noqa: PLC0415

    parser = argparse.ArgumentParser(prog="torchrun --nproc-per-node N -m flywheel.rl.distributed",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--config", help="TOML with [dist] and [learner] tables")
    parser.add_argument("--set", action="append", default=[], help="override, e.g. dist.ep=2")
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--checkpoint", help="save a DCP checkpoint here after the last step")
    parser.add_argument("--resume", help="load this DCP checkpoint first")
    parser.add_argument("--export", help="write the trained model as an HF folder here (rank 0)")
    args = parser.parse_args(argv)
    config = load_config(DistTrainConfig, args.config, args.set)
    init_distributed(config.dist)
    tokenizer = train_tokenizer(["def add(a, b):\n    return a + b\n"] * 20, vocab_size=config.vocab)
    model = build_model(ModelConfig(), tokenizer)
    learner = DistributedLearner(model, config.learner, config.dist)
    if args.resume:
        learner.load_checkpoint(args.resume)
    batch = synthetic_batch(len(tokenizer), config.batch, config.tokens)
    advantages = [t.reward - 0.5 for t in batch]
    for _ in range(args.steps):
        metrics = learner.train_step(batch, advantages)
        if learner.rank == 0:
            print(json.dumps(metrics), flush=True)
    if args.checkpoint:
        learner.save_checkpoint(args.checkpoint)
    if args.export:
        learner.export_hf(args.export, tokenizer)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
