"""VLLMEngine's stream handling, each case made deterministic by a scripted server on loopback.

A real vLLM (tests/model/test_vllm_engine.py) decides by itself how it splits a completion into
stream lines and when an abort lands, so the cases below come up there only by chance: a stream
cut after its last token but before its finish reason (once in CI: the engine asked for 0 more
tokens, and vLLM answered HTTP 400), a stream that ends on a stop token with no finish reason, and
a stream cut with tokens still to sample (resumed as prompt + tokens so far), and a connection
reset under a stream while the server lives (a stale keep-alive connection: it cost a CI run one of
its two servers, taken for dead). The server here
speaks the slice of vLLM's HTTP API the engine uses (/health, the weight-update routes, streamed
/v1/completions with token ids and logprobs) and refuses what vLLM refuses (max_tokens < 1), and
sends each completion as the test scripts it. It runs in the main environment: no vLLM needed.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from flywheel.model.engine import EngineError, SamplingParams
from flywheel.model.factory import ModelConfig, build_model
from flywheel.model.registry import Registry
from flywheel.model.tokenizer import train_tokenizer
from flywheel.model.vllm_engine import VLLMEngine
from flywheel.model.vllm_server import VLLMConfig

STOP = 3


class ScriptedServer:
    """Answers each /v1/completions with the next script: (token ids, finish reason or None, then
    "done" (a [DONE] line), "hold" (keep the stream open, unfinished, until the client leaves), or
    "reset" (reset the connection: the client reads ECONNRESET), "die" (reset it, and /health
    fails from then on), or "error" (an error object in the stream, then [DONE]: what vLLM sends
    when its engine fails under a request)). /health answers 200 while `healthy`."""

    def __init__(self) -> None:
        self.scripts: deque[tuple[list[int], str | None, str]] = deque()
        self.completions: list[dict] = []  # every completion request's body, in order
        self.routes: list[str] = []
        self.holding = threading.Event()  # a "hold" stream has sent its tokens
        self.release = threading.Event()
        self.healthy = True
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                self._json(200 if server.healthy else 503, {})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                path = self.path.split("?")[0]
                server.routes.append(path)
                if path == "/reset_prefix_cache":
                    return self._json(200, {"success": True})
                if path != "/v1/completions":
                    return self._json(200, {"results": [None]})
                server.completions.append(body)
                if body["max_tokens"] < 1:  # vLLM's own refusal
                    return self._json(400, {"error": f"max_tokens must be at least 1, got {body['max_tokens']}"})
                ids, reason, end = server.scripts.popleft()
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                for i, token in enumerate(ids):
                    last = i == len(ids) - 1
                    choice = {"token_ids": [token], "logprobs": {"token_logprobs": [-0.5]},
                              "finish_reason": reason if last else None}
                    self.wfile.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
                self.wfile.flush()
                if end == "error":  # vLLM's ErrorResponse, as its stream generator sends it
                    error = {"error": {"message": "EngineCore encountered an issue.", "type": "InternalServerError",
                                       "code": 500}}
                    self.wfile.write(f"data: {json.dumps(error)}\n\n".encode())
                if end in ("done", "error"):
                    self.wfile.write(b"data: [DONE]\n\n")
                    return
                if end in ("reset", "die"):  # SO_LINGER 0: close sends RST, not FIN
                    server.healthy = end == "reset"
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    self.connection.close()
                    return
                server.holding.set()
                server.release.wait(timeout=30)  # the client closes the connection first

            def _json(self, code: int, payload: dict) -> None:
                data = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    tokenizer = train_tokenizer(["def add(a, b):\n    return a + b\n"] * 8, vocab_size=300)
    registry = Registry(tmp_path_factory.mktemp("registry"))
    registry.register(build_model(ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                              head_dim=32, num_experts=4, experts_per_token=2,
                                              moe_intermediate_size=32), tokenizer), tokenizer)
    return registry, registry.get(0).path


@pytest.fixture
def served(checkpoint, tmp_path):
    registry, path = checkpoint
    server = ScriptedServer()
    config = VLLMConfig(urls=[server.url], request_timeout_s=10.0, health_interval_s=0.2,
                        weights_dir=tmp_path / "weights")
    engine = VLLMEngine(path, config)
    server.routes.clear()  # the attach's weight load
    yield server, engine, registry
    engine.close()
    server.close()


def wait_for(event: threading.Event) -> None:
    assert event.wait(timeout=30), "the scripted stream never started"
    time.sleep(0.2)  # the engine has read the tokens the server flushed


def test_a_stream_cut_by_an_update_after_its_last_token_finishes_without_asking_for_zero_tokens(served):
    server, engine, registry = served
    server.scripts.append(([11, 12, 13, 14], None, "hold"))  # all 4 tokens, the finish reason never sent
    future = engine.submit([5, 6, 7], SamplingParams(temperature=1.0, max_tokens=4))
    wait_for(server.holding)
    engine.update_weights(registry.state_dict(0), 1)  # cancels the open stream
    gen = future.result(timeout=30)
    assert gen.token_ids == [11, 12, 13, 14] and gen.finish_reason == "length"
    assert gen.versions == [0, 0, 0, 0] and gen.logprobs == [-0.5] * 4
    assert len(server.completions) == 1, f"resubmitted: {server.completions[1:]}"
    assert server.routes[1:] == ["/pause", "/collective_rpc", "/reset_prefix_cache", "/resume"]


def test_a_stream_ending_on_a_stop_token_without_a_finish_reason_stops(served):
    server, engine, _ = served
    server.scripts.append(([11, 12, STOP], None, "done"))
    gen = engine.submit([5, 6, 7], SamplingParams(temperature=1.0, max_tokens=8, stop_token_ids=(STOP,))).result(30)
    assert gen.token_ids == [11, 12, STOP] and gen.finish_reason == "stop"
    assert len(server.completions) == 1


def test_a_stream_cut_with_tokens_left_resumes_as_prompt_plus_tokens_under_the_new_version(served):
    server, engine, registry = served
    server.scripts.extend([([11, 12], None, "hold"), ([13, 14], "length", "done")])
    future = engine.submit([5, 6, 7], SamplingParams(temperature=1.0, max_tokens=4))
    wait_for(server.holding)
    engine.update_weights(registry.state_dict(0), 1)
    gen = future.result(timeout=30)
    assert gen.token_ids == [11, 12, 13, 14] and gen.finish_reason == "length"
    assert gen.versions == [0, 0, 1, 1]
    first, resumed = server.completions
    assert first["prompt"] == [5, 6, 7] and first["max_tokens"] == 4
    assert resumed["prompt"] == [5, 6, 7, 11, 12] and resumed["max_tokens"] == 2
    assert engine.stats["resubmitted"] == 1


def test_a_stream_vllm_ends_early_without_a_finish_reason_is_resumed(served):
    """An abort on the server's side ("abort", or [DONE] with tokens left): the rest is asked for."""
    server, engine, _ = served
    server.scripts.extend([([11], "abort", "done"), ([12, 13], None, "done"), ([14], "length", "done")])
    gen = engine.submit([5], SamplingParams(temperature=1.0, max_tokens=4)).result(timeout=30)
    assert gen.token_ids == [11, 12, 13, 14] and gen.finish_reason == "length"
    assert [c["max_tokens"] for c in server.completions] == [4, 3, 1]


