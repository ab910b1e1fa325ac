"""LiveStore on each backend (a real SQLite file, a real PostgreSQL server): idempotent ingestion, the
reasons events are refused, the queries the reward distiller uses, and what survives closing and reopening."""

from __future__ import annotations

import threading

import pytest

from flywheel.api.events import Event, EventType
from flywheel.live.records import Completion
from flywheel.live.store import Ingest, LiveStore, check_event
from flywheel.store.database import IntegrityError


def completion(cid: str, version: int, t: float, session: str = "s", arm: str = "production") -> Completion:
    return Completion(id=cid, session_id=session, user_id="u", version=version, prompt_ids=[1, 2, 3],
                      completion_ids=[4, 5], logprobs=[-0.5, -0.25], latency_ms=12.0, created_at=t, arm=arm,
                      content="hi", request_meta={"family": "bugfix"})


def event(eid: str, kind: EventType, t: float, cid: str | None = "c1", session: str = "s", **payload) -> Event:
    return Event(id=eid, type=kind, session_id=session, completion_id=cid, time=t, payload=payload)


@pytest.fixture
def store(store_url):
    with LiveStore(store_url) as s:
        s.add_completion(completion("c1", 0, 100.0))
        s.add_completion(completion("c2", 1, 200.0, arm="candidate"))
        s.add_completion(completion("c3", 1, 300.0, session="t", arm="candidate"))
        yield s


def test_completions_round_trip_and_filter(store):
    assert store.completion("c2") == completion("c2", 1, 200.0, arm="candidate")
    assert store.completion("nope") is None
    assert [c.id for c in store.completions(version=1)] == ["c2", "c3"]
    assert [c.id for c in store.completions(start=150.0, end=300.0)] == ["c2"]  # end is exclusive
    assert [c.id for c in store.completions(arm="production")] == ["c1"]
    assert [c.id for c in store.completions(session_id="t")] == ["c3"]
    assert [c.id for c in store.completions(limit=2)] == ["c1", "c2"]
    assert (store.count_completions(), store.count_completions(version=1)) == (3, 2)
    with pytest.raises(IntegrityError):
        store.add_completion(completion("c1", 0, 1.0))  # completion ids are unique


