"""The client SDK for feedback events: call `emit` from an editor or a simulated user, never wait.

    client = EventClient("http://127.0.0.1:8000", api_key="...", batch_size=500, flush_interval_s=0.05)
    client.emit("edit_applied", session_id=sid, completion_id=resp.id)
    client.emit("followup", session_id=sid, completion_id=resp.id, payload={"dissatisfied": True})
    client.followup(sid, resp.id, dissatisfied=True, text="no, the bug is in parse.py; run the tests first")
    client.close()                        # flushes what is queued (bounded by a timeout), then stops

    emit ──> bounded queue ──(batch_size events, or flush_interval_s after the first)──> sender threads (concurrency)
                                            POST /v1/events ──200──> settled (accepted / duplicate / rejected)
                                                            ──connection error, 408, 429, 5xx──> retry, backoff x2
                                                            ──413──> split the batch in halves and send each

`emit` only appends to a queue under a lock: it never does I/O and never waits for the network.
When the queue is full (the server is down longer than the queue lasts), the oldest event is
dropped and counted in `stats.dropped`. Oldest first because feedback loses value with age (the
distiller's horizon passes, the candidate it was about may be rolled back) while the newest events
describe the model being served now; dropping is counted, never silent.

Delivery is at least once: a batch whose acknowledgement was lost is sent again, and the server,
idempotent on the client-made event ids, reports the repeats as `duplicate`, so nothing is counted
twice. Events the server rejects (unknown type, bad payload, unknown completion) are not retried,
as they would fail again; they are counted in `stats.rejected` and their reasons kept in
`rejections` (the last 100). An event that is not JSON (a set in its payload, a NaN) is refused
by `emit` itself with a ValueError, before it can take its batch down with it. A batch that still
fails after `max_retries` is counted in `stats.failed` with the error in `last_error`.
"""

from __future__ import annotations

import itertools
import json
import random
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Any

import httpx

from flywheel.api.events import Event, EventType, followup_text_problem

_RETRY_STATUS = {408, 425, 429, 500, 502, 503, 504}


@dataclass(frozen=True)
class ClientStats:
    emitted: int  # events handed to emit/record
    accepted: int  # stored by the server for the first time
    duplicate: int  # the server already had them (a retry after a lost acknowledgement)
    rejected: int  # refused by the server, with a reason (see `rejections`)
    dropped: int  # pushed out of a full queue before they were sent
    failed: int  # given up on after max_retries or a non-retryable error (see `last_error`)
    retries: int  # extra attempts made
    queued: int  # waiting to be sent now

    @property
    def settled(self) -> int:
        return self.accepted + self.duplicate + self.rejected + self.dropped + self.failed


