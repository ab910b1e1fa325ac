from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from flywheel.env.pool import PoolConfig, SandboxPool, reap_orphans
from flywheel.env.sandbox import SandboxConfig, SandboxError


@pytest.fixture
def pool_config(config: SandboxConfig) -> PoolConfig:
    return PoolConfig(max_active=2, warm=1, sandbox=config)


def test_acquire_gives_sandbox_with_files_and_release_destroys_it(pool_config: PoolConfig):
    with SandboxPool(pool_config) as pool:
        with pool.sandbox({"a.txt": "A"}) as sb:
            assert sb.run("cat a.txt; ls").output == "Aa.txt\n"
            workspace = sb.workspace
        assert not workspace.exists()
        with pool.sandbox() as sb2:
            assert sb2.run("ls").output == ""  # nothing left from the previous holder


def test_acquire_times_out_with_clear_message_when_all_are_out(pool_config: PoolConfig):
    with SandboxPool(pool_config) as pool:
        held = [pool.acquire({}), pool.acquire({})]
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="max_active"):
            pool.acquire({}, timeout_s=0.2)
        assert 0.2 <= time.monotonic() - start < 1.0
        assert pool.stats()["queued"] == 0
        pool.release(held[0])
        pool.acquire({}, timeout_s=1.0)


def test_waiters_are_served_in_arrival_order(config: SandboxConfig):
    with SandboxPool(PoolConfig(max_active=1, warm=0, sandbox=config)) as pool:
        first = pool.acquire({})
        order: list[str] = []

        def waiter(name: str) -> None:
            sb = pool.acquire({"who": name}, timeout_s=10)
            order.append(sb.read_text("who"))
            time.sleep(0.05)
            pool.release(sb)

        threads = []
        for name in ["a", "b", "c"]:
            threads.append(threading.Thread(target=waiter, args=(name,)))
            threads[-1].start()
            while pool.stats()["queued"] < len(threads):
                time.sleep(0.005)
        pool.release(first)
        for t in threads:
            t.join(10)
        assert order == ["a", "b", "c"]
        stats = pool.stats()
        assert stats["active"] == 0 and stats["queued"] == 0


def test_stats_count_created_and_latency(pool_config: PoolConfig):
    with SandboxPool(pool_config) as pool:
        for _ in range(3):
            with pool.sandbox({"x": "y"}):
                pass
        stats = pool.stats()
        # 1 warm at start, 3 acquires (the first took the warm one), each release refills warm
        assert stats["created"] == 4 and stats["active"] == 0 and stats["warm"] == 1
        assert 0 < stats["start_latency_ms_p50"] <= stats["start_latency_ms_p99"] < 1000


def test_many_threads_share_the_pool(pool_config: PoolConfig):
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            with pool.sandbox({"n": str(i)}) as sb:
                assert sb.run("cat n").output == str(i)
        except BaseException as exc:  # reported below: a thread's assert would otherwise vanish
            errors.append(exc)

    with SandboxPool(pool_config) as pool:
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert errors == [] and pool.stats()["active"] == 0


def test_sandbox_held_past_max_lifetime_is_reaped(config: SandboxConfig, probes):
    with SandboxPool(PoolConfig(max_active=1, warm=0, max_lifetime_s=0.3, sandbox=config)) as pool:
        leaked = pool.acquire({})
        workspace = leaked.workspace
        sb = pool.acquire({}, timeout_s=5)  # waits for the leaked one to expire
        assert leaked.closed and not workspace.exists() and not probes.is_mounted(workspace)
        assert pool.stats()["reaped"] == 1
        with pytest.raises(SandboxError, match="closed"):
            leaked.run("true")
        pool.release(leaked)  # a no-op, not an error
        pool.release(sb)


def test_closed_pool_refuses_acquire(pool_config: PoolConfig):
    pool = SandboxPool(pool_config)
    sb = pool.acquire({})
    pool.close()
    assert sb.closed
    with pytest.raises(RuntimeError, match="closed"):
        pool.acquire({})


CRASHING_OWNER = """
import sys, threading
from pathlib import Path
from flywheel.env.sandbox import Sandbox, SandboxConfig
sb = Sandbox.create({"f": "x"}, SandboxConfig(root_dir=Path(sys.argv[1]), wall_time_s=60))
threading.Thread(target=sb.run, args=("sleep 543210",), daemon=True).start()
print(sb.workspace, flush=True)
threading.Event().wait()
"""


def test_reap_orphans_cleans_up_after_a_killed_owner(sandbox_root: Path, probes):
    child = subprocess.Popen(
        [sys.executable, "-c", CRASHING_OWNER, str(sandbox_root)], stdout=subprocess.PIPE, text=True
    )
    try:
        workspace = Path(child.stdout.readline().strip())
        device = probes.device_of(workspace)
        deadline = time.monotonic() + 5
        while not probes.jail_pids(device) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert probes.jail_pids(device), "the crashing owner never started its command"
    finally:  # the crash under test; also what keeps a failed run from leaving the owner behind
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        child.stdout.close()
    assert workspace.exists() and probes.is_mounted(workspace)  # what a crash leaves behind

    assert reap_orphans(sandbox_root) == 1
    assert not workspace.exists() and not probes.is_mounted(workspace)
    assert probes.jail_pids(device) == [] and probes.pids_running("sleep 543210") == []
    assert reap_orphans(sandbox_root) == 0  # our own live workspaces are left alone


def test_concurrent_reaps_share_out_the_orphans(sandbox_root: Path):
    """Two pools starting together once both unmounted the same orphan: the second got EINVAL."""
    workspaces = []
    for _ in range(3):
        child = subprocess.Popen(
            [sys.executable, "-c", CRASHING_OWNER, str(sandbox_root)], stdout=subprocess.PIPE, text=True
        )
        workspaces.append(Path(child.stdout.readline().strip()))
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        child.stdout.close()
    with ThreadPoolExecutor(4) as workers:
        counts = list(workers.map(lambda _: reap_orphans(sandbox_root), range(4)))
    assert sum(counts) == 3 and sorted(counts)[-1] >= 1
    assert not any(w.exists() for w in workspaces)


def test_pool_start_reaps_leftovers(config: SandboxConfig, sandbox_root: Path):
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    leftover = sandbox_root / f"{dead.stdout.strip()}-0-deadbeef"
    leftover.mkdir(parents=True)
    (leftover / "junk").write_text("x")
    with SandboxPool(PoolConfig(warm=0, sandbox=config)) as pool:
        assert pool.stats()["reaped"] == 1
    assert not leftover.exists()
