"""Which agent program plays a harness episode, by configuration: `[rollout.harness]`.

    [rollout.harness]
    preset = "mini-swe-agent"                       # or "openai-agents", or none and a command:
    command = ["my-agent", "--base-url", "{base_url}", "--api-key", "{api_key}",
               "--exec", "{exec_url}", "--task", "{instruction_file}", "--max-turns", "{max_turns}"]
    env = {MY_AGENT_HOME = "{workdir}/home"}
    tool_aliases = {shell = "run_command"}          # a tool it declares -> the flywheel tool that does it

A harness is a program, started once per episode in its own folder, that talks to the episode's
OpenAI endpoint and runs its commands through the episode's `exec` endpoint
(flywheel/rl/harness/server.py); flywheel knows nothing else of it. The argv and environment are
templates filled per episode (`PLACEHOLDERS`); an unknown placeholder is refused when the config
is read, not at the first episode. Its exit code and, when it writes one, a status file map to the
episode's Status (a program that stops short says so; one that fails is an abort, graded all the same).

Presets ship for two real frameworks, configured only by their own settings:
- "mini-swe-agent": its `mini` command with its own prompts (mini.yaml), its litellm model pointed at
  the episode's base URL and key, and its `bubblewrap` environment with `executable` = this Python
  and `wrapper_args` = `-m flywheel.rl.harness.sandbox_exec …`, so each command runs in the jail.
- "openai-agents": the OpenAI Agents SDK's `Runner` with one `bash` function tool
  (flywheel/rl/harness/agents_sdk.py, the few lines a user of the SDK writes).

    run_harness_episode(server, task, program, workdir)   start, run the program to its end, grade
    HarnessRunner / harness_runner                        the Orchestrator's runner (`flywheel train`)

What it does not protect against: the program runs on the host as the user who started flywheel
(only what it sends to `exec` runs in the jail); see server.py.
"""

from __future__ import annotations

import json
import os
import string
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from flywheel.agent.episode import EpisodeConfig, EpisodeState
from flywheel.agent.trajectory import Status, Trajectory
from flywheel.env.pool import SandboxPool
from flywheel.env.task import Task
from flywheel.model.engine import Engine
from flywheel.rl.harness.server import HarnessConfig, HarnessResult, HarnessServer

# What an argv or env template may name, filled per episode.
PLACEHOLDERS = {
    "base_url": "the episode's OpenAI base URL (…/episodes/ID/v1)",
    "api_key": "the episode's key (the API key, and the exec endpoint's bearer)",
    "episode_url": "the episode's URL (…/episodes/ID): sandbox_exec's --url",
    "exec_url": "the episode's exec endpoint (POST {command, shell, env, timeout_s} -> {output, exit_code, timed_out})",
    "workdir": "the program's own folder for this episode (its cwd)",
    "instruction": "the task's instruction text",
    "instruction_file": "a file in workdir holding the instruction",
    "model": "the model name the endpoint answers to",
    "max_turns": "the episode's turn limit (orchestrator.episode.max_turns)",
    "python": "this interpreter (sys.executable)",
}

FLYWHEEL_ROOT = Path(__file__).resolve().parents[3]  # on the program's PYTHONPATH, for sandbox_exec

StatusName = Literal["finished", "truncated", "tool_error", "aborted"]


