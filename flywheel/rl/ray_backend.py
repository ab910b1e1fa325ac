"""The Ray backend of the training loop: rollout workers, engines and the learner as actors across nodes.

    driver: rl/train.py (the same loop as local)             Ray cluster
    ┌──────────────────────────────────────────┐   placement group, one bundle per worker (SPREAD)
    │ Orchestrator threads ── RayRollouts ─────┼──> RolloutWorker i: SandboxPool, ≤ episodes_per_worker,
    │   each episode: a streaming call; every  │<──   RayEngine ──requests──> EngineActor i (same bundle)
    │   turn's state saved to run/inflight/    │    ("turn", EpisodeState) ... ("done", Trajectory)
    │ learning_step:                           │   placement group of one bundle
    │   RemoteLearner.train_step ──────────────┼──> LearnerActor (Learner: weights, optimizer, version)
    │   RayRollouts.update_weights(ref, v) ────┼──> the actor's weights are one object in the store;
    │   consumed(groups, v)                    │    every engine loads them at a step boundary
    │ watching: each engine's and worker's     │
    │   `alive` call: start replacements       │
    └──────────────────────────────────────────┘

What waits for what:
- An episode is one call to a worker's `play`, a generator: it yields the EpisodeState at every turn
  boundary and the Trajectory at the end. The driver's thread waits for the next item at most
  `actor_timeout_s`; the Orchestrator's `on_turn` runs here, on the driver, so run/inflight/ holds
  every remote episode's latest state exactly as a local run's. Each item carries the worker's
  count of engine requests resubmitted, so the step's counts need no call to any worker.
- A weight update is one object in the store (the learner actor's return value, put there once) and
  one call per live engine (flywheel/rl/ray_engine.py); the driver waits for every engine's
  acknowledgement at most `engine_timeout_s`. Each engine swaps at its next step boundary, and
  every token keeps the version that sampled it. With `weight_deltas` the driver fetches the
  learner's weights once, compares them with its copy of the last ones pushed, and puts only the
  changes in the store (one object for all engines); an engine at another version than that last
  one (a replacement, one that missed an update) gets the driver's copy whole.
- The learner's step is one call, waited for at most `learner_timeout_s`. A checkpoint's state is
  one more call, queued behind the step: the run folder's writer thread fetches and writes it while
  the next step runs, and the step's metrics line lands only after it (`RunFolder.save_state_later`).
- The fleet's per-node figures (fleet.jsonl) are one call per worker and engine, made on a thread
  of their own after each step (`FleetLog` in flywheel/rl/train.py): no step waits for them.

Faults:
- A worker that dies (`ray.kill`, its node removed, its process killed) fails its calls with a
  `RayActorError`: each of its in-flight episodes continues from its last EpisodeState on the least
  loaded live worker (`failover_episodes` counts them; an episode that had not finished its first
  turn starts again there). The trajectory comes back once, from the worker that finished it, so
  nothing is lost or trained twice. A worker that dies between episodes fails its held-open
  `alive` call, so its death is noticed before an episode is sent to it. A new worker takes the
  dead one's place (`workers_replaced`, and its time in metrics.jsonl's `replacements`) in the
  dead one's bundle, which Ray places again on a live node with room when the node died (or on a
  node that joins later); it is tried until it starts. Until then the others carry the load;
  with none left, episodes and the weight push wait for a replacement that is starting (up to
  `start_timeout_s`), and when none is coming the run stops with an error that says so.
- An engine that dies: its in-flight requests go to another engine as prompt + tokens so far
  (`engine_resubmits`), the driver starts a new engine with the latest weights in its place
  (`engine_restarts`) and hands it to every worker. An engine that sends no token within
  `engine_timeout_s` is named (node, pid) in `ActorHung`.
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
- A replacement waits for room in its bundle: with `STRICT_SPREAD` and no node free of the run's
  bundles, the fleet stays one worker short until a node joins (it is tried again meanwhile).
- The driver (Orchestrator, run folder) is one process: its death is the local run's death (restart
  resumes), and the run folder must be on the driver's disk.
- Engine requests of the held-out eval go through a worker: they move to another engine if the
  engine dies, but fail, not fail over, if the worker dies.
- Weights travel through the object store, not a collective: fine for the tiny default (8 MB per
  update); a billion-parameter policy wants NCCL broadcast between learner and engines. With
  `weight_deltas` the comparison runs on the driver, so the whole weights still cross from the
  learner to the driver once per update (the engines get only the changes); a learner that diffed
  on its own node would save that transfer too.
- Engines rebuild the model from the driver's state dict; they do not read the Registry.

Why one file of about 900 lines: the driver's view of its actors is one piece of state (who is alive,
who is being replaced, the latest weights a replacement must load, each engine's version, which
decides whether it can take a delta) under one lock, and each fault path reads and writes all of it;
split, the invariants between those fields would cross files.
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
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from flywheel.agent.episode import EpisodeConfig, EpisodeState, run_episode
from flywheel.agent.trajectory import Trajectory
from flywheel.env.pool import PoolConfig
from flywheel.env.task import Task
from flywheel.model.engine import EngineConfig, Generation, SamplingParams
from flywheel.model.weight_delta import DeltaSender
from flywheel.rl.cluster import ClusterConfig, LearnerLost
from flywheel.rl.learner import Advantage, Learner, LearnerConfig
from flywheel.rl.ray_engine import DIED as _DIED
from flywheel.rl.ray_engine import ActorHung, RayEngine, describe, start_engine_actor
from flywheel.rl.ray_fleet import FleetClient


class NoWorkersLeft(RuntimeError):
    pass


def ray_env() -> dict[str, str]:
    """The environment every Ray process of a run gets: no usage reporting."""
    return {"RAY_USAGE_STATS_ENABLED": "0"}


class _Stop(Exception):
    """Raised in a worker's episode at its turn boundary once the driver asked it to stop."""


