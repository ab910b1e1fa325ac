"""A thread-safe pool of sandboxes for rollout workers: bounded, fair, and self-cleaning.

    worker threads ──acquire(files)──> [FIFO queue] ──slot free──> warm workspace (or a new one)
                                            ^                          │ files written
                                            │                          v
                      release / lifetime reap ◄────────────── Sandbox in use

- At most `max_active` sandboxes are out at once; more callers wait in arrival order, and a
  waiter that runs out of time gets a TimeoutError that says how to fix it.
- `warm` empty workspaces are kept mounted so a burst of acquires only writes files; under
  demand the warm set grows up to `max_warm` and shrinks back when acquires stop
  (`flywheel.env.fleet`: the policy this pool and the Ray fleet's pool actors share).
  Released sandboxes are destroyed, never reused, so no state leaks from one episode to the next;
  the releasing thread tops the warm set back up.
- An acquired sandbox held longer than `max_lifetime_s` is reaped (its command killed, workspace
  removed) the next time the pool is used, so a crashed worker cannot starve the others.
- On start the pool reaps what dead processes left under the root directory (`reap_orphans`, as
  every process's first `Sandbox.create` on a root does), and counts the workspaces in `stats`.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from flywheel.env.fleet import DemandMeter, FleetPolicy, percentile
from flywheel.env.sandbox import Sandbox, SandboxConfig, check_environment, reap_orphans


class PoolConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    # Sandboxes out at once. Each holds up to sandbox.disk_mb of memory (tmpfs), so this times
    # disk_mb must fit in RAM; higher serves more concurrent rollouts.
    max_active: int = Field(64, ge=1)
    # Empty workspaces kept ready for bursts: acquire gets faster, at the cost of idle mounts.
    warm: int = Field(4, ge=0)
    # An acquired sandbox older than this is reaped; longer than any sane episode, short enough
    # that a leaked sandbox does not hold its slot for long.
    max_lifetime_s: float = Field(900.0, gt=0)
    # The warm set grows with the acquire rate up to this many (never past max_active's room) and
    # shrinks back to `warm` when acquires stop; 0: it stays at `warm`. Higher absorbs larger
    # bursts at ~2 MB of host memory per idle workspace.
    max_warm: int = Field(0, ge=0)
    # The window over which the acquire rate (the demand) and the creation rate are measured.
    demand_window_s: float = Field(5.0, gt=0)
    sandbox: SandboxConfig = SandboxConfig()


class SandboxPool:
    def __init__(self, config: PoolConfig | None = None) -> None:
        self.config = config or PoolConfig()
        self.policy = FleetPolicy(self.config.max_active, self.config.warm, self.config.max_warm)
        self._demand = DemandMeter(self.config.demand_window_s)  # acquires asked
        self._creations = DemandMeter(self.config.demand_window_s)  # sandboxes made
        self._cond = threading.Condition()
        self._queue: deque[object] = deque()  # one ticket per waiting acquire, in arrival order
        self._active: dict[int, tuple[Sandbox, float]] = {}  # id(sandbox) -> (sandbox, acquired at)
        self._starting = 0  # slots granted whose sandbox is still being made
        self._warm: list[Sandbox] = []
        self._closed = False
        self._created = 0
        self._reaped = reap_orphans(self.config.sandbox.resolved_root())
        self._latencies_ms: deque[float] = deque(maxlen=10_000)
        self._waits_ms: deque[float] = deque(maxlen=10_000)  # asked -> slot granted: the admission queue's wait
        self._peak_active = 0
        self._opened = time.monotonic()
        self.adjust()

    def acquire(
        self, files: Mapping[str, str | bytes] | None = None, timeout_s: float | None = None,
        environment: Path | None = None,
    ) -> Sandbox:
        """A sandbox holding exactly `files`, with `environment` (a built dependency prefix) bound
        into its commands; waits in FIFO order while `max_active` are out."""
        if environment is not None:
            check_environment(environment)
        asked = time.monotonic()
        deadline = None if timeout_s is None else asked + timeout_s
        ticket = object()
        with self._cond:
            self._demand.observe(asked)
            self._queue.append(ticket)
            try:
                while True:
                    self._check_open()
                    self._reap_expired()
                    if self.policy.admits(self._queue[0] is ticket, len(self._active) + self._starting):
                        break
                    wait = self._next_expiry() - time.monotonic()
                    if deadline is not None:
                        remaining = deadline - time.monotonic()
                        if remaining <= 0:
                            raise TimeoutError(
                                f"no sandbox free after {timeout_s:.1f} s: all {self.config.max_active} "
                                f"(PoolConfig.max_active) are in use and {self._queue.index(ticket)} callers "
                                "are queued ahead; release sandboxes sooner (use `with pool.sandbox(files)`) "
                                "or raise max_active"
                            )
                        wait = min(wait, remaining)
                    self._cond.wait(max(wait, 0.001))
            finally:
                self._queue.remove(ticket)
                self._cond.notify_all()  # the next in line may now be at the head
            self._starting += 1
            warm = self._warm.pop() if self._warm else None
            granted = time.monotonic()
            self._waits_ms.append((granted - asked) * 1000)
        try:
            if warm is None:
                sandbox = Sandbox.create(files, self.config.sandbox)
                created = 1
            else:
                sandbox = warm
                created = 0
                if files:
                    sandbox.load(files)
            sandbox.environment = environment
        except BaseException:
            if warm is not None:
                warm.close()
            with self._cond:
                self._starting -= 1
                self._cond.notify_all()
            raise
        with self._cond:
            self._starting -= 1
            self._created += created
            if created:
                self._creations.observe(time.monotonic())
            self._active[id(sandbox)] = (sandbox, time.monotonic())
            self._peak_active = max(self._peak_active, len(self._active) + self._starting)
            self._latencies_ms.append((time.monotonic() - granted) * 1000)
        return sandbox

    def release(self, sandbox: Sandbox) -> None:
        """Destroy `sandbox` and free its slot. Releasing a reaped sandbox is a no-op."""
        with self._cond:
            entry = self._active.pop(id(sandbox), None)
            self._cond.notify_all()
        if entry is not None:
            sandbox.close()
            self.adjust()

    @contextmanager
    def sandbox(self, files: Mapping[str, str | bytes] | None = None) -> Iterator[Sandbox]:
        sb = self.acquire(files)
        try:
            yield sb
        finally:
            self.release(sb)

    def stats(self) -> dict[str, float | int]:
        with self._cond:
            self._reap_expired()
            lat, waits = sorted(self._latencies_ms), sorted(self._waits_ms)
            now = time.monotonic()
            return {
                "capacity": self.policy.capacity,
                "active": len(self._active) + self._starting,
                "peak_active": self._peak_active,
                "queued": len(self._queue),
                "warm": len(self._warm),
                "created": self._created,
                "demand_per_s": self._demand.rate(now),
                "created_per_s_recent": self._creations.rate(now),
                "reaped": self._reaped,
                "start_latency_ms_p50": percentile(lat, 0.50),
                "start_latency_ms_p99": percentile(lat, 0.99),
                "queue_wait_ms_p50": percentile(waits, 0.50),
                "queue_wait_ms_p99": percentile(waits, 0.99),
                "uptime_s": time.monotonic() - self._opened,
            }

    def close(self) -> None:
        """Destroy every sandbox, idle or acquired; waiting and later acquires fail."""
        with self._cond:
            self._closed = True
            doomed = [sb for sb, _ in self._active.values()] + self._warm
            self._active.clear()
            self._warm = []
            self._cond.notify_all()
        for sb in doomed:
            sb.close()

    def adjust(self) -> None:
        """Grow or shrink the warm set to the policy's target for the current demand (called without
        the lock: creating takes a while). Releases call it; the Ray fleet's pool actor also calls it
        on a timer, so the warm set follows a burst while nobody releases."""
        while True:
            with self._cond:
                if self._closed:
                    return
                target = self._warm_target()
                extra = self._warm.pop() if len(self._warm) > target else None
                if extra is None and len(self._warm) == target:
                    return
            if extra is not None:
                extra.close()  # shrink: demand fell, or the room went to acquired sandboxes
                continue
            sandbox = Sandbox.create(None, self.config.sandbox)
            with self._cond:
                keep = not self._closed and len(self._warm) < self._warm_target()
                if keep:
                    self._warm.append(sandbox)
                    self._created += 1
                    self._creations.observe(time.monotonic())
            if not keep:
                sandbox.close()
                return

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---- internals (callers hold self._cond unless said otherwise) -------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the SandboxPool is closed; create a new pool")

    def _reap_expired(self) -> None:
        now = time.monotonic()
        limit = self.config.max_lifetime_s
        expired = [key for key, (_, t) in self._active.items() if now - t > limit]
        for key in expired:
            sandbox, _ = self._active.pop(key)
            sandbox.close()  # kills its running command, if any; the holder's next run raises
            self._reaped += 1
        if expired:
            self._cond.notify_all()

    def _next_expiry(self) -> float:
        if not self._active:
            return time.monotonic() + 3600
        return min(t for _, t in self._active.values()) + self.config.max_lifetime_s

    def _warm_target(self) -> int:
        return self.policy.warm_target(self._demand.rate(time.monotonic()), len(self._active) + self._starting)
