"""flywheel's environments over OpenEnv's protocol, driven by `openenv-core`'s own client: three
sessions at once, each a different task in its own sandbox; what one writes the others never see;
the one that applies its task's fix through the tools is graded 1.0 at `finish`, the others less;
a step after the end is refused, not a 500."""

from __future__ import annotations

import threading

import pytest

from flywheel.api.http import RunningServer
from flywheel.env.families import generate
from flywheel.env.pool import PoolConfig, SandboxPool

openenv = pytest.importorskip("openenv.core", reason="openenv-core (the dev extra)")


def test_openenv_clients_play_isolated_sandboxed_episodes_concurrently():
    from flywheel.env.openenv_app import openenv_app  # noqa: PLC0415

    seeds = [11, 12, 13]
    tasks = [generate("bugfix", "train", 1, seed=s)[0] for s in seeds]
    barrier, results, errors = threading.Barrier(len(seeds)), {}, []

    def play(i: int, url: str) -> None:
        try:
            with openenv.GenericEnvClient(base_url=url).sync() as env:
                first = env.reset(family="bugfix", seed=seeds[i])
                barrier.wait(timeout=60)  # every session is open before any writes
                env.step({"tool": "run_command", "arguments": {"command": f"echo session-{i} > mine.txt"}})
                barrier.wait(timeout=60)  # every session has written before any reads
                seen = env.step({"tool": "run_command", "arguments": {"command": "cat mine.txt; ls"}})
                if i == 0:  # solves its task through the tools, as an agent would
                    for edit in tasks[0].reference_edits:
                        env.step({"tool": "edit_file", "arguments": edit.model_dump()})
                state = env.state()
                done = env.step({"tool": "finish", "arguments": {"summary": "done"}})
                after = env.step({"tool": "list_dir", "arguments": {}})
                results[i] = (first, seen, state, done, after)
        except Exception as exc:  # noqa: BLE001  (reported below with its session)
            errors.append((i, exc))

    with SandboxPool(PoolConfig(max_active=len(seeds), warm=0)) as pool:
        running = RunningServer(openenv_app(pool, max_sessions=len(seeds)))
        with running:
            threads = [threading.Thread(target=play, args=(i, running.url)) for i in range(len(seeds))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=120)
    assert not errors, errors
    for i, (first, seen, state, done, after) in results.items():
        assert first.observation["task_id"] == tasks[i].id and first.observation["instruction"] == tasks[i].instruction
        assert {t["function"]["name"] for t in first.observation["tools"]} >= {"run_command", "edit_file", "finish"}
        # Its own workspace: its own marker, the task's files, nothing of the other sessions.
        output = seen.observation["output"]
        assert f"session-{i}" in output and "run_tests.py" in output
        assert not any(f"session-{j}" in output for j in range(len(seeds)) if j != i)
        assert state["step_count"] >= 2 and state["episode_id"]
        assert done.done and done.observation["reward_parts"]
        assert after.done and not after.observation["ok"] and "reset" in after.observation["output"]
    assert results[0][3].reward == pytest.approx(1.0) and results[0][3].observation["all_passed"]
    assert all(results[i][3].reward < 1.0 and results[i][3].observation["all_passed"] is False for i in (1, 2))
