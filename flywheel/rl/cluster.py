"""Where the training loop's parts run: in this process (`local`, the default) or as Ray actors.

    cluster.backend = "local"                      cluster.backend = "ray"
    ┌──────────── this process ────────────┐      driver (rl/train.py)           Ray cluster (nodes)
    │ Orchestrator ── threads ──> Engine   │      Orchestrator ──runner──> RolloutWorker actor × N
    │      │              └──> SandboxPool │        │   (EpisodeState every turn   (LocalEngine + SandboxPool
    │  Learner ──weights──> Engine         │        │    back to run/inflight/)     sized from its node)
    └──────────────────────────────────────┘      RemoteLearner ──> LearnerActor ──ray.put once──> every engine

`train` asks `start_cluster(config)` for the Learner, the Engine and the Orchestrator's episode
runner, and drives them through the same four calls either way (`next_batch`, `train_step`,
`update_weights`, `consumed`); the Orchestrator, its staleness bound, partial rollouts and the run
folder are the same code. The Ray backend lives in `flywheel.rl.ray_backend`, imported only when
it is asked for, so the local backend never loads Ray.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from flywheel.env.pool import PoolConfig
from flywheel.extras import require
from flywheel.model.engine import EngineConfig
from flywheel.model.process_engine import start_engine
from flywheel.model.weight_delta import DeltaPush
from flywheel.rl.learner import Learner, LearnerConfig


class ClusterConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    backend: Literal["local", "ray"] = "local"
    # Ray only. "" starts a Ray cluster of one node in this process's machine (shut down at the end);
    # "auto" joins the one `ray start --head` started here; "host:port" joins that head node.
    address: str = ""
    rollout_workers: int = Field(2, ge=1)  # RolloutWorker actors: each one engine + one sandbox pool
    # Placement of the rollout workers' bundles: SPREAD puts one per node where it can (a node's
    # engine and sandboxes then share only that node's cores); STRICT_SPREAD refuses otherwise.
    placement: Literal["SPREAD", "STRICT_SPREAD", "PACK"] = "SPREAD"
    # Ray CPU requests. Fractional on purpose: an actor's request only reserves scheduling room,
    # and whole CPUs on a 2-core machine would leave the learner or a worker unschedulable.
    worker_cpus: float = Field(0.5, gt=0)
    learner_cpus: float = Field(0.5, gt=0)
    # Custom resources each rollout worker's / the learner's bundle asks for (e.g. {"rollout": 1} on
    # the nodes meant for rollouts, {"learner": 1} on the one with the accelerator).
    worker_resources: dict[str, float] = Field(default_factory=dict)
    learner_resources: dict[str, float] = Field(default_factory=dict)
    episodes_per_worker: int = Field(16, ge=1)  # concurrent episodes one worker plays (its actor threads)
    # Each worker's bundle also holds its node's inference engine, an EngineActor of its own
    # (flywheel/rl/ray_engine.py), which asks for this much CPU.
    engine_cpus: float = Field(0.3, gt=0)
    # An engine that sends no token of a request (or no weight-update acknowledgement) for this long
    # is named as hung. Below actor_timeout_s, so the engine is named, not the worker waiting on it;
    # None: half of actor_timeout_s.
    engine_timeout_s: float | None = Field(None, gt=0)
    # How often an engine sends a request's new tokens to its worker. Shorter loses fewer tokens when
    # an engine dies (they are sampled again elsewhere) at the cost of more store objects per request.
    token_stream_s: float = Field(0.2, gt=0)
    # A worker that sends no turn (or no weight-update acknowledgement) for this long is named as
    # hung and the run stops with that error. Must exceed the slowest turn, queueing for a sandbox included.
    actor_timeout_s: float = Field(300.0, gt=0)
    learner_timeout_s: float = Field(1800.0, gt=0)  # the same for the learner's step
    start_timeout_s: float = Field(300.0, gt=0)  # placing and starting the actors (each imports torch)
    # Learner actor deaths the run survives: each one restarts the run from its last checkpoint
    # (run/state), as a killed local run restarts, buffered and in-flight rollouts intact.
    learner_restarts: int = Field(1, ge=0)
    # The sandbox pool of each worker sizes itself from its node: max_active is the smaller of
    # node CPUs × sandboxes_per_cpu and node memory × sandbox_memory_fraction / sandbox.disk_mb
    # (each sandbox's tmpfs is host memory), capped by pool.max_active.
    sandboxes_per_cpu: float = Field(8.0, gt=0)
    sandbox_memory_fraction: float = Field(0.5, gt=0, le=1)
    # A cluster started here (address ""): its CPUs (None: the machine's) and object store. Keep the
    # store small on a shared machine; a weight update of the embedded default is 8 MB.
    num_cpus: float | None = None
    object_store_mb: int = Field(200, ge=75)

    @model_validator(mode="after")
    def _check(self) -> ClusterConfig:
        if self.backend == "local" and self.address:
            raise ValueError(f"cluster.address={self.address!r} is for the Ray backend; set cluster.backend=\"ray\" "
                             "or leave the address empty")
        if self.engine_timeout_s is None:
            self.engine_timeout_s = self.actor_timeout_s / 2
        if self.engine_timeout_s >= self.actor_timeout_s:
            raise ValueError(f"cluster.engine_timeout_s={self.engine_timeout_s:g} must be below "
                             f"cluster.actor_timeout_s={self.actor_timeout_s:g}, so that a hung engine is named "
                             "before the worker that waits on it; lower it")
        return self


class LearnerLost(RuntimeError):
    """The learner (a Ray actor) died; `train` resumes the run from its last checkpoint."""


class LocalCluster:
    """The embedded default: the Learner here, the Engine here (or in its own process,
    `EngineConfig.separate_process`), episodes on the Orchestrator's threads."""

    def learner(self, model: PreTrainedModel, config: LearnerConfig, version: int = 0,
                threads: int = 1, ref_model: PreTrainedModel | None = None) -> AbstractContextManager[Learner]:
        # threads: the process's own; ref_model: the KL term's reference (loss.kl_coef > 0)
        return nullcontext(Learner(model.train(), config, ref_model=ref_model, version=version))

    @contextmanager
    def engine(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, engine: EngineConfig,
               pool: PoolConfig, version: int = 0, checkpoint: Any = None,
               weight_deltas: bool = False) -> Iterator[Any]:
        # checkpoint: the start checkpoint's folder, which engine.backend = "vllm" serves; weight_deltas:
        # every update after the first sends only the changed weights (flywheel.model.weight_delta; the
        # vLLM engine writes them for its servers' workers to apply, flywheel.model.vllm_worker)
        vllm = engine.backend == "vllm"
        if weight_deltas and vllm:
            engine = engine.model_copy(update={"vllm": engine.vllm.model_copy(update={"weight_deltas": True})})
        with start_engine(model, engine, version=version, checkpoint=checkpoint) as started:
            yield DeltaPush(started) if weight_deltas and not vllm else started

    def runner(self, engine: Any) -> None:
        return None  # the Orchestrator plays episodes on its own threads

    def stats(self) -> dict[str, Any]:
        return {}


