"""Fixtures every test folder shares: the store backends.

`store_url` runs a test once per backend: a SQLite file in the test's folder, and a fresh schema on
a real PostgreSQL server. The server is FLYWHEEL_PG_URL when set (.ci/run starts one and sets it),
else a throwaway cluster this session starts from the local server binaries
(flywheel/store/pg_cluster.py); without either the PostgreSQL cases skip, and fail under
FLYWHEEL_CI=1, where a missing server is a broken setup, not an absent option.

It also sets, before anything imports Ray (its constants are read at import), that the simulated
Ray clusters of tests/rl/test_ray.py advertise loopback addresses, not the address of this
machine's interface, which a sandboxed CI machine may not let it reach itself on; and that Ray
reports no usage.

`one_torch_thread` (`pytestmark = pytest.mark.usefixtures("one_torch_thread")`) runs a module's
tests on one torch thread: reductions split over threads round differently, and one thread leaves
the other core to what a test starts beside it.

`make test` runs the suite on two pytest-xdist workers. Each worker's tests start on one torch
thread (`worker_threads`; the processes they start inherit OMP_NUM_THREADS=1 and a passive OpenMP
wait unless they set their own), so the two workers share the 2 cores instead of oversubscribing
them. Each test file goes to one worker whole (`pytest_xdist_make_scheduler`, `file_group`), so a module's
fixtures are built once; the Ray files go to one worker together (each test starts and kills nodes
of its own cluster), as does tests/tinker/ (one server); and the longest files go first (`FIRST`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

XDIST_WORKER = bool(os.environ.get("PYTEST_XDIST_WORKER"))  # this process is one of `make test`'s workers
if XDIST_WORKER:  # before torch is imported: its thread pool reads them once
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # A process that asks for two threads (a config's `threads`) beside the other worker's: its idle
    # thread sleeps instead of spinning on a core the other process needs.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

from flywheel.store.pg_cluster import ThrowawayCluster, new_schema_url, server_binaries  # noqa: E402

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # on Linux: nodes' IPs are 127.0.0.1
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


@pytest.fixture(scope="session")
def pg_base_url() -> Iterator[str]:
    url = os.environ.get("FLYWHEEL_PG_URL")
    if url:
        yield url
        return
    if server_binaries() is None:
        reason = ("no PostgreSQL: set FLYWHEEL_PG_URL to a server this user may create schemas on, or "
                  "`apt-get install -y postgresql` for a throwaway cluster")
        if os.environ.get("FLYWHEEL_CI") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    with ThrowawayCluster() as cluster:
        yield cluster.url


@pytest.fixture
def pg_url(pg_base_url: str) -> str:
    """A URL to a fresh, empty schema of the session's PostgreSQL."""
    return new_schema_url(pg_base_url)


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request: pytest.FixtureRequest, tmp_path) -> str:
    if request.param == "sqlite":
        return str(tmp_path / "store.sqlite")
    return request.getfixturevalue("pg_url")


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# Test files that must not run beside each other, one worker running the set in turn: each Ray test
# starts a cluster and kills nodes of it.
SHARED_GROUPS = {"rl/test_ray.py": "ray", "rl/test_ray_fleet.py": "ray", "rl/test_ray_join.py": "ray"}
# The longest groups (minutes each on 2 cores), handed out first so that no worker ends the run alone
# with one of them.
FIRST = ["ray", "rl/test_bootstrap.py", "rl/test_distributed.py", "live/test_cycle.py", "rl/test_faults.py",
         "rl/test_learning_bench.py", "model/test_vllm_engine.py", "test_own_model.py"]


def file_group(nodeid: str) -> str:
    """The worker group of a test (its node id, `tests/<file>::<name>`): its file, but for the shared
    groups and tests/tinker/ (one server for the folder)."""
    test_file = nodeid.split("::")[0].removeprefix("tests/")
    if test_file.startswith("tinker/"):
        return "tinker"
    return SHARED_GROUPS.get(test_file, test_file)


@pytest.hookimpl(optionalhook=True)  # xdist's hook: without xdist the suite runs in one process
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """pytest-xdist's scope scheduling with `file_group`'s scopes, in collection order."""
    from xdist.scheduler import LoadScopeScheduling  # noqa: PLC0415  (only where xdist runs the suite)

    class FileGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return file_group(nodeid)

    config.option.loadscopereorder = False  # FIRST's order, not the groups' test counts
    return FileGroups(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if XDIST_WORKER:  # every worker collects the same order
        rank = {group: i for i, group in enumerate(FIRST)}
        items.sort(key=lambda item: rank.get(file_group(item.nodeid), len(FIRST)))


@pytest.fixture(autouse=True)
def worker_threads() -> Iterator[None]:
    """Under xdist, each test starts on one torch thread, whatever the test before it set (a config's
    `threads` sets the process's)."""
    if XDIST_WORKER:
        torch.set_num_threads(1)
    yield
