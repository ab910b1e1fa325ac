from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from flywheel.env.pool import PoolConfig, SandboxPool
from flywheel.env.sandbox import INTERPRETER_DIR, Sandbox, SandboxConfig, SandboxError, reap_orphans, unmount


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
        except BaseException as exc:  # noqa: BLE001 -- reported below: a thread's assert would otherwise vanish
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


def mounts_under(root: Path) -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [p for line in f if (p := line.split(" ")[4]) == str(root) or p.startswith(f"{root}/")]


def kill_owner(child: subprocess.Popen, root: Path, probes, sig: int = signal.SIGKILL, watchdog: bool = False):
    """Kill a sandbox owner; with `watchdog`, first its watchdog too, as when the owner's whole cgroup
    is killed, so that what the owner left stays for the next process to reclaim."""
    try:
        if watchdog:
            watchdogs = probes.pids_running(f"flywheel-sandbox-watchdog {root} {child.pid} ")
            assert len(watchdogs) == 1, f"the owner has no watchdog: {watchdogs}"
            os.kill(watchdogs[0], signal.SIGKILL)
            deadline = time.monotonic() + 5
            while probes.pids_running(f"flywheel-sandbox-watchdog {root} {child.pid} ") and time.monotonic() < deadline:
                time.sleep(0.01)
    finally:  # the owner dies whatever happened, so a failed test leaves no process behind
        os.kill(child.pid, sig)
        child.wait()
        child.stdout.close()


@pytest.fixture
def private_root():
    """A root no other sandbox of this process uses, so nothing of ours holds its interpreter bind."""
    root = Path(f"/tmp/flywheel-test-private-{os.getpid()}-{time.monotonic_ns()}")
    yield root
    while points := mounts_under(root):
        unmount(Path(points[-1]))
    shutil.rmtree(root, ignore_errors=True)


def start_owner(root: Path) -> tuple[subprocess.Popen, Path]:
    child = subprocess.Popen([sys.executable, "-c", CRASHING_OWNER, str(root)], stdout=subprocess.PIPE, text=True)
    return child, Path(child.stdout.readline().strip())


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
        kill_owner(child, sandbox_root, probes, watchdog=True)
    assert workspace.exists() and probes.is_mounted(workspace)  # what a crash leaves behind

    assert reap_orphans(sandbox_root) == 1
    assert not workspace.exists() and not probes.is_mounted(workspace)
    assert probes.jail_pids(device) == [] and probes.pids_running("sleep 543210") == []
    assert reap_orphans(sandbox_root) == 0  # our own live workspaces are left alone


def test_concurrent_reaps_share_out_the_orphans(sandbox_root: Path, probes):
    """Two pools starting together once both unmounted the same orphan: the second got EINVAL."""
    owners = [start_owner(sandbox_root) for _ in range(3)]  # all alive first: each new owner reclaims
    workspaces = [workspace for _, workspace in owners]  # the dead ones it finds at its first use
    for child, _ in owners:
        kill_owner(child, sandbox_root, probes, watchdog=True)
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


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_an_owners_death_leaves_no_mount_under_the_root(private_root: Path, probes, sig: int):
    """The owner's watchdog reclaims its workspace and its command's /tmp, and unmounts the interpreter
    bind that no live process leases any more: nothing mounted outlives the processes using it."""
    child, workspace = start_owner(private_root)
    deadline = time.monotonic() + 10
    while not probes.pids_running("sleep 543210") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert probes.pids_running("sleep 543210"), "the owner never started its command"
    assert mounts_under(private_root)  # a workspace, a command's /tmp (as root), .python
    kill_owner(child, private_root, probes, sig)
    watchdog = f"flywheel-sandbox-watchdog {private_root}"
    deadline = time.monotonic() + 10
    while (
        mounts_under(private_root) or workspace.exists() or probes.pids_running("sleep 543210")
        or probes.pids_running(watchdog)
    ) and time.monotonic() < deadline:  # fmt: skip
        time.sleep(0.02)
    assert mounts_under(private_root) == [] and not workspace.exists()
    assert [p.name for p in private_root.iterdir() if not p.name.startswith(".")] == []
    assert probes.pids_running("sleep 543210") == []
    assert probes.pids_running(watchdog) == []  # its work done, it is gone too


@pytest.mark.parametrize("user", ["Sandbox.create", "SandboxPool"])
def test_the_next_process_on_the_root_reclaims_a_dead_owners_workspace(private_root: Path, probes, user: str):
    """When the watchdog died with its owner (a killed cgroup), the next process to use the root cleans
    up at its first Sandbox.create, pool or not."""
    child, workspace = start_owner(private_root)
    kill_owner(child, private_root, probes, watchdog=True)
    assert workspace.exists()
    use = {
        "Sandbox.create": "Sandbox.create({}, cfg).close()",
        "SandboxPool": "SandboxPool(PoolConfig(warm=0, sandbox=cfg)).close()",
    }[user]
    script = (
        "import sys; from pathlib import Path\n"
        "from flywheel.env.pool import PoolConfig, SandboxPool\n"
        "from flywheel.env.sandbox import Sandbox, SandboxConfig\n"
        f"cfg = SandboxConfig(root_dir=Path(sys.argv[1]))\n{use}\n"
    )
    subprocess.run([sys.executable, "-c", script, str(private_root)], check=True, timeout=60)
    assert not workspace.exists()
    assert not [m for m in mounts_under(private_root) if not m.endswith(f"/{INTERPRETER_DIR}")]


@pytest.mark.skipif(os.geteuid() != 0, reason="the interpreter bind exists only as root")
def test_deleting_the_root_reaches_no_host_file(private_root: Path):
    """`rm -rf` of the root while sandboxes live: the interpreter bind is read-only, so the host's
    interpreter loses nothing; the workspace tmpfs holds only the sandbox's files."""
    prefix = os.path.realpath(sys.base_prefix)
    before = sorted(os.path.join(d, f) for d, _, files in os.walk(prefix) for f in files)
    with Sandbox.create({"a.py": "x = 1\n"}, SandboxConfig(root_dir=private_root)) as sb:
        staged = private_root / INTERPRETER_DIR
        if staged.is_dir() and mounts_under(staged):
            # checked first: on a writable bind the rmtree below would delete the host's interpreter
            assert os.statvfs(staged).f_flag & os.ST_RDONLY
        assert sb.run("echo y > b.py").exit_code == 0
        subprocess.run(["rm", "-rf", str(private_root)], capture_output=True)
        shutil.rmtree(private_root, ignore_errors=True)
    after = sorted(os.path.join(d, f) for d, _, files in os.walk(prefix) for f in files)
    assert after == before and before
