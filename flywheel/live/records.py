"""The records of real-time RL: what the server served (`Completion`) and what the user did (`Event`).

A `Completion` is written before its response leaves the server, so every answer a user saw can be
joined to the feedback that arrives later. An `Event` is made by the client, which picks its id:
ingestion is idempotent on that id, so a client that retries after a lost acknowledgement never
counts the same reaction twice. Feedback names either the completion it is about or only the
session (outcomes like "the session ended unhappy"); `RewardDistiller` assigns session-level events
to the session's completions by a documented rule.

Per-token arrays of a completion (`completion_ids`, `logprobs`) have equal lengths; together with
`prompt_ids` and `version` they are exactly what the Learner needs for an on-policy update.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import BaseModel, Field, model_validator


class EventType(StrEnum):
    EDIT_APPLIED = "edit_applied"  # the editor applied the agent's edit
    EDIT_PERSISTED = "edit_persisted"  # the edit was still there after the horizon
    EDIT_REVERTED = "edit_reverted"  # the user undid the edit within the horizon
    FOLLOWUP = "followup"  # the user wrote again; payload {"dissatisfied": bool}
    THUMBS = "thumbs"  # explicit rating; payload {"up": bool}
    SESSION_END = "session_end"  # payload {"outcome": "success" | "unhappy" | "abandoned"}


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
    # What the request was about, where the client said so (the simulated users do): task family,
    # whether the request was ambiguous. Monitors use it; rewards never do.
    request_meta: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _equal_lengths(self) -> Completion:
        if len(self.logprobs) != len(self.completion_ids):
            raise ValueError(
                f"completion {self.id}: {len(self.logprobs)} logprobs for {len(self.completion_ids)} tokens"
            )
        return self

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
