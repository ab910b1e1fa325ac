"""The `Trajectory` record: exactly what the model saw and produced in one episode.

Per-token arrays all have the length of `tokens`:
- `loss_mask`  1 where the model generated the token, 0 for prompt and tool-output tokens
- `logprobs`   the behaviour logprob of each generated token (0.0 where the mask is 0)
- `versions`   the version of the weights that generated each token (-1 where the mask is 0): in
               training data the policy version (learner steps since the run's start checkpoint);
               the live gate's eval episodes carry the Registry version their engine serves
- `routed_experts`  optional (`EpisodeConfig.routed_experts`): for each token, the experts every
               MoE layer chose when the engine fed it, flat ([layer 0's k ids, layer 1's, ...],
               `flywheel.model.routing`); [] where nothing was recorded (the last token, never fed;
               positions an engine that died had fed); the Learner replays them
               (`LossConfig.routing_replay`). Lists in memory; in JSON (trajectories.jsonl, the
               in-flight `EpisodeState`s) packed by `encode_routing`: each id in the smallest
               unsigned integer that holds the largest (one byte up to 256 experts), base64, with a
               bitmap of the recorded tokens; lists are read too (older records)
- `teacher_logprobs`  optional: a hinted teacher's logprob of each token it distils (null elsewhere:
               the prompt, and generated tokens outside the hinted span), where a user's
               follow-up said what was wrong with the answer; the Learner distils those
               tokens toward it (`flywheel.rl.loss.DistillConfig`, flywheel/live/hints.py).
               None: no teacher, the reward alone

The reward and what happened are kept apart, so that a field says one thing:
- `reward_parts`  the additive terms of `reward`: they sum to it (checked). Simulated RL has the
                  grader's `pass_frac`, `all_passed_bonus`, `visible_tests_penalty`
                  (flywheel/env/grading.py), `invalid_call_penalty` and `truncated_reward`
                  (flywheel/agent/episode.py); real-time RL has the distiller's parts
                  (flywheel/live/rewards.py), its broken-call term under the same name
                  `invalid_call_penalty`, which `flywheel.rl.advantages` reads in both loops.
- counts and indicators: `turns`, `tool_calls`, `invalid_tool_calls`, `asked_question`, and
  `outcome`, the hidden tests' `TestOutcome` (fraction passed, all passed, timed out, visible tests
  modified); None when the workspace was not graded (a sandbox failure, a truncation scored with
  `truncated_reward`, a served completion).

`broken_turns` says which generated tokens made the invalid tool calls: one `[start, end, calls]`
per assistant turn that held at least one invalid call, `tokens[start:end]` being that turn and
`calls` how many of its calls were invalid. The Learner can put the broken-call penalty on those
tokens alone (`flywheel.rl.advantages`, `broken_calls = "turn"`). `failed_turns` does the same for
calls that were well formed but failed: the tool answered with an error (a missing file, an `old`
snippet that is not in the file). They cost nothing in the reward; `failed_call_cost` in
`flywheel.rl.advantages` can charge them to their turn.

The record lives in `agent/` (not `rl/`, where the first design placed it: docs/ARCHITECTURE.md)
because the episode runner produces it and `agent` may not import `rl`; the Learner and
Orchestrator import it from here.
"""

from __future__ import annotations

import base64
import binascii
import math
from enum import StrEnum
from typing import Annotated, Any

import numpy as np
from pydantic import BaseModel, BeforeValidator, Field, PlainSerializer, model_validator

from flywheel.env.outcome import TestOutcome

INVALID_CALL_PENALTY = "invalid_call_penalty"  # the reward part broken tool calls cost, in both loops (<= 0)
# Counts and indicators that older records kept among the reward parts (now `outcome` and the counters).
LEGACY_PARTS = frozenset({"tests_passed_frac", "timed_out", "visible_tests_modified", "invalid_tool_calls"})
PARTS_TOLERANCE = 1e-9  # the parts are summed in another order than the reward was: the last bits may differ


