"""The sandbox fleet of the Ray backend: one pool actor per node, owning that node's sandboxes.

    RolloutWorker (node A)                         SandboxFleet actor (node A, pinned there)
    ┌─────────────────────────────────┐            ┌──────────────────────────────────────────┐
    │ episode thread                  │ acquire ──>│ SandboxPool sized from node A's CPUs and │
    │   FleetClient.play(episode)     │  (queues   │ memory (flywheel.env.fleet), FIFO queue; │
    │     lease = acquire(files)      │  when full)│ a ticker grows/shrinks its warm set      │
    │     Sandbox.attach(workspace) ──┼── same ────┼─ workspace (tmpfs mount owned here)      │
    │     every turn: holds(lease)? ──┼─> host's ──┼─ yes while this actor lives              │
    │     release(lease) ─────────────┼─> files    │ destroys the workspace                   │
    └─────────────────────────────────┘            └──────────────────────────────────────────┘

Why an actor: the node's capacity is one budget however many workers the node runs, and the node's
sandboxes live and die with one process whose death is a fault we can name and recover from. The
worker runs commands and reads files itself, through `Sandbox.attach` on the same host's workspace,
so a tool call costs no Ray round trip; only acquire, release and one `holds` per turn do.

What waits for what:
- `acquire` waits in the pool's FIFO queue while the node is full (never fails for lack of room);
  those calls run in the actor's `admission` concurrency group, so releases, `holds` and stats (the
  default group) are never stuck behind waiting acquires.
- The worker checks its lease after every turn's snapshot and before the driver saves that state:
  a lease still held means the pool was alive when the snapshot was taken, so a saved state never
  holds a workspace the dying pool had already wiped.

Faults: a pool actor killed alone (`ray.kill`, its process killed) takes its workspaces with it (its
watchdog kills the jails in them and unmounts them). Each episode that held one notices at its next
check (or its release) and plays again from its last saved EpisodeState on the node's new pool actor,
which the first worker to notice starts (same name, `get_if_exists`). The trajectory is returned
once, after a release that confirms the lease, so nothing is lost or trained twice;
`resumed_episodes` in the worker's stats (fleet.jsonl) counts them.

What it does not cover:
- The pool actor is owned by the worker that started it: if that worker dies, so does the pool (and
  the node's other workers' episodes resume on a new one, as above).
- Tokens generated after the last saved turn are generated again (as in any resume).
- All workers of a node must see the node's sandbox root (`sandbox.root_dir`, a local filesystem):
  true of Ray's nodes, which are hosts, and of the raylets `ray.cluster_utils.Cluster` simulates.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray
from ray.exceptions import GetTimeoutError, ObjectLostError, RayActorError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from flywheel.env.fleet import node_capacity
from flywheel.env.pool import PoolConfig, SandboxPool
from flywheel.env.sandbox import Sandbox, check_environment

if TYPE_CHECKING:  # the pool actor's process imports this module: keep it free of torch and transformers
    from flywheel.agent.episode import EpisodeState
    from flywheel.agent.trajectory import Trajectory
    from flywheel.rl.cluster import ClusterConfig

_DIED = (RayActorError, ObjectLostError)
FLEET_CPUS = 0.05  # the pool actor's Ray request: it only waits and mounts; room on a 2-core machine
ADMISSION_THREADS = 128  # acquires that wait inside the pool at once; more wait in Ray's queue, in order
MAX_LOSSES = 3  # pools lost under one episode before it gives up (a node that keeps killing its pool)


class SandboxFleet:
    """One node's sandboxes: a SandboxPool sized from the node's resources, handing out leases."""

    def __init__(self, pool: PoolConfig, sandboxes_per_cpu: float, memory_fraction: float, tick_s: float = 0.2):
        context = ray.get_runtime_context()
        self.node_id = context.get_node_id()
        node = next(n for n in ray.nodes() if n["NodeID"] == self.node_id)
        resources = node["Resources"]
        size, reason = node_capacity(resources.get("CPU", 1.0), resources.get("memory", 2**30),
                                     sandboxes_per_cpu, memory_fraction, pool.sandbox.disk_mb, pool.max_active)
        # The warm set may grow to a quarter of the node under demand (bursts), back to pool.warm idle.
        self.pool = SandboxPool(pool.model_copy(update={"max_active": size,
                                                        "max_warm": max(pool.max_warm, size // 4)}))
        self.sizing = f"{size} sandboxes = {reason}"
        self.address = node["NodeManagerAddress"]
        print(f"sandbox fleet on node {self.node_id[:8]} ({self.address}), pid {os.getpid()}: {self.sizing}",
              flush=True)  # the node states its own sizing, in its own log
        self._leases: dict[str, Sandbox] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        threading.Thread(target=self._tick, args=(tick_s,), name="fleet-ticker", daemon=True).start()

    def where(self) -> dict[str, Any]:
        return {"node_id": self.node_id, "address": self.address, "pid": os.getpid(), "sizing": self.sizing,
                "capacity": self.pool.policy.capacity, "actor_id": ray.get_runtime_context().get_actor_id()}

    @ray.method(concurrency_group="admission")
    def acquire(self, files: Mapping[str, str | bytes] | None) -> tuple[str, str]:
        """A lease and the host path of its workspace (holding exactly `files`); waits while full."""
        sandbox = self.pool.acquire(files)
        lease = uuid.uuid4().hex
        with self._lock:
            self._leases[lease] = sandbox
        return lease, str(sandbox.workspace)

    def holds(self, lease: str) -> bool:
        with self._lock:
            return lease in self._leases

    def release(self, lease: str) -> bool:
        """Destroy the lease's workspace; False if this pool never held it (a previous pool's)."""
        with self._lock:
            sandbox = self._leases.pop(lease, None)
        if sandbox is not None:
            self.pool.release(sandbox)
        return sandbox is not None

    def stats(self) -> dict[str, Any]:
        return {"sizing": self.sizing, "pid": os.getpid(), **self.pool.stats()}

    def close(self) -> None:
        self._closed.set()
        self.pool.close()

    def _tick(self, tick_s: float) -> None:
        """The warm set follows demand between releases too (a burst with nobody releasing yet)."""
        while not self._closed.wait(tick_s):
            self.pool.adjust()


class PoolLost(RuntimeError):
    """The node's pool actor died under a lease; the episode plays again from its last saved state."""


