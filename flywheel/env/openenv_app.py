"""flywheel's environments served with OpenEnv's protocol (`openenv-core`): reset / step / state.

    python -m flywheel.env.openenv_app --port 8000 [--max-sessions 8]

    from openenv.core import GenericEnvClient          # any OpenEnv client: TRL, torchforge, ART, ...
    with GenericEnvClient(base_url="http://127.0.0.1:8000").sync() as env:
        first = env.reset(family="bugfix", seed=3)      # or task_id="bugfix/train/s3/d1/0"
        env.step({"tool": "run_command", "arguments": {"command": "python3 run_tests.py tests"}})
        done = env.step({"tool": "finish", "arguments": {"summary": "fixed"}})   # graded: done.reward

Each OpenEnv session (one WebSocket connection) is one `FlywheelEnvironment`: `reset` draws a task
(by id, or a family's task from the seed), takes a sandbox from the shared `SandboxPool` with the
task's files, and returns its instruction and the tool schemas; `step` runs one flywheel tool
call in that session's jail (`Toolbox`, the same tools as the built-in runner) and returns its
output; `finish`, or the step limit, grades the workspace with the hidden tests (`grade`, copied in
only then) and ends the episode with the reward and its parts. Sessions share nothing but the
pool: each has its own sandbox, task and step count. OpenEnv's server runs the sessions' calls on
its own threads; closing a session (or a reset) releases its sandbox.

Departures from the built-in runner: the client is the agent, so flywheel records no tokens here
(an OpenEnv trainer keeps its own); an invalid call is answered with its error (`ok: false`)
and costs a step, not a reward penalty.
"""

from __future__ import annotations

import argparse
import functools
import threading
import uuid
from typing import Any

from pydantic import Field

from flywheel.env.families import generate, get_task
from flywheel.env.grading import GradeConfig, grade
from flywheel.env.pool import PoolConfig, SandboxPool
from flywheel.env.sandbox import Sandbox
from flywheel.env.task import Task
from flywheel.env.tools import Toolbox
from flywheel.env.toolspec import TOOL_SCHEMAS, ToolCall
from flywheel.extras import require

# The server's types subclass OpenEnv's, so the extra is needed when this module is imported; through
# `require`, a missing one is named with the command that installs it.
_server = require("openenv.core.env_server", "the OpenEnv server")
Action, Environment, Observation, State = _server.Action, _server.Environment, _server.Observation, _server.State
create_fastapi_app = _server.create_fastapi_app


class FlywheelAction(Action):
    """One tool call: a flywheel tool's name (TOOL_SCHEMAS) and its arguments."""

    tool: str
    arguments: dict[str, Any] = Field(default_factory=dict)


class FlywheelObservation(Observation):
    output: str = ""  # the tool's answer (after reset: empty)
    ok: bool = True  # False: the call failed or was invalid (its error is the output)
    task_id: str = ""
    instruction: str = ""  # after reset
    tools: list[dict[str, Any]] = Field(default_factory=list)  # after reset: the OpenAI schemas of the tools
    reward_parts: dict[str, float] = Field(default_factory=dict)  # when graded
    all_passed: bool | None = None  # when graded: every hidden test passed


class FlywheelEnvironment(Environment[FlywheelAction, FlywheelObservation, State]):
    """One session: a task in a sandbox of the shared pool, played by the client's tool calls."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, pool: SandboxPool, max_steps: int = 16, grade_config: GradeConfig | None = None):
        super().__init__()
        self.pool, self.max_steps, self.grade_config = pool, max_steps, grade_config or GradeConfig()
        self.task: Task | None = None
        self.sandbox: Sandbox | None = None
        self.toolbox: Toolbox | None = None
        self._state = State()
        self._lock = threading.Lock()

    def reset(self, seed: int | None = None, episode_id: str | None = None, task_id: str | None = None,
              family: str = "bugfix", split: str = "train", difficulty: int | None = None,
              **kwargs: Any) -> FlywheelObservation:
        with self._lock:
            self._release()
            task = get_task(task_id) if task_id else generate(family, split, 1, seed=seed or 0,
                                                               difficulty=difficulty)[0]
            self.task, self.sandbox = task, self.pool.acquire(task.files)
            self.toolbox = Toolbox(self.sandbox)
            self._state = State(episode_id=episode_id or uuid.uuid4().hex[:16], step_count=0)
            return FlywheelObservation(task_id=task.id, instruction=task.instruction, tools=list(TOOL_SCHEMAS.values()))

    def step(self, action: FlywheelAction, timeout_s: float | None = None, **kwargs: Any) -> FlywheelObservation:
        with self._lock:
            if self.task is None or self.toolbox is None or self.sandbox is None:
                return FlywheelObservation(output="error: no episode: call reset first (or again: this one ended)",
                                           ok=False, done=True)
            self._state.step_count += 1
            (result,) = self.toolbox.execute([ToolCall(f"call_{self._state.step_count}", action.tool,
                                                       action.arguments)])
            if action.tool != "finish" and self._state.step_count < self.max_steps:
                return FlywheelObservation(output=result.content, ok=result.ok, task_id=self.task.id)
            graded = grade(self.task, self.sandbox.snapshot(), self.grade_config)
            task_id = self.task.id
            self._release()
            return FlywheelObservation(output=result.content, ok=result.ok, task_id=task_id, done=True,
                                       reward=graded.reward, reward_parts=graded.parts, all_passed=graded.all_passed)

    @property
    def state(self) -> State:
        return self._state

    def close(self) -> None:
        with self._lock:
            self._release()

    def _release(self) -> None:
        if self.toolbox is not None:
            self.toolbox.close()
        if self.sandbox is not None:
            self.pool.release(self.sandbox)
        self.task, self.sandbox, self.toolbox = None, None, None


def openenv_app(pool: SandboxPool, max_sessions: int = 8, max_steps: int = 16) -> Any:
    """The OpenEnv FastAPI app over `pool`: one FlywheelEnvironment per session, at most `max_sessions`."""
    factory = functools.partial(FlywheelEnvironment, pool, max_steps)
    return create_fastapi_app(factory, FlywheelAction, FlywheelObservation, max_concurrent_envs=max_sessions)


def main(argv: list[str] | None = None) -> int:
    import uvicorn  # noqa: PLC0415

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-sessions", type=int, default=8, help="OpenEnv sessions at once (a sandbox each)")
    parser.add_argument("--max-steps", type=int, default=16, help="tool calls per episode before it is graded")
    ns = parser.parse_args(argv)
    with SandboxPool(PoolConfig(max_active=ns.max_sessions)) as pool:
        uvicorn.run(openenv_app(pool, ns.max_sessions, ns.max_steps), host=ns.host, port=ns.port)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = ["FlywheelAction", "FlywheelEnvironment", "FlywheelObservation", "openenv_app"]
