"""Feedback on the wire: the `Event` a client sends to POST /v1/events, and what became of each.

An `Event` is made by the client, which picks its id: ingestion is idempotent on that id, so a
client that retries after a lost acknowledgement never counts the same reaction twice. Feedback
names either the completion it is about (the `id` of the response that served it) or only the
session (outcomes like "the session ended unhappy"); the live loop's RewardDistiller
(flywheel/live/rewards.py) assigns session-level events to the session's completions by a
documented rule.

    POST /v1/events  {"events": [Event, ...]}  ──>  {"accepted": [id], "duplicate": [id],
                                                     "rejected": [{"index", "id", "reason"}]}

Here, below every stage, so that the client SDK (flywheel/client.py) sends events without
importing the server's stage.
"""

from __future__ import annotations

import json
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, Field


class EventType(StrEnum):
    EDIT_APPLIED = "edit_applied"  # the editor applied the agent's edit
    EDIT_PERSISTED = "edit_persisted"  # the edit was still there after the horizon
    EDIT_REVERTED = "edit_reverted"  # the user undid the edit within the horizon
    # The user wrote again; payload {"dissatisfied": bool, "text": str (optional: what they wrote)}
    FOLLOWUP = "followup"
    THUMBS = "thumbs"  # explicit rating; payload {"up": bool}
    SESSION_END = "session_end"  # payload {"outcome": "success" | "unhappy" | "abandoned"}
    # A background session's result, judged hours later: payload {"outcome": one of OUTCOMES}
    # (flywheel/live/sessions.py credits it to the whole session).
    OUTCOME = "outcome"


# A background session's outcomes, best first: the user accepted the result, merged it, their CI
# ran green on it; or reverted it, or abandoned the session.
OUTCOMES = ("accepted", "merged", "ci_green", "reverted", "abandoned")


# A follow-up's words: 4,000 characters hold a long chat message (~1,000 tokens) and keep an event
# small; longer text is refused with its reason, never cut, so no stored text is one the user did not
# write. The reward reads only `dissatisfied`; the text is kept for learning from what users say.
MAX_FOLLOWUP_TEXT_CHARS = 4000


def followup_text_problem(payload: dict[str, Any]) -> str | None:
    """Why a followup payload's `text` cannot be stored, or None (absent text is fine). The server
    (flywheel/live/store.py `check_event`) rejects the event with this reason; the SDK raises it."""
    text = payload.get("text")
    if text is None:
        return None
    if not isinstance(text, str):
        return f"a followup's payload.text must be a string (what the user wrote), got {type(text).__name__}"
    if len(text) > MAX_FOLLOWUP_TEXT_CHARS:
        return (f"a followup's payload.text is {len(text)} characters, past {MAX_FOLLOWUP_TEXT_CHARS}; send the "
                "user's message, not a transcript")
    if "\x00" in text:
        return "a followup's payload.text contains a NUL character (\\u0000); send text without it"
    return None


class Event(BaseModel):
    id: str  # chosen by the client; the idempotency key
    type: EventType
    session_id: str
    completion_id: str | None = None  # None for session-level outcomes
    time: float
    payload: dict[str, Any] = Field(default_factory=dict)
    org_id: str = ""  # the organization of the key that sent it (the server sets it; "" = none)


# An integer literal longer than this is past every number an event may hold (a store column takes
# 19 digits) and, past 4,300 digits, past what Python's int() converts at all (CVE-2020-10735).
MAX_INT_DIGITS = 20


class OversizedInt:
    """An integer literal of a client's JSON that was too long to convert: kept as its digit count, so
    that the event holding it is rejected alone with that reason (flywheel/live/records.py `storable`),
    where int() would fail the whole batch."""

    def __init__(self, digits: int):
        self.digits = digits

    def __repr__(self) -> str:
        return f"<an integer of {self.digits} digits>"


def _parse_int(text: str) -> int | OversizedInt:
    digits = len(text.lstrip("-"))
    return int(text) if digits <= MAX_INT_DIGITS else OversizedInt(digits)


def loads_events_body(body: bytes | str) -> Any:
    """A POST /v1/events body as JSON, with every integer literal past MAX_INT_DIGITS an `OversizedInt`
    (json.JSONDecodeError, UnicodeDecodeError or RecursionError for a body that is not JSON)."""
    return json.loads(body, parse_int=_parse_int)


class EventBatch(BaseModel):
    """The body of POST /v1/events (documented; the server parses it event by event, so that one bad
    event is rejected with its reason and the rest are stored). Each event: id, type, session_id,
    completion_id, time, payload. A followup's payload is {"dissatisfied": bool, "text": str}, `text`
    optional: the user's message, at most MAX_FOLLOWUP_TEXT_CHARS (4,000) characters of valid Unicode
    without NUL; other text is rejected with its reason."""

    events: list[dict[str, Any]]


class _Rejected(BaseModel):
    index: int
    id: str | None
    reason: str


class EventsResponse(BaseModel):
    accepted: list[str]
    duplicate: list[str]
    rejected: list[_Rejected]
