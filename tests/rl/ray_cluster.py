"""A multi-node Ray cluster simulated on this machine, for the Ray tests (never mocks).

`simulated_cluster(nodes)` starts a head node (the learner's: one CPU and the custom resource
`learner`) and one raylet per entry of `nodes`, each with its own resources, a 100 MB object
store and a loopback address; the driver connects to it, and everything stops on exit. Node
death is noticed by health checks every 0.5 s, dead after 4 misses (Ray's default is 3 s x 5),
so a removed node's actors fail over within seconds. `rollout_node()` is a node of one CPU that
offers the custom resource `rollout`, where the rollout workers are placed.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import ray
from ray.cluster_utils import Cluster

STORE = 100 * 2**20
HEALTH_CHECKS = {"health_check_period_ms": 500, "health_check_failure_threshold": 4}


def rollout_node(**overrides: Any) -> dict[str, Any]:
    """`Cluster.add_node` arguments of a rollout node: 1 CPU and `rollout`, unless overridden."""
    return {"num_cpus": 1, "resources": {"rollout": 1}, "object_store_memory": STORE,
            "node_ip_address": "127.0.0.1", **overrides}


@contextmanager
def simulated_cluster(nodes: Mapping[str, Mapping[str, Any]]) -> Iterator[tuple[Cluster, dict[str, Any]]]:
    """The cluster and its added nodes by name, with `ray.init` connected to it."""
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {"learner": 1}, "object_store_memory": STORE, "node_ip_address": "127.0.0.1",
        "include_dashboard": False, "_system_config": HEALTH_CHECKS})
    try:
        added = {name: cluster.add_node(**args) for name, args in nodes.items()}
        cluster.wait_for_nodes()
        ray.init(address=cluster.address)
        yield cluster, added
    finally:
        ray.shutdown()
        cluster.shutdown()