def check_routing(name: str, routed: list[list[int]], loss_mask: list[int]) -> None:
    """Raise ValueError unless `routed` is one entry per token, each [] or of one common width of
    expert ids >= 0."""
    if len(routed) != len(loss_mask):
        raise ValueError(f"trajectory {name}: routed_experts has {len(routed)} entries, tokens {len(loss_mask)}")
    widths = {len(r) for r in routed if r}
    if len(widths) > 1:
        raise ValueError(f"trajectory {name}: routed_experts entries have widths {sorted(widths)}; every recorded "
                         "token holds layers x top-k ids of one model")
    for i, r in enumerate(routed):
        if r and min(r) < 0:
            raise ValueError(f"trajectory {name}: token {i} has routed_experts {r}, an expert id below 0")


_ID_TYPES = {"uint8": np.uint8, "uint16": np.uint16, "uint32": np.uint32}


def encode_routing(routed: list[list[int]] | None) -> dict[str, Any] | None:
    """The JSON form of a routing record: `width` ids per recorded token, each as `dtype` (the
    smallest unsigned type holding the largest id), concatenated and base64'd in `ids`; `recorded`:
    a base64 bitmap of the tokens that have any (np.packbits order). 48 layers x top-8 of up to 256
    experts: 384 bytes per token, 512 characters of base64, where JSON lists took about 1.5 KB."""
    if routed is None:
        return None
    recorded = [bool(r) for r in routed]
    width = next((len(r) for r in routed if r), 0)
    top = max((max(r) for r in routed if r), default=0)
    dtype = next(name for name, t in _ID_TYPES.items() if top <= np.iinfo(t).max)
    ids = np.array([r for r in routed if r], dtype=_ID_TYPES[dtype]).reshape(-1)  # [recorded * width]
    return {"tokens": len(routed), "width": width, "dtype": dtype,
            "recorded": base64.b64encode(np.packbits(np.array(recorded, dtype=bool)).tobytes()).decode(),
            "ids": base64.b64encode(ids.astype(ids.dtype.newbyteorder("<")).tobytes()).decode()}


def decode_routing(value: Any) -> Any:
    """`encode_routing`'s form back to one list of ids per token; anything else is left as it is
    (lists: records written before the encoding, or made in memory)."""
    if not isinstance(value, dict):
        return value
    try:
        n, width, dtype = int(value["tokens"]), int(value["width"]), _ID_TYPES[value["dtype"]]
        recorded = np.unpackbits(np.frombuffer(base64.b64decode(value["recorded"], validate=True), np.uint8))[:n]
        ids = np.frombuffer(base64.b64decode(value["ids"], validate=True), np.dtype(dtype).newbyteorder("<"))
    except (KeyError, TypeError, ValueError, binascii.Error) as exc:
        raise ValueError(f"routed_experts is not a routing record (tokens, width, dtype of {sorted(_ID_TYPES)}, "
                         f"base64 recorded and ids): {type(exc).__name__}: {exc}") from None
    if len(recorded) != n or ids.size != int(recorded.sum()) * width:
        raise ValueError(f"routed_experts records {ids.size} ids for {int(recorded.sum())} of {n} tokens at width "
                         f"{width}: the record is cut or was written for other tokens")
    rows = iter(ids.reshape(-1, width).tolist() if width else [])
    return [next(rows) if r else [] for r in recorded]


# Per-token routing record (module docstring): lists in memory, `encode_routing`'s packed form in JSON.
RoutedExperts = Annotated[list[list[int]] | None, BeforeValidator(decode_routing),
                          PlainSerializer(encode_routing, when_used="json")]


