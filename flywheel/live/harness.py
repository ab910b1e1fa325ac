"""Harness rollouts: any agent program that speaks the OpenAI chat API plays a flywheel episode.

    HarnessServer(engine, tokenizer, pool)          one app, many episodes, on loopback
      start(task) ──> HarnessEpisode: a sandbox holding the task's files, an id and a key
                      base URL  http://HOST:PORT/episodes/ID/v1     (the key: `Authorization: Bearer KEY`)
      harness ──POST …/v1/chat/completions──> TokenLedger: match the messages to the tokens served
                                              ──> Engine (exact ids, logprobs, versions) ──> answer
      harness ──POST …/exec (via sandbox_exec)──> Sandbox.run in that episode's jail
      finish(id) ──> grade the workspace with the hidden tests ──> HarnessResult: one Trajectory
                     per segment, the completions served, the count of history breaks

    run_harness_episode(server, task, workdir)      start, run the harness program, finish
    HarnessRunner / harness_runner                  the Orchestrator's runner: `flywheel train`
                                                    with rollout.harness = "mini-swe-agent"

Token fidelity (`TokenLedger`). A harness resends the whole conversation every turn. The ledger
keeps, per segment, the token ids the engine saw and produced and the messages they stand for
(the last request's messages plus the assistant message served for it). When a request's messages
begin with exactly those, only the new messages (tool results, a user turn) are tokenized
(`ConversationEncoder.continuation`) and appended after the served tokens: the engine is prompted
with, and the trajectory records, the tokens it sampled, never a re-tokenization of them. When the
harness rewrote its history (dropped or edited a message, reformatted a tool result, truncated or
summarised), the request starts a new segment from the rendered prompt, and the break is counted
(`HarnessResult.breaks`, with the index of the first message that differs). An assistant message
matches what was served by role, text and its calls' names and parsed arguments (call ids, JSON
spacing and `null` vs `""` content are a client's serialisation, not a rewrite).

The model and the declared tools. A model that reads tool schemas (`tools_in_prompt`) gets the
client's tools rendered in its prompt and its calls validated against them. The embedded default
was trained on flywheel's own tools without schemas in the prompt: its calls are validated against
those, `HarnessConfig.tool_aliases` maps a declared tool to the flywheel tool that does the same
(mini-swe-agent's `bash` is `run_command`: same `command` argument), and a call of a flywheel tool
the client did not declare is an invalid call in the ledger; each response names the declared
tools the model does not know (`flywheel.unknown_tools`). The tokens recorded are the model's own.
Only calls the harness can dispatch come back as `tool_calls`; an invalid one (unparsable, cut at
max_tokens, undeclared) comes back as text (`ChatFormat.client_view`, flywheel/model/chat.py) and still counts,
with its penalty, in the episode's trajectory. A harness that leaves mid-turn (its connection
closed) cancels the turn: nothing of it enters the ledger; an `exec` whose client left is killed.

Departures from the built-in runner (flywheel/agent/episode.py): a segment is a Trajectory of its
own, and every segment carries the episode's whole reward (below). Weight swaps happen inside the
Engine as they do for any request, and every token keeps the version that sampled it. A harness
episode has no resumable state: a killed run plays it again from its start.

How a segment's reward is assigned. The reward grades the workspace the episode left, which every
segment's commands shaped; no segment can be credited apart from the others (a later segment
starts where the earlier ones left the files), so each carries the episode's reward and its parts,
as each token of a built-in episode carries the same advantage. Played directly
(`run_harness_episode`), an episode with breaks yields several training sequences of one reward.
Under the Orchestrator (`HarnessRunner`, `flywheel train` with `rollout.harness`) an episode is one
member of its GRPO group, compared once with its siblings, so it is trained on its last segment
(the one that reached the graded workspace) and the others are counted as dropped: several
segments of one reward would weigh that episode several times in its group's baseline.

What it does not protect against: the harness program itself runs on the host, as the user who
started it (only the commands it sends through `exec` run in the jail); a harness that runs
commands some other way than through the episode's endpoint is not contained by flywheel.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shlex
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from flywheel.agent.episode import EpisodeConfig, EpisodeState
from flywheel.agent.trajectory import INVALID_CALL_PENALTY, Status, Trajectory
from flywheel.api.errors import ApiError, describe_errors, install_error_handlers
from flywheel.api.http import RunningServer, read_body, unless_client_left
from flywheel.api.records import openai_tool_call, parse_chat, usage
from flywheel.api.streaming import stream_message
from flywheel.env.grading import GradeConfig, grade
from flywheel.env.pool import SandboxPool
from flywheel.env.sandbox import Sandbox, SandboxError
from flywheel.env.task import Task
from flywheel.env.toolspec import TOOL_SCHEMAS, ToolCall
from flywheel.model.chat import tools_in_prompt
from flywheel.model.conversation import ConversationEncoder
from flywheel.model.engine import Engine, EngineError, Generation, SamplingParams


class HarnessConfig(BaseModel):
    """One harness episode's limits and how the embedded model's tools meet the client's."""

    model_config = ConfigDict(extra="forbid")
    max_turns: int = Field(default=16, ge=1)  # completions per episode; more get 400 (the harness then stops)
    max_tokens: int = Field(default=4096, ge=16)  # a segment's whole sequence, prompt included
    max_tokens_per_turn: int = Field(default=256, ge=1)  # when the request names no max_tokens
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)  # when the request names none
    exec_timeout_s: float = Field(default=10.0, gt=0)  # per command, unless the harness asks for less
    harness_timeout_s: float = Field(default=600.0, gt=0)  # the whole program; past it: killed, truncated
    invalid_call_penalty: float = 0.1  # per invalid call, as in the built-in runner
    max_invalid_penalty: float = 0.5
    # A tool the client declares -> the flywheel tool the embedded model calls for it (same arguments).
    tool_aliases: dict[str, str] = Field(default_factory=lambda: {"bash": "run_command"})
    grade: GradeConfig = GradeConfig()

    @classmethod
    def for_episode(cls, episode: EpisodeConfig) -> HarnessConfig:
        """The limits the built-in runner plays `episode` with, for a harness episode in the same run:
        turns, tokens, temperature, the broken-call penalty and the grading are the same."""
        return cls(max_turns=episode.max_turns, max_tokens=episode.max_tokens,
                   max_tokens_per_turn=episode.max_tokens_per_turn, temperature=episode.temperature,
                   invalid_call_penalty=episode.invalid_call_penalty, max_invalid_penalty=episode.max_invalid_penalty,
                   grade=episode.grade)