class RolloutWorker:
    """One node's rollout capacity: an engine and a sandbox pool, playing episodes for the driver."""

    def __init__(self, name: str, engines: Sequence[Any], engine_where: Sequence[Mapping[str, Any]], home: int,
                 tokenizer: PreTrainedTokenizerBase, pool: PoolConfig, cluster: ClusterConfig):
        self.name, self.tokenizer = name, tokenizer
        # its node's EngineActor (`home`), and the others while that one is dead (flywheel/rl/ray_engine.py)
        self.engine = RayEngine(engines, engine_where, home, cluster)
        context = ray.get_runtime_context()
        self.node_id = context.get_node_id()
        node = next(n for n in ray.nodes() if n["NodeID"] == self.node_id)
        self.pool = FleetClient(pool, cluster)  # this node's sandbox pool actor (flywheel.rl.ray_fleet)
        self.sizing = f"{name} on node {self.node_id[:8]} ({node['NodeManagerAddress']}): {self.pool.sizing}"
        print(self.sizing, flush=True)  # the sizing is the node's to state, in its own log too
        self._stopped: set[str] = set()
        self._turns: dict[str, int] = {}  # each episode being played: the turns it has done
        self._lock = threading.Lock()
        self._closed = threading.Event()

    def where(self) -> dict[str, Any]:
        return {"name": self.name, "node_id": self.node_id, "pid": os.getpid(), "sizing": self.sizing,
                "actor_id": ray.get_runtime_context().get_actor_id(), "max_active": self.pool.capacity}

    def play(self, key: str, task: Task, config: EpisodeConfig, group_id: str, resume: EpisodeState | None,
             priority: int):
        """Run one episode; yield ("turn", EpisodeState) at every turn boundary, then ("done", Trajectory),
        each with this worker's engine requests resubmitted so far (the driver's `engine_resubmits`)."""
        out: queue.Queue[tuple[str, Any]] = queue.Queue()

        def on_turn(state: EpisodeState) -> None:
            with self._lock:
                if key in self._stopped:
                    raise _Stop
                self._turns[key] = state.turns
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

        with self._lock:
            self._turns[key] = resume.turns if resume else 0
        threading.Thread(target=episode, name=f"episode-{key}", daemon=True).start()
        try:
            while True:
                kind, value = out.get()
                if kind == "error":
                    raise value
                if kind == "stopped":
                    return
                yield kind, value, self.engine.resubmits
                if kind == "done":
                    return
        finally:
            with self._lock:
                self._stopped.discard(key)
                self._turns.pop(key, None)

    def playing(self) -> list[int]:
        """The turns done by each episode this worker is playing now (what `ray` debugging asks first)."""
        with self._lock:
            return sorted(self._turns.values(), reverse=True)

    def stop(self, key: str) -> None:
        """The driver stopped waiting for episode `key`: end it at its next turn boundary."""
        with self._lock:
            self._stopped.add(key)

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation:
        return self.engine.submit(prompt_ids, params).result()

    def engine_ready(self, i: int, engine: Any, where: Mapping[str, Any]) -> None:
        self.engine.engine_ready(i, engine, where)

    def stats(self) -> dict[str, Any]:
        return {"name": self.name, "node_id": self.node_id, "engine_resubmits": self.engine.resubmits,
                **self.pool.stats()}

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

    def alive(self) -> None:
        """Returns only when the worker closes; the driver holds this call to learn of its death."""
        self._closed.wait()

    def close(self) -> None:
        self._closed.set()
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

    def snapshot(self) -> Callable[[], dict[str, Any]]:
        """The actor's state as of now, fetched when called: the call is queued behind this step
        and ahead of the next, so the snapshot is this step's, and the driver does not wait for it."""
        ref = self._actor.state.remote()
        return lambda: self._get(ref, self.cluster.learner_timeout_s, "a checkpoint")

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


