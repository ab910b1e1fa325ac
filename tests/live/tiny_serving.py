"""What the live-server tests share: a real Registry of tiny models, and the one scripted Engine.

`make_registry` registers two real tiny Qwen3-MoE versions (v0 production, v1 candidate) with a
tokenizer trained on chat-format text; the server loads them like any checkpoint. `ScriptedEngine`
implements the Engine protocol by answering with fixed text: only the tool-call format tests use it,
because an untrained model never writes a tool call; every other test runs the real model.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

from flywheel.live.records import Completion
from flywheel.model.chat import IM_END, SYSTEM_PROMPT, render_messages, tool_schemas
from flywheel.model.engine import Generation, SamplingParams
from flywheel.model.factory import ModelConfig, build_model
from flywheel.model.registry import CANDIDATE, PRODUCTION, Registry
from flywheel.model.tokenizer import train_tokenizer

TINY = dict(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, num_experts=4,
            experts_per_token=2, moe_intermediate_size=32)
KEYS = {"inference-key": ["inference"], "events-key": ["events"], "admin-key": ["inference", "events", "admin"]}
TOOL_ANSWER = ('Let me look.\n<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "read_file", "arguments": {"path": 3}}\n</tool_call>\n'
               '<tool_call>\n{"name": "grep", "arguments": {"pattern": "x"</tool_call>' + IM_END)


def corpus() -> list[str]:
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "Fix the failing test."},
                {"role": "assistant", "content": "Reading.", "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "read_file", "arguments": {"path": "a.py"}}}]},
                {"role": "tool", "content": "def add(a, b):\n    return a - b\n"}]
    return [render_messages(messages, tool_schemas())] * 4 + ["def add(a, b):\n    return a + b\n"] * 4


def make_registry(root: Path, url: str | None = None) -> Registry:
    tokenizer = train_tokenizer(corpus(), vocab_size=400)
    registry = Registry(root, url=url)
    registry.register(build_model(ModelConfig(**TINY, seed=0), tokenizer), tokenizer, aliases=[PRODUCTION])
    registry.register(build_model(ModelConfig(**TINY, seed=1), tokenizer), tokenizer, parent=0, aliases=[CANDIDATE])
    return registry


def tiny_registry_root(tmp_path_factory) -> Path:
    """A registry folder with the two tiny versions of `make_registry`, closed (a module fixture's body)."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("registry")
    make_registry(root).close()
    return root


class ScriptedEngine:
    """An Engine that answers every prompt with the same token ids (for the format tests only)."""

    def __init__(self, token_ids: list[int], version: int = 0, turns: list[list[int]] | None = None):
        """`turns`: a different answer per request, in order (then `token_ids` for every later one)."""
        self.token_ids, self._version, self.prompts = token_ids, version, []
        self.turns = list(turns or [])
        self.closed = False

    @property
    def version(self) -> int:
        return self._version

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams) -> Future[Generation]:
        self.prompts.append(list(prompt_ids))
        ids = (self.turns.pop(0) if self.turns else self.token_ids)[: params.max_tokens]
        future: Future[Generation] = Future()
        finish = "stop" if ids and ids[-1] in params.stop_token_ids else "length"
        future.set_result(Generation(ids, [-0.25] * len(ids), [self._version] * len(ids), finish))
        return future

    def update_weights(self, weights, version: int, timeout_s: float = 60.0) -> None:
        raise NotImplementedError("a scripted engine has no weights")

    def close(self) -> None:
        self.closed = True


def stored_completion(cid: str, session: str, version: int = 0) -> Completion:
    """A completion record as the server writes one (for tests that need known completion ids)."""
    return Completion(id=cid, session_id=session, user_id="u", version=version, prompt_ids=[1, 2],
                      completion_ids=[3], logprobs=[-0.1], latency_ms=5.0, created_at=1000.0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Lines the API fuzz test leaves for the end of the pytest run (tests/live/conftest.py prints them).
FUZZ_SUMMARY = pytest.StashKey[list[str]]()