# ---- token fidelity


def _canonical(message: dict[str, Any]) -> tuple[Any, ...]:
    """What decides whether two messages render to the same turn: role, text, calls (name, arguments)."""
    calls = []
    for call in message.get("tool_calls") or []:
        args = call["function"]["arguments"]
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:  # not JSON, or an integer past int()'s 4,300 digits
                pass  # kept as the string: it matches only the same string
        calls.append((call["function"]["name"], json.dumps(args, sort_keys=True)))
    return message["role"], message.get("content") or "", tuple(calls)


@dataclass
class Segment:
    """Tokens of one unbroken stretch of an episode, as the engine saw and produced them."""

    tokens: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    prompt_len: int = 0
    messages: list[tuple[Any, ...]] = field(default_factory=list)  # canonical messages the tokens stand for
    closed: bool = True  # the last generated turn ended with its end token (<|im_end|>, <|eot_id|>)
    turns: int = 0
    tool_calls: int = 0
    invalid_tool_calls: int = 0
    asked_question: bool = False
    broken_turns: list[tuple[int, int, int]] = field(default_factory=list)

    def context(self, ids: list[int]) -> None:
        self.tokens += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)


@dataclass
class Break:
    """A request whose messages do not extend the segment's: where they first differ, and how."""

    turn: int  # the episode's completion count when it happened
    at_message: int  # index of the first message that differs (or the length of the shorter list)
    kind: str  # "rewritten" (a message differs) or "truncated" (fewer messages than were served)


@dataclass
class Plan:
    """A request's prompt before it is served (TokenLedger.prompt); `record` commits it."""

    segment: Segment
    new_context: list[int]
    prompt_ids: list[int]
    broke: Break | None