def test_concurrent_completions_share_commits_and_a_refused_one_fails_alone(store):
    """The group commit: 64 completions from 16 threads at once, one of them with an id stored before;
    that one raises IntegrityError in its own thread and every other one is stored."""
    ids = [f"g{i}" for i in range(63)] + ["c1"]
    outcomes: dict[str, str] = {}
    barrier = threading.Barrier(16)

    def commit(share: list[str]) -> None:
        barrier.wait()
        for cid in share:
            try:
                store.add_completion(completion(cid, 0, 500.0))
                outcomes[cid] = "stored"
            except IntegrityError:
                outcomes[cid] = "refused"

    threads = [threading.Thread(target=commit, args=(ids[i::16],)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert outcomes == {**{cid: "stored" for cid in ids[:-1]}, "c1": "refused"}
    assert store.count_completions() == 3 + 63 and store.completion("c1") == completion("c1", 0, 100.0)


def test_ingestion_is_idempotent_on_the_event_id(store):
    first = [event("e1", EventType.EDIT_APPLIED, 101), event("e2", EventType.THUMBS, 102, up=False)]
    assert store.add_events(first) == [(Ingest.ACCEPTED, ""), (Ingest.ACCEPTED, "")]
    changed = event("e1", EventType.EDIT_REVERTED, 150)  # the same id with other content: the first stands
    assert store.add_events([changed, first[1]]) == [(Ingest.DUPLICATE, ""), (Ingest.DUPLICATE, "")]
    assert [e.type for e in store.events_for_completion("c1")] == [EventType.EDIT_APPLIED, EventType.THUMBS]
    assert store.count_events() == 2


@pytest.mark.parametrize("bad, reason", [
    (event("", EventType.THUMBS, 1, up=True), "id must be"),
    (event("x" * 201, EventType.THUMBS, 1, up=True), "id must be"),
    (event("a", EventType.THUMBS, float("nan"), up=True), "finite"),
    (event("a", EventType.THUMBS, 1, session=""), "session_id is empty"),
    (event("a", EventType.EDIT_PERSISTED, 1, cid=None), "must name the completion"),
    (event("a", EventType.FOLLOWUP, 1, dissatisfied="yes"), "dissatisfied"),
    (event("a", EventType.THUMBS, 1), '"up"'),
    (event("a", EventType.SESSION_END, 1, cid=None, outcome="meh"), "outcome"),
])
def test_malformed_events_are_refused_with_the_reason(store, bad, reason):
    assert reason in check_event(bad)
    [(outcome, why)] = store.add_events([bad])
    assert outcome == Ingest.REJECTED and reason in why
    assert store.count_events() == 0


def test_events_must_name_a_served_completion_of_their_session(store, tmp_path):
    unknown, wrong = (event("e1", EventType.EDIT_APPLIED, 1, cid="c9"),
                      event("e2", EventType.EDIT_APPLIED, 1, session="t"))
    results = store.add_events([unknown, wrong, event("e3", EventType.SESSION_END, 1, cid=None, outcome="success")])
    assert [r[0] for r in results] == [Ingest.REJECTED, Ingest.REJECTED, Ingest.ACCEPTED]
    assert "unknown completion_id 'c9'" in results[0][1] and "belongs to session 's'" in results[1][1]
    with LiveStore(tmp_path / "lenient.sqlite", require_known_completion=False) as lenient:
        assert lenient.add_events([unknown]) == [(Ingest.ACCEPTED, "")]


def test_queries_the_distiller_needs_and_reopening(store, store_url):
    store.add_events([
        event("e3", EventType.EDIT_PERSISTED, 130), event("e1", EventType.EDIT_APPLIED, 110),
        event("e2", EventType.FOLLOWUP, 220, cid="c2", dissatisfied=True),
        event("e4", EventType.SESSION_END, 400, cid=None, session="t", outcome="unhappy"),
    ])
    assert [e.id for e in store.events_for_completion("c1")] == ["e1", "e3"]  # in event time order
    assert {k: [e.id for e in v] for k, v in store.events_for_completions(["c1", "c2", "c3"]).items()} == \
        {"c1": ["e1", "e3"], "c2": ["e2"]}
    assert [e.id for e in store.events_for_session("s")] == ["e1", "e3", "e2"]
    assert [e.id for e in store.events(types=[EventType.SESSION_END])] == ["e4"]
    assert len(store.events(start=0.0)) == 4 and store.events(end=0.0) == []
    store.record_deployment(0, 1, 0.25, "start")
    store.close()
    with LiveStore(store_url) as again:
        assert again.events_for_session("t")[0].payload == {"outcome": "unhappy"}
        assert again.completion("c3").request_meta == {"family": "bugfix"}
        assert [(d["production"], d["candidate"], d["fraction"]) for d in again.deployments()] == [(0, 1, 0.25)]


def test_a_snapshot_reads_one_instant_while_another_store_writes(store, store_url):
    with LiveStore(store_url) as writer, store.snapshot():
        before = (store.count_completions(), store.count_events())
        writer.add_completion(completion("c4", 2, 400.0))
        writer.add_events([event("e1", EventType.EDIT_APPLIED, 401, cid="c4")])
        assert (store.count_completions(), store.count_events()) == before  # the writes came after the snapshot
        assert store.events_for_completion("c4") == []
    assert (store.count_completions(), store.count_events()) == (before[0] + 1, before[1] + 1)


def test_latest_deployment_is_the_newest_row(store):
    assert store.latest_deployment() is None
    first = store.record_deployment(0, 1, 0.1, "start")
    second = store.record_deployment(1, None, 0.0, "promoted")
    assert second > first
    latest = store.latest_deployment()
    assert (latest["seq"], latest["production"], latest["candidate"], latest["note"]) == (second, 1, None, "promoted")