class EventClient:
    def __init__(self, base_url: str, api_key: str, batch_size: int = 500, flush_interval_s: float = 0.05,
                 max_retries: int = 8, max_queue: int = 100_000, timeout_s: float = 10.0,
                 backoff_s: float = 0.05, max_backoff_s: float = 5.0, concurrency: int = 2):
        if batch_size < 1 or max_queue < batch_size:
            raise ValueError(f"need 1 <= batch_size <= max_queue, got batch_size={batch_size}, max_queue={max_queue}")
        if flush_interval_s < 0 or max_retries < 0 or concurrency < 1:
            raise ValueError("need flush_interval_s >= 0, max_retries >= 0 and concurrency >= 1")
        self.batch_size, self.flush_interval_s, self.max_retries = batch_size, flush_interval_s, max_retries
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self._http = httpx.Client(base_url=base_url.rstrip("/"), timeout=timeout_s,
                                  headers={"authorization": f"Bearer {api_key}", "content-type": "application/json"})
        self._queue: deque[dict[str, Any]] = deque()
        self._max_queue = max_queue
        self._cond = threading.Condition()
        # Counters change under `_cond`; `flush` waits until `settled` reaches what was emitted.
        self._emitted = self._accepted = self._duplicate = self._rejected = 0
        self._dropped = self._failed = self._retries = 0
        self._oldest_at = 0.0  # monotonic time the oldest queued event arrived: the flush deadline counts from it
        self._flushing = 0  # callers in flush(): send partial batches at once
        self._closing = False
        self._abort = threading.Event()  # close() gave up waiting: stop retrying
        self.rejections: deque[dict[str, Any]] = deque(maxlen=100)
        self.last_error: str = ""
        self._ids = itertools.count()
        self._id_prefix = uuid.uuid4().hex  # ids are prefix-counter: unique across clients, cheap to make
        # `concurrency` batches in flight: one is serialized and sent while the server commits another
        # (its fsync), which nearly doubles throughput. Events carry their own times, so the order in
        # which batches land does not matter.
        self._threads = [threading.Thread(target=self._run, name=f"event-client-{i}", daemon=True)
                         for i in range(concurrency)]
        for thread in self._threads:
            thread.start()

    # ---- the caller's side: never blocks on the network

    def emit(self, type: EventType | str, session_id: str, completion_id: str | None = None,
             payload: dict[str, Any] | None = None, event_id: str | None = None, at: float | None = None) -> str:
        """Queue one event; returns its id (made here unless given)."""
        event_id = event_id or f"{self._id_prefix}-{next(self._ids)}"
        self._put({"id": event_id, "type": str(type), "session_id": session_id, "completion_id": completion_id,
                   "time": time.time() if at is None else at, "payload": payload or {}})
        return event_id

    def followup(self, session_id: str, completion_id: str | None, dissatisfied: bool, text: str | None = None,
                 event_id: str | None = None, at: float | None = None) -> str:
        """Queue a follow-up: the user wrote again about `completion_id`, with `text` their message
        (bounded by MAX_FOLLOWUP_TEXT_CHARS; ValueError here, as the server would reject it)."""
        payload: dict[str, Any] = {"dissatisfied": dissatisfied}
        if text is not None:
            payload["text"] = text
        problem = followup_text_problem(payload)
        if problem is not None:
            raise ValueError(problem)
        return self.emit(EventType.FOLLOWUP, session_id, completion_id, payload, event_id=event_id, at=at)

    def record(self, event: Event) -> None:
        self._put(event.model_dump(mode="json"))

    def _put(self, item: dict[str, Any]) -> None:
        # Serialized once here, where the caller can fix it: an event that is not JSON would otherwise
        # fail its whole batch in the sender thread, and NaN is no JSON the server stores.
        try:
            json.dumps(item, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"event {item['id']!r} is not JSON ({exc}); its payload may hold str, finite numbers, "
                             "bool, None, lists and dicts") from None
        with self._cond:
            if self._closing:
                raise RuntimeError("EventClient is closed; make a new one")
            if len(self._queue) >= self._max_queue:
                self._queue.popleft()
                self._dropped += 1
            if not self._queue:
                self._oldest_at = time.monotonic()
            self._queue.append(item)
            self._emitted += 1
            if len(self._queue) >= self.batch_size or len(self._queue) == 1:
                self._cond.notify_all()  # a full batch is ready, or the flush timer must start

    @property
    def stats(self) -> ClientStats:
        with self._cond:
            return ClientStats(self._emitted, self._accepted, self._duplicate, self._rejected, self._dropped,
                               self._failed, self._retries, len(self._queue))

    def flush(self, timeout_s: float | None = 30.0) -> bool:
        """Wait until every event emitted before this call is settled; False if `timeout_s` passed first."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            target = self._emitted
            self._flushing += 1
            self._cond.notify_all()
            try:
                while self._settled() < target:
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        return False
                    self._cond.wait(remaining)
                return True
            finally:
                self._flushing -= 1

    def close(self, timeout_s: float = 30.0) -> bool:
        """Flush (up to `timeout_s`), stop the sender and close the connection. True if all was settled."""
        with self._cond:
            if self._closing:
                return True
            self._closing = True
            self._cond.notify_all()
        done = self.flush(timeout_s)
        self._abort.set()
        with self._cond:
            self._cond.notify_all()
        for thread in self._threads:
            thread.join(timeout=self.max_backoff_s + 5)
        self._http.close()
        return done

    def __enter__(self) -> EventClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _settled(self) -> int:
        return self._accepted + self._duplicate + self._rejected + self._dropped + self._failed

    # ---- the sender thread

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._abort.is_set():
                    if self._queue and (len(self._queue) >= self.batch_size or self._flushing or self._closing
                                        or time.monotonic() - self._oldest_at >= self.flush_interval_s):
                        break
                    wait = None if not self._queue else self.flush_interval_s - (time.monotonic() - self._oldest_at)
                    self._cond.wait(wait)
                if self._abort.is_set():
                    self._failed += len(self._queue)  # close() timed out: what is left is given up, counted
                    self._queue.clear()
                    self._cond.notify_all()
                    return
                batch = [self._queue.popleft() for _ in range(min(self.batch_size, len(self._queue)))]
                if self._queue:
                    self._oldest_at = time.monotonic()
            self._send(batch)

    def _send(self, batch: list[dict[str, Any]]) -> None:
        """Deliver `batch` (retrying) and settle every event in it, whatever happens."""
        attempt = 0
        while True:
            error, retry = self._post(batch)
            if error is None:
                return
            if error == "split" and len(batch) > 1:
                half = len(batch) // 2
                self._send(batch[:half])
                self._send(batch[half:])
                return
            if not retry or attempt >= self.max_retries or self._abort.is_set():
                with self._cond:
                    self._failed += len(batch)
                    self.last_error = error
                    self._cond.notify_all()
                return
            delay = min(self.max_backoff_s, self.backoff_s * 2**attempt) * (0.5 + random.random() / 2)
            attempt += 1
            with self._cond:
                self._retries += 1
            self._abort.wait(delay)

    def _post(self, batch: list[dict[str, Any]]) -> tuple[str | None, bool]:
        """(None, _) when the server settled the batch; else (error, whether retrying can help)."""
        try:
            response = self._http.post("/v1/events", content=json.dumps({"events": batch}))
        except httpx.TransportError as exc:  # refused, reset, timed out: the server may come back
            return f"{type(exc).__name__}: {exc}", True
        if response.status_code == 413:
            return ("split" if len(batch) > 1 else "413: one event is larger than the server's body limit"), False
        if response.status_code != 200:
            return f"{response.status_code}: {response.text[:300]}", response.status_code in _RETRY_STATUS
        try:
            result = response.json()
            accepted, duplicate, rejected = len(result["accepted"]), len(result["duplicate"]), result["rejected"]
        except (ValueError, KeyError, TypeError) as exc:
            return f"unreadable acknowledgement ({exc}): {response.text[:300]}", True
        with self._cond:
            self._accepted += accepted
            self._duplicate += duplicate
            self._rejected += len(rejected)
            self.rejections.extend(rejected)
            unanswered = len(batch) - accepted - duplicate - len(rejected)
            if unanswered:  # a server that answered for fewer events than it got: count, so flush can finish
                self._failed += unanswered
                self.last_error = f"the server answered for {len(batch) - unanswered} of {len(batch)} events"
            self._cond.notify_all()
        return None, False