class TokenLedger:
    """An episode's segments: matches each request's messages to the tokens already served."""

    def __init__(self, encoder: ConversationEncoder):
        self.encoder = encoder
        self.segments: list[Segment] = []
        self.breaks: list[Break] = []
        self.turns = 0

    def prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> Plan:
        """How this request's prompt is made: the segment it extends (or a new one), the context ids
        to append, the whole prompt, and the break it makes. Nothing changes until `record`."""
        canonical = [_canonical(m) for m in messages]
        current = self.segments[-1] if self.segments else None
        broke = None
        if current is not None:
            known = current.messages
            same = next((i for i, (a, b) in enumerate(zip(known, canonical, strict=False)) if a != b),
                        min(len(known), len(canonical)))
            if same == len(known) and len(canonical) > len(known):
                new = self.encoder.continuation(messages[len(known):], closed=current.closed)
                return Plan(current, new, current.tokens + new, None)
            broke = Break(turn=self.turns, at_message=same, kind="truncated" if same == len(canonical) else "rewritten")
        ids = self.encoder.encode(messages, tools)
        return Plan(Segment(prompt_len=len(ids)), ids, ids, broke)

    def record(self, plan: Plan, generation: Generation, messages: list[dict[str, Any]], served: dict[str, Any],
               calls: list[ToolCall]) -> int:
        """Append the request's new context and the generated turn (starting the plan's segment and
        counting its break if it makes one); the segment now stands for `messages` plus the `served`
        assistant message. Returns the segment's index."""
        segment = plan.segment
        if not self.segments or segment is not self.segments[-1]:
            self.segments.append(segment)
        if plan.broke is not None:
            self.breaks.append(plan.broke)
        segment.context(plan.new_context)
        start = len(segment.tokens)
        segment.tokens += generation.token_ids
        segment.mask += [1] * len(generation.token_ids)
        segment.logprobs += generation.logprobs
        segment.versions += generation.versions
        segment.closed = generation.finish_reason == "stop"
        segment.messages = [_canonical(m) for m in messages] + [_canonical(served)]
        segment.turns += 1
        self.turns += 1
        segment.tool_calls += len(calls)
        invalid = sum(not c.valid for c in calls)
        segment.invalid_tool_calls += invalid
        if invalid and len(segment.tokens) > start:
            segment.broken_turns.append((start, len(segment.tokens), invalid))
        if not calls:
            segment.asked_question = True
        return len(self.segments) - 1


# ---- episodes and the endpoint


@dataclass
class ServedCompletion:
    """One completion the endpoint served: exactly what the engine saw and sampled."""

    id: str
    segment: int
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    content: str
    tool_calls: list[dict[str, Any]]
    engine_ms: float
    received_s: float  # time.perf_counter() when the request arrived (bench/live.py's per-turn figures)


@dataclass
class HarnessEpisode:
    id: str
    key: str
    task: Task
    sandbox: Sandbox
    ledger: TokenLedger
    started: float
    completions: list[ServedCompletion] = field(default_factory=list)
    commands: int = 0
    exec_s: float = 0.0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one request of an episode at a time
    url: str = ""  # http://HOST:PORT/episodes/ID, once the server runs
    group_id: str = ""  # the trajectories' GRPO group (default: harness-ID, a group of its own)
    priority: int = 0  # the engine's admission order (SamplingParams.priority): a rollout's group order
    # Called after every served turn (the Orchestrator's progress and shutdown check). What it raises
    # stops the episode: kept in `stopped`, the harness gets a 503, its runner ends the program.
    on_turn: Callable[[], None] | None = None
    stopped: BaseException | None = None


class HarnessResult(BaseModel):
    """What a finished harness episode yields: a Trajectory per segment and what it took."""

    model_config = ConfigDict(arbitrary_types_allowed=True)
    episode_id: str
    trajectories: list[Trajectory]
    completions: list[dict[str, Any]]
    breaks: int
    break_details: list[dict[str, Any]]
    commands: int
    timings: dict[str, float]
    harness_exit_code: int | None = None
    harness_output: str = ""


class _ExecRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    command: str = Field(max_length=1 << 20)
    shell: str = Field(default="sh", pattern=r"^(sh|bash)$")
    env: dict[str, str] = Field(default_factory=dict)
    timeout_s: float | None = Field(default=None, gt=0)


