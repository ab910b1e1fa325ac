"""The Ray backend of the training loop: rollout workers and the learner as actors across nodes.

    driver: rl/train.py (the same loop as local)             Ray cluster
    ┌──────────────────────────────────────────┐   placement group, one bundle per worker (SPREAD)
    │ Orchestrator threads ── RayRollouts ─────┼──> RolloutWorker i: LocalEngine + FleetPool, ≤ episodes_per_worker
    │   each episode: a streaming call; every  │<── ("turn", EpisodeState) ... ("done", Trajectory)
    │   turn's state saved to run/inflight/    │
    │ learning_step:                           │   placement group of one bundle
    │   RemoteLearner.train_step ──────────────┼──> LearnerActor (Learner: weights, optimizer, version)
    │   RayRollouts.update_weights(ref, v) ────┼──> the actor's weights are one object in the store;
    │   consumed(groups, v)                    │    every worker's engine loads them at a step boundary
    └──────────────────────────────────────────┘

What waits for what:
- An episode is one call to a worker's `play`, a generator: it yields the EpisodeState at every turn
  boundary and the Trajectory at the end. The driver's thread waits for the next item at most
  `actor_timeout_s`; the Orchestrator's `on_turn` runs here, on the driver, so run/inflight/ holds
  every remote episode's latest state exactly as a local run's.
- A weight update is one object in the store (the learner actor's return value, put there once) and
  one call per worker; the driver waits for every worker's acknowledgement at most `actor_timeout_s`.
  Each engine swaps at its next step boundary, and every token keeps the version that sampled it.
- The learner's step is one call, waited for at most `learner_timeout_s`.

Faults:
- A worker that dies (`ray.kill`, its node removed, its process killed) fails its calls with a
  `RayActorError`: each of its in-flight episodes continues from its last EpisodeState on the least
  loaded live worker (`failover_episodes` counts them; an episode that had not finished its first
  turn starts again there). The trajectory comes back once, from the worker that finished it, so
  nothing is lost or trained twice. Dead workers are not replaced; when none is left the run stops
  with an error that says so.
- A worker or learner that does not answer within its timeout is named (actor name, node, pid) in
  `ActorHung`; the Orchestrator turns that into `OrchestratorStalled`. Never a silent hang.
- The learner actor's death raises `LearnerLost`; `train` restarts the run from its last checkpoint
  (`cluster.learner_restarts` times), the path a killed local run takes: groups consumed after the
  checkpoint are buffered again, in-flight episodes resume from run/inflight/.

Sandbox fleet (`flywheel.rl.ray_fleet`): each node's sandboxes belong to one pool actor, sized from
the resources Ray reports for the node (CPUs and memory; its log says how it chose), growing and
shrinking its warm set with demand; when it is full, acquires queue in arrival order instead of
failing. A pool actor that dies alone takes its workspaces with it; the episodes that held one play
on from their last EpisodeState on the node's next pool (`resumed_episodes`). `RayCluster.stats`
reports per node: live, peak and warm sandboxes, capacity, admission queue wait (p50, p99),
sandboxes created per second, resumed episodes.

What it does not cover:
- Dead workers are not replaced with new actors, so a long run loses capacity with every node lost.
- The driver (Orchestrator, run folder) is one process: its death is the local run's death (restart
  resumes), and the run folder must be on the driver's disk.
- Engine requests of the held-out eval go to a worker's engine and fail, not fail over, if it dies.
- Weights travel through the object store, not a collective: fine for the tiny default (8 MB per
  update); a billion-parameter policy wants NCCL broadcast between learner and engines.
- Workers rebuild the model from the driver's state dict; they do not read the Registry.
"""

from __future__ import annotations

import os
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import ray
import torch
from ray.exceptions import GetTimeoutError, ObjectLostError, RayActorError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from flywheel.agent.episode import EpisodeConfig, EpisodeState, run_episode
from flywheel.agent.trajectory import Trajectory
from flywheel.env.pool import PoolConfig
from flywheel.env.task import Task
from flywheel.model.engine import EngineConfig, Generation, LocalEngine, SamplingParams
from flywheel.rl.cluster import ClusterConfig, LearnerLost
from flywheel.rl.learner import Advantage, Learner, LearnerConfig
from flywheel.rl.ray_fleet import FleetClient

