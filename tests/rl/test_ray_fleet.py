"""The sandbox fleet on Ray: one pool actor per node, on a multi-raylet cluster, with real bwrap sandboxes.

One `ray.cluster_utils.Cluster` for the module: a head node (the learner's) and two rollout nodes
that differ on purpose: node A has 1 CPU and plenty of memory (CPU-bound: 1 × sandboxes_per_cpu),
node B has 2 CPUs but 256 MiB of Ray memory (memory-bound: 256 MiB × 0.5 / 64 MB = 2 sandboxes).
The faults are real: `ray.kill` of one node's pool actor while its sandboxes are in use.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import ray

from flywheel.env.pool import PoolConfig
from flywheel.rl.cluster import ClusterConfig
from flywheel.rl.ray_fleet import FleetClient
from flywheel.rl.run_folder import RunFolder
from flywheel.rl.train import train
from tests.rl import test_ray
from tests.rl.ray_cluster import rollout_node, simulated_cluster
from tests.rl.test_ray import check_run, rows, run_config, when_inflight

registry_root = test_ray.registry_root  # the tiny policy that talks for four turns (a module fixture)


@pytest.fixture(scope="module")
def cluster():
    """The head and two rollout nodes: A CPU-bound (1 CPU), B memory-bound (2 CPUs, 256 MiB)."""
    nodes = {"A": rollout_node(), "B": rollout_node(num_cpus=2, memory=256 * 2**20)}
    with simulated_cluster(nodes) as (c, added):
        c.rollout_nodes = {k: n.node_id for k, n in added.items()}
        yield c


def burst(fleet: FleetClient, n: int, hold_s: float) -> dict:
    """`n` sandboxes asked of one node's pool at once, each running a command, held, released."""
    errors, seen = [], []

    def one(i: int) -> None:
        try:
            sandbox = fleet.acquire({"n.txt": str(i)})
            try:
                seen.append(sandbox.run("cat n.txt").output)  # a command in the attached workspace
                time.sleep(hold_s)
            finally:
                assert fleet.release(sandbox)
        except BaseException as exc:  # noqa: BLE001 - returned to the test
            errors.append(repr(exc))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return {"errors": errors, "seen": sorted(seen), **fleet.stats()}


def fleet_actors() -> list[str]:
    found = ray.util.list_named_actors(all_namespaces=True)
    return [a["name"] for a in found if a["name"].startswith("sandbox-fleet-")]


@pytest.mark.slow  # 16 s on the shared 2-core machine (load ~10)
def test_each_node_sizes_its_pool_from_its_resources_queues_a_burst_and_grows_then_shrinks_its_warm_set(cluster):
    pool = PoolConfig(warm=0, max_warm=2, demand_window_s=3.0)
    config = ClusterConfig(backend="ray", sandboxes_per_cpu=4)
    # The raylets share this host, so the test (the driver) can use each node's pool as its worker would.
    on = {k: FleetClient(pool, config, node_id=node) for k, node in cluster.rollout_nodes.items()}
    try:
        (size_a, why_a), (size_b, why_b) = [(f.capacity, f.sizing) for f in (on["A"], on["B"])]
        assert size_a == 4 and why_a.startswith("4 sandboxes = min(1 CPU × 4 = 4,"), why_a  # CPU-bound
        assert size_b == 2 and "2 CPU × 4 = 8, 0.2 GiB × 0.5 / 64 MB = 2," in why_b, why_b  # memory-bound
        assert len(fleet_actors()) == 2  # one pool actor per node

        # Three times what each node holds, at once: the rest queue, none fails, the cap holds.
        with ThreadPoolExecutor(2) as both:
            a, b = both.map(lambda args: burst(*args), [(on["A"], 12, 0.2), (on["B"], 6, 0.2)])
        for stats, n, size in ((a, 12, 4), (b, 6, 2)):
            assert stats["errors"] == [] and stats["seen"] == sorted(str(i) for i in range(n)), stats
            assert stats["peak_active"] == size and stats["capacity"] == size
            assert stats["queue_wait_ms_p99"] >= 150  # the last ones waited for two holders before them
            assert stats["created"] >= n and stats["created_per_s_recent"] > 0 and stats["active"] == 0
        # The burst's demand grew node A's warm set (the ticker, with nobody releasing), within the room
        # left; once the demand window has passed it is back to the floor.
        assert 1 <= a["warm"] <= 2, a
        time.sleep(3.5)
        assert on["A"].stats()["warm"] == 0
    finally:
        for fleet in on.values():
            fleet.close()
    deadline = time.monotonic() + 30
    while fleet_actors() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert fleet_actors() == []


@pytest.mark.slow  # 30 s on the shared 2-core machine (load ~10)
def test_a_pool_actor_killed_alone_its_episodes_resume_from_their_saved_state(cluster, registry_root, tmp_path):
    """A run with one rollout worker per node; one node's pool actor (not its worker, not its node) is
    killed while its sandboxes are in use. The episodes that held them play on from their saved
    state on that node's next pool; the run finishes with every episode once and nothing lost."""
    run_dir, killed = tmp_path / "run", []

    def kill_a_pool() -> None:
        name = sorted(fleet_actors())[0]
        ray.kill(ray.get_actor(name, namespace=next(
            a["namespace"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"] == name)))
        killed.append(name)

    watcher = when_inflight(run_dir, 4, kill_a_pool)
    _, summary = train(run_config(registry_root, run_dir, steps=2, rollout_workers=2), log=lambda _: None)
    watcher.join(timeout=60)
    assert killed and summary["steps"] == 2
    metrics = check_run(run_dir, 2)  # each step once, each episode recorded once, versions in bound
    assert metrics[-1]["failover_episodes"] == 0  # no worker died: the pools did

    fleet = rows(run_dir / "fleet.jsonl")
    resumed = max(sum(n["resumed_episodes"] for n in row["nodes"].values()) for row in fleet)
    assert resumed >= 1, fleet
    assert all(n["peak"] <= n["capacity"] for row in fleet for n in row["nodes"].values())
    by_group: dict[str, int] = {}
    for r in rows(run_dir / "trajectories.jsonl"):
        by_group[r["episode"].split("/")[0]] = by_group.get(r["episode"].split("/")[0], 0) + 1
    _, progress = RunFolder(run_dir).load_state()
    assert progress["consumed"] and all(by_group.get(g) == 4 for g in progress["consumed"])  # none lost