class Status(StrEnum):
    FINISHED = "finished"  # the agent called finish
    TRUNCATED = "truncated"  # ran out of turns or tokens
    TOOL_ERROR = "tool_error"  # stopped after too many turns of only invalid tool calls
    SANDBOX_ERROR = "sandbox_error"  # the sandbox itself failed; not the agent's doing
    ABORTED = "aborted"  # cancelled from outside (shutdown)


class Trajectory(BaseModel):
    task_id: str
    family: str
    tokens: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    versions: list[int]
    prompt_len: int  # tokens of the first prompt (system + instruction)
    status: Status
    reward: float
    reward_parts: dict[str, float]  # additive terms that sum to `reward`
    turns: int
    tool_calls: int
    invalid_tool_calls: int  # a count; what they cost is reward_parts["invalid_call_penalty"]
    asked_question: bool  # replied to the user instead of calling a tool at least once
    # [start, end, invalid calls] per turn that had any
    broken_turns: list[tuple[int, int, int]] = Field(default_factory=list)
    # [start, end, failed calls]: valid calls the tool refused
    failed_turns: list[tuple[int, int, int]] = Field(default_factory=list)
    outcome: TestOutcome | None = None  # the hidden tests' verdict; None: not graded
    timings: dict[str, float] = Field(default_factory=dict)
    group_id: str = ""  # episodes of one task sampled together (GRPO group)
    error: str = ""  # what went wrong, for sandbox_error / aborted
    routed_experts: RoutedExperts = None  # per token; see the module docstring
    teacher_logprobs: list[float | None] | None = None  # per token, null where not distilled; see the module docstring

    @model_validator(mode="after")
    def _equal_lengths(self) -> Trajectory:
        n = len(self.tokens)
        for name in ("loss_mask", "logprobs", "versions", "teacher_logprobs"):
            if getattr(self, name) is not None and len(getattr(self, name)) != n:
                raise ValueError(f"trajectory {self.task_id}: {name} has {len(getattr(self, name))} entries, tokens "
                                 f"{n}")
        if self.routed_experts is not None:
            check_routing(self.task_id, self.routed_experts, self.loss_mask)
        for kind, spans in (("broken", self.broken_turns), ("failed", self.failed_turns)):
            for start, end, calls in spans:
                if not (0 <= start < end <= n) or calls < 1 or not all(self.loss_mask[start:end]):
                    raise ValueError(f"trajectory {self.task_id}: {kind} turn [{start}, {end}, {calls}] is not a span "
                                     f"of generated tokens within its {n} tokens with at least one {kind} call")
        total = math.fsum(self.reward_parts.values())
        if not abs(total - self.reward) <= PARTS_TOLERANCE * max(1.0, abs(self.reward)):
            if legacy := sorted(LEGACY_PARTS & self.reward_parts.keys()):
                raise ValueError(f"trajectory {self.task_id}: reward_parts has {legacy}, counts and indicators that "
                                 "reward parts held before they became the reward's additive terms; this record "
                                 "was written by an older flywheel: start a new run_dir rather than resume it")
            raise ValueError(f"trajectory {self.task_id}: reward_parts {self.reward_parts} sum to {total}, not to the "
                             f"reward {self.reward}; reward_parts holds the reward's additive terms only (counts and "
                             "indicators go in the trajectory's counters and `outcome`)")
        return self

    @property
    def all_passed(self) -> bool:
        """Whether the hidden tests all passed (False when the workspace was not graded)."""
        return self.outcome is not None and self.outcome.all_passed

    @property
    def generated_tokens(self) -> int:
        return sum(self.loss_mask)

    @property
    def failed_tool_calls(self) -> int:
        """Valid calls whose tool answered with an error (those `failed_turns` records)."""
        return sum(calls for _, _, calls in self.failed_turns)

    def version_span(self) -> tuple[int, int]:
        """(oldest, newest) policy version among generated tokens."""
        vs = [v for v, m in zip(self.versions, self.loss_mask, strict=True) if m]
        return (min(vs), max(vs)) if vs else (-1, -1)