_DIED = (RayActorError, ObjectLostError)  # what a call to a dead actor (or to one on a dead node) raises


class ActorHung(RuntimeError):
    """An actor did not answer within its configured timeout; the message names it."""


class NoWorkersLeft(RuntimeError):
    pass


def ray_env() -> dict[str, str]:
    """The environment every Ray process of a run gets: no usage reporting."""
    return {"RAY_USAGE_STATS_ENABLED": "0"}


class _Stop(Exception):
    """Raised in a worker's episode at its turn boundary once the driver asked it to stop."""


class RolloutWorker:
    """One node's rollout capacity: an engine and a sandbox pool, playing episodes for the driver."""

    def __init__(self, name: str, model_class: type, model_config: Any, state: Mapping[str, torch.Tensor],
                 tokenizer: PreTrainedTokenizerBase, engine: EngineConfig, pool: PoolConfig, cluster: ClusterConfig,
                 version: int, engine_factory: Callable[[PreTrainedTokenizerBase, int], Any] | None = None):
        torch.set_num_threads(engine.threads or 1)
        self.name, self.tokenizer = name, tokenizer
        if engine_factory is not None:  # another Engine (bench/ray_scale.py: a modeled accelerator)
            self.engine = engine_factory(tokenizer, version)
        else:
            model = model_class(model_config)
            model.load_state_dict(state, strict=True)
            self.engine = LocalEngine(model.eval(), engine, version)
        context = ray.get_runtime_context()
        self.node_id = context.get_node_id()
        node = next(n for n in ray.nodes() if n["NodeID"] == self.node_id)
        self.pool = FleetClient(pool, cluster)  # this node's sandbox pool actor (flywheel.rl.ray_fleet)
        self.sizing = f"{name} on node {self.node_id[:8]} ({node['NodeManagerAddress']}): {self.pool.sizing}"
        print(self.sizing, flush=True)  # the sizing is the node's to state, in its own log too
        self._stopped: set[str] = set()
        self._lock = threading.Lock()

    def where(self) -> dict[str, Any]:
        return {"name": self.name, "node_id": self.node_id, "pid": os.getpid(), "sizing": self.sizing,
                "actor_id": ray.get_runtime_context().get_actor_id(), "max_active": self.pool.capacity}

    def play(self, key: str, task: Task, config: EpisodeConfig, group_id: str, resume: EpisodeState | None,
             priority: int):
        """Run one episode; yield ("turn", EpisodeState) at every turn boundary, then ("done", Trajectory)."""
        out: queue.Queue[tuple[str, Any]] = queue.Queue()

        def on_turn(state: EpisodeState) -> None:
            with self._lock:
                if key in self._stopped:
                    raise _Stop
            out.put(("turn", state.model_copy(deep=True)))

        def episode() -> None:
            try:
                out.put(("done", self.pool.play(  # resumed from its last state if the node's pool dies under it
                    lambda pool, state, turn: run_episode(task, self.engine, self.tokenizer, pool, config,
                                                          group_id=group_id, resume=state, on_turn=turn,
                                                          priority=priority),
                    resume, on_turn, f"episode {task.id} ({group_id})")))
            except _Stop:
                out.put(("stopped", None))
            except BaseException as exc:  # noqa: BLE001 - re-raised in the generator, so the driver sees it
                out.put(("error", exc))

        threading.Thread(target=episode, name=f"episode-{key}", daemon=True).start()
        try:
            while True:
                kind, value = out.get()
                if kind == "error":
                    raise value
                if kind == "stopped":
                    return
                yield kind, value
                if kind == "done":
                    return
        finally:
            with self._lock:
                self._stopped.discard(key)

    def stop(self, key: str) -> None:
        """The driver stopped waiting for episode `key`: end it at its next turn boundary."""
        with self._lock:
            self._stopped.add(key)

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation:
        return self.engine.submit(prompt_ids, params).result()

    def update_weights(self, weights: Mapping[str, torch.Tensor], version: int, timeout_s: float) -> int:
        self.engine.update_weights(weights, version, timeout_s=timeout_s)
        return self.engine.version

    def stats(self) -> dict[str, Any]:
        return {"name": self.name, "node_id": self.node_id, **self.pool.stats()}

    def burst(self, n: int) -> dict[str, float]:
        """`n` sandboxes asked for at once through this node's pool (more than it holds queue, none
        fail), each released when made: sandboxes created per second, and the worst queue wait."""
        def one() -> float:
            asked = time.perf_counter()
            self.pool.release(self.pool.acquire({"a.py": "x = 1\n"}))
            return time.perf_counter() - asked

        t0 = time.perf_counter()
        with ThreadPoolExecutor(self.pool.capacity) as threads:
            waits = list(threads.map(lambda _: one(), range(n)))
        seconds = time.perf_counter() - t0
        return {"sandboxes": n, "max_active": self.pool.capacity, "seconds": seconds,
                "created_per_s": n / seconds, "slowest_acquire_s": max(waits)}

    def close(self) -> None:
        self.engine.close()
        self.pool.close()