class HarnessProgram(BaseModel):
    """One harness: a preset, or a command of your own; fields you set override the preset's."""

    model_config = ConfigDict(extra="forbid")
    preset: Literal["mini-swe-agent", "openai-agents"] | None = None
    command: list[str] = Field(default_factory=list)  # argv template (PLACEHOLDERS), run with cwd = {workdir}
    env: dict[str, str] = Field(default_factory=dict)  # added to this process's environment; templates too
    # A tool the program declares -> the flywheel tool the embedded model calls for it (same
    # arguments). A model that reads tool schemas (tools in its prompt) calls the declared tools directly.
    tool_aliases: dict[str, str] = Field(default_factory=lambda: {"bash": "run_command"})
    # Where a program says why it stopped: a JSON file in workdir, a dotted field in it, and its values
    # -> the episode's status. Missing file or unmapped value: "finished" (exit code 0) or "aborted".
    status_file: str | None = None
    status_field: str = "exit_status"
    statuses: dict[str, StatusName] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _complete(self) -> HarnessProgram:
        if self.preset is not None:
            own = {name: getattr(self, name) for name in self.model_fields_set if name != "preset"}
            base = PRESETS[self.preset]
            for name in ("command", "env", "status_file", "status_field", "statuses", "tool_aliases"):
                object.__setattr__(self, name, own.get(name, getattr(base, name)))
        if not self.command:
            raise ValueError("[rollout.harness] needs a command (an argv template) or a preset (\"mini-swe-agent\" "
                             f"or \"openai-agents\"); the placeholders are {', '.join(PLACEHOLDERS)}")
        for template in [*self.command, *self.env.values()]:
            fields = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
            unknown = [f for f in fields if f not in PLACEHOLDERS]
            if unknown:
                raise ValueError(f"[rollout.harness] template {template!r} names {unknown}: the placeholders are "
                                 f"{', '.join(PLACEHOLDERS)} (write a literal brace as {{{{ or }}}})")
        return self

    def argv_env(self, values: dict[str, str]) -> tuple[list[str], dict[str, str]]:
        """(argv, environment) for one episode: every template filled from `values`."""
        argv = [t.format_map(values) for t in self.command]
        path = os.pathsep.join(p for p in (str(FLYWHEEL_ROOT), os.environ.get("PYTHONPATH", "")) if p)
        env = {**os.environ, "PYTHONPATH": path, **{k: v.format_map(values) for k, v in self.env.items()}}
        return argv, env

    def status(self, workdir: Path, exit_code: int) -> Status:
        """The episode's status from the program's exit code and its status file."""
        if exit_code != 0:
            return Status.ABORTED
        if self.status_file is None:
            return Status.FINISHED
        try:
            value: Any = json.loads((workdir / self.status_file).read_text())
            for key in self.status_field.split("."):
                value = value.get(key, "") if isinstance(value, dict) else ""
        except (OSError, json.JSONDecodeError):
            return Status.FINISHED  # exited 0 without its record: nothing says it stopped short
        return Status(self.statuses.get(str(value), "finished"))


PRESETS: dict[str, HarnessProgram] = {
    # mini-swe-agent's `mini`, unmodified: its own mini.yaml, then key=value overrides (it parses each
    # value as JSON when it can). Out of steps or time is a truncation, repeated unparseable answers a
    # tool error (its trajectory's info.exit_status).
    "mini-swe-agent": HarnessProgram(
        command=["{python}", "-m", "minisweagent.run.mini", "-c", "mini.yaml",
                 "-c", "agent.step_limit={max_turns}", "-c", "agent.cost_limit=0",
                 "-c", "model.model_class=litellm", "-c", "model.model_name=openai/{model}",
                 "-c", "model.cost_tracking=ignore_errors",
                 "-c", "model.model_kwargs.api_base={base_url}", "-c", 'model.model_kwargs.api_key="{api_key}"',
                 "-c", "model.model_kwargs.drop_params=true",
                 "-c", "environment.environment_class=bubblewrap", "-c", "environment.cwd=/workspace",
                 "-c", 'environment.executable="{python}"',
                 "-c", ('environment.wrapper_args=["-m", "flywheel.rl.harness.sandbox_exec", "--url", '
                        '"{episode_url}", "--key", "{api_key}", "--"]'),
                 "--agent-class", "default", "--exit-immediately", "-t", "{instruction}",
                 "-o", "{workdir}/mini.traj.json"],
        env={"MSWEA_CONFIGURED": "true", "MSWEA_GLOBAL_CONFIG_DIR": "{workdir}/mswea", "MSWEA_SILENT_STARTUP": "1",
             "MSWEA_COST_TRACKING": "ignore_errors", "MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT": "1",
             "LITELLM_LOCAL_MODEL_COST_MAP": "True"},  # litellm's price list from disk; no retries hide an error
        status_file="mini.traj.json", status_field="info.exit_status",
        statuses={"LimitsExceeded": "truncated", "TimeExceeded": "truncated", "RepeatedFormatError": "tool_error"}),
    # The OpenAI Agents SDK: an Agent with a `bash` tool, Runner.run to max_turns (agents_sdk.py).
    "openai-agents": HarnessProgram(
        command=["{python}", "-m", "flywheel.rl.harness.agents_sdk", "--base-url", "{base_url}",
                 "--api-key", "{api_key}", "--exec-url", "{exec_url}", "--model", "{model}",
                 "--instruction-file", "{instruction_file}", "--max-turns", "{max_turns}",
                 "--status-file", "{workdir}/agents_sdk.json"],
        status_file="agents_sdk.json", status_field="exit_status", statuses={"MaxTurnsExceeded": "truncated"}),
}


