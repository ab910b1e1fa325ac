"""The live server over real HTTP on loopback: a real Registry of tiny models, real SQLite, real forward passes.

The official `openai` client talks to it (plain, streaming, logprobs); every completion must be in
the store, read through a second connection, by the time the response arrives, with the version
that served it. Sessions stick to their A/B arm; the deployment changes at runtime. Keys, scopes and
bad requests get 4xx JSON. Events are acknowledged per event and idempotently, and a `flywheel serve`
process killed with SIGKILL in the middle of a flood of events and completions loses none it acknowledged
or returned, on SQLite and on a real PostgreSQL server.
Only the tool-call format test uses a scripted engine (an untrained model writes no tool calls).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
from tiny_serving import KEYS, TOOL_ANSWER, ScriptedEngine, free_port, stored_completion

from flywheel.live.deploy import Deployment, Router
from flywheel.live.server import LiveServer, ServeConfig, serve_in_thread
from flywheel.live.settings import LoopConfig
from flywheel.live.store import LiveStore
from flywheel.model.chat import IM_END, SYSTEM_PROMPT, TOOLS_IN_PROMPT, render_messages, tool_schemas
from flywheel.model.conversation import ConversationEncoder
from flywheel.model.registry import CANDIDATE, PRODUCTION, CheckpointNotFound, Registry
from flywheel.model.tokenizer import load_tokenizer

REPO = Path(__file__).resolve().parents[2]
MESSAGES = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "Fix the failing test."}]


@pytest.fixture(scope="module")
def live(registry_root, tmp_path_factory):
    config = ServeConfig(loop=LoopConfig.at(tmp_path_factory.mktemp("live") / "live.sqlite", registry_root), keys=KEYS,
                         candidate_fraction=0.5, max_body_bytes=64 * 1024, max_events_per_batch=100, threads=1)
    server = LiveServer.from_config(config)
    with serve_in_thread(server) as running:
        yield server, running.url
    server.close()


def client(url: str, key: str = "inference-key") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)


def full_logprobs(model, ids: list[int], start: int) -> torch.Tensor:
    """log p(ids[i] | ids[:i]) for i >= start, from one forward pass of the plain model."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()  # [seq, vocab]
    logp = torch.log_softmax(logits[start - 1 : -1], dim=-1)
    return logp.gather(1, torch.tensor(ids[start:]).unsqueeze(1)).squeeze(1)


def test_openai_round_trip_is_stored_before_the_response_with_its_version(live, registry_root):
    server, url = live
    resp = client(url).chat.completions.create(
        model="flywheel", messages=MESSAGES, tools=tool_schemas(), max_tokens=6, temperature=0, logprobs=True,
        user="alice", extra_headers={"X-Session-Id": "round-trip"}, metadata={"family": "bugfix"})
    info = resp.model_extra["flywheel"]
    assert resp.id.startswith("chatcmpl-") and info["session_id"] == "round-trip"
    assert resp.choices[0].finish_reason in {"stop", "length", "tool_calls"}
    # A second connection to the file, as the distiller would open: the commit happened before the reply.
    with LiveStore(server.config.loop.store.path) as reader:
        stored = reader.completion(resp.id)
    assert stored is not None
    assert (stored.session_id, stored.user_id, stored.request_meta) == ("round-trip", "alice", {"family": "bugfix"})
    assert stored.version == info["version"] and stored.arm == info["arm"]
    assert resp.usage.completion_tokens == len(stored.completion_ids) <= 6
    assert [t.logprob for t in resp.choices[0].logprobs.content] == pytest.approx(stored.logprobs)
    # Token in, token out: the prompt is the rendered conversation, the logprobs are the served model's.
    model, tokenizer = Registry(registry_root).load(stored.version)
    text = render_messages(MESSAGES, tool_schemas(), add_generation_prompt=True)
    assert stored.prompt_ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    expected = full_logprobs(model, stored.prompt_ids + stored.completion_ids, len(stored.prompt_ids))
    assert torch.allclose(torch.tensor(stored.logprobs), expected, atol=1e-4)
    assert (resp.choices[0].message.content or "") == stored.content


