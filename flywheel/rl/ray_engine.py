"""Inference engines as Ray actors of their own, and the Engine that rollout workers call them through.

    rollout worker i (actor)                                  EngineActor j (one per node, placement bundle j)
    ┌────────────────────────────────────────┐               ┌──────────────────────────────────────────┐
    │ run_episode ── submit ──> RayEngine ───┼─ generate ───>│ LocalEngine: continuous batching, KV     │
    │   future <── Generation (merged) ──────┼<─ ("tokens",  │ cache, every token stamped with the      │
    │                                        │    ids, logprobs, versions) every token_stream_s,        │
    │                                        │    then ("done", Generation)                             │
    └────────────────────────────────────────┘               │ update_weights(ref, v): the store's copy │
    driver (RayRollouts): update_weights(ref, v) ───────────>└──────────────────────────────────────────┘
    to every live engine; watches every engine (`alive`, a call that returns only when the actor dies),
    starts a new one in its place with the latest weights, and hands it to every worker (`engine_ready`).

What waits for what:
- A request is one streaming call. The worker's RayEngine waits for its next chunk at most
  `cluster.engine_timeout_s` (below `actor_timeout_s`, so a hung engine is named before the worker
  that waits on it); then `ActorHung` names the engine, its node and pid.
- Chunks carry what was sampled so far, with each token's version. When the engine dies mid-request
  (`RayActorError`), the request goes again to another live engine as prompt + tokens so far, for
  the tokens still owed; those tokens keep their versions and logprobs, the rest are the new
  engine's. `engine_resubmits` counts such requests. The tokens sampled after the last chunk were
  never returned, so they are sampled again, never trained twice.
- A weight update is one call per live engine from the driver with a reference to the learner's
  weights in the object store; each engine fetches the one copy, swaps at its next step boundary
  and stamps later tokens with the new version. An engine being replaced misses it and is brought
  to the latest version before it is handed to the workers.

What it does not cover:
- An engine's death costs its sessions' KV and its prompt cache: resubmitted requests prefill whole.
- Requests of one worker go to its home engine only while it lives; there is no load balancing
  between live engines.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import ray
import torch
from ray.exceptions import ObjectLostError, RayActorError
from transformers import PreTrainedTokenizerBase

from flywheel.model.engine import EngineConfig, Generation, LocalEngine, SamplingParams
from flywheel.model.weight_delta import WeightDelta, weights_digest
from flywheel.rl.cluster import ClusterConfig

DIED = (RayActorError, ObjectLostError)  # what a call to a dead actor (or to one on a dead node) raises


class ActorHung(RuntimeError):
    """An actor did not answer within its configured timeout; the message names it."""


def describe(where: Mapping[str, Any], kind: str = "engine") -> str:
    return f"{kind} {where.get('name', '?')} (node {str(where.get('node_id', '?'))[:8]}, pid {where.get('pid', '?')})"


class EngineActor:
    """One LocalEngine (or a modeled one, `engine_factory`) in an actor of its own."""

    def __init__(self, name: str, model_class: type, model_config: Any, state: Mapping[str, torch.Tensor],
                 engine: EngineConfig, version: int, tokenizer: PreTrainedTokenizerBase,
                 engine_factory: Callable[[PreTrainedTokenizerBase, int], Any] | None = None,
                 token_stream_s: float = 0.2):
        torch.set_num_threads(engine.threads or 1)
        self.name, self.token_stream_s = name, token_stream_s
        if engine_factory is not None:  # another Engine (bench/ray_scale.py: a modeled accelerator)
            self.engine = engine_factory(tokenizer, version)
        else:
            model = model_class(model_config)
            model.load_state_dict(state, strict=True)
            self.engine = LocalEngine(model.eval(), engine, version)
        self._closed = threading.Event()

    def where(self) -> dict[str, Any]:
        context = ray.get_runtime_context()
        return {"name": self.name, "node_id": context.get_node_id(), "pid": os.getpid(),
                "actor_id": context.get_actor_id(), "version": self.engine.version}

    def alive(self) -> None:
        """Returns only when the actor closes; the driver holds this call to learn of its death."""
        self._closed.wait()

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams):
        """Yield ("tokens", ids, logprobs, versions) as they are sampled (at most one chunk per
        `token_stream_s`: each chunk is a store object, and a chunk per token would cost more than
        the decode step), then ("done", Generation)."""
        sampled: queue.SimpleQueue[tuple[int, float, int] | None] = queue.SimpleQueue()

        def on_token(token: int, logprob: float) -> None:  # the engine's loop: its version is this token's
            sampled.put((token, logprob, self.engine.version))

        future = self.engine.submit(prompt_ids, dataclasses.replace(params, on_token=on_token))
        future.add_done_callback(lambda _: sampled.put(None))  # after the last token's on_token
        done = False
        while not done:
            chunk = [sampled.get()]
            deadline = time.monotonic() + self.token_stream_s
            while chunk[-1] is not None and (left := deadline - time.monotonic()) > 0:
                try:
                    chunk.append(sampled.get(timeout=left))
                except queue.Empty:
                    break
            done = chunk[-1] is None
            tokens = [c for c in chunk if c is not None]
            if tokens:
                yield "tokens", [t[0] for t in tokens], [t[1] for t in tokens], [t[2] for t in tokens]
        yield "done", future.result()

    def update_weights(self, weights: Mapping[str, torch.Tensor] | WeightDelta, version: int, timeout_s: float) -> int:
        """Swap in `weights` (a state dict, or a `WeightDelta` against this engine's version: else
        ValueError, and the driver sends the whole weights) as `version`; returns the version held."""
        if version != self.engine.version:  # a replaced engine may be sent the version it started with
            self.engine.update_weights(weights, version, timeout_s=timeout_s)
        return self.engine.version

    def weights_digest(self) -> str:
        """The hash of the weights this engine holds (`weight_delta.weights_digest`): equal on two
        engines, or to that of a state dict, means bit-identical weights."""
        return weights_digest(self.engine.model.state_dict())

    def close(self) -> None:
        self.engine.close()
        self._closed.set()


def start_engine_actor(options: dict[str, Any], name: str, model_class: type, model_config: Any, state: Any,
                       engine: EngineConfig, version: int, tokenizer: PreTrainedTokenizerBase,
                       engine_factory: Any, cluster: ClusterConfig) -> Any:
    """An EngineActor with the given Ray options (placement, name); `state` may be a store reference."""
    return ray.remote(EngineActor).options(
        name=name, num_cpus=cluster.engine_cpus, max_restarts=0,
        # every worker's requests may come here when their own engine dies; + 8: updates, stats, alive
        max_concurrency=cluster.episodes_per_worker * cluster.rollout_workers + 8, **options,
    ).remote(name, model_class, model_config, state, engine, version, tokenizer, engine_factory,
             cluster.token_stream_s)


class RayEngine:
    """What an episode calls of an Engine (submit, close) over the run's EngineActors, for one
    rollout worker: its requests go to its home engine (the one on its node), and while that one is
    dead, to the live others. The driver replaces dead engines (`engine_ready`) and sends every
    weight update to every engine itself, so an engine whose worker is gone keeps up too."""

    def __init__(self, engines: Sequence[Any], where: Sequence[Mapping[str, Any]], home: int,
                 cluster: ClusterConfig):
        self.cluster, self.home = cluster, home
        self._engines, self._where = list(engines), [dict(w) for w in where]
        self._alive = set(range(len(self._engines)))
        self._cond = threading.Condition()
        self._next = 0
        self.resubmits = 0
        self._threads = ThreadPoolExecutor(cluster.episodes_per_worker + 4, thread_name_prefix="engine-request")

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams) -> Future[Generation]:
        return self._threads.submit(self._generate, list(prompt_ids), params)

    def engine_ready(self, i: int, engine: Any, where: Mapping[str, Any]) -> None:
        """Engine i has started (at the run's start, or in a dead one's place): where it is, and it serves."""
        with self._cond:
            self._engines[i], self._where[i] = engine, dict(where)
            self._alive.add(i)
            self._cond.notify_all()

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)

    # ---- internals ------------------------------------------------------------------------------------

    def _generate(self, prompt: list[int], params: SamplingParams) -> Generation:
        on_token = params.on_token  # called here: a function does not travel to the engine's process
        params = dataclasses.replace(params, on_token=None)
        ids: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        while True:
            i, engine, where = self._pick()
            before = len(ids)
            stream = engine.generate.remote(prompt + ids, dataclasses.replace(params, max_tokens=params.max_tokens
                                                                              - before))
            try:
                while True:
                    ready, _ = ray.wait([stream], timeout=self.cluster.engine_timeout_s)
                    if not ready:
                        raise ActorHung(f"{describe(where)} sent no token for {self.cluster.engine_timeout_s:.0f} s "
                                        "(cluster.engine_timeout_s); inspect it (`ray stack`, py-spy) or raise "
                                        "the timeout if its queue is that long")
                    try:
                        item = ray.get(next(stream))
                    except StopIteration:
                        raise RuntimeError(f"{describe(where)} ended a request without a result") from None
                    if item[0] == "done":
                        gen: Generation = item[1]
                        if on_token is not None:
                            for token, lp in zip(gen.token_ids[len(ids) - before:], gen.logprobs[len(ids) - before:],
                                                 strict=True):
                                on_token(token, lp)
                        # the resubmitted prompt starts with the original one: its routing's positions are the same
                        return Generation(ids[:before] + gen.token_ids, logprobs[:before] + gen.logprobs,
                                          versions[:before] + gen.versions, gen.finish_reason,
                                          gen.top_logprobs if not before else None, gen.routed_experts,
                                          gen.routed_from)
                    _, chunk_ids, chunk_logprobs, chunk_versions = item
                    ids += chunk_ids
                    logprobs += chunk_logprobs
                    versions += chunk_versions
                    if on_token is not None:
                        for token, lp in zip(chunk_ids, chunk_logprobs, strict=True):
                            on_token(token, lp)
            except DIED:
                self._died(i, engine)
                with self._cond:
                    self.resubmits += 1
                # its engine died with the routing of this request's positions: none recorded
                routed = (dict(routed_experts=[], routed_from=len(prompt) + len(ids) - 1) if params.routed_experts
                          else {})
                if ids and ids[-1] in params.stop_token_ids:
                    return Generation(ids, logprobs, versions, "stop", **routed)
                if len(ids) >= params.max_tokens:
                    return Generation(ids, logprobs, versions, "length", **routed)

    def _pick(self) -> tuple[int, Any, dict[str, Any]]:
        """The home engine if it lives, else the live others in turn; none: wait for a replacement."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._alive, timeout=self.cluster.start_timeout_s):
                raise RuntimeError(f"no inference engine came back within {self.cluster.start_timeout_s:.0f} s "
                                   "(cluster.start_timeout_s); the cluster may have no room for a new one")
            if self.home in self._alive:
                i = self.home
            else:
                others = sorted(self._alive)
                i = others[self._next % len(others)]
                self._next += 1
            return i, self._engines[i], self._where[i]

    def _died(self, i: int, engine: Any) -> None:
        with self._cond:
            if self._engines[i] is engine:  # not a replacement that arrived meanwhile
                self._alive.discard(i)
