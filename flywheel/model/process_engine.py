"""A LocalEngine in a process of its own, behind the same `Engine` interface.

    parent (rollout threads, learner)                      child process (its own interpreter)
    submit(prompt, params) ── ("submit", id, ...) ──pipe──> LocalEngine.submit ─┐
    Future[Generation] <────── ("done", id, Generation) <── done callback <───────┘
    update_weights(w, v) ──── ("update", id, w, v) ──pipe──> LocalEngine.update_weights
                      <────── ("updated", id, error) <─────┘
    params.on_token <───────── ("token", id, token, logprob) <── on_token, as each is sampled
    counters() ────────────── ("counters", id) ───────> LocalEngine.counters(): prefill/decode tokens, seconds
    a reader thread in the parent completes the futures and calls the requests' on_token

Why a process: the decode loop of a small model is mostly Python (module calls, the dispatcher),
so in one process it needs the GIL for most of every step, and shares it with every rollout
thread (tool calls, tokenizing, saving episode state) and with the learner. In its own interpreter
it only competes for a core. `bench/async_rl.py --engine-process` measures the difference.

Streaming: a function cannot cross the pipe, so a request's `on_token` stays in the parent and the
child sends each sampled token as a message of its own, before the request's "done" (one pipe, so
in order); the reader thread calls `on_token` with it, as the engine's loop would in-process.

Messages are pickled explicitly (`pickle`, not multiprocessing's pickler, which would move the
learner's tensors into shared memory): a weight update is a copy of the state dict, 8 MB for the
embedded default. Requests are checked in the parent as `LocalEngine.submit` checks them, so a bad
request raises at the call, not in the child. If the child dies, every waiting future and any later
call fails with `EngineError` saying so; if the parent dies, the child exits: it sees the pipe close,
or, when a process the parent forked still holds the pipe's other end (a sandbox's supervisor), it
sees itself adopted by another parent within half a second (SIGTERM skips the parent's `close`).
The child is spawned, not forked (a fork would copy the locks of the parent's threads), so a script
that starts one must keep its work under `if __name__ == "__main__":`.
"""

from __future__ import annotations

import dataclasses
import itertools
import multiprocessing
import os
import pickle
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from flywheel.model.engine import (
    Engine,
    EngineConfig,
    EngineError,
    Generation,
    LocalEngine,
    SamplingParams,
    check_delta,
    check_request,
)
from flywheel.model.weight_delta import WeightDelta


