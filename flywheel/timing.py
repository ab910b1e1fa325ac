"""One timer for every stage: `timed(seconds, "name")` adds a block's wall time to `seconds["name"]`.

    seconds: dict[str, float] = {}
    with timed(seconds, "wait_s"):
        batch = orchestrator.next_batch()

The RL step (`flywheel.rl.train.learning_step`), the Learner's phases, the Engine's prefills and
decode steps, an episode's turns, tool calls, grading and sandbox creation, and the live cycle's
stages all time themselves with it, so that a stage's seconds mean the same thing wherever they are
read: wall seconds of the block, added up (a block that runs twice, or a stage resumed after a
crash, counts both). Modelled on verl's `marked_timer`. `delta` turns two readings of cumulative
counters (an engine's, which outlive a step) into what happened between them.

A library: it imports nothing of flywheel, and every stage may use it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager


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
