"""One agent episode: the model and the tools in a multi-turn loop, recorded as a `Trajectory`.

    prompt = system + tools + instruction        (in the model's own chat format: model/formats.py)
    repeat up to max_turns:
        generate until the turn's end token (tokens, logprobs, versions kept as generated)
        tool calls?  run them in parallel, append <tool_response>s as one user turn
        no calls?    it spoke to the user: append the user's reply (costs a turn)
        finish?      stop
    grade the final workspace with the hidden tests

Token in, token out: each appended turn is tokenized on its own and added after the generated
tokens; earlier turns are never re-tokenized, so the trainer sees exactly what the engine saw.
Nothing is dropped: an invalid tool call is answered with its error, counted, and costs
`invalid_call_penalty`; running out of turns or tokens, a sandbox failure or an abort each end
the episode with an explicit status and a defined reward.

An episode can outlive its process: with `on_turn`, the runner hands out an `EpisodeState` at
every turn boundary (tokens, logprobs, versions, counters and the workspace files), and
`run_episode(..., resume=state)` continues from it in a fresh sandbox holding those files. The
Orchestrator writes these states down, so a run killed mid-rollout resumes its in-flight episodes
where they were instead of dropping or restarting them.
"""

from __future__ import annotations

import base64
import time
import uuid
from collections.abc import Callable
from concurrent.futures import TimeoutError as FutureTimeout

from pydantic import BaseModel, ConfigDict, Field
from transformers import PreTrainedTokenizerBase

from flywheel.agent.trajectory import INVALID_CALL_PENALTY, RoutedExperts, Status, Trajectory
from flywheel.env.environments import task_environment
from flywheel.env.grading import GradeConfig, grade
from flywheel.env.pool import SandboxPool
from flywheel.env.sandbox import SandboxError
from flywheel.env.task import Task
from flywheel.env.tools import Toolbox, ToolConfig
from flywheel.model.chat import SYSTEM_PROMPT, render_messages, tool_schemas
from flywheel.model.conversation import ConversationEncoder
from flywheel.model.engine import Engine, SamplingParams
from flywheel.timing import timed


class EpisodeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    max_turns: int = 8  # each turn is one generation; questions to the user count too
    max_tokens: int = 4096  # whole sequence, prompt included; longer episodes end as truncated
    max_tokens_per_turn: int = 512
    temperature: float = 1.0
    top_p: float = 1.0
    max_invalid_turns: int = 3  # consecutive turns of only invalid calls before the episode stops (tool_error)
    invalid_call_penalty: float = 0.1  # per invalid call, so emitting broken calls is never free
    max_invalid_penalty: float = 0.5
    generation_timeout_s: float = 600.0  # an engine that does not answer a turn in time fails the episode loudly
    truncated_reward: float | None = None  # None: grade the workspace anyway; a number: use it instead
    # Record each generated token's experts (`Trajectory.routed_experts`) for the Learner's routing
    # replay (`loss.routing_replay`, which needs it): layers x top-k ints per generated token kept in
    # the trajectory and in every saved episode state
    routed_experts: bool = False
    grade: GradeConfig = GradeConfig()
    tools: ToolConfig = ToolConfig()


def opening(task: Task) -> list[dict[str, str]]:
    """The messages an episode starts from: the system prompt and the task's instruction."""
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": task.instruction}]


def initial_prompt(task: Task, with_tools: bool = True) -> str:
    """The opening as text in flywheel's own format, then the assistant header; with_tools: list the
    tool schemas (`chat.tools_in_prompt` of the model's tokenizer). Benchmarks train tokenizers on it."""
    return render_messages(opening(task), tool_schemas() if with_tools else None, add_generation_prompt=True)


class EngineTimeout(RuntimeError):
    pass


class EpisodeState(BaseModel):
    """An unfinished episode at a turn boundary: everything needed to continue it elsewhere."""

    task_id: str
    group_id: str = ""
    tokens: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    versions: list[int]
    prompt_len: int
    turns: int
    tool_calls: int
    invalid_tool_calls: int
    invalid_streak: int
    asked_question: bool
    broken_turns: list[tuple[int, int, int]] = Field(default_factory=list)
    failed_turns: list[tuple[int, int, int]] = Field(default_factory=list)
    routed_experts: RoutedExperts = None  # as Trajectory's
    workspace: dict[str, str]  # path -> base64 of the file's bytes (exact for any content)
    timings: dict[str, float] = Field(default_factory=dict)

    def files(self) -> dict[str, bytes]:
        return {path: base64.b64decode(data) for path, data in self.workspace.items()}