class LearnerActor:
    """The Learner in an actor of its own; `weights()`'s return value is the one copy in the store."""

    def __init__(self, model_class: type, model_config: Any, state: Mapping[str, torch.Tensor], config: LearnerConfig,
                 version: int, threads: int):
        torch.set_num_threads(threads)
        model = model_class(model_config)
        model.load_state_dict(state, strict=True)
        self.learner = Learner(model.train(), config, version=version)

    def where(self) -> dict[str, Any]:
        return {"node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}

    def train_step(self, trajectories: Sequence[Trajectory], advantages: Sequence[Advantage]) -> tuple[dict, int]:
        return self.learner.train_step(trajectories, advantages), self.learner.version

    def weights(self) -> dict[str, torch.Tensor]:
        return self.learner.weights()

    def state(self) -> dict[str, Any]:
        return self.learner.state()

    def load_state(self, state: Mapping[str, Any]) -> int:
        self.learner.load_state(state)
        return self.learner.version


def _state_of(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class RemoteLearner:
    """The `Learner` interface the loop uses (train_step, weights, state, load_state, version, model)
    over a LearnerActor. `version` is kept here, so the Orchestrator's getter never waits on Ray."""

    def __init__(self, model: PreTrainedModel, config: LearnerConfig, cluster: ClusterConfig, version: int = 0,
                 threads: int = 1):
        self.cluster, self._model, self.version = cluster, model, version
        bundle = {"CPU": cluster.learner_cpus, **cluster.learner_resources}
        self._pg = placement_group([bundle], name="flywheel-learner")
        _ready(self._pg, "the learner's bundle", bundle, cluster.start_timeout_s)
        actor_class = ray.remote(LearnerActor)
        self._actor = actor_class.options(
            name=f"learner-{uuid.uuid4().hex[:6]}", num_cpus=cluster.learner_cpus, resources=cluster.learner_resources,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=0),
            max_restarts=0).remote(type(model), model.config, _state_of(model), config, version, threads)
        self._where_ref = self._actor.where.remote()  # not waited for: the rollout workers start meanwhile
        self._where: dict[str, Any] = {}

    @property
    def where(self) -> dict[str, Any]:
        """Node and pid of the actor (waits for it to have started)."""
        if not self._where:
            self._where = self._get(self._where_ref, self.cluster.start_timeout_s, "starting")
        return self._where

    def _get(self, ref: Any, timeout_s: float, what: str) -> Any:
        try:
            return ray.get(ref, timeout=timeout_s)
        except GetTimeoutError:
            where = self._where
            raise ActorHung(f"the learner actor (node {where.get('node_id', '?')[:8]}, pid {where.get('pid', '?')}) "
                            f"did not finish {what} within {timeout_s:.0f} s; raise cluster.learner_timeout_s if "
                            "its steps are that slow, else inspect it (`ray stack`)") from None
        except _DIED as exc:
            raise LearnerLost(f"the learner actor died during {what} ({type(exc).__name__}); the run resumes from "
                              "its last checkpoint") from exc

    def train_step(self, trajectories: Sequence[Trajectory], advantages: Sequence[Advantage]) -> dict[str, float]:
        metrics, self.version = self._get(self._actor.train_step.remote(list(trajectories), list(advantages)),
                                          self.cluster.learner_timeout_s, "a train step")
        return metrics

    def weights(self) -> ray.ObjectRef:
        """A reference to the weights in the object store (put there once, by the actor's return)."""
        return self._actor.weights.remote()

    def state(self) -> dict[str, Any]:
        return self._get(self._actor.state.remote(), self.cluster.learner_timeout_s, "a checkpoint")

    def load_state(self, state: Mapping[str, Any]) -> None:
        self.version = self._get(self._actor.load_state.remote(dict(state)), self.cluster.learner_timeout_s,
                                 "loading a checkpoint")

    @property
    def model(self) -> PreTrainedModel:
        """The driver's copy of the model, with the learner's current weights (to register them)."""
        self._model.load_state_dict(self._get(self.weights(), self.cluster.learner_timeout_s, "sending weights"))
        return self._model

    def close(self) -> None:
        ray.kill(self._actor, no_restart=True)
        remove_placement_group(self._pg)


def _ready(pg: Any, what: str, bundle: Mapping[str, float], timeout_s: float) -> None:
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except GetTimeoutError:
        remove_placement_group(pg)
        raise RuntimeError(f"the cluster cannot place {what} ({dict(bundle)}) within {timeout_s:.0f} s: it has "
                           f"{ray.available_resources()} free; lower cluster.worker_cpus / learner_cpus, remove the "
                           "custom resources no node offers, or add nodes") from None


class RayRollouts:
    """The Engine interface (submit, update_weights, version, close) and the Orchestrator's episode
    runner over N RolloutWorker actors, placed with one placement group."""

    def __init__(self, cluster: ClusterConfig, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                 engine: EngineConfig, pool: PoolConfig, version: int = 0, log: Callable[[str], None] = print,
                 engine_factory: Callable[[PreTrainedTokenizerBase, int], Any] | None = None):
        self.cluster, self._version, self.log = cluster, version, log
        bundle = {"CPU": cluster.worker_cpus, **cluster.worker_resources}
        self._pg = placement_group([bundle] * cluster.rollout_workers, strategy=cluster.placement,
                                   name="flywheel-rollouts")
        _ready(self._pg, f"{cluster.rollout_workers} rollout worker bundles ({cluster.placement})", bundle,
               cluster.start_timeout_s)
        state = ray.put(_state_of(model))  # one copy in the store, whatever the number of workers
        actor_class = ray.remote(RolloutWorker)
        tag = uuid.uuid4().hex[:6]
        self.workers = [
            actor_class.options(
                name=f"rollout-{i}-{tag}", num_cpus=cluster.worker_cpus, resources=cluster.worker_resources,
                max_concurrency=cluster.episodes_per_worker + 8, max_restarts=0,  # + 8: updates, stats, generate
                scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=i),
            ).remote(f"rollout-{i}", type(model), model.config, state, tokenizer, engine, pool, cluster, version,
                     engine_factory)
            for i in range(cluster.rollout_workers)]
        self.where: list[dict[str, Any]] = []
        for i, worker in enumerate(self.workers):
            try:
                self.where.append(ray.get(worker.where.remote(), timeout=cluster.start_timeout_s))
            except GetTimeoutError:
                raise ActorHung(f"rollout worker {i} did not start within {cluster.start_timeout_s:.0f} s "
                                "(cluster.start_timeout_s)") from None
            log(f"rollout worker {self.where[-1]['sizing']}")
        self._lock = threading.Lock()
        self._alive = set(range(len(self.workers)))
        self._load = [0] * len(self.workers)
        self._next = 0
        self._counts = {"failover_episodes": 0}

    # ---- Engine ---------------------------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self._version

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams) -> Future[Generation]:
        with self._lock:
            alive = sorted(self._alive)
            if not alive:
                raise NoWorkersLeft("every rollout worker is dead; restart the run (it resumes) with live nodes")
            i = alive[self._next % len(alive)]
            self._next += 1
        return self.workers[i].generate.remote(list(prompt_ids), params).future()

    def update_weights(self, weights: Mapping[str, torch.Tensor] | ray.ObjectRef, version: int,
                       timeout_s: float = 60.0) -> None:
        """Every live worker's engine swaps in `weights` (a reference: the learner's copy in the store;
        a dict is put there once first) as `version`."""
        ref = weights if isinstance(weights, ray.ObjectRef) else ray.put(dict(weights))
        with self._lock:
            alive = sorted(self._alive)
        if not alive:
            raise NoWorkersLeft(f"no rollout worker is left to take the weights of policy {version}; restart the run "
                                "on a cluster with live nodes (it resumes from its last checkpoint)")
        calls = {self.workers[i].update_weights.remote(ref, version, timeout_s): i for i in alive}
        timeout = max(timeout_s, self.cluster.actor_timeout_s)
        done, pending = ray.wait(list(calls), num_returns=len(calls), timeout=timeout)
        if pending:
            raise ActorHung(f"{self._describe(calls[pending[0]])} did not apply the weights of policy {version} "
                            f"within {timeout:.0f} s (or the learner actor did not produce them); inspect both "
                            "(`ray stack`) or raise cluster.actor_timeout_s")
        for ref_done in done:
            try:
                ray.get(ref_done)
            except _DIED as exc:
                if not self._is_worker(calls[ref_done], exc):  # the weights' producer, the learner, died
                    raise LearnerLost(f"the weights of policy {version} were lost ({type(exc).__name__}: the learner "
                                      "actor or its node died); the run resumes from its last checkpoint") from exc
                self._dead(calls[ref_done], exc)
        self._version = version

    def close(self) -> None:
        for worker in self.workers:
            ray.kill(worker, no_restart=True)
        remove_placement_group(self._pg)

    # ---- the Orchestrator's runner ------------------------------------------------------------------

    def __call__(self, task: Task, config: EpisodeConfig, group_id: str, resume: EpisodeState | None,
                 on_turn: Callable[[EpisodeState], None], priority: int) -> Trajectory:
        """Play the episode on the least loaded live worker; if that worker dies, continue from the
        last state on another one."""
        state = resume
        while True:
            i = self._acquire()
            key = uuid.uuid4().hex
            stream = self.workers[i].play.remote(key, task, config, group_id, state, priority)
            finished = False
            try:
                while True:
                    ready, _ = ray.wait([stream], timeout=self.cluster.actor_timeout_s)
                    if not ready:
                        raise ActorHung(f"{self._describe(i)} sent no turn of {task.id} ({group_id}) for "
                                        f"{self.cluster.actor_timeout_s:.0f} s (cluster.actor_timeout_s); inspect it "
                                        "(`ray stack`, py-spy) or raise the timeout if its turns are that slow")
                    try:
                        kind, value = ray.get(next(stream))
                    except StopIteration:
                        raise RuntimeError(f"{self._describe(i)} ended episode {task.id} without a result") from None
                    if kind == "done":
                        finished = True
                        return value
                    state = value
                    on_turn(value)  # the driver saves it; raises if the run is closing
            except _DIED as exc:
                self._dead(i, exc)
                with self._lock:
                    self._counts["failover_episodes"] += 1
                self.log(f"episode {task.id} ({group_id}) continues on another worker from turn "
                         f"{state.turns if state else 0}: {self._describe(i)} died")
            finally:
                self._release(i)
                if not finished:
                    self.workers[i].stop.remote(key)  # a dead worker drops it; a live one ends it at its next turn

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def stats(self) -> dict[str, Any]:
        """Per node: live and peak sandboxes, admission queue wait, creation rate; and the live workers."""
        with self._lock:
            alive = sorted(self._alive)
        rows = {}
        for i in alive:
            try:
                s = ray.get(self.workers[i].stats.remote(), timeout=self.cluster.actor_timeout_s)
            except _DIED + (GetTimeoutError,):
                continue
            rows[s["node_id"][:8]] = {"worker": s["name"], "live_sandboxes": s["active"], "peak": s["peak_active"],
                                      "queued": s["queued"], "queue_wait_ms_p99": s["queue_wait_ms_p99"],
                                      "created_per_s": s["created"] / max(s["uptime_s"], 1e-9),
                                      "capacity": s["capacity"], "warm": s["warm"],
                                      "queue_wait_ms_p50": s["queue_wait_ms_p50"],
                                      "created_per_s_recent": s["created_per_s_recent"],
                                      "resumed_episodes": s["resumed_episodes"]}
        return {"live_workers": len(alive), "nodes": rows}

    # ---- internals ------------------------------------------------------------------------------------

    def _acquire(self) -> int:
        with self._lock:
            if not self._alive:
                raise NoWorkersLeft(f"all {len(self.workers)} rollout workers are dead; restart the run on a cluster "
                                    "with live nodes (it resumes from run/inflight/)")
            i = min(self._alive, key=lambda j: (self._load[j], j))
            self._load[i] += 1
            return i

    def _release(self, i: int) -> None:
        with self._lock:
            self._load[i] -= 1

    def _is_worker(self, i: int, exc: BaseException) -> bool:
        """Whether `exc`, raised by a call to worker i, says that worker died (not an actor whose
        object the call took as an argument)."""
        return isinstance(exc, RayActorError) and exc.actor_id in (None, self.where[i]["actor_id"])

    def _dead(self, i: int, exc: BaseException) -> None:
        with self._lock:
            if i not in self._alive:
                return
            self._alive.discard(i)
        self.log(f"{self._describe(i)} is gone ({type(exc).__name__}); {len(self._alive)} rollout workers left")

    def _describe(self, i: int) -> str:
        w = self.where[i] if i < len(self.where) else {}
        return f"rollout worker {w.get('name', i)} (node {w.get('node_id', '?')[:8]}, pid {w.get('pid', '?')})"


