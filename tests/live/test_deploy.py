"""Deployment routing (sticky, proportional, monotone in the fraction) and the Router's engine leases."""

from __future__ import annotations

import time

import pytest
from pydantic import ValidationError
from tiny_serving import ScriptedEngine

from flywheel.live.deploy import Deployment, NotServed, Router
from flywheel.model.registry import CANDIDATE, PRODUCTION

SESSIONS = [f"session-{i}" for i in range(4000)]


def test_routing_is_sticky_and_proportional():
    deployment = Deployment(production=3, candidate=4, candidate_fraction=0.2)
    routes = [deployment.route(s) for s in SESSIONS]
    assert routes == [deployment.route(s) for s in SESSIONS]  # same session, same arm
    assert {r for r in routes} == {(PRODUCTION, 3), (CANDIDATE, 4)}
    share = sum(arm == CANDIDATE for arm, _ in routes) / len(routes)
    assert abs(share - 0.2) < 0.03  # 4000 sessions: the standard error is 0.006


def test_raising_the_fraction_only_moves_sessions_to_the_candidate():
    low, high = (Deployment(production=0, candidate=1, candidate_fraction=f) for f in (0.1, 0.5))
    on_candidate = {s for s in SESSIONS if low.route(s)[0] == CANDIDATE}
    assert on_candidate <= {s for s in SESSIONS if high.route(s)[0] == CANDIDATE}
    other = Deployment(production=0, candidate=2, candidate_fraction=0.1)  # a new candidate draws a new split
    assert on_candidate != {s for s in SESSIONS if other.route(s)[0] == CANDIDATE}
    assert Deployment(production=0).route("x") == (PRODUCTION, 0)


@pytest.mark.parametrize("fields, message", [
    ({"production": 0, "candidate_fraction": 0.5}, "no candidate"),
    ({"production": 0, "candidate": 0}, "both production and candidate"),
    ({"production": 0, "candidate": 1, "candidate_fraction": 1.5}, "less than or equal to 1"),
])
def test_inconsistent_deployments_say_the_fix(fields, message):
    with pytest.raises(ValidationError, match=message):
        Deployment(**fields)


def test_router_retires_an_engine_after_its_last_request():
    engines: dict[int, ScriptedEngine] = {}

    def load(version: int):
        engines[version] = ScriptedEngine([1], version)
        return engines[version], None

    router = Router(load, Deployment(production=0, candidate=1, candidate_fraction=1.0))
    lease = router.checkout("s")
    assert (lease.arm, lease.version) == (CANDIDATE, 1)
    router.deploy(Deployment(production=0))
    assert router.served_versions() == [0] and not engines[1].closed  # still answering its request
    with pytest.raises(NotServed):
        router.checkout("s", version=1)
    router.release(lease)
    deadline = time.monotonic() + 5
    while not engines[1].closed and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engines[1].closed
    router.deploy(Deployment(production=2))  # a new version loads; the old production retires
    assert router.served_versions() == [2] and router.checkout("s").version == 2
    with pytest.raises(ValueError, match="version"):
        Router(lambda v: (ScriptedEngine([1], v + 1), None), Deployment(production=0))
    router.close()