def test_prompts_tokenized_turn_by_turn_equal_the_whole_text(registry_root):
    # Text that holds a markup token's string ("<tool_call>" in a tool result) is tokenized as text,
    # not as the whole text would be: tests/model/test_conversation.py's forgery tests cover it.
    tokenizer = load_tokenizer(registry_root / "checkpoints" / "v0")
    encoder = ConversationEncoder(tokenizer)
    call = {"id": "c1", "type": "function", "function": {"name": "grep", "arguments": '{"pattern": "def  x"}'}}
    conversation = [
        *MESSAGES, {"role": "assistant", "content": "Looking.", "tool_calls": [call, call]},
        {"role": "tool", "content": "a.py:1:def  x():"}, {"role": "tool", "content": "  <tool call> not a call\n"},
        {"role": "user", "content": "ünïcödé “quotes”\n\n  trailing  "}, {"role": "system", "content": "late system"},
        {"role": "assistant", "content": ""},
    ]
    assert encoder.piecewise
    for messages, tools in [(conversation, tool_schemas()), (conversation[1:], tool_schemas()), (conversation, None)]:
        whole = tokenizer(render_messages(messages, tools, add_generation_prompt=True), add_special_tokens=False)
        ids, fresh = encoder.encode_request(messages, tools)
        assert ids == whole["input_ids"]
        encoder.remember(fresh)
        assert encoder.encode_request(messages, tools) == (whole["input_ids"], {})  # all from the cache


def test_streaming_sends_openai_chunks_of_the_stored_answer(live):
    server, url = live
    stream = client(url).chat.completions.create(
        model="flywheel", messages=MESSAGES, max_tokens=5, temperature=0.8, stream=True,
        stream_options={"include_usage": True}, extra_body={"session_id": "streamer"})
    chunks = list(stream)
    ids = {c.id for c in chunks}
    assert len(ids) == 1
    stored = server.store.completion(ids.pop())
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == stored.content and stored.session_id == "streamer"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == stored.finish_reason
    assert chunks[-1].usage.completion_tokens == len(stored.completion_ids)


def scripted_server(tmp_path: Path, registry_root: Path, text: str) -> tuple[LiveServer, ScriptedEngine]:
    tokenizer = load_tokenizer(registry_root / "checkpoints" / "v0")
    engine = ScriptedEngine(tokenizer(text, add_special_tokens=False)["input_ids"])
    router = Router(lambda version: (engine, tokenizer), Deployment(production=0))
    config = ServeConfig(loop=LoopConfig.at(tmp_path / "live.sqlite"), keys=KEYS)
    return LiveServer(config, router, LiveStore(config.loop.store.path)), engine


def test_valid_tool_calls_come_back_in_openai_format_and_invalid_ones_as_text(tmp_path, registry_root):
    server, engine = scripted_server(tmp_path, registry_root, TOOL_ANSWER)
    with server, serve_in_thread(server) as running:
        api = client(running.url)
        resp = api.chat.completions.create(model="flywheel", messages=MESSAGES, tools=tool_schemas())
        message = resp.choices[0].message
        assert resp.choices[0].finish_reason == "tool_calls"
        calls = message.tool_calls
        assert [c.function.name for c in calls] == ["read_file"]
        assert json.loads(calls[0].function.arguments) == {"path": "a.py"} and calls[0].type == "function"
        assert "error" not in calls[0].model_extra
        # The two calls no client could dispatch (wrong argument type; cut off, so no name) are text.
        assert message.content == ('Let me look.\n<tool_call>\n{"name": "read_file", "arguments": {"path": 3}}\n'
                                   '</tool_call>\n<tool_call>\n{"name": "grep", "arguments": {"pattern": "x"'
                                   '</tool_call>')
        stored = server.store.completion(resp.id)  # the record keeps every call, with its error
        assert [c.valid for c in stored.tool_calls] == [True, False, False] and stored.finish_reason == "tool_calls"
        assert "must be a string" in stored.tool_calls[1].error and "bad JSON" in stored.tool_calls[2].error
        assert stored.content == message.content and resp.model_extra["flywheel"]["invalid_tool_calls"] == 2

        # Streamed, the same calls arrive as tool_call deltas.
        chunks = list(api.chat.completions.create(model="flywheel", messages=MESSAGES, tools=tool_schemas(),
                                                  stream=True))
        streamed = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
        assert [(tc.index, tc.function.name, tc.function.arguments) for tc in streamed] == \
            [(i, c.function.name, c.function.arguments) for i, c in enumerate(calls)]

        # The previous turn's calls render back into the prompt; tool_choice "none" drops the tools section,
        # and whatever the model writes is its text: no tool call comes back or is stored.
        follow = [*MESSAGES, message.model_dump(exclude_none=True),
                  {"role": "tool", "tool_call_id": calls[0].id, "content": "print(1)"}]
        resp = api.chat.completions.create(model="flywheel", messages=follow, tools=tool_schemas(), tool_choice="none")
        prompt = server.router.tokenizer(0).decode(engine.prompts[-1])
        assert "<tools>" not in prompt and '"path": "a.py"' in prompt and "<tool_response>\nprint(1)" in prompt
        choice = resp.choices[0]
        assert choice.message.tool_calls is None and choice.finish_reason == "stop"
        assert choice.message.content == TOOL_ANSWER.removesuffix(IM_END)
        stored = server.store.completion(resp.id)
        assert stored.tool_calls == [] and stored.content == choice.message.content


