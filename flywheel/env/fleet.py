"""How many sandboxes a node holds, who gets one next, and how many to keep ready: the fleet policy.

Pure arithmetic on counts and timestamps the caller passes in (no clock, no threads, no Ray), so the
local `SandboxPool` and the per-node pool actor of the Ray backend (`flywheel.rl.ray_fleet`) decide
the same way, and every rule has a unit test (tests/env/test_fleet.py).

    node CPUs, memory ──node_capacity──> capacity (and the sentence that explains it, for the log)
    acquire asked ──admits(at_head, busy)──> FIFO head and room left: a slot; else wait in the queue
    acquires seen ──DemandMeter.rate──> warm_target: ready workspaces = demand × horizon,
                                        within [warm_min, warm_max] and the room left under capacity

Invariants:
- Sandboxes acquired or being made never exceed `capacity`; warm ones fill only the room left, so
  everything alive on the node (acquired, starting, warm) stays within it: a node's memory bound holds
  even with a warm set.
- Admission never fails for lack of room: a caller who cannot be served waits in arrival order (the
  pool decides how long; the local pool's `timeout_s`, none for the Ray fleet).
- The warm set grows when acquires come faster (a burst sees workspaces already mounted) and shrinks
  back to `warm_min` once they stop for `window_s`, so an idle node does not keep mounts for nothing.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass


def node_capacity(cpus: float, memory_bytes: float, sandboxes_per_cpu: float, memory_fraction: float,
                  disk_mb: int, cap: int) -> tuple[int, str]:
    """Sandboxes one node holds at once, and why (for the log): the smaller of its CPUs ×
    `sandboxes_per_cpu` (test runs are CPU-bound) and its memory × `memory_fraction` / `disk_mb`
    (each sandbox's tmpfs is host memory, up to disk_mb), capped by `cap`; at least one."""
    by_cpu = int(cpus * sandboxes_per_cpu)
    by_memory = int(memory_bytes * memory_fraction / (disk_mb * 2**20))
    size = max(1, min(by_cpu, by_memory, cap))
    reason = (f"min({cpus:g} CPU × {sandboxes_per_cpu:g} = {by_cpu}, {memory_bytes / 2**30:.1f} GiB × "
              f"{memory_fraction:g} / {disk_mb} MB = {by_memory}, pool.max_active {cap})")
    return size, reason


@dataclass(frozen=True)
class FleetPolicy:
    capacity: int  # sandboxes acquired or starting at once (and, with the warm ones, alive at once)
    warm_min: int = 0  # ready workspaces kept even when nothing is asked for
    warm_max: int = 0  # the most the warm set grows to under demand (below warm_min: warm_min)
    # The warm set holds the acquires expected within this long: about one sandbox creation under a
    # burst (4-15 ms measured), padded for the refill running behind the acquires.
    horizon_s: float = 0.5

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise ValueError(f"a fleet policy needs capacity >= 1, got {self.capacity}")
        if self.warm_min < 0 or self.warm_max < 0 or self.horizon_s <= 0:
            raise ValueError(f"warm_min, warm_max must be >= 0 and horizon_s > 0: {self}")

    def admits(self, at_head: bool, busy: int) -> bool:
        """Whether a waiting caller gets a slot now, with `busy` sandboxes acquired or starting:
        only the head of the queue (FIFO, so a burst cannot starve an earlier caller), and only
        below capacity."""
        return at_head and busy < self.capacity

    def warm_target(self, rate_per_s: float, busy: int) -> int:
        """How many idle workspaces to keep, with acquires arriving at `rate_per_s` and `busy` out."""
        wanted = max(self.warm_min, min(math.ceil(rate_per_s * self.horizon_s), max(self.warm_max, self.warm_min)))
        return max(0, min(wanted, self.capacity - busy))


class DemandMeter:
    """Events per second over the last `window_s` (acquires asked, sandboxes created), from the
    timestamps the caller passes, so a test drives it with made-up times."""

    def __init__(self, window_s: float = 5.0) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.window_s = window_s
        self._times: deque[float] = deque()

    def observe(self, t: float) -> None:
        self._times.append(t)
        self._trim(t)

    def rate(self, now: float) -> float:
        self._trim(now)
        return len(self._times) / self.window_s

    def _trim(self, now: float) -> None:
        while self._times and self._times[0] <= now - self.window_s:
            self._times.popleft()


def percentile(sorted_values: list[float], q: float) -> float:
    """The q-quantile (0..1) of already sorted values by rank; 0.0 for none."""
    if not sorted_values:
        return 0.0
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]