class HarnessServer:
    """The per-episode OpenAI endpoints and exec endpoints over one Engine and one SandboxPool."""

    def __init__(self, engine: Engine, tokenizer: Any, pool: SandboxPool, config: HarnessConfig | None = None,
                 model_name: str = "flywheel"):
        self.engine, self.tokenizer, self.pool = engine, tokenizer, pool
        self.config = config or HarnessConfig()
        self.model_name = model_name
        self.encoder = ConversationEncoder(tokenizer)
        self.reads_tools = tools_in_prompt(tokenizer)
        self.episodes: dict[str, HarnessEpisode] = {}
        self._lock = threading.Lock()
        self._stop = self.encoder.stop_ids
        self.app = self._create_app()
        self.base_url = ""  # set by `serve`

    # ---- episode lifecycle

    def start(self, task: Task, group_id: str = "", priority: int = 0,
              on_turn: Callable[[], None] | None = None) -> HarnessEpisode:
        """A fresh episode of `task`: a sandbox holding its files, an id for the URL, a key."""
        sandbox = self.pool.acquire(task.files)
        episode = HarnessEpisode(id=uuid.uuid4().hex[:16], key=secrets.token_urlsafe(24), task=task, sandbox=sandbox,
                                 ledger=TokenLedger(self.encoder), started=time.perf_counter(), group_id=group_id,
                                 priority=priority, on_turn=on_turn)
        episode.url = f"{self.base_url}/episodes/{episode.id}"
        with self._lock:
            self.episodes[episode.id] = episode
        return episode

    def finish(self, episode_id: str, status: Status = Status.FINISHED, error: str = "") -> HarnessResult:
        """Grade the episode's workspace, release its sandbox, build a Trajectory per segment."""
        with self._lock:
            episode = self.episodes.pop(episode_id)
        timings = {"total_s": time.perf_counter() - episode.started, "exec_s": episode.exec_s,
                   "generate_s": sum(c.engine_ms for c in episode.completions) / 1000, "grade_s": 0.0}
        try:
            final = episode.sandbox.snapshot()
        except SandboxError as exc:
            final, status, error = None, Status.SANDBOX_ERROR, str(exc)
        finally:
            self.pool.release(episode.sandbox)
        parts: dict[str, float] = {}
        outcome = None
        if final is not None:
            t0 = time.perf_counter()
            graded = grade(episode.task, final, self.config.grade)
            timings["grade_s"] = time.perf_counter() - t0
            parts.update(graded.parts)
            outcome = graded.outcome
        segments = episode.ledger.segments
        n_invalid = sum(s.invalid_tool_calls for s in segments)
        penalty = min(self.config.max_invalid_penalty, self.config.invalid_call_penalty * n_invalid)
        parts[INVALID_CALL_PENALTY] = -penalty
        reward = sum(v for k, v in parts.items() if k != INVALID_CALL_PENALTY) - penalty
        trajectories = [Trajectory(
            task_id=episode.task.id, family=episode.task.family, tokens=s.tokens, loss_mask=s.mask,
            logprobs=s.logprobs, versions=s.versions, prompt_len=s.prompt_len, status=status, reward=reward,
            reward_parts=dict(parts), turns=s.turns, tool_calls=s.tool_calls, invalid_tool_calls=s.invalid_tool_calls,
            asked_question=s.asked_question, broken_turns=s.broken_turns, outcome=outcome, timings=timings,
            group_id=episode.group_id or f"harness-{episode.id}", error=error) for s in segments]
        return HarnessResult(
            episode_id=episode.id, trajectories=trajectories,
            completions=[c.__dict__ for c in episode.completions], breaks=len(episode.ledger.breaks),
            break_details=[b.__dict__ for b in episode.ledger.breaks], commands=episode.commands, timings=timings)

    def abandon(self, episode_id: str) -> None:
        """End an episode without grading it (its run stopped): the sandbox goes back to the pool."""
        with self._lock:
            episode = self.episodes.pop(episode_id, None)
        if episode is not None:
            self.pool.release(episode.sandbox)

    def close(self) -> None:
        with self._lock:
            episodes, self.episodes = list(self.episodes.values()), {}
        for episode in episodes:
            self.pool.release(episode.sandbox)

    # ---- the endpoints

    def _episode(self, episode_id: str, request: Request) -> HarnessEpisode:
        episode = self.episodes.get(episode_id)
        if episode is None:
            raise ApiError(404, f"no running harness episode {episode_id!r}; start one with HarnessServer.start",
                           code="episode_not_found")
        kind, _, key = request.headers.get("authorization", "").partition(" ")
        if kind.lower() != "bearer" or not secrets.compare_digest(key.strip().encode(), episode.key.encode()):
            raise ApiError(401, "this episode's key is missing or wrong: send `Authorization: Bearer KEY` with the key "
                           "HarnessServer.start gave", "authentication_error", "invalid_api_key")
        return episode

    async def complete(self, episode: HarnessEpisode, body: bytes, request: Request) -> Response:
        """One turn: a harness that leaves before its answer cancels the engine request, and nothing
        of the turn enters the ledger (a generation nobody received is no training turn)."""
        received = time.perf_counter()
        req = parse_chat(body)
        if req.tool_choice == "none":
            raise ApiError(400, "tool_choice 'none' is not supported on a harness episode: the episode's tools are the "
                           "model's; leave tool_choice unset or 'auto'", param="tool_choice")
        if episode.ledger.turns >= self.config.max_turns:
            raise ApiError(400, f"this episode has used its {self.config.max_turns} turns (harness max_turns); end "
                           "the harness", code="turn_budget_exhausted")
        messages = [m.as_template_message() for m in req.messages]
        declared = {t["function"]["name"]: t for t in req.tools or []}
        max_tokens = req.max_completion_tokens or req.max_tokens or self.config.max_tokens_per_turn
        async with episode.lock:
            plan = await run_in_threadpool(
                episode.ledger.prompt, messages, list(declared.values()) if self.reads_tools else None)
            prompt_ids = plan.prompt_ids
            budget = self.config.max_tokens - len(prompt_ids)
            if budget <= 0:
                raise ApiError(400, f"the episode's context ({len(prompt_ids)} tokens) reached harness max_tokens "
                               f"({self.config.max_tokens}); end the harness", code="context_length_exceeded")
            params = SamplingParams(
                temperature=self.config.temperature if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p, max_tokens=min(max_tokens, budget),
                stop_token_ids=self._stop, session=f"{episode.id}-{id(plan.segment)}", priority=episode.priority,
                seed=req.seed)
            t0 = time.perf_counter()
            try:
                future = self.engine.submit(prompt_ids, params)
                generation = await unless_client_left(request, asyncio.wrap_future(future), future.cancel)
            except EngineError as exc:
                raise ApiError(503, f"the engine failed ({exc}); retry later", "server_error",
                               "engine_failed") from None
            if generation.finish_reason == "aborted":  # nothing recorded: the harness's retry is served anew
                raise ApiError(503, "the engine aborted this turn (shutting down); retry", "server_error",
                               "engine_aborted")
            engine_ms = (time.perf_counter() - t0) * 1000
            answer = self.tokenizer.decode(generation.token_ids, skip_special_tokens=False)
            completion_id = f"chatcmpl-{uuid.uuid4().hex}"
            content, calls, unknown = self._calls(answer, declared, completion_id)
            # Only calls the harness can dispatch go out as tool_calls; the ledger counts every call.
            content, sent_calls = self.encoder.format.client_view(answer, content, calls) if calls else (content, [])
            message: dict[str, Any] = {"role": "assistant", "content": content or (None if sent_calls else "")}
            if sent_calls:
                message["tool_calls"] = [openai_tool_call(c) for c in sent_calls]
            segment_index = episode.ledger.record(plan, generation, messages, message, calls)
        served = ServedCompletion(
            id=completion_id, segment=segment_index, prompt_ids=list(prompt_ids),
            completion_ids=list(generation.token_ids), logprobs=list(generation.logprobs),
            versions=list(generation.versions), finish_reason=generation.finish_reason, content=content,
            tool_calls=message.get("tool_calls", []), engine_ms=engine_ms, received_s=received)
        episode.completions.append(served)
        if episode.on_turn is not None:
            try:
                await run_in_threadpool(episode.on_turn)
            except BaseException as exc:  # noqa: BLE001 - kept for the episode's runner, which raises it
                episode.stopped = exc
                raise ApiError(503, "this episode was stopped (its run is shutting down); end the harness",
                               "server_error", "episode_stopped") from None
        finish = "length" if generation.finish_reason == "length" else ("tool_calls" if sent_calls else "stop")
        counts = usage(len(prompt_ids), len(generation.token_ids))
        head = {"id": completion_id, "created": int(time.time()), "model": req.model,
                "system_fingerprint": f"flywheel-v{generation.versions[-1] if generation.versions else -1}",
                "flywheel": {"episode": episode.id, "segment": served.segment, "engine_ms": round(engine_ms, 3),
                             "unknown_tools": unknown, "breaks": len(episode.ledger.breaks)}}
        if req.stream:
            from fastapi.responses import StreamingResponse  # noqa: PLC0415  (streaming harnesses only)

            include_usage = bool((req.stream_options or {}).get("include_usage"))
            return StreamingResponse(stream_message(head, message, finish, None, counts if include_usage else None),
                                     media_type="text/event-stream")
        payload = {**head, "object": "chat.completion", "usage": counts,
                   "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish}]}
        return Response(json.dumps(payload), media_type="application/json")

    def _calls(self, answer: str, declared: dict[str, dict[str, Any]], completion_id: str
               ) -> tuple[str, list[ToolCall], list[str]]:
        """(content, calls as the client sees them, declared tools the model does not know)."""
        prefix = f"call_{completion_id[9:21]}"
        if self.reads_tools:  # the client's schemas were in the prompt: its calls are checked against them
            content, calls = self.encoder.format.parse(answer, call_id_prefix=prefix, schemas=declared)
            return content, calls, []
        aliases = {own: client for client, own in self.config.tool_aliases.items() if client in declared}
        unknown = sorted(n for n in declared if n not in TOOL_SCHEMAS and n not in self.config.tool_aliases)
        content, own_calls = self.encoder.format.parse(answer, call_id_prefix=prefix)
        calls = []
        for call in own_calls:
            if not call.valid:
                calls.append(call)
            elif call.name in aliases:
                calls.append(ToolCall(call.id, aliases[call.name], call.arguments))
            elif call.name in declared:
                calls.append(call)
            else:
                calls.append(ToolCall(call.id, call.name, call.arguments, error=(
                    f"tool {call.name!r} is not among the tools this request declares "
                    f"({', '.join(declared) or 'none'})")))
        return content, calls, unknown

    def execute(self, episode: HarnessEpisode, body: bytes, cancel: threading.Event | None = None) -> dict[str, Any]:
        """Run the command in the episode's sandbox; `cancel` (its client left) kills it, the sandbox
        staying usable for the next."""
        try:
            req = _ExecRequest.model_validate_json(body)
        except ValidationError as exc:
            raise ApiError(400, f"invalid exec request: {describe_errors(exc)}") from None
        exports = "".join(f"export {k}={shlex.quote(v)}; " for k, v in req.env.items() if k.isidentifier())
        command = f"{exports}{req.shell} -c {shlex.quote(req.command)}"
        timeout = min(req.timeout_s or self.config.exec_timeout_s, self.config.exec_timeout_s)
        t0 = time.perf_counter()
        try:
            result = episode.sandbox.run(command, timeout_s=timeout, cancel=cancel)
        except SandboxError as exc:
            raise ApiError(409, f"the episode's sandbox failed: {exc}", code="sandbox_error") from None
        episode.exec_s += time.perf_counter() - t0
        episode.commands += 1
        return {"output": result.output, "exit_code": result.exit_code, "timed_out": result.timed_out}

    def _create_app(self) -> FastAPI:
        app = FastAPI(title="flywheel harness", docs_url=None, redoc_url=None, openapi_url=None)
        install_error_handlers(app)

        @app.post("/episodes/{episode_id}/v1/chat/completions")
        async def chat_completions(episode_id: str, request: Request) -> Response:
            episode = self._episode(episode_id, request)
            return await self.complete(episode, await read_body(request, 4 << 20), request)

        @app.get("/episodes/{episode_id}/v1/models")
        async def models(episode_id: str, request: Request) -> dict[str, Any]:
            self._episode(episode_id, request)
            return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                                "owned_by": "flywheel"}]}

        @app.post("/episodes/{episode_id}/exec")
        async def execute(episode_id: str, request: Request) -> Response:
            episode = self._episode(episode_id, request)
            body = await read_body(request, 2 << 20)
            cancel = threading.Event()
            result = await unless_client_left(request, run_in_threadpool(self.execute, episode, body, cancel),
                                              cancel.set)
            return Response(json.dumps(result), media_type="application/json")

        return app

    def serve(self, host: str = "127.0.0.1", port: int = 0) -> Any:
        """Run the endpoints on a background thread (a `RunningServer`); `base_url` is set from it."""
        running = RunningServer(self.app, host, port)
        self.base_url = running.url
        return running


