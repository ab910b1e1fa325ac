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

One step (`DistributedLearner.train_step` is `Learner.train_step`: minibatches, PPO epochs, the
KL reference, clipping and the metrics are that code; this class replaces four seams of it):

    micro-batches    every rank gets the whole batch; of each minibatch it keeps the contiguous
                     slice `rank` of `world`, packed as the Learner packs; the count is made equal
                     on all ranks (max, padded with an empty micro-batch) because every forward is
                     a collective (FSDP all-gathers, EP all-to-alls) that all ranks must enter
    forwards         on the FSDP root (`ScoredPolicy`); the reference model, when kl_coef > 0, is a
                     whole copy on every rank (a no-grad forward of the rank's own micro-batches)
    reduce           loss denominators, losses and the metrics' token statistics summed over ranks:
                     each rank's loss is its tokens' share of the global mean, so the sum of the
                     ranks' gradients is the single-process gradient; FSDP reduces with a divide
                     factor of 1 (a sum), not the default mean; a NaN on one rank is in the sum,
                     so every rank skips that step
    grad norm        per mesh (dense, experts), the experts' summed over the EP group; clipped as
                     `torch.nn.utils.clip_grad_norm_` clips
    AdamW on the sharded parameters (DTensors), two parameter groups so no foreach op mixes meshes

Numerics: a step equals the single-process Learner's up to float32 summation order (tested for
meshes 1, 2x1, 1x2, 2x2, 2x2 with ep 2 and 1x4 with ep 4, and with ppo_epochs = minibatches = 2
and a KL reference; tests/rl/test_distributed.py states the tolerance).

Under `flywheel train` (`TrainConfig.dist`), rank 0 runs the whole loop (Orchestrator, engine,
sandboxes) with a `LeaderLearner`, which broadcasts each of its calls; the other ranks run
`follow`, which makes the same call on their own shard, so every rank steps on the same batch.

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
import shutil
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from pydantic import BaseModel, ConfigDict, Field, model_validator
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
    ScoredPolicy,
)


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
    # How long a rank waits in a collective before the run fails. Under `flywheel train` the other
    # ranks wait in one while rank 0 collects a batch and evaluates; longer = a slow eval does not
    # kill the run, a hung rank is named later.
    timeout_s: float = Field(default=7200.0, gt=0)

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
    if config.backend == "nccl":  # one GPU per process: torchrun's LOCAL_RANK names this one's
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(config.backend, timeout=timedelta(seconds=config.timeout_s))


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


