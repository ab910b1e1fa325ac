"""`flywheel.env.verifiers_env.load_environment()` with the verifiers package (0.4, in .venv-ecosystem:
it pins openai < 3): it builds a verifiers Env over flywheel's OpenEnv server, one task per seed,
and plays an episode end to end with verifiers' reply parsing and reward record (`FlywheelEnv`:
verifiers' OpenEnvEnv, whose 0.4 run() works with no openenv-core release). The model is scripted
(as ScriptedEngine is in the harness tests): its replies are the JSON actions that apply the task's
fix, then finish; the reward verifiers records is flywheel's grade, 1.0. A reply of nothing usable
ends the run unrewarded."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from flywheel.api.http import RunningServer
from flywheel.env.pool import PoolConfig, SandboxPool

REPO = Path(__file__).resolve().parents[2]
ECOSYSTEM_PYTHON = REPO / ".venv-ecosystem" / "bin" / "python"
pytest.importorskip("openenv.core", reason="openenv-core (the dev extra)")
needs_verifiers = pytest.mark.skipif(not ECOSYSTEM_PYTHON.exists() and os.environ.get("FLYWHEEL_CI") != "1",
                                     reason="verifiers pins openai < 3: make ecosystem-env builds .venv-ecosystem")

# Run in .venv-ecosystem: verifiers' Env and its run(), with a scripted player in place of the model.
PLAY = """
import asyncio, contextlib, json, sys
from verifiers.v1.agent import Segment
from verifiers.v1.types import AssistantMessage
from flywheel.env.families import generate
from flywheel.env.verifiers_env import load_environment

env = load_environment(sys.argv[1], family="bugfix", n=2, seed=21)
tasks = list(env.taskset)

class Trace:
    def __init__(self): self.rewards, self.stopped = {}, None
    def record_reward(self, name, value, weight=1.0): self.rewards[name] = value
    def stop(self, condition, override=False): self.stopped = condition

class Player:  # the model's side of verifiers' interaction: scripted replies, the observations kept
    def __init__(self, replies): self.replies, self.seen, self.trace = list(replies), [], Trace()
    @contextlib.asynccontextmanager
    async def interaction(self, task):
        yield self
    async def turn(self, message=None):
        self.seen.append(json.loads(message))
        if not self.replies:
            return Segment(messages=[], terminated=True)
        reply = self.replies.pop(0)
        return Segment(messages=[AssistantMessage(content=reply)], root_reply=reply)

class Agents:
    def __init__(self, player): self.player = player

results = []
for task, replies in zip(tasks, ("fix", "empty")):
    flywheel_task = generate("bugfix", "train", 1, seed=task.data.reset["seed"])[0]
    if replies == "fix":
        edits = flywheel_task.reference_edits
        replies = [json.dumps({"tool": "edit_file", "arguments": e.model_dump()}) for e in edits]
        replies += ["```json\\n" + json.dumps({"tool": "finish", "arguments": {"summary": "fixed"}}) + "\\n```"]
    else:
        replies = [""]
    player = Player(replies)
    asyncio.run(env.run(task, Agents(player)))
    first = player.seen[0]
    from verifiers.v1.tasksets.openenv import OpenEnvEnv
    results.append({"type": type(env).__name__, "is_openenv_env": isinstance(env, OpenEnvEnv),
                    "reset": task.data.reset, "task_id": first["observation"]["task_id"],
                    "expected_id": flywheel_task.id, "schema": sorted(first["action_schema"]["properties"]),
                    "rewards": player.trace.rewards, "stopped": player.trace.stopped, "turns": len(player.seen)})
print(json.dumps(results))
"""


@pytest.mark.slow  # 34 s wall at load 35 on the shared 2-core machine: verifiers' imports (5 s of CPU)
@needs_verifiers
def test_verifiers_plays_a_flywheel_episode_through_its_own_openenv_env():
    from flywheel.env.openenv_app import openenv_app  # noqa: PLC0415

    with SandboxPool(PoolConfig(max_active=2, warm=0)) as pool, RunningServer(openenv_app(pool)) as running:
        run = subprocess.run([str(ECOSYSTEM_PYTHON), "-c", PLAY, running.url], capture_output=True, text=True,
                             timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert run.returncode == 0, run.stderr[-3000:]
    solved, idle = json.loads(run.stdout.splitlines()[-1])
    assert solved["type"] == idle["type"] == "FlywheelEnv" and solved["is_openenv_env"]
    assert [solved["reset"]["seed"], idle["reset"]["seed"]] == [21, 22]
    assert solved["task_id"] == solved["expected_id"] and idle["task_id"] == idle["expected_id"]
    assert {"tool", "arguments"} <= set(solved["schema"])  # what verifiers shows the model as the action
    assert solved["rewards"] == {"openenv_reward": pytest.approx(1.0)} and solved["stopped"] is None
    assert idle["rewards"] == {"openenv_reward": 0.0} and idle["stopped"] == "empty_action"