class RayCluster:
    """Connects to (or starts) the Ray cluster and makes the run's actors."""

    def __init__(self, config: ClusterConfig, log: Callable[[str], None] = print):
        self.config, self.log = config, log
        self._started = False
        self._actors: list[Any] = []
        os.environ.update(ray_env())
        if not ray.is_initialized():
            if config.address:
                ray.init(address=config.address, log_to_driver=True)
            else:
                ray.init(num_cpus=config.num_cpus, object_store_memory=config.object_store_mb * 2**20,
                         include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=True)
                self._started = True
        nodes = [n for n in ray.nodes() if n["Alive"]]
        log(f"ray cluster: {len(nodes)} nodes, {ray.cluster_resources().get('CPU', 0):g} CPUs"
            + (" (started here)" if self._started else f" (joined {config.address or 'the connected one'})"))

    @contextmanager
    def learner(self, model: PreTrainedModel, config: LearnerConfig, version: int = 0,
                threads: int = 1) -> Iterator[RemoteLearner]:
        learner = RemoteLearner(model, config, self.config, version, threads)
        self._actors.append(learner)
        try:
            yield learner
        finally:
            self._close(learner)

    @contextmanager
    def engine(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, engine: EngineConfig,
               pool: PoolConfig, version: int = 0, checkpoint: Any = None) -> Iterator[RayRollouts]:
        if engine.backend == "vllm":
            raise ValueError("engine.backend = \"vllm\" runs with cluster.backend = \"local\" (the rollout workers "
                             "on Ray build local engines); set cluster.backend = \"local\"")
        rollouts = RayRollouts(self.config, model, tokenizer, engine, pool, version, self.log)
        self._actors.append(rollouts)
        try:
            yield rollouts
        finally:
            self._close(rollouts)

    def runner(self, engine: Any) -> RayRollouts:
        return engine

    def stats(self) -> dict[str, Any]:
        return next((a.stats() for a in self._actors if isinstance(a, RayRollouts)), {})

    def _close(self, actor: RemoteLearner | RayRollouts) -> None:
        if actor in self._actors:
            self._actors.remove(actor)
            actor.close()

    def close(self) -> None:
        for actor in list(self._actors):
            self._close(actor)
        if self._started:
            ray.shutdown()

    def __enter__(self) -> RayCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
