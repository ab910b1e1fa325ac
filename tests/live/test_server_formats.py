"""The live server in each model family's own chat format, over real HTTP: the prompt it samples
from is the model's template's, tool calls are parsed the family's way (whole, streamed, and
forced by tool_choice), and a call never leaks into the streamed content."""

from __future__ import annotations

import json

import httpx
import pytest
from tiny_serving import KEYS, ScriptedEngine

from flywheel.live.deploy import Deployment, Router
from flywheel.live.server import LiveServer, ServeConfig, serve_in_thread
from flywheel.live.settings import LoopConfig
from flywheel.live.store import LiveStore
from flywheel.model.chat import SYSTEM_PROMPT, tool_schemas
from flywheel.model.formats import format_of
from tests.model.families import family_tokenizer

MESSAGES = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "Fix the failing test."}]
AUTH = {"authorization": "Bearer inference-key"}
CALL = {"role": "assistant", "content": "", "tool_calls": [
    {"id": "c", "type": "function", "function": {"name": "read_file", "arguments": {"path": "a.py"}}}]}


def serving(tmp_path, tokenizer, answer: str) -> tuple[LiveServer, ScriptedEngine]:
    engine = ScriptedEngine(tokenizer(answer, add_special_tokens=False)["input_ids"])
    config = ServeConfig(loop=LoopConfig.at(tmp_path / "live.sqlite"), keys=KEYS)
    server = LiveServer(config, Router(lambda version: (engine, tokenizer), Deployment(production=0)),
                        LiveStore(config.loop.store.path))
    return server, engine


@pytest.mark.parametrize("family", ["qwen2.5", "qwen3", "llama3"])
def test_prompts_are_the_template_s_and_calls_parse_the_family_s_way(tmp_path, family):
    tokenizer = family_tokenizer(family)
    chat_format = format_of(tokenizer)
    server, engine = serving(tmp_path, tokenizer, chat_format.assistant_body(CALL))
    body = {"model": "flywheel", "messages": MESSAGES, "tools": tool_schemas()}
    with server, serve_in_thread(server) as running, httpx.Client(base_url=running.url, headers=AUTH) as http:
        reply = http.post("/v1/chat/completions", json=body).json()
        with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
            chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
        stored = server.store.completion(reply["id"])
    template = tokenizer.apply_chat_template(MESSAGES, tools=tool_schemas(), tokenize=False,
                                             add_generation_prompt=True, **chat_format.template_kwargs())
    assert stored.prompt_ids == engine.prompts[0] == tokenizer(template, add_special_tokens=False)["input_ids"]
    (call,) = reply["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "read_file" and json.loads(call["function"]["arguments"]) == {"path": "a.py"}
    assert reply["choices"][0]["finish_reason"] == "tool_calls" and stored.tool_calls[0].valid
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    calls = [t for c in chunks if c["choices"] for t in c["choices"][0]["delta"].get("tool_calls") or []]
    assert streamed == "" and [t["function"]["name"] for t in calls] == ["read_file"]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "read_file"}}])
def test_tool_choice_opens_a_llama_call_in_the_prompt(tmp_path, choice):
    tokenizer = family_tokenizer("llama3")
    rest = 'read_file", "parameters": {"path": "a.py"}}' if choice == "required" else '{"path": "a.py"}}'
    rest += "<|eot_id|>"
    server, _ = serving(tmp_path, tokenizer, rest)
    with server, serve_in_thread(server) as running, httpx.Client(base_url=running.url, headers=AUTH) as http:
        reply = http.post("/v1/chat/completions", json={"model": "flywheel", "messages": MESSAGES,
                                                        "tools": tool_schemas(), "tool_choice": choice}).json()
        stored = server.store.completion(reply["id"])
    (call,) = reply["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "read_file" and json.loads(call["function"]["arguments"]) == {"path": "a.py"}
    opening = tokenizer.decode(stored.prompt_ids)
    assert opening.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n" + format_of(tokenizer).forced_call(
        None if choice == "required" else "read_file"))