def run_harness_episode(server: HarnessServer, task: Task, program: HarnessProgram, workdir: Path,
                        max_turns: int = 8, group_id: str = "", priority: int = 0,
                        on_turn: Callable[[], None] | None = None) -> HarnessResult:
    """Play `task` with `program` as the agent loop: start, run it to its end, grade, build.

    `on_turn` is called after every served turn and about once a second while the program runs;
    what it raises ends the program (its whole process group), releases the sandbox ungraded and
    is raised here: how a run that shuts down stops it without waiting for its next turn."""
    episode = server.start(task, group_id=group_id, priority=priority, on_turn=on_turn)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "instruction.md").write_text(task.instruction)
    argv, env = program.argv_env({
        "base_url": f"{episode.url}/v1", "api_key": episode.key, "episode_url": episode.url,
        "exec_url": f"{episode.url}/exec", "workdir": str(workdir), "instruction": task.instruction,
        "instruction_file": str(workdir / "instruction.md"), "model": server.model_name,
        "max_turns": str(max_turns), "python": sys.executable})
    deadline = time.monotonic() + server.config.harness_timeout_s
    # Its own session, so that stopping it also stops the sandbox_exec commands it has running.
    try:
        proc = subprocess.Popen(argv, env=env, cwd=workdir, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
    except OSError as exc:
        server.abandon(episode.id)
        raise ValueError(f"[rollout.harness] cannot start {argv[0]!r}: {exc}") from None
    output, killed = "", False
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
                    killed = True
                    break
    except BaseException:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
        server.abandon(episode.id)
        raise
    if episode.stopped is not None:
        server.abandon(episode.id)
        raise episode.stopped
    code = None if killed else proc.returncode
    if killed:
        status = Status.TRUNCATED
        output = f"harness killed after {server.config.harness_timeout_s:.0f} s: {output[-2000:]}"
    else:
        status = program.status(workdir, proc.returncode)
    output = output[-4000:]
    result = server.finish(episode.id, status, "" if status != Status.ABORTED else output[-500:])
    result.harness_exit_code, result.harness_output = code, output
    return result


class HarnessRunner:
    """The Orchestrator's `EpisodeRunner` for harness episodes: each episode is a run of the
    configured program against its own endpoint of one `HarnessServer`, scheduled, admitted and
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
    - Each episode's program files (its instruction, its own records) are in `workdir/<group>-<i>`.
    """

    def __init__(self, server: HarnessServer, program: HarnessProgram, workdir: Path):
        self.server, self.program, self.workdir = server, program, Path(workdir)
        self._counts = {"harness_episodes": 0, "harness_breaks": 0, "harness_dropped_segments": 0}
        self._lock = threading.Lock()
        self._played = 0

    def __call__(self, task: Task, config: EpisodeConfig, group_id: str, resume: EpisodeState | None,
                 on_turn: Callable[[EpisodeState | None], None], priority: int) -> Trajectory:
        on_turn(None)  # the episode's first boundary: a run already shutting down starts no program
        with self._lock:
            self._played += 1
            workdir = self.workdir / f"{group_id}-{self._played}"
        result = run_harness_episode(self.server, task, self.program, workdir, max_turns=config.max_turns,
                                     group_id=group_id, priority=priority, on_turn=lambda: on_turn(None))
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
def harness_runner(program: HarnessProgram, engine: Engine, tokenizer: Any, pool: SandboxPool,
                   episode: EpisodeConfig, workdir: Path) -> Iterator[HarnessRunner]:
    """A running HarnessServer on loopback over `engine` and `pool` with `episode`'s limits and the
    program's tool aliases, and its runner for the Orchestrator (`flywheel train`, `[rollout.harness]`)."""
    config = HarnessConfig.for_episode(episode).model_copy(update={"tool_aliases": dict(program.tool_aliases)})
    server = HarnessServer(engine, tokenizer, pool, config)
    try:
        with server.serve():
            yield HarnessRunner(server, program, workdir)
    finally:
        server.close()


__all__ = ["PLACEHOLDERS", "PRESETS", "HarnessProgram", "HarnessRunner", "harness_runner", "run_harness_episode"]