class DistributedLearner(Learner):
    """`Learner` on a sharded model: its train_step (minibatches, PPO epochs, the KL reference,
    clipping, the metrics) with the forwards on the FSDP root, each rank on its share of every
    minibatch, and the ranks' shares added up (see the module doc). Every call is collective."""

    def __init__(self, model: PreTrainedModel, config: LearnerConfig, dist_config: DistConfig,
                 mesh: ParallelMesh | None = None, ref_model: PreTrainedModel | None = None, version: int = 0):
        init_distributed(dist_config)
        self.dist_config = dist_config
        self.mesh = mesh or build_mesh(dist_config)
        self.hf_config = model.config
        self.root = parallelize(model, self.mesh, dist_config.expert_precision)
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.params = {_strip(n): p for n, p in self.root.named_parameters()}
        # The reference model (kl_coef > 0) stays whole on every rank: a no-grad forward of the rank's
        # own micro-batches, no collective. At a scale where a copy does not fit, shard it as the policy.
        super().__init__(model, config, ref_model=ref_model, version=version)

    # ---- the Learner's step, sharded

    @property
    def policy(self) -> ScoredPolicy:
        return self.root

    def _parameter_groups(self) -> Any:
        named = list(self.root.named_parameters())  # two groups: no foreach op mixes the two meshes
        return [{"params": [p for n, p in named if not is_expert(n)]},
                {"params": [p for n, p in named if is_expert(n)]}]

    def shard(self, n: int) -> range:
        """The trajectories of a minibatch of n this rank trains on: a contiguous slice."""
        return range(self.rank * n // self.world, (self.rank + 1) * n // self.world)

    def _micro_batches(self, trajectories: Sequence[Trajectory], advantages: Sequence[Advantage],
                       masks: Sequence[Sequence[int]], device: torch.device) -> list[MicroBatch]:
        mine = self.shard(len(trajectories))
        batches = super()._micro_batches([trajectories[i] for i in mine], [advantages[i] for i in mine],
                                         [masks[i] for i in mine], device)
        count = torch.tensor([len(batches)], device=device)  # on the GPU under nccl, which reduces no CPU tensor
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        while len(batches) < int(count):
            batches.append(empty_micro_batch(device))  # every forward is a collective: all ranks run as many
        return batches

    def _reduce(self, value: torch.Tensor, op: Literal["sum", "max"] = "sum") -> torch.Tensor:
        out = value.detach().clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
        return out

    def _clip_grad_norm(self) -> torch.Tensor:
        norm = self.grad_norm()
        if torch.isfinite(norm):  # otherwise the step is skipped and the gradients dropped
            coef = min(1.0, self.config.grad_clip / (float(norm) + 1e-6))  # clip_grad_norm_'s formula
            for p in self.params.values():
                if p.grad is not None:
                    p.grad.mul_(coef)
        return norm

    def _train_step(self, trajectories: Sequence[Trajectory], advantages: Sequence[Advantage]) -> dict[str, float]:
        """The Learner's metrics plus moe_load_max_over_mean (the busiest expert's routed rows over
        the mean, all layers and ranks) and world. `LearnerConfig.threads` is applied per process."""
        layers = list(self.moe_layers())
        for m in layers:
            m.tokens_per_expert.zero_()
        metrics = super()._train_step(trajectories, advantages)
        load = self._reduce(torch.stack([m.tokens_per_expert for m in layers]).sum(0).float()) if layers else None
        balance = float(load.max() / load.mean()) if load is not None and load.sum() else float("nan")
        return metrics | {"moe_load_max_over_mean": balance, "world": float(self.world)}

    def moe_layers(self) -> Iterator[ExpertParallelMoE]:
        return (m for m in self.root.modules() if isinstance(m, ExpertParallelMoE))

    def grad_norm(self) -> torch.Tensor:
        """The global L2 norm of the gradients, as clip_grad_norm_ of the whole unsharded model computes it."""
        squares = []
        device = next(iter(self.params.values())).device
        for group in self.optimizer.param_groups:
            grads = [p.grad for p in group["params"] if p.grad is not None]
            sq = torch.zeros((), device=device)
            for g in grads:
                norm = torch.linalg.vector_norm(g, dtype=torch.float32)
                norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
                sq = sq + norm * norm
            squares.append(sq)
        dense, experts = squares
        if self.mesh.ep_size > 1:
            dist.all_reduce(experts, group=self.mesh.ep.get_group())  # each EP rank holds other experts
        return (dense + experts).sqrt()

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

    def full_model(self) -> PreTrainedModel | None:
        """The unsharded model (a new `Qwen3MoeForCausalLM` with the trained weights) on rank 0, None
        elsewhere (collective): what the Registry registers and `export_hf` writes."""
        state = self.full_state_dict()
        if state is None:
            return None
        from transformers import AutoModelForCausalLM  # noqa: PLC0415  (rank 0 only)

        model = AutoModelForCausalLM.from_config(self.hf_config, dtype=torch.float32)
        model.load_state_dict(state, strict=True)
        return model

    def export_hf(self, path: str | Path, tokenizer: Any = None) -> Path | None:
        """Write the unsharded model as an HF safetensors folder on rank 0 (collective); its path there."""
        model = self.full_model()
        if model is None:
            return None
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


def empty_micro_batch(device: torch.device | str = "cpu") -> MicroBatch:
    """One row of two padding tokens with no loss: a forward and backward that change nothing."""
    zeros = torch.zeros((1, 2), device=device)
    return MicroBatch(ids=torch.zeros((1, 2), dtype=torch.long, device=device),
                      attention=torch.ones((1, 2), dtype=torch.long, device=device),
                      mask=zeros, logp_behaviour=zeros.clone(), advantages=zeros.clone())


# ---- under `flywheel train`: rank 0 drives the loop, the other ranks follow its Learner calls
#
#   rank 0: train.py's loop (Orchestrator, engine, sandboxes, run folder)      ranks 1..N-1: `follow`
#     LeaderLearner.train_step(batch) ── broadcast ("train_step", batch) ──>  learner.train_step(batch)
#       then its own shard's train_step; all ranks meet in the step's collectives (FSDP, EP, sums)
#     LeaderLearner.weights()  ── broadcast ──>  full_state_dict(): gathered on rank 0 for its engine
#     LeaderLearner.state()    ── broadcast ──>  save_checkpoint(run/learner/policy-N): every rank its shards
#     close()                  ── broadcast ("stop") ──>  the followers return
#     (a call that raised on rank 0 sends no stop: the followers are inside its collectives, and
#     torchrun ends them when rank 0 exits with the error; a follower's error ends rank 0 the same way)
#
# The followers wait in the broadcast while rank 0 collects rollouts and evaluates: that wait is
# bounded by `DistConfig.timeout_s`. The checkpoint folder must be one filesystem for all ranks
# (one node under torchrun --standalone; a shared filesystem across nodes).

FOLLOWED = frozenset({"train_step", "weights", "save_checkpoint", "load_checkpoint", "full_model"})


class LeaderLearner:
    """Rank 0's Learner under `flywheel train`: each call is broadcast to the other ranks (`follow`),
    then made on rank 0's shard. It offers what the training loop uses of a `Learner` (train_step,
    weights, state, load_state, version, model); state() is a DCP checkpoint of every rank's shards
    under `checkpoints`, named in the small dict the run folder saves with the Orchestrator's
    progress, so a run killed at any point resumes from the last one written in full, under any mesh."""

    def __init__(self, learner: DistributedLearner, checkpoints: Path):
        self.learner = learner
        self.checkpoints = Path(checkpoints)
        # A call that raised left the other ranks inside one of its collectives: they cannot take a
        # "stop" then, so close() sends none and torchrun ends them when this process exits.
        self.failed = False

    def _call(self, name: str, *args: Any) -> Any:
        dist.broadcast_object_list([(name, args)], src=0)
        try:
            return getattr(self.learner, name)(*args)
        except BaseException:
            self.failed = True
            raise

    @property
    def version(self) -> int:
        return self.learner.version

    @property
    def model(self) -> PreTrainedModel:
        """The trained model, unsharded, for the Registry (collective: the followers gather with it)."""
        return self._call("full_model")

    def train_step(self, trajectories: Sequence[Trajectory], advantages: Sequence[Advantage]) -> dict[str, float]:
        return self._call("train_step", list(trajectories), list(advantages))

    def weights(self) -> dict[str, torch.Tensor]:
        return self._call("weights")

    def state(self) -> dict[str, Any]:
        folder = self.checkpoints / f"policy-{self.learner.version:06d}"
        shutil.rmtree(folder, ignore_errors=True)  # one a killed run wrote and never pointed to
        self._call("save_checkpoint", str(folder))
        # The run folder still points at the previous checkpoint until this one is recorded: keep both.
        older = sorted(p for p in self.checkpoints.glob("policy-*") if p.name < folder.name)
        for stale in older[:-1]:
            shutil.rmtree(stale, ignore_errors=True)
        return {"dcp": str(folder), "version": self.learner.version,
                "mesh": self.learner.dist_config.model_dump(include={"dp_replicate", "dp_shard", "ep"})}

    def snapshot(self) -> Callable[[], dict[str, Any]]:
        """`state()` taken now (every rank writes its shards), for `RunFolder.save_state_later`."""
        state = self.state()
        return lambda: state

    def load_state(self, state: dict[str, Any]) -> None:
        if "dcp" not in state:
            raise ValueError("the run folder holds a single-process Learner's state (learner.pt with weights), "
                             "not a distributed checkpoint; resume it without [dist], or give a new run_dir")
        self._call("load_checkpoint", state["dcp"])

    def close(self) -> None:
        if not self.failed:
            dist.broadcast_object_list([("stop", ())], src=0)


def follow(learner: DistributedLearner) -> None:
    """Ranks > 0 under `flywheel train`: make each call rank 0's `LeaderLearner` broadcasts, until stop."""
    while True:
        message: list[Any] = [None]
        dist.broadcast_object_list(message, src=0)
        name, args = message[0]
        if name == "stop":
            return
        if name not in FOLLOWED:
            raise ValueError(f"rank 0 asked for {name!r}; a follower makes only {sorted(FOLLOWED)}")
        getattr(learner, name)(*args)


@contextmanager
def leading(model: PreTrainedModel, start: int, config: LearnerConfig, dist_config: DistConfig,
            checkpoints: Path) -> Iterator[LeaderLearner]:
    """Rank 0's side of `flywheel train`: tells the followers the start checkpoint (Registry version
    `start`), shards `model` with them, and stops them on exit."""
    dist.broadcast_object_list([start], src=0)
    learner = LeaderLearner(DistributedLearner(model.train(), config, dist_config), checkpoints)
    try:
        yield learner
    finally:
        learner.close()


def follow_training(registry_root: Path, config: LearnerConfig, dist_config: DistConfig) -> None:
    """The other ranks' side of `flywheel train`: load the start checkpoint rank 0 names, shard it,
    follow rank 0's calls until it stops."""
    from flywheel.model.registry import Registry  # noqa: PLC0415  (the command only)

    start: list[Any] = [None]
    dist.broadcast_object_list(start, src=0)
    with Registry(registry_root) as registry:
        model, _ = registry.load(start[0])
    follow(DistributedLearner(model.train(), config, dist_config))


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
    dist.barrier()  # no process tears its connections down while a peer still uses them
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
