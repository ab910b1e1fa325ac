"""FleetLog: a Ray run's fleet.jsonl written off the step's path, in step order, and a failed
stats call costs its row, never the run. (The real Ray fleet's rows: tests/rl/test_ray.py.)"""

from __future__ import annotations

import threading

from flywheel.rl.cluster import LocalCluster
from flywheel.rl.run_folder import RunFolder
from flywheel.rl.train import FleetLog


class SlowFleet:
    """A cluster whose stats take a while (as a round trip to every worker does) and fail once."""

    def __init__(self, fail_at: int):
        self.calls, self.fail_at = 0, fail_at
        self.threads: set[str] = set()

    def stats(self) -> dict:
        self.calls += 1
        self.threads.add(threading.current_thread().name)
        threading.Event().wait(0.05)
        if self.calls == self.fail_at:
            raise ConnectionError("worker 1 unreachable")
        return {"nodes": {"n1": {"live_sandboxes": self.calls}}}


def test_fleet_rows_land_in_step_order_off_the_loop_and_a_failed_call_costs_only_its_row(tmp_path):
    run, lines = RunFolder(tmp_path / "run"), []
    cluster = SlowFleet(fail_at=2)
    fleet = FleetLog(cluster, run, lines.append)
    for step in (1, 2, 3, 4):
        fleet.after_step(step)  # returns at once: the calls run on the fleet thread
    fleet.close()  # waits for the last
    rows = run.read("fleet.jsonl")
    assert [r["step"] for r in rows] == [1, 3, 4]
    assert [r["nodes"]["n1"]["live_sandboxes"] for r in rows] == [1, 3, 4]
    assert lines == ["fleet stats after step 2 failed: ConnectionError: worker 1 unreachable"]
    assert cluster.threads and all(name.startswith("fleet-stats") for name in cluster.threads)


def test_a_local_run_has_no_fleet_thread_and_writes_no_fleet_file(tmp_path):
    run = RunFolder(tmp_path / "run")
    fleet = FleetLog(LocalCluster(), run, print)
    fleet.after_step(1)
    fleet.close()
    assert not (tmp_path / "run" / "fleet.jsonl").exists()