class FleetClient:
    """The SandboxPool interface a worker's episodes use (acquire, release, stats), over its node's
    SandboxFleet actor; `play` runs one episode and resumes it when the pool dies under it."""

    def __init__(self, pool: PoolConfig, cluster: ClusterConfig, log: Callable[[str], None] = print,
                 node_id: str | None = None):
        # node_id: whose pool; default this process's node. It must be the node this process runs on
        # (workspaces are attached by host path), except on raylets simulated on one host (tests).
        self.config, self.cluster, self.log = pool, cluster, log
        self.node_id = node_id or ray.get_runtime_context().get_node_id()
        self.name = f"sandbox-fleet-{self.node_id[:12]}-{ray.get_runtime_context().get_job_id()}"
        self._lock = threading.Lock()
        self._held: dict[int, tuple[str, Any]] = {}  # id(handle) -> (lease, the actor that granted it)
        self.resumed_episodes = 0
        self._actor, self._where = self._connect()
        self.capacity: int = self._where["capacity"]
        self.sizing = f"{self._where['sizing']} (sandbox fleet {self.name}, pid {self._where['pid']})"

    # ---- the SandboxPool interface ------------------------------------------------------------------

    def acquire(self, files: Mapping[str, str | bytes] | None = None, timeout_s: float | None = None,
                environment: Path | None = None) -> Sandbox:
        """A sandbox holding `files` from this node's pool; waits in its queue while the node is full.
        `timeout_s` is the local pool's: the fleet queues without a deadline, and a worker stuck
        there is named by the driver's `cluster.actor_timeout_s`."""
        del timeout_s
        if environment is not None:
            check_environment(environment)
        actor = self._actor
        try:
            lease, workspace = ray.get(actor.acquire.remote(dict(files or {})))
        except _DIED as exc:
            self._replace(actor)
            raise PoolLost(f"the sandbox pool {self.name} died while an acquire waited ({type(exc).__name__})") from exc
        sandbox = Sandbox.attach(Path(workspace), self.config.sandbox)
        sandbox.environment = environment
        with self._lock:
            self._held[id(sandbox)] = (lease, actor)
        return sandbox

    def release(self, sandbox: Sandbox) -> bool:
        """End this handle's commands and give the workspace back; False if the pool that granted it
        died meanwhile (the workspace is gone, and whatever was read from it since is suspect)."""
        sandbox.close()
        with self._lock:
            lease, actor = self._held.pop(id(sandbox), (None, None))
        if lease is None:
            return True
        try:
            return bool(self._get(actor.release.remote(lease), "release"))
        except _DIED:
            self._replace(actor)
            return False

    def holds(self, sandbox: Sandbox) -> bool:
        """Whether the pool that granted `sandbox` still holds it (it is alive, and not a new one)."""
        with self._lock:
            lease, actor = self._held.get(id(sandbox), (None, None))
        if lease is None:
            return False
        try:
            return bool(self._get(actor.holds.remote(lease), "holds"))
        except _DIED:
            self._replace(actor)
            return False

    def stats(self) -> dict[str, Any]:
        actor = self._actor
        try:
            stats = self._get(actor.stats.remote(), "stats")
        except _DIED:
            self._replace(actor)
            stats = self._get(self._actor.stats.remote(), "stats")
        return {**stats, "resumed_episodes": self.resumed_episodes}

    def close(self) -> None:
        try:
            self._get(self._actor.close.remote(), "close")
        except _DIED:
            pass
        ray.kill(self._actor, no_restart=True)

    # ---- one episode, resumed when its pool dies ----------------------------------------------------

    def play(self, episode: Callable[[Any, EpisodeState | None, Callable[[EpisodeState], None]], Trajectory],
             resume: EpisodeState | None, on_turn: Callable[[EpisodeState], None], what: str) -> Trajectory:
        """`episode(pool, resume, on_turn)` (run_episode's arguments) with a lease from this node's
        fleet; if the pool actor dies under it, play again from the last state `on_turn` was given."""
        last, losses = resume, 0
        while True:
            lease = _EpisodeLease(self)

            def turn(state: EpisodeState, lease: _EpisodeLease = lease) -> None:
                nonlocal last
                if not lease.intact():  # after the snapshot: then the snapshot saw the whole workspace
                    raise PoolLost(f"the sandbox pool {self.name} no longer holds the workspace of {what}")
                last = state.model_copy(deep=True)
                on_turn(state)

            try:
                result = episode(lease, last, turn)
                if not lease.lost:
                    return result
            except PoolLost as exc:
                lease.why = lease.why or str(exc)
            except BaseException:
                if not lease.lost:
                    raise
            losses += 1
            if losses > MAX_LOSSES:
                raise PoolLost(f"{what} lost its sandbox pool {losses} times on node {self.node_id[:8]}; "
                               "inspect the node (memory, its pool actor's log)")
            with self._lock:
                self.resumed_episodes += 1
            self.log(f"{what} resumes from turn {last.turns if last else 0} on a new sandbox pool: "
                     f"{self.name} died under it ({lease.why})")

    # ---- internals ------------------------------------------------------------------------------------

    def _get(self, ref: Any, what: str) -> Any:
        try:
            return ray.get(ref, timeout=self.cluster.actor_timeout_s)
        except GetTimeoutError:
            raise TimeoutError(f"the sandbox pool {self.name} (pid {self._where.get('pid', '?')}) did not answer "
                               f"{what} within {self.cluster.actor_timeout_s:.0f} s (cluster.actor_timeout_s); "
                               "inspect it (`ray stack`)") from None

    def _connect(self) -> tuple[Any, dict[str, Any]]:
        """This node's pool actor: the live one of that name, else a new one pinned to this node. A
        killed actor's name stays taken for a moment, so a dead handle is asked for again."""
        actor_class = ray.remote(concurrency_groups={"admission": ADMISSION_THREADS}, max_concurrency=16)(SandboxFleet)
        deadline = time.monotonic() + self.cluster.start_timeout_s
        while True:
            actor = actor_class.options(
                name=self.name, get_if_exists=True, num_cpus=FLEET_CPUS, max_restarts=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(self.node_id, soft=False),
            ).remote(self.config, self.cluster.sandboxes_per_cpu, self.cluster.sandbox_memory_fraction)
            try:
                where = ray.get(actor.where.remote(), timeout=self.cluster.start_timeout_s)
            except _DIED:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
                continue
            return actor, where

    def _replace(self, dead: Any) -> None:
        """The pool `dead` is gone: connect to (or start) the node's next one, once for all episodes."""
        with self._lock:
            if self._actor is not dead:
                return  # another episode already did
            self._actor, self._where = self._connect()
        self.log(f"sandbox pool {self.name} replaced: pid {self._where['pid']}, {self._where['sizing']}")


class _EpisodeLease:
    """What one try of an episode sees as its pool: the fleet, and whether the lease it got survived."""

    def __init__(self, fleet: FleetClient):
        self.fleet, self.sandbox, self.lost = fleet, None, False
        self.why = ""  # how the loss showed, for the log

    def acquire(self, files: Mapping[str, str | bytes] | None = None, timeout_s: float | None = None,
                environment: Path | None = None) -> Sandbox:
        try:
            self.sandbox = self.fleet.acquire(files, timeout_s, environment)
        except PoolLost as exc:
            self.lost, self.why = True, str(exc)
            raise
        return self.sandbox

    def release(self, sandbox: Sandbox) -> None:
        if not self.fleet.release(sandbox):
            self.lost, self.why = True, self.why or "its release found the lease gone"

    def intact(self) -> bool:
        return self.sandbox is not None and self.fleet.holds(self.sandbox)
