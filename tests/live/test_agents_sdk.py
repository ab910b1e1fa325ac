"""The official OpenAI Agents SDK, with its default settings, against the live server on loopback.

The model (scripted: an untrained model writes no tool call) first calls a declared tool, then
answers with a call of a tool nobody declared and a call cut off at max_tokens. The SDK ends a run
with `ModelBehaviorError: Tool ? not found` when such calls come back as `tool_calls`; here they come
back as text with a finish reason it knows, the run ends normally, and the store still holds both
invalid calls, each costing the completion its broken-call penalty.
"""

from __future__ import annotations

import asyncio

import pytest
from tiny_serving import KEYS, ScriptedEngine

from flywheel.agent.trajectory import INVALID_CALL_PENALTY
from flywheel.live.deploy import Deployment, Router
from flywheel.live.rewards import RewardDistiller
from flywheel.live.server import LiveServer, ServeConfig, serve_in_thread
from flywheel.live.settings import LoopConfig
from flywheel.live.store import LiveStore
from flywheel.model.chat import IM_END
from flywheel.model.tokenizer import load_tokenizer

agents = pytest.importorskip("agents", reason="the OpenAI Agents SDK (openai-agents, the dev extra)")

VALID = '<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call>' + IM_END
INVALID = ('Checking the disk.\n<tool_call>\n{"name": "format_disk", "arguments": {}}\n</tool_call>\n'
           '<tool_call>\n{"name": "read_file", "arguments": {"pa')  # no <|im_end|>: cut at max_tokens


def test_the_agents_sdk_runs_a_whole_episode_in_which_the_model_emits_invalid_calls(tmp_path, registry_root):
    from openai import AsyncOpenAI  # noqa: PLC0415

    tokenizer = load_tokenizer(registry_root / "checkpoints" / "v0")
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in (VALID, INVALID)]
    engine = ScriptedEngine(ids[1], turns=ids)
    config = ServeConfig(loop=LoopConfig.at(tmp_path / "live.sqlite"), keys=KEYS)
    server = LiveServer(config, Router(lambda version: (engine, tokenizer), Deployment(production=0)),
                        LiveStore(config.loop.store.path))
    read = []

    @agents.function_tool
    def read_file(path: str) -> str:
        """Read a file of the workspace."""
        read.append(path)
        return "def add(a, b):\n    return a - b\n"

    agents.set_tracing_disabled(True)  # no export to OpenAI's servers
    with server, serve_in_thread(server) as running:
        client = AsyncOpenAI(base_url=f"{running.url}/v1", api_key="admin-key", max_retries=0)
        agent = agents.Agent(name="fixer", instructions="Fix the failing test.", tools=[read_file],
                             model=agents.OpenAIChatCompletionsModel(model="flywheel", openai_client=client))
        result = asyncio.run(agents.Runner.run(agent, "The test of add fails.", max_turns=5))
        stored = server.store.completions()
    assert read == ["a.py"]  # the valid call was dispatched
    assert result.final_output == INVALID  # the invalid calls reached the client as the answer's text
    assert [c.finish_reason for c in stored] == ["tool_calls", "length"]
    assert [[(c.name, c.valid) for c in s.tool_calls] for s in stored] == [
        [("read_file", True)], [("format_disk", False), ("?", False)]]
    reward = RewardDistiller().distill(stored, [], now=stored[-1].created_at + 1e6)[1]
    assert reward.parts[INVALID_CALL_PENALTY] < 0  # the invalid calls still cost the completion
