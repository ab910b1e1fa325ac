"""One timer for every stage: `timed(seconds, "name")` adds a block's wall time to `seconds["name"]`.

    seconds: dict[str, float] = {}
    with timed(seconds, "wait_s"):
        batch = orchestrator.next_batch()

The RL step (`flywheel.rl.train.learning_step`), the Learner's phases, the Engine's prefills and
decode steps, an episode's turns, tool calls, grading and sandbox creation, and the live cycle's
stages all time themselves with it, so that a stage's seconds mean the same thing wherever they are
read: wall seconds of the block, added up (a block that runs twice, or a stage resumed after a
crash, counts both). Modelled on verl's `marked_timer`. `delta` turns two readings of cumulative
counters (an engine's, which outlive a step) into what happened between them. `cpu_seconds` is the
other clock: the CPU time this process and its descendants used, which a shared machine's load
does not shrink as it shrinks what a wall-clock budget buys (`TrainConfig.cpu_budget_s`).

A library: it imports nothing of flywheel, and every stage may use it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import psutil


@contextmanager
def timed(seconds: dict[str, float], name: str) -> Iterator[None]:
    """Add the wall seconds of the block to `seconds[name]` (created at 0), also when it raises."""
    start = time.perf_counter()
    try:
        yield
    finally:
        seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - start


def delta(now: Mapping[str, float], before: Mapping[str, float] | None) -> dict[str, float]:
    """Cumulative counters `now` minus an earlier reading `before` (None, or counters that went
    backwards because their owner restarted: `now` itself, counted from that restart)."""
    if before is None or any(now[k] < before.get(k, 0.0) for k in now):
        return dict(now)
    return {k: now[k] - before.get(k, 0.0) for k in now}


def cpu_seconds() -> float:
    """CPU seconds (user + system) used so far by this process and its descendants: its own threads,
    its live child processes (an engine in a process of its own) and the children each has reaped
    (sandboxed commands). A child that ends between two readings moves from the live sum to the
    reaped one, so differences of readings count it once."""
    me = psutil.Process()
    own = me.cpu_times()
    total = own.user + own.system + own.children_user + own.children_system
    for child in me.children(recursive=True):
        try:
            times = child.cpu_times()
        except psutil.Error:  # ended since it was listed: counted with the reaped ones once waited for
            continue
        total += times.user + times.system + times.children_user + times.children_system
    return total