def join_env(address: str) -> dict[str, str]:
    """What a driver joining the cluster at `address` needs: `ray start --head` (Ray 2.60) turns token
    authentication on and writes the token to ~/.ray/auth_token, and a driver in the default mode
    is refused ("InvalidAuthToken"); with a token at hand it asks for token mode. Read by Ray when
    it is imported. The user's own RAY_AUTH_MODE wins.

    A token file alone may be stale: left by an earlier `ray start` while this cluster runs without
    authentication. A driver in token mode then joins, but the cluster's calls back to it carry no
    token and are refused, so its first actor is cancelled ("Actor creation cancelled"). So with only
    a file to go by, a driver in the default mode tries the cluster first (a throwaway process, a few
    seconds), and token mode is asked for only if that one is refused."""
    if "RAY_AUTH_MODE" in os.environ:
        return {}
    if os.environ.get("RAY_AUTH_TOKEN"):
        return {"RAY_AUTH_MODE": "token"}
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH", Path.home() / ".ray" / "auth_token"))
    if not path.is_file() or _joins_without_token(address):
        return {}
    return {"RAY_AUTH_MODE": "token"}


def _joins_without_token(address: str, timeout_s: float = 60.0) -> bool:
    """Whether a driver in Ray's default mode (no token) can join `address`."""
    probe = "import sys, ray; ray.init(address=sys.argv[1], log_to_driver=False); ray.shutdown()"
    try:
        done = subprocess.run([sys.executable, "-c", probe, address], capture_output=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return False
    return done.returncode == 0


@contextmanager
def start_cluster(config: ClusterConfig, log: Any = print) -> Iterator[Any]:
    """The backend `config` names, connected; a Ray cluster started here is shut down at the end."""
    if config.backend == "local":
        yield LocalCluster()
        return
    if config.address:
        os.environ.update(join_env(config.address))  # before Ray is imported: it reads the mode then
    require("ray", 'cluster.backend = "ray"')
    from flywheel.rl.ray_backend import RayCluster  # noqa: PLC0415 - Ray is loaded only when asked for

    with RayCluster(config, log) as cluster:
        yield cluster