def _send(conn: Any, lock: threading.Lock, message: tuple) -> None:
    """Pickle outside the lock (a weight update takes a while), then send whole under it."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    with lock:
        conn.send_bytes(data)


def _serve(conn: Any, model_class: type, model_config: Any, state: dict[str, torch.Tensor],
           config: EngineConfig, version: int) -> None:
    """The child: build the model, run a LocalEngine, answer the parent until it closes or goes away."""
    parent = os.getppid()

    def watch_parent() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)  # adopted: the parent died without closing the pipe, and nobody is left to answer

    threading.Thread(target=watch_parent, name="parent-watch", daemon=True).start()
    torch.set_num_threads(config.threads or 1)
    model = model_class(model_config)
    model.load_state_dict(state, strict=True)
    lock = threading.Lock()

    def reply(rid: int, future: Future[Generation]) -> None:
        error = future.exception()
        try:
            _send(conn, lock,
                  ("done", rid, future.result()) if error is None else ("error", rid, EngineError(str(error))))
        except OSError:  # the parent is gone
            pass

    def token(rid: int, token_id: int, logprob: float) -> None:  # from the engine's loop: never raises
        try:
            _send(conn, lock, ("token", rid, token_id, logprob))
        except OSError:  # the parent is gone
            pass

    def update(uid: int, weights: Mapping[str, torch.Tensor], new_version: int, timeout_s: float) -> None:
        try:
            engine.update_weights(weights, new_version, timeout_s)
            _send(conn, lock, ("updated", uid, None))
        except Exception as exc:  # noqa: BLE001 -- reported to the caller, who raises it
            _send(conn, lock, ("updated", uid, EngineError(str(exc))))

    with LocalEngine(model, config, version) as engine:
        _send(conn, lock, ("ready",))
        while True:
            try:
                message = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                return  # the parent closed the pipe or died
            kind = message[0]
            if kind == "submit":
                _, rid, prompt, params, stream = message
                if stream:
                    params = dataclasses.replace(params, on_token=lambda t, lp, rid=rid: token(rid, t, lp))
                try:
                    engine.submit(prompt, params).add_done_callback(lambda f, rid=rid: reply(rid, f))
                except Exception as exc:  # noqa: BLE001 -- the parent checked it; anything left is reported
                    _send(conn, lock, ("error", rid, EngineError(str(exc))))
            elif kind == "counters":
                _send(conn, lock, ("counters", message[1], engine.counters()))
            elif kind == "update":  # applied by the loop at a step boundary; meanwhile keep taking requests
                threading.Thread(target=update, args=message[1:], daemon=True).start()
            elif kind == "close":
                engine.close()  # in-flight requests finish as "aborted", their replies go out first
                _send(conn, lock, ("closed",))
                return


class ProcessEngine:
    """`Engine` whose LocalEngine runs in a spawned child process (see the module docstring)."""

    def __init__(self, model: PreTrainedModel, config: EngineConfig | None = None, version: int = 0,
                 start_timeout_s: float = 300.0):
        self.config = config or EngineConfig()
        self._version = version
        self._vocab = model.get_input_embeddings().num_embeddings
        # Two locks: the reader thread takes only `_lock` (the tables), never held while sending, so
        # it always drains the child's replies and a large send cannot deadlock against them.
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._futures: dict[int, Future[Generation]] = {}
        self._on_token: dict[int, Any] = {}  # request id -> its params.on_token (streamed requests)
        self._updates: dict[int, Future[Any]] = {}  # weight updates and counters asked for, by id
        self._ids = itertools.count()
        self._error: str | None = None
        self._closed = False
        self._ready = threading.Event()
        self._closed_ack = threading.Event()
        context = multiprocessing.get_context("spawn")  # a fork would copy the parent's threads' locks
        self._conn, child = context.Pipe()
        # Copies: spawn pickles the arguments with multiprocessing's pickler, which would move the
        # model's own tensors into shared memory.
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self._process = context.Process(target=_serve, name="engine", daemon=True,
                                        args=(child, type(model), model.config, state, self.config, version))
        self._process.start()
        child.close()
        self._reader = threading.Thread(target=self._read, name="engine-reader", daemon=True)
        self._reader.start()
        if not self._ready.wait(start_timeout_s):
            self._process.kill()
            raise EngineError(f"engine process did not start within {start_timeout_s:.0f} s")
        if self._error is not None:  # a spawned child re-imports the main script: guard it with __main__
            raise EngineError(f"engine process failed to start: {self._error}; see its traceback above")

    @property
    def version(self) -> int:
        return self._version

    @property
    def pid(self) -> int | None:
        """The child process's id (to account its CPU time, as bench/rl_throughput.py does)."""
        return self._process.pid

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams) -> Future[Generation]:
        check_request(prompt_ids, params, self._vocab)
        future: Future[Generation] = Future()
        with self._lock:
            self._check_alive()
            rid = next(self._ids)
            self._futures[rid] = future
            if params.on_token is not None:
                self._on_token[rid] = params.on_token
        stream = params.on_token is not None
        self._send(("submit", rid, list(prompt_ids), dataclasses.replace(params, on_token=None), stream))
        return future

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Generation]:
        futures = [self.submit(p, params) for p in prompts]
        return [f.result() for f in futures]

    def update_weights(self, weights: Mapping[str, torch.Tensor] | WeightDelta, version: int,
                       timeout_s: float = 60.0) -> None:
        check_delta(weights, self._version)
        done: Future[None] = Future()
        state = weights if isinstance(weights, WeightDelta) else {k: v.detach() for k, v in weights.items()}
        with self._lock:
            self._check_alive()
            uid = next(self._ids)
            self._updates[uid] = done
        self._send(("update", uid, state, version, timeout_s))
        try:
            done.result(timeout=timeout_s + 5.0)  # the child waits timeout_s for its loop; then the pipe
        except TimeoutError:
            raise EngineError(f"weight update to version {version} not acknowledged within {timeout_s + 5.0:.0f} s; "
                              "the engine process is stuck") from None
        self._version = version

    def counters(self, timeout_s: float = 30.0) -> dict[str, float]:
        """The child's `LocalEngine.counters()`, asked over the pipe (answered between its requests)."""
        reply: Future[dict[str, float]] = Future()
        with self._lock:
            self._check_alive()
            uid = next(self._ids)
            self._updates[uid] = reply
        self._send(("counters", uid))
        try:
            return reply.result(timeout=timeout_s)
        except TimeoutError:
            raise EngineError(f"engine counters not answered within {timeout_s:.0f} s; the engine process is "
                              "stuck") from None

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            alive = self._error is None
        if alive:
            try:
                _send(self._conn, self._send_lock, ("close",))
                self._closed_ack.wait(15.0)
            except OSError:
                pass
        self._process.join(timeout=10.0)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        self._conn.close()
        self._fail_all("engine is closed")

    def __enter__(self) -> ProcessEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals ----

    def _check_alive(self) -> None:  # caller holds the lock
        if self._error is not None:
            raise EngineError(f"engine process failed: {self._error}; build a new engine")
        if self._closed:
            raise EngineError("engine is closed; build a new one")

    def _send(self, message: tuple) -> None:
        try:
            _send(self._conn, self._send_lock, message)
        except OSError as exc:  # the pipe broke: the child is gone
            reason = f"the engine process exited (code {self._process.exitcode}; {exc!r})"
            self._fail_all(reason)
            raise EngineError(f"engine process failed: {reason}") from exc

    def _read(self) -> None:
        while True:
            try:
                message = pickle.loads(self._conn.recv_bytes())
            except (EOFError, OSError):
                if not self._closed:
                    self._process.join(timeout=1.0)
                    self._fail_all(f"the engine process exited (code {self._process.exitcode})")
                self._ready.set()
                return
            kind = message[0]
            if kind == "ready":
                self._ready.set()
            elif kind == "closed":
                self._closed_ack.set()
            elif kind == "token":
                with self._lock:
                    on_token = self._on_token.get(message[1])
                if on_token is not None:
                    on_token(message[2], message[3])
            elif kind in ("done", "error"):
                with self._lock:
                    future = self._futures.pop(message[1], None)
                    self._on_token.pop(message[1], None)
                if future is not None and kind == "done":
                    future.set_result(message[2])
                elif future is not None:
                    future.set_exception(message[2])
            elif kind == "updated":
                with self._lock:
                    done = self._updates.pop(message[1], None)
                if done is not None and message[2] is None:
                    done.set_result(None)
                elif done is not None:
                    done.set_exception(message[2])
            elif kind == "counters":
                with self._lock:
                    reply = self._updates.pop(message[1], None)
                if reply is not None:
                    reply.set_result(message[2])

    def _fail_all(self, reason: str) -> None:
        with self._lock:
            if self._error is None and not self._closed:
                self._error = reason
            futures, self._futures = list(self._futures.values()) + list(self._updates.values()), {}
            self._updates, self._on_token = {}, {}
        for future in futures:
            if not future.done():
                future.set_exception(EngineError(reason))


def start_engine(model: PreTrainedModel | None, config: EngineConfig | None = None, version: int = 0,
                 checkpoint: str | Path | None = None) -> Engine:
    """The engine `config` asks for: in this process (`LocalEngine`), its own (`ProcessEngine`), or
    vLLM servers on the checkpoint folder `checkpoint` (`VLLMEngine`, `backend = "vllm"`; `model` unused)."""
    config = config or EngineConfig()
    if config.backend == "vllm":
        if checkpoint is None:
            raise ValueError("engine.backend = \"vllm\" serves a checkpoint folder: pass checkpoint=")
        from flywheel.model.vllm_engine import VLLMEngine  # noqa: PLC0415  (httpx and the servers only when asked)

        return VLLMEngine(checkpoint, config.vllm, version)
    if model is None:
        raise ValueError("the local engine needs the model")
    return ProcessEngine(model, config, version) if config.separate_process else LocalEngine(model, config, version)