# ---- mini-swe-agent, configured by its own settings


def mini_swe_agent_command(episode: HarnessEpisode, workdir: Path, step_limit: int = 8,
                           model_name: str = "flywheel") -> tuple[list[str], dict[str, str]]:
    """(argv, environment) that run mini-swe-agent, unmodified, on `episode`.

    Its model is litellm's OpenAI-compatible client with the episode's base URL and key; its
    environment is its own `bubblewrap` one with `executable` set to this interpreter and
    `wrapper_args` to `-m flywheel.live.sandbox_exec`, so every command it runs goes to the
    episode's sandbox. The default agent (not the interactive one) runs with no terminal."""
    workdir.mkdir(parents=True, exist_ok=True)
    config = {
        "agent": {"step_limit": step_limit, "cost_limit": 0},
        "model": {"model_class": "litellm", "model_name": f"openai/{model_name}", "cost_tracking": "ignore_errors",
                  "model_kwargs": {"api_base": f"{episode.url}/v1", "api_key": episode.key, "drop_params": True}},
        "environment": {"environment_class": "bubblewrap", "cwd": "/workspace", "executable": sys.executable,
                        "wrapper_args": ["-m", "flywheel.live.sandbox_exec", "--url", episode.url,
                                         "--key", episode.key, "--"]},
    }
    config_path = workdir / "flywheel.yaml"
    config_path.write_text(json.dumps(config, indent=2))  # JSON is YAML
    # mini.yaml: mini-swe-agent's own prompts, as its `mini` command uses them; ours only overrides.
    argv = [sys.executable, "-m", "minisweagent.run.mini", "-c", "mini.yaml",
            "-c", str(config_path), "--agent-class", "default", "--exit-immediately", "-t", episode.task.instruction,
            "-o", str(workdir / "mini.traj.json")]
    env = {**os.environ, "MSWEA_CONFIGURED": "true", "MSWEA_GLOBAL_CONFIG_DIR": str(workdir / "mswea"),
           "MSWEA_SILENT_STARTUP": "1", "MSWEA_COST_TRACKING": "ignore_errors",
           # litellm reads its model price list from disk, not the network; no retries hide an error
           "LITELLM_LOCAL_MODEL_COST_MAP": "True", "MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(Path(__file__).resolve().parents[2]),
                                                     os.environ.get("PYTHONPATH", "")) if p)}
    return argv, env


