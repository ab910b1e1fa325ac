"""flywheel's task families as a verifiers environment: `load_environment()` (verifiers 0.4, prime-rl).

    python -m flywheel.env.openenv_app --port 8000          # flywheel's sandboxes and grader, served

    from flywheel.env.verifiers_env import load_environment
    env = load_environment("http://127.0.0.1:8000", family="bugfix", n=32, seed=0)   # a verifiers Env

verifiers 0.4 reads OpenEnv environments with its own `openenv` taskset, and flywheel's
environment is that taskset pointed at flywheel's OpenEnv server (flywheel/env/openenv_app.py): one
verifiers task per (family, seed) `reset`, each episode in its own flywheel sandbox, graded by
flywheel's hidden tests at `finish`. An episode: reset, show the model the observation and the
action schema, parse each reply as an action with verifiers' own `parse_action` (JSON, fenced or
not: `{"tool": "run_command", "arguments": {...}}`), step, and score the sum of the step rewards
(`openenv_reward`; flywheel's whole reward arrives at `finish`).

Departure from verifiers' `OpenEnvEnv.run`, which `FlywheelEnv.run` replaces: 0.4's reads
`client._base_url`, which no openenv-core release has (0.2.x, 0.3.0), and fails before the first
turn; flywheel's knows its action schema (`FlywheelAction`) and needs no `/schema` request. A reply
that is no action gets the parse error as its observation instead of ending the run.

verifiers 0.4 pins openai < 3 (flywheel's dev extra has openai-agents, which needs >= 3): it lives in
.venv-ecosystem (`make ecosystem-env`), with openenv-core and mcp 2.0.0.
"""

from __future__ import annotations

import functools
import json
from typing import Any


@functools.cache
def environment_class() -> type:
    """`FlywheelEnv`: verifiers' OpenEnvEnv with a run() that works with openenv-core (module docstring)."""
    from openenv.core import GenericEnvClient  # noqa: PLC0415  (verifiers' environment only)
    from verifiers.v1.tasksets.openenv import OpenEnvEnv  # noqa: PLC0415
    from verifiers.v1.tasksets.openenv.taskset import parse_action  # noqa: PLC0415

    from flywheel.env.openenv_app import FlywheelAction  # noqa: PLC0415

    schema = FlywheelAction.model_json_schema()

    class FlywheelEnv(OpenEnvEnv):
        async def run(self, task: Any, agents: Any) -> None:
            total, note = 0.0, ""
            async with GenericEnvClient(base_url=task.data.base_url) as client:
                result = await client.reset(**task.data.reset)

                def payload() -> str:
                    return json.dumps({"observation": result.observation, "action_schema": schema}
                                      | ({"error": note} if note else {}), ensure_ascii=False)

                async with agents.player.interaction(task) as interaction:
                    segment = await interaction.turn(payload())
                    while not segment.terminated and not result.done:
                        reply = segment.last_reply.strip()
                        if not reply:  # nothing can advance the episode: end the run, not loop on it
                            interaction.trace.stop("empty_action")
                            break
                        try:
                            action, note = parse_action(reply, schema), ""
                        except ValueError as exc:
                            note = f"not an action ({exc}): reply with one JSON object of tool and arguments"
                            segment = await interaction.turn(payload())
                            continue
                        result = await client.step(action)
                        total += result.reward or 0.0
                        if result.done:
                            break
                        segment = await interaction.turn(payload())
            interaction.trace.record_reward("openenv_reward", total)

    return FlywheelEnv


def load_environment(base_url: str, family: str = "bugfix", n: int = 8, seed: int = 0, split: str = "train",
                     difficulty: int | None = None, **env_config: Any) -> Any:
    """A verifiers `Env` of `n` tasks of `family` (seeds seed .. seed+n-1) played against the
    flywheel OpenEnv server at `base_url`; `env_config`: more fields of verifiers' OpenEnvEnvConfig
    (the player's harness, timeouts)."""
    from verifiers.v1.tasksets.openenv import OpenEnvEnvConfig  # noqa: PLC0415  (verifiers' environment only)

    if n < 1:
        raise ValueError(f"n = {n}: a verifiers environment needs at least one task")
    resets = [{"family": family, "seed": seed + i, "split": split}
              | ({"difficulty": difficulty} if difficulty is not None else {}) for i in range(n)]
    config = OpenEnvEnvConfig(taskset={"id": "openenv", "base_url": base_url, "resets": resets}, **env_config)
    return environment_class()(config)


__all__ = ["environment_class", "load_environment"]
