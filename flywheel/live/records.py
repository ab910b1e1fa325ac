"""The records of real-time RL: what the server served (`Completion`) and what the user did (`Event`).

A `Completion` is written before its response leaves the server, so every answer a user saw can be
joined to the feedback that arrives later. An `Event` is made by the client, which picks its id:
ingestion is idempotent on that id, so a client that retries after a lost acknowledgement never
counts the same reaction twice. Feedback names either the completion it is about or only the
session (outcomes like "the session ended unhappy"); `RewardDistiller` assigns session-level events
to the session's completions by a documented rule.

Per-token arrays of a completion (`completion_ids`, `logprobs`) have equal lengths; together with
`prompt_ids` and `version` they are exactly what the Learner needs for an on-policy update. A
completion also keeps the `temperature` and `top_p` it was sampled with: its logprobs are of the
temperature-scaled distribution (flywheel/model/engine.py), so a learner may score it only at that
temperature (`scoring_temperature`; flywheel/live/batch.py leaves the others out). Records stored
before these fields existed load as sampled at 1.0 and 1.0, the server's defaults then, which is
what they were unless the client asked for another temperature.

Everything a record holds must read back: `storable` is the check the store and the server apply
to client-supplied values (ids, `request_meta`, event payloads) before anything is committed, so
no record can make a later read of the store fail.
"""

from __future__ import annotations

import math
from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

# JSON values a record may hold: nesting this deep, integers a signed 64-bit column (and every JSON
# reader: JavaScript's safe integers end at 2**53) can carry.
MAX_DEPTH = 32
MAX_INT = 2**53


def storable(value: Any, where: str = "value", depth: int = 0) -> str | None:
    """Why `value` (decoded JSON) cannot be stored and read back, or None.

    Refused: strings that are not valid Unicode (lone surrogates from a `\\ud800` escape: UTF-8 and
    so SQLite cannot encode them), non-finite floats (JSON has no NaN; they would come back as
    null or break a strict reader), integers past +-2**53, nesting past MAX_DEPTH, and keys that
    are not strings."""
    if depth > MAX_DEPTH:
        return f"{where} nests deeper than {MAX_DEPTH} levels; flatten it"
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return f"{where} is not valid Unicode (a lone surrogate escape such as \\ud800); send UTF-8 text"
        return None
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int):
        return None if -MAX_INT <= value <= MAX_INT else f"{where} = {value} is past +-2**53; send it as a string"
    if isinstance(value, float):
        return None if math.isfinite(value) else f"{where} is {value}; JSON numbers must be finite"
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                return f"{where} has a key {key!r} that is not a string"
            reason = storable(key, f"{where} key", depth + 1) or storable(item, f"{where}.{key}", depth + 1)
            if reason:
                return reason
        return None
    if isinstance(value, list | tuple):
        for i, item in enumerate(value):
            reason = storable(item, f"{where}[{i}]", depth + 1)
            if reason:
                return reason
        return None
    return f"{where} is a {type(value).__name__}, not a JSON value"


class EventType(StrEnum):
    EDIT_APPLIED = "edit_applied"  # the editor applied the agent's edit
    EDIT_PERSISTED = "edit_persisted"  # the edit was still there after the horizon
    EDIT_REVERTED = "edit_reverted"  # the user undid the edit within the horizon
    FOLLOWUP = "followup"  # the user wrote again; payload {"dissatisfied": bool}
    THUMBS = "thumbs"  # explicit rating; payload {"up": bool}
    SESSION_END = "session_end"  # payload {"outcome": "success" | "unhappy" | "abandoned"}
    # A background session's result, judged hours later: payload {"outcome": one of OUTCOMES}
    # (flywheel/live/sessions.py credits it to the whole session).
    OUTCOME = "outcome"


# A background session's outcomes, best first: the user accepted the result, merged it, their CI
# ran green on it; or reverted it, or abandoned the session.
OUTCOMES = ("accepted", "merged", "ci_green", "reverted", "abandoned")
INTERACTIVE, BACKGROUND = "interactive", "background"


class CompletionToolCall(BaseModel):
    name: str
    arguments: dict[str, Any] | None = None
    valid: bool = True
    error: str = ""


class Completion(BaseModel):
    id: str
    session_id: str
    user_id: str
    version: int  # the policy version that produced every completion token
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    latency_ms: float
    tool_calls: list[CompletionToolCall] = Field(default_factory=list)
    content: str = ""  # the text outside tool calls
    finish_reason: str = "stop"  # stop | length | tool_calls
    arm: str = "production"  # the deployment arm that routed the session: production | candidate
    created_at: float = 0.0
    # What it was sampled with (0 = greedy); see the module docstring for records from before.
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    # What the request was about, where the client said so (the simulated users do): task family,
    # whether the request was ambiguous. Monitors use it; rewards never do.
    request_meta: dict[str, Any] = Field(default_factory=dict)
    # The organization the request came from ("" = none): the API key's, else metadata["org_id"].
    org_id: str = ""
    # "background": a long agent session with no user between its turns, judged by one OUTCOME
    # event at its end (metadata["session_kind"]); "interactive": feedback per answer.
    session_kind: Literal["interactive", "background"] = INTERACTIVE

    @model_validator(mode="after")
    def _equal_lengths(self) -> Completion:
        if len(self.logprobs) != len(self.completion_ids):
            raise ValueError(
                f"completion {self.id}: {len(self.logprobs)} logprobs for {len(self.completion_ids)} tokens"
            )
        return self

    @property
    def scoring_temperature(self) -> float:
        """The temperature its logprobs are of: the sampling one, or 1.0 for greedy (the engine's convention)."""
        return self.temperature or 1.0

    @property
    def invalid_tool_calls(self) -> int:
        return sum(not c.valid for c in self.tool_calls)

    @property
    def asked_question(self) -> bool:
        """Answered in words without calling any tool: a question or a refusal to act."""
        return not self.tool_calls and bool(self.content.strip())


class Event(BaseModel):
    id: str  # chosen by the client; the idempotency key
    type: EventType
    session_id: str
    completion_id: str | None = None  # None for session-level outcomes
    time: float
    payload: dict[str, Any] = Field(default_factory=dict)
    org_id: str = ""  # the organization of the key that sent it (the server sets it; "" = none)