def run_harness_episode(server: HarnessServer, task: Task, workdir: Path, step_limit: int = 8, group_id: str = "",
                        priority: int = 0, on_turn: Callable[[], None] | None = None) -> HarnessResult:
    """Play `task` with mini-swe-agent as the agent loop: start, run it to its end, grade, build.

    `on_turn` is called after every served turn and about once a second while the program runs;
    what it raises ends the program (its whole process group), releases the sandbox ungraded and
    is raised here: how a run that shuts down stops it without waiting for its next turn."""
    episode = server.start(task, group_id=group_id, priority=priority, on_turn=on_turn)
    argv, env = mini_swe_agent_command(episode, workdir, step_limit)
    deadline = time.monotonic() + server.config.harness_timeout_s
    # Its own session, so that stopping it also stops the sandbox_exec commands it has running.
    proc = subprocess.Popen(argv, env=env, cwd=workdir, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    output, status = "", Status.FINISHED
    try:
        while True:
            try:
                output, _ = proc.communicate(timeout=1.0)
                break
            except subprocess.TimeoutExpired:
                if on_turn is not None and episode.stopped is None:
                    on_turn()
                if episode.stopped is not None or time.monotonic() > deadline:
                    os.killpg(proc.pid, 9)
                    output, _ = proc.communicate()
                    status = Status.TRUNCATED
                    break
    except BaseException:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
        server.abandon(episode.id)
        raise
    if episode.stopped is not None:
        server.abandon(episode.id)
        raise episode.stopped
    code = proc.returncode if status == Status.FINISHED else None
    if status == Status.TRUNCATED:
        output = f"harness killed after {server.config.harness_timeout_s:.0f} s: {output[-2000:]}"
    elif code != 0:
        status = Status.ABORTED
    else:
        status = _mini_status(workdir / "mini.traj.json")
    output = output[-4000:]
    result = server.finish(episode.id, status, "" if status != Status.ABORTED else output[-500:])
    result.harness_exit_code, result.harness_output = code, output
    return result


# mini-swe-agent's exit statuses (its trajectory's info.exit_status) as the built-in runner's: out of
# steps or time is a truncation (graded all the same), repeated unparseable answers a tool error.
_MINI_STATUS = {"LimitsExceeded": Status.TRUNCATED, "TimeExceeded": Status.TRUNCATED,
                "RepeatedFormatError": Status.TOOL_ERROR}


def _mini_status(trajectory: Path) -> Status:
    try:
        exit_status = json.loads(trajectory.read_text()).get("info", {}).get("exit_status", "")
    except (OSError, json.JSONDecodeError):
        return Status.FINISHED  # exited 0 without its record: nothing says it stopped short
    return _MINI_STATUS.get(exit_status, Status.FINISHED)


class HarnessRunner:
    """The Orchestrator's `EpisodeRunner` for harness episodes: each episode is a mini-swe-agent
    program playing against its own endpoint of one `HarnessServer`, scheduled, admitted and
    staleness-bounded like a built-in episode (flywheel/rl/orchestrator.py).

    - Versions: weight swaps happen inside the Engine between tokens, as for any request; a turn in
      flight when the Learner steps keeps sampling under the new weights, and every token keeps the
      version that sampled it (a partial rollout).
    - One Trajectory per episode, as the Orchestrator's groups compare one reward per member: the
      episode's last segment (its final turns, carrying the episode's reward). Earlier segments, cut
      off by a rewritten history, are counted (`harness_dropped_segments`), not trained on.
    - Turn boundaries: `on_turn` is called at the start, after every served turn and about once a
      second while the program runs, with no state (None): a harness program cannot be resumed
      mid-episode, so a killed run plays an unfinished harness episode again from its start. What
      `on_turn` raises (the Orchestrator's shutdown) ends the program and is raised to the
      Orchestrator. A program that hangs is bounded by `HarnessConfig.harness_timeout_s` (then
      truncated and graded), not by the Orchestrator's `episode_timeout_s`, which these calls reset.
    - Each episode's mini-swe-agent files (its config, its own trajectory) are in `workdir/<group>-<i>`.
    """

    def __init__(self, server: HarnessServer, workdir: Path):
        self.server, self.workdir = server, Path(workdir)
        self._counts = {"harness_episodes": 0, "harness_breaks": 0, "harness_dropped_segments": 0}
        self._lock = threading.Lock()
        self._played = 0

    def __call__(self, task: Task, config: EpisodeConfig, group_id: str, resume: EpisodeState | None,
                 on_turn: Callable[[EpisodeState | None], None], priority: int) -> Trajectory:
        on_turn(None)  # the episode's first boundary: a run already shutting down starts no program
        with self._lock:
            self._played += 1
            workdir = self.workdir / f"{group_id}-{self._played}"
        result = run_harness_episode(self.server, task, workdir, step_limit=config.max_turns, group_id=group_id,
                                     priority=priority, on_turn=lambda: on_turn(None))
        with self._lock:
            self._counts["harness_episodes"] += 1
            self._counts["harness_breaks"] += result.breaks
            self._counts["harness_dropped_segments"] += max(0, len(result.trajectories) - 1)
        if result.trajectories:
            return result.trajectories[-1]
        # The program ended before asking the model anything: an episode with no tokens, no gradient.
        error = f"the harness served no turn (exit code {result.harness_exit_code}): {result.harness_output[-300:]}"
        return Trajectory(task_id=task.id, family=task.family, tokens=[], loss_mask=[], logprobs=[], versions=[],
                          prompt_len=0, status=Status.ABORTED, reward=0.0, reward_parts={}, turns=0, tool_calls=0,
                          invalid_tool_calls=0, asked_question=False, group_id=group_id, error=error)

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


@contextmanager
def harness_runner(name: str, engine: Engine, tokenizer: Any, pool: SandboxPool, episode: EpisodeConfig,
                   workdir: Path) -> Iterator[HarnessRunner]:
    """A running HarnessServer on loopback over `engine` and `pool` with `episode`'s limits, and its
    runner for the Orchestrator (`flywheel train` with `rollout.harness = "mini-swe-agent"`)."""
    if name != "mini-swe-agent":  # the harnesses `RolloutConfig.harness` names (flywheel/rl/train.py)
        raise ValueError(f"unknown harness {name!r}: flywheel runs mini-swe-agent")
    server = HarnessServer(engine, tokenizer, pool, HarnessConfig.for_episode(episode))
    try:
        with server.serve():
            yield HarnessRunner(server, workdir)
    finally:
        server.close()


__all__ = ["HarnessConfig", "HarnessEpisode", "HarnessResult", "HarnessRunner", "HarnessServer",
           "Segment", "TokenLedger", "harness_runner", "mini_swe_agent_command", "run_harness_episode"]
