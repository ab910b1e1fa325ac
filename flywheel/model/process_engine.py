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
request raises at the call, not in the child.

If the child dies (killed, out of memory), the reader thread starts another in its place
(`EngineConfig.process_restarts` times in the engine's life), with the latest weights: the last
whole state dict sent and the deltas since, kept pickled in the parent. Every request in flight is
sent to it again: a streamed one as its prompt and the tokens already streamed (the child sends
each token with the version that sampled it, so those keep theirs; the result is those tokens and
the new child's), any other from its prompt, its tokens never having left the dead child. So no
token reaches a caller twice or under another version, and an RL run's episodes go on as after a
Ray engine's death (flywheel/rl/ray_engine.py); what is lost is the dead child's KV (its sessions
prefill whole again) and the tokens it sampled and did not send. A weight update the dead child did
not acknowledge is done (the new child starts with it); one asked for while the new child starts
is sent to it once it is ready. A replacement that dies before it is ready counts as a restart too.
With the restarts spent, every waiting future and any later call fails with `EngineError` saying so.
The weights go to a new child over the pipe, not with the process's arguments (`_start_child`).

If the parent dies, the child exits: it sees the pipe close, or, when a process the parent forked
still holds the pipe's other end (a sandbox's supervisor), it sees itself adopted by another parent
within half a second (SIGTERM skips the parent's `close`).
The child is spawned, not forked (a fork would copy the locks of the parent's threads), so a script
that starts one must keep its work under `if __name__ == "__main__":`.
"""

from __future__ import annotations

import dataclasses
import itertools
import multiprocessing
import os
import pickle
import sys
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


def _serve(conn: Any, model_class: type, model_config: Any, config: EngineConfig) -> None:
    """The child: build the model from the weights the parent sends first (a pickled state dict of
    a version, and the deltas since), run a LocalEngine, answer the parent until it closes or goes away."""
    parent = os.getppid()

    def watch_parent() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)  # adopted: the parent died without closing the pipe, and nobody is left to answer

    threading.Thread(target=watch_parent, name="parent-watch", daemon=True).start()
    try:
        _, weights, deltas, version = pickle.loads(conn.recv_bytes())
    except (EOFError, OSError):
        return  # the parent gave up on this child before sending them
    torch.set_num_threads(config.threads or 1)
    model = model_class(model_config)
    model.load_state_dict(pickle.loads(weights), strict=True)
    lock = threading.Lock()

    def reply(rid: int, future: Future[Generation]) -> None:
        error = future.exception()
        try:
            _send(conn, lock,
                  ("done", rid, future.result()) if error is None else ("error", rid, EngineError(str(error))))
        except OSError:  # the parent is gone
            pass

    def token(rid: int, token_id: int, logprob: float) -> None:  # from the engine's loop: never raises
        try:  # the engine's version now is the token's (the loop swaps weights between its steps)
            _send(conn, lock, ("token", rid, token_id, logprob, engine.version))
        except OSError:  # the parent is gone
            pass

    def update(uid: int, weights: bytes, new_version: int, timeout_s: float) -> None:
        try:
            engine.update_weights(pickle.loads(weights), new_version, timeout_s)
            _send(conn, lock, ("updated", uid, None))
        except Exception as exc:  # noqa: BLE001 -- reported to the caller, who raises it
            _send(conn, lock, ("updated", uid, EngineError(str(exc))))

    with LocalEngine(model, config, version) as engine:
        for delta, delta_version in deltas:  # a restarted child: the updates since the last whole weights
            engine.update_weights(pickle.loads(delta), delta_version)
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


@dataclasses.dataclass
class _Request:
    """A request in flight, as the parent keeps it to send again to a restarted child."""
    prompt: list[int]
    params: SamplingParams  # without on_token (a function does not cross the pipe)
    on_token: Any  # the caller's, or None: then the child streams nothing for it
    future: Future[Generation]
    ids: list[int] = dataclasses.field(default_factory=list)  # streamed so far, each with its logprob and version
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    resumed: int = 0  # of those, sampled by children that died before it finished: the result's head


class ProcessEngine:
    """`Engine` whose LocalEngine runs in a spawned child process (see the module docstring)."""

    def __init__(self, model: PreTrainedModel, config: EngineConfig | None = None, version: int = 0,
                 start_timeout_s: float = 300.0):
        self.config = config or EngineConfig()
        self._version = version
        self._vocab = model.get_input_embeddings().num_embeddings
        self._model_class, self._model_config = type(model), model.config
        self._start_timeout_s = start_timeout_s
        # Two locks: the reader thread takes only `_lock` (the tables), never held while sending, so
        # it always drains the child's replies and a large send cannot deadlock against them.
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._requests: dict[int, _Request] = {}
        # weight updates (with what they sent) and counters asked for, by id
        self._pending: dict[int, tuple[str, Future[Any], tuple]] = {}
        self._ids = itertools.count()
        self._error: str | None = None
        self._closed = False
        self._restarting = False  # a child died and the next is starting: requests wait for it
        self.restarts = 0  # children started in a dead one's place (those that died starting included)
        self.resent = 0  # requests in flight at a death, sent again to the next child
        self._closed_ack = threading.Event()
        # What a restarted child starts from: the last whole weights sent and the deltas since
        # (pickled once, as they were sent), with their versions.
        self._weights = pickle.dumps({k: v.detach() for k, v in model.state_dict().items()},
                                     protocol=pickle.HIGHEST_PROTOCOL)
        self._weights_version, self._deltas = version, []
        self._process, self._conn = self._start_child(self._weights, [], version)
        if self.config.process_restarts == 0:
            self._weights = b""
        self._reader = threading.Thread(target=self._read, name="engine-reader", daemon=True)
        self._reader.start()

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
        request = _Request(list(prompt_ids), dataclasses.replace(params, on_token=None), params.on_token, future)
        with self._lock:
            self._check_alive()
            rid = next(self._ids)
            self._requests[rid] = request
            conn = None if self._restarting else self._conn  # else the restart sends it
        if conn is not None:
            self._send_request(conn, rid, request)
        return future

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Generation]:
        futures = [self.submit(p, params) for p in prompts]
        return [f.result() for f in futures]

    def update_weights(self, weights: Mapping[str, torch.Tensor] | WeightDelta, version: int,
                       timeout_s: float = 60.0) -> None:
        check_delta(weights, self._version)
        done: Future[None] = Future()
        state = weights if isinstance(weights, WeightDelta) else {k: v.detach() for k, v in weights.items()}
        data = pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            self._check_alive()
            uid = next(self._ids)
            message = ("update", uid, data, version, timeout_s)
            self._pending[uid] = ("update", done, message)
            if self.config.process_restarts == 0:
                pass  # no child will start again: nothing to keep
            elif isinstance(weights, WeightDelta):
                self._deltas.append((data, version))
            else:
                self._weights, self._weights_version, self._deltas = data, version, []
            conn = None if self._restarting else self._conn  # else the restarted child starts with them
        if conn is not None:
            self._send(conn, message)
        try:
            done.result(timeout=timeout_s + 5.0)  # the child waits timeout_s for its loop; then the pipe
        except TimeoutError:
            raise EngineError(f"weight update to version {version} not acknowledged within {timeout_s + 5.0:.0f} s; "
                              "the engine process is stuck") from None
        self._version = version

    def counters(self, timeout_s: float = 30.0) -> dict[str, float]:
        """The child's `LocalEngine.counters()`, asked over the pipe (answered between its requests).
        A restarted child counts from 0 again (`flywheel.timing.delta` reads that as a restart)."""
        reply: Future[dict[str, float]] = Future()
        with self._lock:
            self._check_alive()
            uid = next(self._ids)
            message = ("counters", uid)
            self._pending[uid] = ("counters", reply, message)
            conn = None if self._restarting else self._conn  # else the restart asks the new child
        if conn is not None:
            self._send(conn, message)
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
            alive = self._error is None and not self._restarting
            conn = self._conn
        if alive:
            try:
                _send(conn, self._send_lock, ("close",))
                self._closed_ack.wait(15.0)
            except OSError:
                pass
        self._process.join(timeout=10.0)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        conn.close()
        self._fail_all("engine is closed")

    def __enter__(self) -> ProcessEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals ----

    def _start_child(self, weights: bytes, deltas: list[tuple[bytes, int]], version: int) -> tuple[Any, Any]:
        """Spawn a child with these weights (of `version`, then `deltas`) and wait for its "ready";
        EngineError if it dies first."""
        context = multiprocessing.get_context("spawn")  # a fork would copy the parent's threads' locks
        conn, child = context.Pipe()
        # The weights go over the pipe, not with the process's arguments: spawn writes those into a pipe
        # whose reading end it holds itself until the write is done, so a child that died before reading
        # them all (killed while it imports torch) would leave that write, and this call, blocked for good.
        process = context.Process(target=_serve, name="engine", daemon=True,
                                  args=(child, self._model_class, self._model_config, self.config))
        process.start()
        child.close()
        # In a thread of its own: it blocks until the child reads it, and fails once the child is gone.
        load = threading.Thread(target=self._send, args=(conn, ("load", weights, deltas, version), threading.Lock()),
                                name="engine-load", daemon=True)
        load.start()
        try:
            if not conn.poll(self._start_timeout_s):
                raise EngineError(f"engine process did not start within {self._start_timeout_s:.0f} s")
            if pickle.loads(conn.recv_bytes()) != ("ready",):
                raise EngineError("engine process sent something before it was ready")
        except (EOFError, OSError, EngineError) as exc:
            process.kill()
            process.join()
            load.join(timeout=10.0)  # its send fails once the child is gone; then the pipe can close
            conn.close()
            if isinstance(exc, EngineError):
                raise
            if process.exitcode is not None and process.exitcode < 0:
                raise EngineError(f"engine process died before it was ready (code {process.exitcode})") from None
            # a spawned child re-imports the main script: guard it with __main__
            raise EngineError(f"engine process failed to start (exit code {process.exitcode}); see its traceback "
                              "above") from None
        return process, conn

    def _check_alive(self) -> None:  # caller holds the lock
        if self._error is not None:
            raise EngineError(f"engine process failed: {self._error}; build a new engine")
        if self._closed:
            raise EngineError("engine is closed; build a new one")

    def _send(self, conn: Any, message: tuple, lock: threading.Lock | None = None) -> None:
        """Send to the child on `conn`; a broken pipe is left to the reader, which sees the child's
        death and starts another (or fails every request): what was sent is sent again there."""
        try:
            _send(conn, lock or self._send_lock, message)
        except OSError:
            pass

    def _send_request(self, conn: Any, rid: int, request: _Request) -> None:
        done = len(request.ids)  # a restart: the tokens streamed before it are the prompt's tail now
        params = request.params if not done else dataclasses.replace(request.params,
                                                                     max_tokens=request.params.max_tokens - done)
        self._send(conn, ("submit", rid, request.prompt + request.ids, params, request.on_token is not None))

    def _read(self) -> None:
        while True:
            try:
                message = pickle.loads(self._conn.recv_bytes())
            except (EOFError, OSError):
                if self._closed or not self._restart():
                    return
                continue
            kind = message[0]
            if kind == "closed":
                self._closed_ack.set()
            elif kind == "token":
                with self._lock:
                    request = self._requests.get(message[1])
                if request is not None:
                    request.ids.append(message[2])
                    request.logprobs.append(message[3])
                    request.versions.append(message[4])
                    request.on_token(message[2], message[3])
            elif kind in ("done", "error"):
                with self._lock:
                    request = self._requests.pop(message[1], None)
                if request is None:
                    continue
                if kind == "error":
                    request.future.set_exception(message[2])
                    continue
                gen: Generation = message[2]
                if request.resumed:  # the head was sampled by a child that died: its tokens keep their versions
                    k = request.resumed
                    gen = Generation(request.ids[:k] + gen.token_ids, request.logprobs[:k] + gen.logprobs,
                                     request.versions[:k] + gen.versions, gen.finish_reason, None,
                                     gen.routed_experts, gen.routed_from)
                request.future.set_result(gen)
            elif kind in ("updated", "counters"):
                with self._lock:
                    _, reply, _ = self._pending.pop(message[1], (None, None, None))
                if reply is None:
                    continue
                if kind == "counters":
                    reply.set_result(message[2])
                elif message[2] is None:
                    reply.set_result(None)
                else:
                    reply.set_exception(message[2])

    def _restart(self) -> bool:
        """The child died: start another with the latest weights and send it every request in flight
        (a streamed one as its prompt and the tokens streamed so far, for the tokens still owed: those
        keep the versions they were sampled under). A replacement that dies before it is ready counts
        as a restart too. False (every request failed) once the restarts are spent."""
        self._process.join(timeout=1.0)
        reason = f"the engine process exited (code {self._process.exitcode})"
        while True:  # a replacement that dies before it is ready is a death too: another takes its place
            with self._lock:
                if self._closed:
                    return False
                if self.restarts >= self.config.process_restarts:
                    spent = f"; {self.restarts} restarts spent (engine.process_restarts)" if self.restarts else ""
                    self._restarting = False
                    self._error = reason + spent
                    failed = True
                else:
                    self._restarting, failed = True, False
                    self.restarts += 1
                # what the new child starts with; a weight update asked for after this is sent to it once ready
                weights, deltas, version, since = (self._weights, list(self._deltas), self._weights_version,
                                                   next(self._ids))
            if failed:
                self._fail_all(self._error)
                return False
            latest = deltas[-1][1] if deltas else version
            print(f"engine: {reason}; starting another with the weights of version {latest}", file=sys.stderr,
                  flush=True)
            try:
                process, conn = self._start_child(weights, deltas, version)
                break
            except EngineError as exc:
                reason = f"its replacement failed: {exc}"
        finished: list[tuple[Future[Any], Any, BaseException | None]] = []  # completed outside the lock
        with self._lock:
            if self._closed:  # closed while the new child started: nobody will ask it anything
                process.kill()
                conn.close()
                return False
            self._conn.close()
            self._process, self._conn = process, conn
            self._restarting = False
            resend: list[tuple[int, _Request]] = []
            for rid, request in list(self._requests.items()):
                request.resumed = len(request.ids)
                owed = request.params.max_tokens - len(request.ids)
                if request.ids and (request.ids[-1] in request.params.stop_token_ids or owed <= 0):
                    del self._requests[rid]  # its last token was streamed; only the reply was lost
                    finished.append((request.future, Generation(request.ids, request.logprobs, request.versions,
                                                                "length" if owed <= 0 else "stop"), None))
                elif request.ids and request.params.top_logprobs:
                    del self._requests[rid]  # the streamed tokens' alternatives died with the child
                    finished.append((request.future, None, EngineError(f"{reason} after {len(request.ids)} tokens "
                                                                       "of a streamed request with top_logprobs")))
                else:
                    resend.append((rid, request))
            # updates asked for before the new child's weights were taken: it started with them
            for uid in [u for u, (kind, _, _) in self._pending.items() if kind == "update" and u < since]:
                finished.append((self._pending.pop(uid)[1], None, None))
            # counters asked of the dead child (the new one's count from 0: `flywheel.timing.delta` reads a
            # restart), and updates asked for while it started, in the order they were asked
            again = [message for _, _, message in self._pending.values()]
        for future, result, error in finished:
            if error is None:
                future.set_result(result)
            else:
                future.set_exception(error)
        for message in again:
            self._send(conn, message)
        self.resent += len(resend)
        for rid, request in resend:
            self._send_request(conn, rid, request)
        return True

    def _fail_all(self, reason: str) -> None:
        with self._lock:
            if self._error is None and not self._closed:
                self._error = reason
            futures = [r.future for r in self._requests.values()] + [f for _, f, _ in self._pending.values()]
            self._requests, self._pending = {}, {}
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
