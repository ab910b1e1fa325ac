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
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from flywheel.store.pg_cluster import ThrowawayCluster, new_schema_url, server_binaries

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
