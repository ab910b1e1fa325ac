"""The records of real-time RL: what the server served (`Completion`). What the user did, the
`Event`, is the client's record and lives with the wire (flywheel/api/events.py).

A `Completion` is written before its response leaves the server, so every answer a user saw can be
joined to the feedback that arrives later, by its id.

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
from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

from flywheel.api.events import OversizedInt

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
    if isinstance(value, OversizedInt):
        return f"{where} is an integer of {value.digits} digits, past +-2**53; send it as a string"
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

