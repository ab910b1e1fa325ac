"""The fleet policy (capacity from a node's resources, FIFO admission, a warm set that follows demand)
as arithmetic, then through the local SandboxPool with real sandboxes."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from flywheel.env.fleet import DemandMeter, FleetPolicy, node_capacity, percentile
from flywheel.env.pool import PoolConfig, SandboxPool
from flywheel.env.sandbox import Sandbox, SandboxConfig

GIB = 2**30


def test_capacity_is_the_tighter_of_cpus_and_memory_and_says_why():
    size, reason = node_capacity(4, 64 * GIB, 8, 0.5, 64, 1000)
    assert size == 32 and reason.startswith("min(4 CPU × 8 = 32, 64.0 GiB × 0.5 / 64 MB = 512")
    size, _ = node_capacity(64, 4 * GIB, 8, 0.5, 64, 1000)  # memory-bound: 2 GiB of tmpfs / 64 MB
    assert size == 32
    assert node_capacity(64, 64 * GIB, 8, 0.5, 64, 10)[0] == 10  # pool.max_active caps both
    assert node_capacity(0.1, 1, 8, 0.5, 64, 10)[0] == 1  # a tiny node still serves one


def test_admission_serves_the_head_of_the_queue_below_capacity_only():
    policy = FleetPolicy(capacity=2)
    assert policy.admits(True, 0) and policy.admits(True, 1)
    assert not policy.admits(True, 2)  # full: the head waits, it is not refused
    assert not policy.admits(False, 0)  # room, but someone arrived first


def test_warm_set_grows_with_demand_within_the_room_left_and_shrinks_back():
    policy = FleetPolicy(capacity=10, warm_min=1, warm_max=6, horizon_s=0.5)
    assert policy.warm_target(0.0, busy=0) == 1  # idle: the floor
    assert policy.warm_target(8.0, busy=0) == 4  # 8 acquires/s × 0.5 s
    assert policy.warm_target(100.0, busy=0) == 6  # capped by warm_max
    assert policy.warm_target(100.0, busy=7) == 3  # and by the room under capacity
    assert policy.warm_target(100.0, busy=10) == 0  # full: nothing idle, memory bound holds
    with pytest.raises(ValueError, match="capacity >= 1"):
        FleetPolicy(capacity=0)


def test_demand_meter_counts_only_its_window():
    meter = DemandMeter(window_s=2.0)
    for t in (0.0, 0.5, 1.0, 1.5):
        meter.observe(t)
    assert meter.rate(1.5) == 2.0
    assert meter.rate(2.4) == 1.5  # the event at 0.0 left the window
    assert meter.rate(10.0) == 0.0
    assert percentile([], 0.5) == 0.0 and percentile([1.0, 2.0, 3.0, 4.0], 0.99) == 4.0


def test_local_pool_warm_set_follows_a_burst_then_shrinks(config: SandboxConfig):
    """Real sandboxes: 12 acquires in a burst raise the demand, so releases top the warm set up past
    its floor; once the window passes with no acquires, it shrinks back to the floor."""
    pool_config = PoolConfig(max_active=4, warm=1, max_warm=2, demand_window_s=3.0, sandbox=config)
    with SandboxPool(pool_config) as pool:
        assert pool.stats()["warm"] == 1
        errors: list[BaseException] = []

        def one() -> None:
            try:
                with pool.sandbox({"a.py": "x = 1\n"}) as sb:
                    assert sb.read_text("a.py") == "x = 1\n"
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=one) for _ in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        stats = pool.stats()
        assert errors == [] and stats["peak_active"] <= 4 and stats["demand_per_s"] >= 12 / 3.0
        assert stats["warm"] == 2, stats  # grown: 12 acquires / 3 s × 0.5 s (FleetPolicy.horizon_s)
        time.sleep(3.1)  # the burst leaves the demand window
        pool.adjust()
        assert pool.stats()["warm"] == 1


def test_an_attached_workspace_is_its_owners_and_goes_when_the_owner_dies(config: SandboxConfig):
    """What the Ray fleet rests on: a worker attaches a workspace that a pool process made; closing
    the handle leaves it to its owner, and the owner's death (SIGKILL) takes it, jails and all."""
    code = ("import sys; from pathlib import Path; from flywheel.env.sandbox import Sandbox, SandboxConfig; "
            "sb = Sandbox.create({'a.txt': 'A'}, SandboxConfig(root_dir=Path(sys.argv[1]))); "
            "print(sb.workspace, flush=True); sys.stdin.read()")
    owner = subprocess.Popen([sys.executable, "-c", code, str(config.resolved_root())], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        workspace = Path(owner.stdout.readline().strip())
        handle = Sandbox.attach(workspace, config)
        assert handle.run("cat a.txt && echo B > b.txt").output == "A"
        assert handle.read_text("b.txt") == "B\n"
        handle.close()
        assert workspace.is_dir() and (workspace / "a.txt").exists()  # still the owner's
        owner.kill()
        owner.wait(10)
        deadline = time.monotonic() + 20
        while workspace.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not workspace.exists()  # the owner's watchdog reclaimed it
    finally:
        owner.kill()