def _died_itself(exc: BaseException, where: Mapping[str, Any]) -> bool:
    """Whether `exc`, raised by a call to the actor `where` describes, says that actor died (not an
    actor whose object the call took as an argument, such as the learner's weights)."""
    return (isinstance(exc, RayActorError) and not isinstance(exc, RayTaskError)
            and exc.actor_id in (None, where["actor_id"]))


class RayRollouts:
    """The Engine interface (submit, update_weights, version, close) and the Orchestrator's episode
    runner over N RolloutWorker actors, placed with one placement group."""

    def __init__(self, cluster: ClusterConfig, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                 engine: EngineConfig, pool: PoolConfig, version: int = 0, log: Callable[[str], None] = print,
                 engine_factory: Callable[[PreTrainedTokenizerBase, int], Any] | None = None,
                 weight_deltas: bool = False):
        self.cluster, self._version, self.log = cluster, version, log
        # one bundle per worker: the worker and its node's engine
        bundle = {"CPU": cluster.worker_cpus + cluster.engine_cpus, **cluster.worker_resources}
        self._tag = uuid.uuid4().hex[:6]  # in the actors' names: two fleets (two runs) may share a cluster
        self._pg = placement_group([bundle] * cluster.rollout_workers, strategy=cluster.placement,
                                   name=f"flywheel-rollouts-{self._tag}")
        _ready(self._pg, f"{cluster.rollout_workers} rollout worker bundles ({cluster.placement})", bundle,
               cluster.start_timeout_s)
        # the weights an engine started from now on loads, and their version: the start state, put in the
        # store once whatever the number of engines, then each update's reference (with weight deltas:
        # None until an engine needs the whole weights, then the driver's copy put once, `_latest_full`)
        start = _state_of(model)
        self._latest: tuple[ray.ObjectRef | None, int] = (ray.put(start), version)
        # weight_deltas: the driver's copy of the last weights pushed, which each update is compared with
        # (flywheel.model.weight_delta); the engines that hold that version get only the changes
        self._sender = DeltaSender() if weight_deltas else None
        if self._sender is not None:
            self._sender.delta(start, version)
        self.last_update_bytes: int | None = None  # weight_deltas: tensor bytes the last update sent to the engines
        self._engine_args = (type(model), model.config, engine, tokenizer, engine_factory)
        self._worker_args = (tokenizer, pool)
        self._lock = threading.Lock()
        self._worker_ready = threading.Condition(self._lock)  # a worker replaced, or a replacement given up
        self._replacing: set[int] = set()  # workers whose replacement is starting: `_acquire` waits for one
        self._closing = False
        self._counts = {"failover_episodes": 0, "engine_restarts": 0, "workers_replaced": 0}
        self._replaced: list[dict[str, Any]] = []  # replacements since the last `replacements()` call
        self._attempts: set[Any] = set()  # replacement actors still starting: `close` kills them
        self._threads: list[threading.Thread] = []  # the watch and the replacements: `close` joins them
        self._closed = threading.Event()  # wakes a replacement waiting to try again
        self._resubmits: dict[str, int] = {}  # worker actor id -> its engine_resubmits, as last reported
        n = cluster.rollout_workers
        # engines and workers start together (each imports torch: most of the start-up); the workers
        # learn where their engines are once those have started
        self.engines = [self._start_engine(i, self._bundle(i)) for i in range(n)]
        self.engine_where: list[dict[str, Any]] = [{"name": f"engine-{i}"} for i in range(n)]
        self.workers = [self._start_worker(i, self._bundle(i)) for i in range(n)]
        self.engine_where = [self._started(e, f"inference engine {i}") for i, e in enumerate(self.engines)]
        self.where = [self._started(w, f"rollout worker {i}") for i, w in enumerate(self.workers)]
        ray.get([w.engine_ready.remote(i, e, where) for w in self.workers
                 for i, (e, where) in enumerate(zip(self.engines, self.engine_where, strict=True))],
                timeout=cluster.start_timeout_s)
        for w in self.where:
            log(f"rollout worker {w['sizing']}")
        self._alive = set(range(n))
        self._engines_alive = set(range(n))
        self._engine_versions = [version] * n  # each engine's version as it last acknowledged (a delta's base)
        self._load = [0] * n
        self._next = 0
        # every actor holds one `alive` call open; the watch learns of a death when that call fails, so
        # a dead engine, or a worker that died between episodes, is replaced before anything asks it
        self._watch: dict[Any, tuple[str, int, Any]] = {e.alive.remote(): ("engine", i, e)
                                                        for i, e in enumerate(self.engines)}
        self._watch.update({w.alive.remote(): ("worker", i, w) for i, w in enumerate(self.workers)})
        self._spawn(self._watch_actors, "actor-watch")

    # ---- Engine ---------------------------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self._version

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams) -> Future[Generation]:
        with self._lock:
            if not self._a_worker_lives():
                raise NoWorkersLeft("every rollout worker is dead; restart the run (it resumes) with live nodes")
            alive = sorted(self._alive)
            i = alive[self._next % len(alive)]
            self._next += 1
        return self.workers[i].generate.remote(list(prompt_ids), params).future()

    def update_weights(self, weights: Mapping[str, torch.Tensor] | ray.ObjectRef, version: int,
                       timeout_s: float = 60.0) -> None:
        """Every live engine swaps in `weights` (a reference: the learner's copy in the store; a dict
        is put there once first) as `version`. Sent by the driver, not by the workers, so that an
        engine whose worker is dead or not yet replaced keeps up too (other workers' requests go there).

        With weight deltas the driver fetches the weights once, compares them with its copy of the
        last ones pushed and puts the changes in the store once: an engine at that last version gets
        them, any other (a replacement started since, one that missed an update) the whole weights,
        as does one that refuses the changes (its version moved meanwhile)."""
        with self._lock:
            if not self._a_worker_lives():
                raise NoWorkersLeft(f"no rollout worker is left to take the weights of policy {version}; restart the "
                                    "run on a cluster with live nodes (it resumes from its last checkpoint)")
        if self._sender is None:
            ref = weights if isinstance(weights, ray.ObjectRef) else ray.put(dict(weights))
            with self._lock:
                # an engine being replaced is not here: its replacement is brought to this version before it serves
                engines = {i: self.engines[i] for i in sorted(self._engines_alive)}
                self._latest = (ref, version)
            self._push(engines, {i: ref for i in engines}, version, timeout_s)
        else:
            state = self._learner_weights(weights, version)
            with self._lock:
                delta = self._sender.delta(state, version)  # the driver's copy becomes `state`
                self._latest = (None, version)
                engines = {i: self.engines[i] for i in sorted(self._engines_alive)}
                based = {i for i in engines if self._engine_versions[i] == delta.base_version}
            delta_ref = ray.put(delta) if based else None
            refs = {i: delta_ref if i in based else self._latest_full()[0] for i in engines}
            refused = self._push(engines, refs, version, timeout_s)
            if refused:
                self._push({i: engines[i] for i in refused}, {i: self._latest_full()[0] for i in refused}, version,
                           timeout_s)
            whole = sum(t.numel() * t.element_size() for t in state.values())
            self.last_update_bytes = delta.nbytes * (len(based) - len(refused)) + whole * (len(engines) - len(based)
                                                                                           + len(refused))
        with self._lock:
            self._version = version

    def _learner_weights(self, weights: Mapping[str, torch.Tensor] | ray.ObjectRef,
                         version: int) -> Mapping[str, torch.Tensor]:
        if not isinstance(weights, ray.ObjectRef):
            return weights
        try:
            return ray.get(weights, timeout=max(self.cluster.engine_timeout_s, self.cluster.learner_timeout_s))
        except GetTimeoutError:
            raise ActorHung(f"the learner actor did not produce the weights of policy {version} within "
                            f"{self.cluster.learner_timeout_s:.0f} s; inspect it (`ray stack`)") from None
        except _DIED as exc:
            raise LearnerLost(f"the weights of policy {version} were lost ({type(exc).__name__}: the learner actor "
                              "or its node died); the run resumes from its last checkpoint") from exc

    def _latest_full(self) -> tuple[ray.ObjectRef, int]:
        """The latest weights as one object in the store, and their version. With weight deltas the
        driver's copy is put there the first time an engine needs it after an update (then shared)."""
        with self._lock:
            ref, version = self._latest
            if ref is None:
                ref = ray.put(dict(self._sender.weights))
                self._latest = (ref, version)
            return ref, version

    def _push(self, engines: Mapping[int, Any], refs: Mapping[int, ray.ObjectRef], version: int,
              timeout_s: float) -> set[int]:
        """Send `refs[i]` to engine i as `version` and wait for every acknowledgement; returns the
        engines that refused a delta (made against another version than theirs)."""
        calls = {engines[i].update_weights.remote(refs[i], version, timeout_s): i for i in engines}
        timeout = max(timeout_s, self.cluster.engine_timeout_s)
        done, pending = ray.wait(list(calls), num_returns=len(calls), timeout=timeout)
        if pending:
            raise ActorHung(f"{describe(self.engine_where[calls[pending[0]]])} did not apply the weights of policy "
                            f"{version} within {timeout:.0f} s (or the learner actor did not produce them); inspect "
                            "both (`ray stack`) or raise cluster.engine_timeout_s")
        refused = set()
        for ref_done in done:
            i = calls[ref_done]
            try:
                held = ray.get(ref_done)
            except RayTaskError as exc:
                if not isinstance(exc.cause, ValueError) or self._sender is None:
                    raise
                refused.add(i)  # a delta against another version than the engine's: it gets the whole weights
                continue
            except _DIED as exc:
                if not _died_itself(exc, self.engine_where[i]):
                    raise LearnerLost(f"the weights of policy {version} were lost ({type(exc).__name__}: the learner "
                                      "actor or its node died); the run resumes from its last checkpoint") from exc
                with self._lock:  # the engine died: its watcher starts another, at the latest version
                    if self.engines[i] is engines[i]:
                        self._engines_alive.discard(i)
                continue
            with self._lock:
                if self.engines[i] is engines[i]:
                    self._engine_versions[i] = held
        return refused

    def close(self) -> None:
        """Kill every actor (replacements still starting too) and wait for the driver's own threads
        to end, so that none is inside a Ray call when the process shuts Ray down (a call into a
        core worker that is shut down ends the process with an error, after a run that succeeded)."""
        with self._lock:
            self._closing = True  # deaths from here on are ours: nothing is replaced
            self._worker_ready.notify_all()
            attempts = list(self._attempts)
        self._closed.set()
        for actor in self.workers + self.engines + attempts:
            ray.kill(actor, no_restart=True)
        for thread in list(self._threads):
            thread.join(timeout=self.cluster.actor_timeout_s)
        remove_placement_group(self._pg)

    # ---- the Orchestrator's runner ------------------------------------------------------------------

    def __call__(self, task: Task, config: EpisodeConfig, group_id: str, resume: EpisodeState | None,
                 on_turn: Callable[[EpisodeState], None], priority: int) -> Trajectory:
        """Play the episode on the least loaded live worker; if that worker dies, continue from the
        last state on another one."""
        state = resume
        while True:
            i, worker, actor_id = self._acquire()
            key = uuid.uuid4().hex
            stream = worker.play.remote(key, task, config, group_id, state, priority)
            finished = False
            try:
                while True:
                    ready, _ = ray.wait([stream], timeout=self.cluster.actor_timeout_s)
                    if not ready:
                        raise ActorHung(f"{self._describe(i)} sent no turn of {task.id} ({group_id}) for "
                                        f"{self.cluster.actor_timeout_s:.0f} s (cluster.actor_timeout_s); inspect it "
                                        "(`ray stack`, py-spy) or raise the timeout if its turns are that slow")
                    try:
                        kind, value, resubmits = ray.get(next(stream))
                    except RayTaskError as exc:
                        if isinstance(exc.cause, ActorHung):  # the worker named its hung engine
                            raise exc.cause from None
                        raise
                    except StopIteration:
                        raise RuntimeError(f"{self._describe(i)} ended episode {task.id} without a result") from None
                    with self._lock:
                        self._resubmits[actor_id] = resubmits
                    if kind == "done":
                        finished = True
                        return value
                    state = value
                    on_turn(value)  # the driver saves it; raises if the run is closing
            except _DIED as exc:
                self._dead(i, exc, worker)
                with self._lock:
                    self._counts["failover_episodes"] += 1
                self.log(f"episode {task.id} ({group_id}) continues on another worker from turn "
                         f"{state.turns if state else 0}: {self._describe(i)} died")
            finally:
                self._release(i)
                if not finished:
                    worker.stop.remote(key)  # a dead worker drops it; a live one ends it at its next turn

    def counts(self) -> dict[str, int]:
        """Episodes failed over, engines restarted, workers replaced, and the engine requests the
        workers resubmitted, as of each one's last episode turn (no call: the figure comes with every
        turn, so reading it costs the step nothing; a dead worker keeps its last figure)."""
        with self._lock:
            return {**self._counts, "engine_resubmits": sum(self._resubmits.values())}

    def replacements(self) -> list[dict[str, Any]]:
        """The workers and engines that replacements took the place of since the last call: which
        one, where the replacement runs, and the seconds from the death being noticed to the
        replacement serving (metrics.jsonl's `replacements`, on the step during which it happened)."""
        with self._lock:
            replaced, self._replaced = self._replaced, []
        return replaced

    def stats(self) -> dict[str, Any]:
        """Per node: live and peak sandboxes, admission queue wait, creation rate; and the live workers."""
        with self._lock:
            alive = sorted(self._alive)
            live_engines = [self.engines[i] for i in sorted(self._engines_alive)]
        # every worker and engine asked at once, then waited for together: one round trip, not one each
        worker_calls = [self.workers[i].stats.remote() for i in alive]
        engine_calls = [e.where.remote() for e in live_engines]
        ray.wait(worker_calls + engine_calls, num_returns=len(worker_calls) + len(engine_calls),
                 timeout=self.cluster.actor_timeout_s)
        rows = {}
        for ref in worker_calls:
            try:
                s = ray.get(ref, timeout=0)
            except _DIED + (GetTimeoutError,):  # dead, or hung: its row is missing this time
                continue
            rows[s["node_id"][:8]] = {"worker": s["name"], "live_sandboxes": s["active"], "peak": s["peak_active"],
                                      "queued": s["queued"], "queue_wait_ms_p99": s["queue_wait_ms_p99"],
                                      "created_per_s": s["created"] / max(s["uptime_s"], 1e-9),
                                      "capacity": s["capacity"], "warm": s["warm"],
                                      "queue_wait_ms_p50": s["queue_wait_ms_p50"],
                                      "created_per_s_recent": s["created_per_s_recent"],
                                      "resumed_episodes": s["resumed_episodes"]}
        engines = {}
        for ref in engine_calls:
            try:
                e = ray.get(ref, timeout=0)
            except _DIED + (GetTimeoutError,):
                continue
            engines[e["name"]] = {"node": e["node_id"][:8], "version": e["version"]}
        return {"live_workers": len(alive), "nodes": rows, "engines": engines}

    # ---- internals ------------------------------------------------------------------------------------

    def _a_worker_lives(self) -> bool:
        """Whether a rollout worker is alive, called holding the lock. With none alive but a replacement
        starting (the last node died while another worker's replacement still imported torch), it waits
        for that one, as long as a start may take (cluster.start_timeout_s)."""
        self._worker_ready.wait_for(lambda: self._alive or not self._replacing or self._closing,
                                    timeout=self.cluster.start_timeout_s)
        return bool(self._alive)

    def _acquire(self) -> tuple[int, Any, str]:
        """The least loaded live worker: its index, its actor handle and its actor id."""
        with self._lock:
            if not self._a_worker_lives():
                raise NoWorkersLeft(f"all {len(self.workers)} rollout workers are dead; restart the run on a cluster "
                                    "with live nodes (it resumes from run/inflight/)")
            i = min(self._alive, key=lambda j: (self._load[j], j))
            self._load[i] += 1
            return i, self.workers[i], self.where[i]["actor_id"]

    def _release(self, i: int) -> None:
        with self._lock:
            self._load[i] -= 1

    def _dead(self, i: int, exc: BaseException, worker: Any) -> None:
        """Worker i (the actor `worker`, not a replacement started since) died: a new one takes its place."""
        with self._lock:
            if i not in self._alive or self.workers[i] is not worker:
                return
            self._alive.discard(i)
            closing = self._closing
            if not closing:
                self._replacing.add(i)
        self.log(f"{self._describe(i)} is gone ({type(exc).__name__}); {len(self._alive)} rollout workers left")
        if not closing:
            self._spawn(lambda: self._replace_worker(i), f"replace-worker-{i}")

    # ---- starting and replacing actors ----------------------------------------------------------------

    def _bundle(self, i: int) -> dict[str, Any]:
        return {"scheduling_strategy": PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=i)}


    def _start_engine(self, i: int, options: dict[str, Any]) -> Any:
        model_class, model_config, engine, tokenizer, engine_factory = self._engine_args
        weights, version = self._latest_full()
        return start_engine_actor(options, f"engine-{i}-{self._tag}-{uuid.uuid4().hex[:4]}", model_class,
                                  model_config, weights, engine, version, tokenizer, engine_factory, self.cluster)

    def _start_worker(self, i: int, options: dict[str, Any]) -> Any:
        tokenizer, pool = self._worker_args
        with self._lock:
            engines, engine_where = list(self.engines), list(self.engine_where)
        return ray.remote(RolloutWorker).options(
            name=f"rollout-{i}-{self._tag}-{uuid.uuid4().hex[:4]}", num_cpus=self.cluster.worker_cpus,
            resources=self.cluster.worker_resources, max_restarts=0,
            max_concurrency=self.cluster.episodes_per_worker + 8, **options,  # + 8: alive, updates, stats, generate
        ).remote(f"rollout-{i}", engines, engine_where, i, tokenizer, pool, self.cluster)

    def _started(self, actor: Any, what: str) -> dict[str, Any]:
        try:
            return ray.get(actor.where.remote(), timeout=self.cluster.start_timeout_s)
        except GetTimeoutError:
            raise ActorHung(f"{what} did not start within {self.cluster.start_timeout_s:.0f} s "
                            "(cluster.start_timeout_s)") from None

    def _replace_worker(self, i: int) -> None:
        old, since = self.where[i], time.monotonic()

        def attempt(track: Callable[[Any], Any]) -> tuple[Any, dict[str, Any]] | None:
            worker = track(self._start_worker(i, self._bundle(i)))
            where = self._started(worker, f"the replacement of rollout worker {i}")
            with self._lock:
                if self._closing:
                    return None
                self.workers[i], self.where[i] = worker, where
                self._alive.add(i)
                self._worker_ready.notify_all()  # episodes waiting for a worker take this one
                self._counts["workers_replaced"] += 1
                self._watch[worker.alive.remote()] = ("worker", i, worker)
            return worker, where

        try:
            done = self._until_replaced(f"rollout worker {i}", since, attempt)
        finally:
            with self._lock:
                self._replacing.discard(i)
                self._worker_ready.notify_all()
        if done is not None:
            self.log(f"rollout worker {done[1]['sizing']} replaces {describe(old, 'rollout worker')}")

    def _until_replaced(self, what: str, since: float,
                        attempt: Callable[[Callable[[Any], Any]], tuple[Any, dict[str, Any]] | None]
                        ) -> tuple[Any, dict[str, Any]] | None:
        """`attempt` until one succeeds or the run closes. A replacement goes into the dead actor's
        bundle of the placement group: when its node died, Ray places that bundle again on a live
        node with room under `cluster.placement` (or on one that joins later), and the actor
        starts there. An attempt waits `start_timeout_s` for that; one that fails (its actor died:
        sent to the dying node before Ray knew it dead; or no room in time) is killed and tried
        again after a pause that doubles up to 30 s. The time it took goes to `replacements()`."""
        delay, tries = 1.0, 0
        while not self._closed.is_set():
            tries += 1
            started: list[Any] = []

            def track(actor: Any, started: list[Any] = started) -> Any:
                with self._lock:
                    self._attempts.add(actor)
                started.append(actor)
                return actor

            try:
                done = attempt(track)
            except Exception as exc:  # noqa: BLE001 - the run goes on with one fewer meanwhile, and says so
                done = None
                if not self._closed.is_set():
                    self.log(f"{what} not replaced yet ({type(exc).__name__}: {str(exc)[:200]}); trying again in "
                             f"{delay:.0f} s, {len(self._alive)} workers go on")
            with self._lock:
                self._attempts.difference_update(started)
            if done is not None:
                with self._lock:
                    self._replaced.append({"actor": what, "node": done[1]["node_id"][:8], "tries": tries,
                                           "seconds": round(time.monotonic() - since, 3)})
                return done
            for actor in started:
                ray.kill(actor, no_restart=True)
            self._closed.wait(delay)
            delay = min(2 * delay, 30.0)
        return None

    def _spawn(self, target: Callable[[], None], name: str) -> None:
        """A thread of the driver's own (the watch, a replacement), which `close` waits for."""
        thread = threading.Thread(target=target, name=name, daemon=True)
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()

    def _watch_actors(self) -> None:
        """Every engine and worker holds one `alive` call open; when one fails, that actor died: start
        another (a worker through `_dead`, which an episode on it may have called first)."""
        while True:
            with self._lock:
                if self._closing:
                    return
                watched = list(self._watch)
            ready, _ = ray.wait(watched, num_returns=1, timeout=1.0)
            for ref in ready:
                with self._lock:
                    kind, i, actor = self._watch.pop(ref)
                    if self._closing:
                        return
                try:
                    ray.get(ref)
                except _DIED as exc:
                    if kind == "worker":
                        self._dead(i, exc, actor)
                        continue
                    with self._lock:
                        self._engines_alive.discard(i)
                    self._spawn(lambda i=i: self._replace_engine(i), f"replace-engine-{i}")

    def _replace_engine(self, i: int) -> None:
        old, since = self.engine_where[i], time.monotonic()
        self.log(f"{describe(old)} died; starting another")

        def attempt(track: Callable[[Any], Any]) -> tuple[Any, dict[str, Any]] | None:
            engine = track(self._start_engine(i, self._bundle(i)))
            where = self._started(engine, f"the replacement of inference engine {i}")
            while True:  # to the latest weights, then live for the next update (an update may go out meanwhile)
                ref, version = self._latest_full()
                ray.get(engine.update_weights.remote(ref, version, 60.0), timeout=self.cluster.actor_timeout_s)
                with self._lock:
                    if self._closing:
                        return None
                    if self._latest[1] != version:
                        continue
                    self.engines[i], self.engine_where[i] = engine, {**where, "version": version}
                    self._engine_versions[i] = version
                    self._engines_alive.add(i)
                    self._watch[engine.alive.remote()] = ("engine", i, engine)
                    self._counts["engine_restarts"] += 1
                    workers = [self.workers[j] for j in sorted(self._alive)]
                    break
            # a worker that dies meanwhile is replaced with the engines as they are now
            ray.wait([w.engine_ready.remote(i, engine, where) for w in workers], num_returns=len(workers),
                     timeout=self.cluster.actor_timeout_s)
            return engine, {**where, "version": version}

        done = self._until_replaced(f"inference engine {i}", since, attempt)
        if done is not None:
            self.log(f"{describe(done[1])} replaces {describe(old)} at policy {done[1]['version']}")

    def _describe(self, i: int) -> str:
        return describe(self.where[i] if i < len(self.where) else {"name": i}, "rollout worker")


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
                # "local": a new cluster even where another one runs on this machine (ray.init() would join it)
                ray.init(address="local", num_cpus=config.num_cpus,
                         object_store_memory=config.object_store_mb * 2**20, include_dashboard=False,
                         _node_ip_address="127.0.0.1", log_to_driver=True)
                self._started = True
        nodes = [n for n in ray.nodes() if n["Alive"]]
        log(f"ray cluster: {len(nodes)} nodes, {ray.cluster_resources().get('CPU', 0):g} CPUs"
            + (" (started here)" if self._started else f" (joined {config.address or 'the connected one'})"))

    @contextmanager
    def learner(self, model: PreTrainedModel, config: LearnerConfig, version: int = 0,
                threads: int = 1, ref_model: PreTrainedModel | None = None) -> Iterator[RemoteLearner]:
        if ref_model is not None:  # TrainConfig refuses kl_coef > 0 on Ray at load; this says it here too
            raise ValueError("the Ray learner actor holds no KL reference model: set cluster.backend = \"local\" "
                             "or learner.loss.kl_coef = 0")
        learner = RemoteLearner(model, config, self.config, version, threads)
        self._actors.append(learner)
        try:
            yield learner
        finally:
            self._close(learner)

    @contextmanager
    def engine(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, engine: EngineConfig,
               pool: PoolConfig, version: int = 0, checkpoint: Any = None,
               weight_deltas: bool = False) -> Iterator[RayRollouts]:
        if engine.backend == "vllm":
            raise ValueError("engine.backend = \"vllm\" runs with cluster.backend = \"local\" (the rollout workers "
                             "on Ray build local engines); set cluster.backend = \"local\"")
        rollouts = RayRollouts(self.config, model, tokenizer, engine, pool, version, self.log,
                               weight_deltas=weight_deltas)
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