def test_a_model_trained_without_tool_schemas_is_served_without_them(tmp_path, registry_root):
    tokenizer = load_tokenizer(registry_root / "checkpoints" / "v0")
    tokenizer.init_kwargs[TOOLS_IN_PROMPT] = False  # as saved by `train_tokenizer(..., tools_in_prompt=False)`
    engine = ScriptedEngine(tokenizer(TOOL_ANSWER, add_special_tokens=False)["input_ids"])
    config = ServeConfig(loop=LoopConfig.at(tmp_path / "live.sqlite"), keys=KEYS)
    server = LiveServer(config, Router(lambda version: (engine, tokenizer), Deployment(production=0)),
                        LiveStore(config.loop.store.path))
    with server, serve_in_thread(server) as running:
        resp = client(running.url).chat.completions.create(model="flywheel", messages=MESSAGES, tools=tool_schemas())
    prompt = tokenizer.decode(engine.prompts[-1])
    assert prompt == render_messages(MESSAGES, None, add_generation_prompt=True) and "<tools>" not in prompt
    # The request's tools still decide which calls are valid.
    assert [c.function.name for c in resp.choices[0].message.tool_calls] == ["read_file"]
    assert "error" not in resp.choices[0].message.tool_calls[0].model_extra


def test_calls_are_checked_against_the_tools_the_request_declared(tmp_path, registry_root):
    answer = '<tool_call>\n{"name": "lookup", "arguments": {"q": "clamp", "limit": 3}}\n</tool_call>' + IM_END
    server, _ = scripted_server(tmp_path, registry_root, answer)
    lookup = {"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"q": {"type": "string"}, "limit": {"type": "integer"}}, "required": ["q"]}}}
    with server, serve_in_thread(server) as running:
        resp = client(running.url).chat.completions.create(model="flywheel", messages=MESSAGES, tools=[lookup])
        call = resp.choices[0].message.tool_calls[0]
        assert call.function.name == "lookup" and "error" not in call.model_extra
        assert server.store.completions()[0].tool_calls[0].valid


def test_sessions_stick_to_their_arm(live):
    server, url = live
    assert server.deployment == Deployment(production=0, candidate=1, candidate_fraction=0.5)
    api = client(url)
    seen: dict[str, set[tuple[int, str]]] = {}
    for session in [f"sticky-{i}" for i in range(16)] * 2:
        resp = api.chat.completions.create(model="flywheel", messages=MESSAGES, max_tokens=1,
                                           metadata={"session_id": session})
        info = resp.model_extra["flywheel"]
        seen.setdefault(session, set()).add((info["version"], info["arm"]))
        assert server.store.completion(resp.id).version == info["version"]
    assert all(len(arms) == 1 for arms in seen.values())  # sticky
    arms = {arm for (only,) in seen.values() for arm in [only]}
    assert arms == {(0, PRODUCTION), (1, CANDIDATE)}  # 16 sessions at 50%: both arms (chance of not: 2^-15)
    for session, ((version, _),) in seen.items():
        assert server.deployment.route(session)[1] == version


def test_deployment_changes_at_runtime_and_moves_the_registry_aliases(live, registry_root):
    server, url = live
    admin = {"authorization": "Bearer admin-key"}
    r = httpx.post(f"{url}/v1/admin/deployment", json={"production": 0, "candidate": None},
                   headers={"authorization": "Bearer inference-key"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "insufficient_scope"
    r = httpx.post(f"{url}/v1/admin/deployment", json={"production": 0, "candidate": None}, headers=admin, timeout=60)
    assert r.status_code == 200 and r.json()["served_versions"] == [0]
    registry = Registry(registry_root)
    assert registry.get(PRODUCTION).version == 0
    with pytest.raises(CheckpointNotFound):
        registry.get(CANDIDATE)
    assert [m.id for m in client(url).models.list()] == ["flywheel", "v0"]
    with pytest.raises(openai.NotFoundError, match="v1 is not served"):
        client(url).chat.completions.create(model="v1", messages=MESSAGES, max_tokens=1)
    resp = client(url).chat.completions.create(model="v0", messages=MESSAGES, max_tokens=1)
    assert resp.model_extra["flywheel"]["arm"] == "pinned"

    bad = httpx.post(f"{url}/v1/admin/deployment", json={"production": 0, "candidate_fraction": 0.5}, headers=admin)
    assert bad.status_code == 400 and "no candidate" in bad.json()["error"]["message"]
    missing = httpx.post(f"{url}/v1/admin/deployment", json={"production": 7}, headers=admin, timeout=60)
    assert missing.status_code == 404 and "no checkpoint v7" in missing.json()["error"]["message"]

    # `flywheel registry promote` elsewhere, then a sync: the server follows the aliases.
    registry.set_alias(CANDIDATE, 1)
    synced = httpx.post(f"{url}/v1/admin/deployment/sync", headers=admin, timeout=60).json()
    assert synced["deployment"] == {"production": 0, "candidate": 1, "candidate_fraction": 0.5}
    assert synced["served_versions"] == [0, 1]

    previous = server.set_deployment(Deployment(production=0, candidate=1, candidate_fraction=0.25), note="test")
    assert previous == Deployment(production=0, candidate=1, candidate_fraction=0.5)
    assert server.router.served_versions() == [0, 1] and registry.get(CANDIDATE).version == 1
    got = httpx.get(f"{url}/v1/admin/deployment", headers=admin).json()
    assert got["deployment"] == {"production": 0, "candidate": 1, "candidate_fraction": 0.25}
    notes = [d["note"] for d in server.store.deployments()]
    assert notes[-4:] == ["serve start", "admin endpoint", "synced from registry", "test"]
    server.set_deployment(Deployment(production=0, candidate=1, candidate_fraction=0.5))


def test_concurrent_requests_are_each_stored_once(live):
    server, url = live
    api, results = client(url), []

    def ask(i: int) -> None:
        results.append(api.chat.completions.create(model="flywheel", messages=MESSAGES, max_tokens=3,
                                                   extra_body={"session_id": f"parallel-{i % 3}"}))

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len({r.id for r in results}) == 8
    for r in results:
        stored = server.store.completion(r.id)
        assert stored.version == r.model_extra["flywheel"]["version"] == server.deployment.route(stored.session_id)[1]


def test_config_errors_say_the_fix(tmp_path):
    with pytest.raises(ValueError, match=r"add a \[keys\] table"):
        LiveServer(ServeConfig(loop=LoopConfig.at(tmp_path / "live.sqlite")),
                   Router(lambda v: (ScriptedEngine([1], v), None), Deployment(production=0)))
    with pytest.raises(ValueError, match="lower the first or raise the second"):
        ServeConfig(default_max_tokens=10, max_tokens_limit=5)
    with pytest.raises(ValueError, match="flywheel bootstrap"):
        LiveServer.from_config(ServeConfig(loop=LoopConfig.at(tmp_path / "live.sqlite", tmp_path / "none"), keys=KEYS))


def test_keys_and_scopes(live):
    _, url = live
    body = {"model": "flywheel", "messages": MESSAGES, "max_tokens": 1}
    cases = [
        ("post", "/v1/chat/completions", None, 401, "missing_api_key"),
        ("post", "/v1/chat/completions", "Bearer nope", 401, "invalid_api_key"),
        ("post", "/v1/chat/completions", "Basic inference-key", 401, "missing_api_key"),
        ("post", "/v1/chat/completions", "Bearer events-key", 403, "insufficient_scope"),
        ("post", "/v1/events", "Bearer inference-key", 403, "insufficient_scope"),
        ("get", "/v1/admin/deployment", "Bearer events-key", 403, "insufficient_scope"),
        ("get", "/v1/models", "Bearer events-key", 403, "insufficient_scope"),
    ]
    for method, path, auth, status, code in cases:
        headers = {"authorization": auth} if auth else {}
        r = httpx.request(method, f"{url}{path}", json=body, headers=headers)
        assert (r.status_code, r.json()["error"]["code"]) == (status, code), (method, path, auth)
    with pytest.raises(openai.AuthenticationError):
        client(url, key="wrong").models.list()
    assert httpx.get(f"{url}/health").json() == {"status": "ok", "store": "ok", "registry": "ok"}
    assert client(url, key="admin-key").models.list().data[0].id == "flywheel"


def test_bad_requests_get_4xx_json_never_500(live):
    _, url = live
    chat, events = f"{url}/v1/chat/completions", f"{url}/v1/events"
    ok = {"model": "flywheel", "messages": MESSAGES, "max_tokens": 1}

    def chunks():
        for _ in range(100):
            yield b"x" * 1024  # no Content-Length: the limit must hold while streaming in

    cases = [
        (chat, b"{not json", 400), (chat, b"", 400), (chat, b"[]", 400), (chat, json.dumps({"model": "flywheel"}), 400),
        (chat, json.dumps({**ok, "messages": []}), 400),
        (chat, json.dumps({**ok, "messages": [{"role": "robot", "content": "hi"}]}), 400),
        (chat, json.dumps({**ok, "messages": [{"role": "user"}]}), 400),
        (chat, json.dumps({**ok, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}),
         400),
        (chat, json.dumps({**ok, "temperature": 5}), 400), (chat, json.dumps({**ok, "n": 17}), 400),
        (chat, json.dumps({**ok, "stop": ["a", "b", "c", "d", "e"]}), 400),
        (chat, json.dumps({**ok, "logit_bias": {"5": 10}}), 400),
        (chat, json.dumps({**ok, "tools": [{"type": "function"}]}), 400),
        (chat, json.dumps({**ok, "tools": [{"type": "function",
                                            "function": {"name": "f", "parameters": {"properties": []}}}]}), 400),
        (chat, json.dumps({**ok, "max_tokens": 0}), 400), (chat, json.dumps({**ok, "max_tokens": 10**6}), 400),
        (chat, json.dumps({**ok, "model": "gpt-4"}), 404), (chat, json.dumps({**ok, "user": "u" * 500}), 400),
        (chat, json.dumps({**ok, "messages": MESSAGES * 2000}), 413), (chat, chunks(), 413),
        (chat, json.dumps({**ok, "response_format": {"type": "json_object"}}), 400),
        (events, b"\xff\xfe", 400), (events, b"{}", 400), (events, json.dumps({"events": {}}), 400),
        (events, b"[" * 20000 + b"]" * 20000, 400), (chat, b"[" * 20000 + b"]" * 20000, 400),
        (events, json.dumps({"events": [{}] * 101}), 413),
    ]
    for target, content, status in cases:
        key = "Bearer admin-key"
        r = httpx.post(target, content=content, headers={"authorization": key, "content-type": "application/json"},
                       timeout=60)
        assert r.status_code == status, (target, str(content)[:80], r.status_code, r.text[:200])
        assert r.json()["error"]["message"], r.text
    for method, path, status in [("get", "/v1/chat/completions", 405), ("get", "/v1/nothing", 404)]:
        r = httpx.request(method, f"{url}{path}", headers={"authorization": "Bearer admin-key"})
        assert r.status_code == status and "error" in r.json()


def test_events_are_acknowledged_per_event_and_idempotently(live):
    server, url = live
    server.store.add_completion(stored_completion("c-ev", "s-ev"))
    base = {"session_id": "s-ev", "completion_id": "c-ev", "time": 1000.0}
    batch = [
        {**base, "id": "e1", "type": "edit_applied"},
        {**base, "id": "e2", "type": "followup", "payload": {"dissatisfied": True}},
        {**base, "id": "e1", "type": "edit_applied"},  # the same id again in one batch
        {**base, "id": "e3", "type": "telepathy"},
        {**base, "id": "e4", "type": "followup"},
        {**base, "id": "e5", "type": "edit_reverted", "completion_id": "c-unknown"},
        {**base, "id": "e6", "type": "thumbs", "session_id": "other", "payload": {"up": True}},
        "not an event",
        {**base, "id": "e7", "type": "session_end", "completion_id": None, "payload": {"outcome": "success"}},
        {**base, "id": "e8", "type": "edit_persisted", "completion_id": None},
    ]
    headers = {"authorization": "Bearer events-key"}
    first = httpx.post(f"{url}/v1/events", json={"events": batch}, headers=headers).json()
    assert first["accepted"] == ["e1", "e2", "e7"] and first["duplicate"] == ["e1"]
    reasons = {r["index"]: r["reason"] for r in first["rejected"]}
    assert sorted(reasons) == [3, 4, 5, 6, 7, 9]
    assert "edit_applied" in reasons[3] and "dissatisfied" in reasons[4] and "unknown completion_id" in reasons[5]
    assert "belongs to session 's-ev'" in reasons[6] and "name the completion" in reasons[9]
    again = httpx.post(f"{url}/v1/events", json={"events": batch}, headers=headers).json()
    assert again["accepted"] == [] and again["duplicate"] == ["e1", "e2", "e1", "e7"]
    assert [e.id for e in server.store.events_for_completion("c-ev")] == ["e1", "e2"]
    assert [e.id for e in server.store.events_for_session("s-ev")] == ["e1", "e2", "e7"]
    assert server.store.events_for_completion("c-ev")[1].payload == {"dissatisfied": True}


@pytest.mark.slow  # 24 s on the shared 2-core machine (load ~10)
def test_kill_9_during_a_flood_loses_no_acknowledged_event(registry_root, tmp_path, store_url):
    run_dir, port = tmp_path / "live", free_port()
    postgres = store_url.startswith("postgresql://")
    location = store_url if postgres else run_dir / "live.sqlite"
    with LiveStore(location) as store:
        for i in range(8):
            store.add_completion(stored_completion(f"c{i}", f"s{i}"))
    cmd = [sys.executable, "-m", "flywheel.cli", "serve", "--config", str(REPO / "configs" / "serve.toml"),
           "--set", f"loop.store.registry_root={json.dumps(str(registry_root))}",
           "--set", f"loop.store.path={json.dumps(str(run_dir / 'live.sqlite'))}",
           "--set", f"port={port}", "--set", "threads=1"]
    if postgres:
        cmd += ["--set", f"loop.store.url={json.dumps(store_url)}"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, proc.stdout.read().decode()
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.1)
        acked: list[str] = []
        returned: list[str] = []  # completion ids the server answered with
        lock, stop = threading.Lock(), threading.Event()

        def complete() -> None:
            with httpx.Client(base_url=url, headers={"authorization": "Bearer dev-inference-key"}, timeout=30) as http:
                for n in range(10**6):
                    if stop.is_set():
                        return
                    body = {"model": "flywheel", "messages": MESSAGES, "max_tokens": 2, "session_id": f"k{n}"}
                    try:
                        r = http.post("/v1/chat/completions", json=body)
                    except httpx.TransportError:
                        return
                    assert r.status_code == 200, r.text
                    returned.append(r.json()["id"])

        def flood(worker: int) -> None:
            with httpx.Client(base_url=url, headers={"authorization": "Bearer dev-events-key"}, timeout=10) as http:
                for n in range(10**6):
                    if stop.is_set():
                        return
                    ids = [f"w{worker}-{n}-{j}" for j in range(100)]
                    events = [{"id": i, "type": "followup", "session_id": f"s{j % 8}", "completion_id": f"c{j % 8}",
                               "time": time.time(), "payload": {"dissatisfied": j % 2 == 0}} for j, i in enumerate(ids)]
                    try:
                        r = http.post("/v1/events", json={"events": events})
                    except httpx.TransportError:
                        return  # the server died mid-request: that batch was never acknowledged
                    assert r.status_code == 200 and not r.json()["rejected"], r.text
                    with lock:
                        acked.extend(r.json()["accepted"])

        workers = [threading.Thread(target=flood, args=(w,)) for w in range(3)] + [threading.Thread(target=complete)]
        for w in workers:
            w.start()
        while (len(acked) < 3000 or not returned) and all(w.is_alive() for w in workers):
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)  # while the workers are still sending
        proc.wait(10)
        stop.set()
        for w in workers:
            w.join(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert len(acked) >= 3000 and returned
    with LiveStore(location) as store:
        if not postgres:
            assert store._query("PRAGMA integrity_check")[0][0] == "ok"
        missing = [i for i in acked if not store.has_event(i)]
        assert not missing, f"{len(missing)} acknowledged events lost, e.g. {missing[:3]}"
        assert store.count_events() >= len(acked)
        lost = [c for c in returned if store.completion(c) is None]
        assert not lost, f"{len(lost)} of {len(returned)} returned completions lost, e.g. {lost[:3]}"