def test_a_reset_connection_while_the_server_answers_its_health_is_resubmitted_not_a_death(served):
    server, engine, _ = served
    server.scripts.extend([([11, 12], None, "reset"), ([13, 14], "length", "done")])
    gen = engine.submit([5, 6, 7], SamplingParams(temperature=1.0, max_tokens=4)).result(timeout=30)
    assert gen.token_ids == [11, 12, 13, 14] and gen.finish_reason == "length"
    assert engine.live_servers() == [server.url] and engine.stats["server_failures"] == 0
    assert engine.stats["stream_errors"] == 1 and engine.stats["resubmitted"] == 1
    assert server.completions[1]["prompt"] == [5, 6, 7, 11, 12]


def test_a_reset_connection_of_a_server_whose_health_fails_is_a_death(served):
    server, engine, _ = served
    server.scripts.append(([11], None, "die"))
    with pytest.raises(EngineError, match="no live vLLM server"):
        engine.submit([5, 6, 7], SamplingParams(temperature=1.0, max_tokens=4)).result(timeout=30)
    assert engine.live_servers() == [] and engine.stats["stream_errors"] == 0
    assert "Error" in engine._servers[0].dead and len(server.completions) == 1  # the stream's error, not /health's


def test_a_server_that_breaks_every_stream_is_a_death_though_its_health_answers(served):
    server, engine, _ = served
    server.scripts.extend([([11 + i], None, "reset") for i in range(5)])
    with pytest.raises(EngineError, match="3 broken streams in a row"):
        engine.submit([5, 6, 7], SamplingParams(temperature=1.0, max_tokens=8)).result(timeout=30)
    assert engine.stats["stream_errors"] == 2 and len(server.completions) == 3


def test_an_error_inside_a_stream_is_a_broken_stream_not_a_failed_run(served):
    """vLLM reports its engine failing under a request as an error object inside the stream, and its
    /health may still answer for a moment (its engine core SIGKILLed in bench/faults.py's vllm part:
    the engine read the error as a completion and the run died of a KeyError). Now it is a broken
    stream: the request goes on from its tokens so far (here on the same server, which answers its
    /health; a server that breaks three in a row is dead)."""
    server, engine, _ = served
    server.scripts.extend([([11, 12], None, "error"), ([13, 14], "length", "done")])
    gen = engine.submit([5, 6, 7], SamplingParams(temperature=1.0, max_tokens=4)).result(timeout=30)
    assert gen.token_ids == [11, 12, 13, 14] and gen.finish_reason == "length"
    assert engine.stats["stream_errors"] == 1 and engine.live_servers() == [server.url]
    assert server.completions[1]["prompt"] == [5, 6, 7, 11, 12]