class _Recorder:
    """Accumulates the per-token arrays of one episode."""

    def __init__(self, routed: bool = False) -> None:
        self.tokens: list[int] = []
        self.mask: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.routed: list[list[int]] | None = [] if routed else None  # Trajectory.routed_experts
        self.broken_turns: list[tuple[int, int, int]] = []  # [start, end, invalid calls] of generated turns
        self.failed_turns: list[tuple[int, int, int]] = []  # [start, end, failed calls]: valid calls the tool refused

    def context(self, ids: list[int]) -> None:
        self.tokens += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)
        if self.routed is not None:
            self.routed += [[] for _ in ids]

    def generated(self, ids: list[int], logprobs: list[float], versions: list[int],
                  routed: list[list[int]] | None = None, routed_from: int = 0) -> None:
        """A turn's generated tokens; routed: the engine's routing of positions routed_from .. (the
        newest token's excluded: never fed), `Generation.routed_experts`."""
        self.tokens += ids
        self.mask += [1] * len(ids)
        self.logprobs += logprobs
        self.versions += versions
        if self.routed is not None:
            self.routed += [[] for _ in ids]
            if routed is None or routed_from + len(routed) != len(self.tokens) - 1:
                raise ValueError(f"the engine returned routed experts for {'no' if routed is None else len(routed)} "
                                 f"positions from {routed_from}, not up to the sequence's last fed position "
                                 f"{len(self.tokens) - 2}; episode.routed_experts needs an engine that records them "
                                 "(the local engine)")
            self.routed[routed_from : routed_from + len(routed)] = routed

    def broken(self, turn_start: int, invalid_calls: int) -> None:
        """The turn generated from `turn_start` to the end so far made `invalid_calls` invalid calls."""
        self.broken_turns.append((turn_start, len(self.tokens), invalid_calls))

    def failed(self, turn_start: int, failed_calls: int) -> None:
        """The turn generated from `turn_start` to the end so far made `failed_calls` valid calls that failed."""
        self.failed_turns.append((turn_start, len(self.tokens), failed_calls))


def run_episode(task: Task, engine: Engine, tokenizer: PreTrainedTokenizerBase, pool: SandboxPool,
                config: EpisodeConfig | None = None, group_id: str = "", resume: EpisodeState | None = None,
                on_turn: Callable[[EpisodeState], None] | None = None, priority: int = 0) -> Trajectory:
    """Play `task` to the end (or continue `resume`); `on_turn` receives the state after every turn;
    every turn asks the engine with `priority` (lower first when requests queue)."""
    config = config or EpisodeConfig()
    start = time.perf_counter()
    # wall seconds of this episode's turns (waiting for the engine included), tool calls, grading and
    # sandbox creation: the rollout side of the RL step's anatomy (flywheel/rl/train.py)
    timings = {"generate_s": 0.0, "tools_s": 0.0, "grade_s": 0.0, "sandbox_s": 0.0}
    rec = _Recorder(config.routed_experts)
    encoder = ConversationEncoder(tokenizer)

    turns = n_calls = n_invalid = invalid_streak = 0
    asked = False
    earlier_s = 0.0  # time spent on this episode before it was resumed
    if resume is None:
        rec.context(encoder.encode(opening(task), encoder.tools))
        prompt_len, files = len(rec.tokens), task.files
    else:
        if resume.task_id != task.id:
            raise ValueError(f"episode state is for task {resume.task_id}, not {task.id}")
        rec.tokens, rec.mask = list(resume.tokens), list(resume.loss_mask)
        rec.logprobs, rec.versions = list(resume.logprobs), list(resume.versions)
        rec.broken_turns, rec.failed_turns = list(resume.broken_turns), list(resume.failed_turns)
        if rec.routed is not None:  # a state saved without them: its tokens so far are routed by the Learner
            rec.routed = (list(resume.routed_experts) if resume.routed_experts is not None
                          else [[] for _ in resume.tokens])
        prompt_len, files, group_id = resume.prompt_len, resume.files(), resume.group_id or group_id
        turns, n_calls, n_invalid = resume.turns, resume.tool_calls, resume.invalid_tool_calls
        invalid_streak, asked = resume.invalid_streak, resume.asked_question
        timings.update(resume.timings)
        earlier_s = timings.pop("total_s", 0.0)
    status, error = Status.TRUNCATED, ""
    stop = encoder.stop_ids
    session = uuid.uuid4().hex  # each turn extends the last: the engine prefills only the new tokens

    def checkpoint() -> None:
        if on_turn is None:
            return
        snap = box.snapshot()
        on_turn(EpisodeState(
            task_id=task.id, group_id=group_id, tokens=rec.tokens, loss_mask=rec.mask, logprobs=rec.logprobs,
            versions=rec.versions, prompt_len=prompt_len, turns=turns, tool_calls=n_calls, invalid_tool_calls=n_invalid,
            invalid_streak=invalid_streak, asked_question=asked, broken_turns=rec.broken_turns,
            failed_turns=rec.failed_turns, routed_experts=rec.routed,
            timings=dict(timings, total_s=earlier_s + time.perf_counter() - start),
            workspace={p: base64.b64encode(d).decode() for p, d in snap.files.items()},
        ))

    with timed(timings, "sandbox_s"):
        box = pool.acquire(files, environment=task_environment(task))
    try:
        with Toolbox(box, config.tools) as tools:
            while turns < config.max_turns:
                budget = config.max_tokens - len(rec.tokens)
                if budget <= 0:
                    break
                params = SamplingParams(config.temperature, config.top_p, min(budget, config.max_tokens_per_turn),
                                        stop_token_ids=stop, session=session, priority=priority,
                                        routed_experts=config.routed_experts)
                try:
                    with timed(timings, "generate_s"):
                        gen = engine.submit(rec.tokens, params).result(timeout=config.generation_timeout_s)
                except FutureTimeout:
                    raise EngineTimeout(f"the engine did not answer turn {turns + 1} of {task.id} within "
                                        f"{config.generation_timeout_s:.0f} s (episode.generation_timeout_s); "
                                        "is its loop alive?") from None
                turn_start = len(rec.tokens)
                rec.generated(gen.token_ids, gen.logprobs, gen.versions, gen.routed_experts, gen.routed_from)
                turns += 1
                if gen.finish_reason == "aborted":
                    status, error = Status.ABORTED, "generation aborted"
                    break
                if gen.finish_reason != "stop":
                    break  # the turn hit its token cap mid-message: truncated
                content, calls = encoder.format.parse(tokenizer.decode(gen.token_ids), call_id_prefix=f"call_{turns}")
                if not calls:
                    asked = True
                    rec.context(encoder.user_reply(task.answer_question(content)))
                    checkpoint()
                    continue
                with timed(timings, "tools_s"):
                    results = tools.execute(calls)
                n_calls += len(calls)
                invalid = sum(not c.valid for c in calls)
                n_invalid += invalid
                if invalid:
                    rec.broken(turn_start, invalid)
                failed = sum(c.valid and not r.ok for c, r in zip(calls, results, strict=True))
                if failed:
                    rec.failed(turn_start, failed)
                invalid_streak = invalid_streak + 1 if invalid == len(calls) else 0
                if any(c.valid and c.name == "finish" for c in calls):
                    status = Status.FINISHED
                    break
                if invalid_streak >= config.max_invalid_turns:
                    status = Status.TOOL_ERROR
                    break
                rec.context(encoder.tool_reply([r.content for r in results]))
                checkpoint()
            final = box.snapshot()
    except SandboxError as exc:
        status, error, final = Status.SANDBOX_ERROR, str(exc), None
    finally:
        pool.release(box)

    parts: dict[str, float] = {}  # the reward's additive terms (Trajectory's docstring)
    outcome = None
    if final is None:  # the sandbox failed: nothing to grade
        reward = 0.0
    elif status == Status.TRUNCATED and config.truncated_reward is not None:
        reward = parts["truncated_reward"] = config.truncated_reward
    else:
        with timed(timings, "grade_s"):
            graded = grade(task, final, config.grade)
        parts.update(graded.parts)
        reward, outcome = graded.reward, graded.outcome
    penalty = min(config.max_invalid_penalty, config.invalid_call_penalty * n_invalid)
    parts[INVALID_CALL_PENALTY] = -penalty
    timings["total_s"] = earlier_s + time.perf_counter() - start
    return Trajectory(
        task_id=task.id, family=task.family, tokens=rec.tokens, loss_mask=rec.mask, logprobs=rec.logprobs,
        versions=rec.versions, prompt_len=prompt_len, status=status, reward=reward - penalty, reward_parts=parts,
        turns=turns, tool_calls=n_calls, invalid_tool_calls=n_invalid, asked_question=asked, outcome=outcome,
        broken_turns=rec.broken_turns, failed_turns=rec.failed_turns, timings=timings, group_id=group_id, error=error,
        routed_experts=rec.routed,
    )
