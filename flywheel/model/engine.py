"""The inference Engine: batched sampling with a KV cache, continuous batching, live weight swaps.

    submit(prompt) ──> queue ──admit by priority (prefill, ≤ max_batch)──> active batch ──decode step──> finished?
                                  ^                                 │  every token: id, logprob, version
    update_weights(w, v) ──> pending ──(next step boundary)──> load w, rebuild KV of all active
                                                                     sequences under w (or keep it), resume

One background thread owns the model and runs the loop; `submit` and `update_weights` are safe
to call from any thread. Sequences join the batch as others finish (continuous batching), so a
long answer never holds a slot that a short one has left. A weight update pauses the loop between
two decode steps: in-flight sequences keep their tokens, their cache is recomputed under the new
weights (or kept as it is: `EngineConfig.kv_on_update`), and generation resumes; each token records
the version that produced it. When more requests wait than the batch has rows, the lowest
`SamplingParams.priority` is admitted first.

Logprobs are of the temperature-scaled distribution (log_softmax(logits / T)), before top-p, the
convention the Learner uses for importance ratios; with T=0 (greedy) they are of T=1.

The KV cache is left-padded: row i holds its tokens right-aligned, an attention mask marks the
padding, and position ids count real tokens only, so rows of different lengths decode together.
It is preallocated with headroom along time and written in place (`_KVLayer`), so a decode step
moves only the new keys and values, not a copy of the whole cache as `DynamicCache`'s concat
does. Rows leave and join in place too (`EngineConfig.rows_in_place`): a finished row's slot takes
the batch's last row, and a newcomer no wider than the batch is written into the room that leaves;
the whole cache is copied only for a newcomer wider than the batch, when leading padding reaches a
quarter of the width, and on a swap that rebuilds it. The engine's `counters()` say how its time
went: prefill and decode tokens and seconds, weight swaps.
Sampling is vectorized over the batch: no per-row Python sampling loop or per-row host syncs.

Sessions (`SamplingParams.session`): an agent's next turn is its whole conversation again, which
it would be wasteful to prefill from scratch each time. When a request with a session id finishes,
its row's KV is kept (LRU, `EngineConfig.session_cache`); the session's next request, if its prompt
extends those tokens, prefills only what is new on top of them. Kept KV is dropped on a weight swap
(it belongs to the old weights) unless `kv_on_update = "keep"`, and a prompt that does not extend
it is prefilled whole.

Prompt cache (`EngineConfig.prompt_cache`): the G episodes of a GRPO group start from one prompt.
A fresh prompt's KV is kept (LRU) for the same weights; an identical prompt, in the same admission
or later, copies it and prefills only its last token (for its own first logits). 32 first turns of
450 tokens in groups of 8 are admitted in a fifth of the time.

Prefills run the model's `transformers` forward; decode steps of a Qwen3 or Qwen3-MoE model run
`decode.LeanDecoder`, the same function in fewer and larger ops over the same KV buffers
(`EngineConfig.lean_decode`; 1.32x on whole agent conversations on 2 cores).

`Engine` is the small interface; `LocalEngine` implements it in-process, `ProcessEngine`
(`flywheel.model.process_engine`) runs a LocalEngine in a child process. An OpenAI-compatible
HTTP engine (vLLM, SGLang) can implement the same four methods.

Why one file of about 870 lines: one background loop owns the model, the KV cache and the batch;
admission, decoding, the weight swap and the counters all run on that thread and share its state,
so the loop reads top to bottom here rather than across modules that would each need its locks.
"""

from __future__ import annotations

import heapq
import itertools
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal, Protocol

import torch
from pydantic import BaseModel, ConfigDict, Field
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from flywheel.model.decode import LeanDecoder
from flywheel.model.routing import record_routing, routing_width
from flywheel.model.vllm_server import VLLMConfig
from flywheel.model.weight_delta import WeightDelta
from flywheel.timing import timed


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    max_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    # A multi-turn caller's conversation id. The engine keeps the KV cache of the session's last
    # request when it finishes; a next request of the session whose prompt extends those tokens
    # prefills only what is new (the tool results and the next turn's header), not the whole context.
    session: str | None = None
    # When more requests wait than the batch has free rows, lower priorities are admitted first
    # (ties in arrival order). An RL rollout gives older groups lower numbers: the learner waits on
    # the oldest groups, so the engine finishes those before it starts on newer ones.
    priority: int = 0
    # The request's own random stream: the same seed, prompt and parameters sample the same tokens
    # (at batch 1; in a batch the logits of a row can differ in their last bits with its neighbours).
    # None: the engine's shared stream.
    seed: int | None = None
    # Called from the engine's loop with (token id, logprob) as each token is sampled (the live
    # server's streaming). It must return at once and never raise. A ProcessEngine keeps it in the
    # parent and calls it from its reader thread with each token the child sends.
    on_token: Callable[[int, float], None] | None = field(default=None, compare=False)
    # Also return, at each sampled position, the k most likely tokens and their logprobs under the
    # same distribution as the sampled token's (OpenAI's top_logprobs; 0: none, at most 20).
    top_logprobs: int = 0
    # Also return the experts each MoE layer chose at every position this request fed through the model
    # (`Generation.routed_experts`, `flywheel.model.routing`): what the Learner replays with
    # `loss.routing_replay`. Costs a host copy of [rows, layers x k] ids per step.
    routed_experts: bool = False


@dataclass
class Generation:
    token_ids: list[int]
    logprobs: list[float]  # of each sampled token, under the weights of its version
    versions: list[int]  # the engine's version (Engine docstring) when each token was produced
    finish_reason: str  # "stop" (a stop token, included in token_ids), "length" or "aborted"
    # SamplingParams.top_logprobs > 0: per generated token, the (token id, logprob) of the k most likely
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # SamplingParams.routed_experts: for each position p from `routed_from` to the last fed one (the prompt's
    # and the generated tokens' but the newest, which was never fed), [layer 0's k expert ids, layer 1's, ...]
    # chosen with token p as input. Positions before `routed_from` came from KV computed for an earlier
    # request of the session, whose own record has them.
    routed_experts: list[list[int]] | None = None
    routed_from: int = 0


class Engine(Protocol):
    """`version` is the number its driver gives the weights, stamped on every token: the trainer's
    policy version in simulated RL (learner steps since the start checkpoint), the Registry version
    it serves in the live server (docs/ARCHITECTURE.md, "Versions: two names")."""

    @property
    def version(self) -> int: ...

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams) -> Future[Generation]: ...

    def update_weights(self, weights: Mapping[str, torch.Tensor], version: int, timeout_s: float = 60.0) -> None: ...

    def close(self) -> None: ...


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    max_batch: int = 32  # more rows amortize per-step overhead; each row costs KV memory
    max_prefill_per_step: int = 8  # admissions per step: bounds the stall a burst of prompts causes
    seed: int = 0
    # PyTorch intra-op threads of the engine's loop while it decodes (None: leave them alone).
    # Measured on 2 cores with the embedded default at batch 32: the decode loop ran at 4,000
    # tokens/s in the engine's thread with 2 OpenMP threads, 7,400 with 1 (8,100 with 2 in the
    # main thread: tiny ops from a second thread pay more for the fork-join than they gain).
    # The setting is not private to the engine's thread (threads started later inherit it), so
    # `_DecodeThreads` sets it only while some engine is busy and restores it once all are idle.
    threads: int | None = 1
    # Finished sessions whose KV cache is kept for their next request (least recently used dropped
    # first). Each costs its tokens' KV (about 1 MB per 1,000 tokens for the embedded default).
    # On 2 cores, re-prefilling every turn's whole context was half of an RL rollout's engine time.
    session_cache: int = Field(default=256, ge=0)
    # Fresh prompts whose KV is kept for an identical prompt (least recently used dropped first).
    # A GRPO group's G episodes start from one prompt: it is prefilled once and the others copy its
    # KV (a prefix cache, as vLLM's and SGLang's, for the exact prompt). Dropped on every weight swap,
    # so a reused prompt's KV is always of the current weights.
    prompt_cache: int = Field(default=64, ge=0)
    # What a weight swap does to the KV computed under the old weights (in-flight rows, kept sessions).
    # "recompute": rebuild it under the new weights, so each token is sampled from one version.
    # "keep": leave it (an in-flight update, as in PipelineRL): later tokens come from the new
    # weights reading old keys and values. Their logprobs are still those they were sampled with,
    # so the decoupled loss's behaviour weight stays exact, and a swap costs nothing. On 2 cores,
    # recomputing took a quarter of an async rollout's engine time (bench/async_rl.py).
    kv_on_update: Literal["recompute", "keep"] = "recompute"
    # Rows leave the batch and join it in place: a finished row's slot is filled by moving the last
    # row into it, and newcomers no wider than the batch are written into the room that leaves
    # (`_BatchCache.drop`, `append`). False: each change of the batch's rows copies its whole KV
    # cache (the path before; on 2 cores those copies were a tenth of an RL rollout's engine time).
    rows_in_place: bool = True
    # Run the engine in a process of its own (`process_engine.ProcessEngine`, through `start_engine`):
    # its decode loop then does not share the GIL with rollout threads and the learner.
    separate_process: bool = False
    # How many times such a process that died (killed, out of memory) is started again in its
    # engine's life, with the latest weights; the requests in flight go on there, a streamed one
    # from its last streamed token (those keep the versions that sampled them), the others from
    # their prompts. The parent keeps a pickled copy of the latest weights for it (8 MB for the
    # embedded default). 0: the first death fails every request and every later call.
    process_restarts: int = Field(default=3, ge=0)
    # Decode steps through `decode.LeanDecoder` (Qwen3 and Qwen3-MoE models; others always use the
    # `transformers` forward, as prefills do). False: the `transformers` forward for every step.
    lean_decode: bool = True
    # "local": LocalEngine (or ProcessEngine) in flywheel's own processes. "vllm": vLLM servers over
    # HTTP (`flywheel.model.vllm_engine.VLLMEngine`, configured by `vllm`); the fields above are
    # LocalEngine's and do not apply to it.
    backend: Literal["local", "vllm"] = "local"
    vllm: VLLMConfig = Field(default_factory=VLLMConfig)


def check_request(prompt_ids: Sequence[int], params: SamplingParams, vocab: int) -> None:
    """Raise ValueError for a request no engine should take (in its loop it would fail everyone's)."""
    if not prompt_ids:
        raise ValueError("empty prompt: an engine request needs at least one token")
    if params.max_tokens < 1:
        raise ValueError(f"max_tokens must be ≥ 1, got {params.max_tokens}")
    if params.temperature < 0 or not 0 < params.top_p <= 1:
        raise ValueError(f"need temperature ≥ 0 and 0 < top_p ≤ 1, got {params.temperature} and {params.top_p}")
    if not 0 <= params.top_logprobs <= 20:
        raise ValueError(f"top_logprobs must be between 0 and 20, got {params.top_logprobs}")
    if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
        bad = next(t for t in prompt_ids if not 0 <= t < vocab)
        raise ValueError(f"prompt token id {bad} is outside the model's vocabulary of {vocab}; "
                         "encode prompts with this model's tokenizer")


def check_delta(weights: Mapping[str, torch.Tensor] | WeightDelta, version: int) -> None:
    """Raise ValueError for a `WeightDelta` made against other weights than the engine's `version`."""
    if isinstance(weights, WeightDelta) and weights.base_version is not None and weights.base_version != version:
        raise ValueError(f"weight delta is against version {weights.base_version}, the engine holds {version}; send "
                         "a full update (DeltaSender.reset)")


class _DecodeThreads:
    """The intra-op thread count while any engine is busy, restored when all are idle
    (EngineConfig.threads). Called from the engines' loop threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._busy: dict[int, int] = {}  # id(engine) -> its thread count
        self._saved: int | None = None

    def busy(self, engine: object, threads: int | None) -> None:
        if threads is None:
            return
        with self._lock:
            if id(engine) in self._busy:
                return
            if not self._busy:
                self._saved = torch.get_num_threads()
            self._busy[id(engine)] = threads
            torch.set_num_threads(min(self._busy.values()))

    def idle(self, engine: object) -> None:
        with self._lock:
            if self._busy.pop(id(engine), None) is None:
                return
            if self._busy:
                torch.set_num_threads(min(self._busy.values()))
            elif self._saved is not None:
                torch.set_num_threads(self._saved)
                self._saved = None


DECODE_THREADS = _DecodeThreads()


@dataclass
class _Sequence:
    prompt: list[int]
    params: SamplingParams
    future: Future[Generation]
    tokens: list[int] = field(default_factory=list)  # prompt + generated; the last one is not yet cached
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)  # params.top_logprobs > 0
    routed: list[list[int]] = field(default_factory=list)  # params.routed_experts: Generation.routed_experts
    routed_from: int = 0

    @property
    def generated(self) -> list[int]:
        return self.tokens[len(self.prompt) :]

    @cached_property
    def generator(self) -> torch.Generator | None:
        """The request's own random stream (`SamplingParams.seed`), made on first use."""
        return None if self.params.seed is None else torch.Generator().manual_seed(self.params.seed)

    @cached_property
    def prompt_key(self) -> tuple[int, ...]:
        """The prompt as the prompt cache's key, built once per request."""
        return tuple(self.prompt)


class EngineError(RuntimeError):
    pass


class _KVLayer(DynamicLayer):
    """One layer's KV cache in a buffer [batch, kv_heads, capacity, head_dim] written in place.

    `update` writes the new keys and values at `length` and returns views of the first
    `length + new` positions, so the attention sees exactly what a concatenating cache would.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int):
        super().__init__()
        self.buf_k, self.buf_v, self.length = keys, values, length
        self.keys, self.values = keys[:, :, :length], values[:, :, :length]
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        end = self.length + key_states.shape[-2]
        if end > self.buf_k.shape[-2]:
            raise EngineError(f"KV cache overflow: {end} > capacity {self.buf_k.shape[-2]}; the engine must grow it "
                              "first")
        self.buf_k[:, :, self.length : end] = key_states
        self.buf_v[:, :, self.length : end] = value_states
        self.length = end
        self.keys, self.values = self.buf_k[:, :, :end], self.buf_v[:, :, :end]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length


def _capacity(width: int) -> int:
    """Time capacity for `width` cached positions: headroom so most steps write in place."""
    return (width + max(64, width // 2) + 63) // 64 * 64


class _BatchCache:
    """The KV cache, mask and positions of the active batch, all left-padded to one time width.

    keys/values per layer: [batch, kv_heads, capacity, head_dim]; mask: [batch, capacity] (1 = real
    token; columns ≥ width unused); positions: [batch] (the position id of each row's next token).
    """

    def __init__(self, layers: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor, width: int):
        self.layers, self.mask, self.width = layers, mask, width
        self.positions = mask[:, :width].sum(-1)  # [batch]
        # What the rows are views of: rows `drop` removes leave room at the end for `append`.
        self._buffers = (layers, mask, self.positions)

    @staticmethod
    def allocate(like: list[tuple[torch.Tensor, torch.Tensor]], batch: int, capacity: int) -> tuple[list, torch.Tensor]:
        layers = [(k.new_zeros((batch, k.shape[1], capacity, k.shape[3])),
                   v.new_zeros((batch, v.shape[1], capacity, v.shape[3])))
                  for k, v in like]
        return layers, torch.zeros((batch, capacity), dtype=torch.long, device=like[0][0].device)

    @classmethod
    def from_parts(cls, parts: list[_BatchCache]) -> _BatchCache:
        """Stack several caches row-wise, right-aligning each in time (one copy of each)."""
        width = max(p.width for p in parts)
        batch = sum(p.mask.shape[0] for p in parts)
        layers, mask = cls.allocate(parts[0].layers, batch, _capacity(width))
        row = 0
        for p in parts:
            rows, shift = p.mask.shape[0], width - p.width
            for (k, v), (pk, pv) in zip(layers, p.layers, strict=True):
                k[row : row + rows, :, shift:width] = pk[:, :, : p.width]
                v[row : row + rows, :, shift:width] = pv[:, :, : p.width]
            mask[row : row + rows, shift:width] = p.mask[:, : p.width]
            row += rows
        return cls(layers, mask, width)

    def select(self, keep: list[int]) -> _BatchCache:
        """Only rows `keep`, dropping time columns that are padding in every one of them."""
        index = torch.tensor(keep, device=self.mask.device)
        mask = self.mask[:, : self.width].index_select(0, index)
        first = int((mask.sum(0) > 0).nonzero()[0])
        width = self.width - first
        layers, new_mask = self.allocate(self.layers, len(keep), _capacity(width))
        for (k, v), (ok, ov) in zip(layers, self.layers, strict=True):
            k[:, :, :width] = ok[:, :, first : self.width].index_select(0, index)
            v[:, :, :width] = ov[:, :, first : self.width].index_select(0, index)
        new_mask[:, :width] = mask[:, first:]
        return _BatchCache(layers, new_mask, width)

    def place(self, part: _BatchCache, rows: list[int]) -> None:
        """Write `part` (no wider than this cache) into `rows` in place, right-aligned: only its data moves."""
        index, shift = torch.tensor(rows, device=self.mask.device), self.width - part.width
        for (k, v), (pk, pv) in zip(self.layers, part.layers, strict=True):
            k[index, :, shift : self.width] = pk[:, :, : part.width]
            v[index, :, shift : self.width] = pv[:, :, : part.width]
        self.mask[index, : self.width] = 0
        self.mask[index, shift : self.width] = part.mask[:, : part.width]
        self.positions[index] = part.positions

    def drop(self, gone: list[int]) -> list[int]:
        """Remove rows `gone` in place: the last rows that stay move into the places of those before
        them (only their data moves, not the batch's), and the batch shrinks to the rows that stay,
        views of the same buffers. Returns the new order: row i now holds what row order[i] held."""
        rows, stay, gone_set = self.mask.shape[0], self.mask.shape[0] - len(gone), set(gone)
        holes = [r for r in sorted(gone_set) if r < stay]
        movers = [r for r in range(stay, rows) if r not in gone_set]
        if holes:
            dst, src = (torch.tensor(r, device=self.mask.device) for r in (holes, movers))
            for k, v in self.layers:
                k[dst, :, : self.width] = k[src, :, : self.width]
                v[dst, :, : self.width] = v[src, :, : self.width]
            self.mask[dst] = self.mask[src]
            self.positions[dst] = self.positions[src]
        self.layers = [(k[:stay], v[:stay]) for k, v in self.layers]
        self.mask, self.positions = self.mask[:stay], self.positions[:stay]
        order = list(range(stay))
        for hole, mover in zip(holes, movers, strict=True):
            order[hole] = mover
        return order

    def append(self, part: _BatchCache) -> bool:
        """Add `part`'s rows after these, in place, where the buffers have room (rows dropped at the
        end) and `part` is no wider; False, with nothing done, otherwise."""
        layers, mask, positions = self._buffers
        rows, new = self.mask.shape[0], part.mask.shape[0]
        if rows + new > mask.shape[0] or part.width > self.width or mask.shape[1] != self.mask.shape[1]:
            return False
        self.layers = [(k[: rows + new], v[: rows + new]) for k, v in layers]
        self.mask, self.positions = mask[: rows + new], positions[: rows + new]
        self.place(part, list(range(rows, rows + new)))
        return True

    def padding_columns(self) -> int:
        """Leading time columns that are padding in every row."""
        return int((self.mask[:, : self.width].sum(0) > 0).nonzero()[0])

    def reserve(self, new: int) -> None:
        """Make room for `new` more positions, growing the buffers (one copy) only when full."""
        if self.width + new <= self.mask.shape[1]:
            return
        layers, mask = self.allocate(self.layers, self.mask.shape[0], _capacity(self.width + new))
        for (k, v), (ok, ov) in zip(layers, self.layers, strict=True):
            k[:, :, : self.width] = ok[:, :, : self.width]
            v[:, :, : self.width] = ov[:, :, : self.width]
        mask[:, : self.width] = self.mask[:, : self.width]
        self.layers, self.mask = layers, mask
        self._buffers = (layers, mask, self.positions)

    def row_kv(self, row: int, start: int, end: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A copy of one row's keys and values over time columns [start, end), per layer."""
        return [(k[row, :, start:end].clone(), v[row, :, start:end].clone()) for k, v in self.layers]

    def hf_cache(self) -> DynamicCache:
        cache = DynamicCache()
        cache.layers = [_KVLayer(k, v, self.width) for k, v in self.layers]
        cache.layer_class_to_replicate = None
        return cache


class LocalEngine:
    """In-process engine over a Hugging Face causal LM."""

    def __init__(self, model: PreTrainedModel, config: EngineConfig | None = None, version: int = 0):
        self.model = model.eval()
        self.config = config or EngineConfig()
        self._version = version
        self._pad_id = 0
        self._inbox: queue.Queue[_Sequence] = queue.Queue()
        self._weights: queue.Queue[tuple[Mapping[str, torch.Tensor], int, threading.Event]] = queue.Queue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._active: list[_Sequence] = []
        self._pending: list[tuple[int, int, _Sequence]] = []  # heap of (priority, arrival, request) off the inbox
        self._arrivals = itertools.count()
        self._admitting: list[_Sequence] = []  # taken from the queue, not yet in the batch
        self._cache: _BatchCache | None = None  # of the rows in `_active`, in order
        self._free: list[int] = []  # rows of `_active` that finished; their slots wait for a newcomer or compaction
        self._generator = torch.Generator().manual_seed(self.config.seed)
        # session -> (the tokens whose KV is kept, per layer (keys, values) [kv_heads, tokens, head_dim])
        self._sessions: OrderedDict[str, tuple[list[int], list[tuple[torch.Tensor, torch.Tensor]]]] = OrderedDict()
        # prompt -> (its tokens but the last, per layer (keys, values) [kv_heads, tokens, head_dim])
        self._prompts: OrderedDict[tuple[int, ...],
                                   tuple[list[int], list[tuple[torch.Tensor, torch.Tensor]]]] = OrderedDict()
        self.reused_tokens = 0  # prompt tokens not prefilled thanks to a kept session or an identical prompt
        self._vocab = model.get_input_embeddings().num_embeddings
        text = model.config.get_text_config(decoder=True)
        kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        # The model's device is the engine's: move the model to a GPU before building the engine.
        self._device = next(model.parameters()).device
        empty = torch.empty(0, kv_heads, 0, head_dim, dtype=model.dtype, device=self._device)
        self._layer_shapes = [(empty, empty)] * text.num_hidden_layers  # templates for `_BatchCache.allocate`
        self._lean = LeanDecoder(model) if self.config.lean_decode and LeanDecoder.supports(model) else None
        self._routing_width = routing_width(model)
        self._last_routing: torch.Tensor | None = None  # [batch, new, layers * k] of the last recording `_forward`
        # prompt cache key -> the routing of its tokens but the last (as the KV kept in `_prompts`)
        self._prompt_routing: dict[tuple[int, ...], list[list[int]]] = {}
        self.steps = 0
        self.swaps = 0
        self._counters = dict.fromkeys(("prefill_s", "prefill_tokens", "decode_s", "decode_tokens", "decode_steps",
                                        "swap_s"), 0.0)  # `counters()`
        self._error: BaseException | None = None
        self._closed = False
        self._applying: threading.Event | None = None  # the weight update being applied
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()

    # ---- public interface ----

    @property
    def version(self) -> int:
        return self._version

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams) -> Future[Generation]:
        self._check_alive()
        check_request(prompt_ids, params, self._vocab)
        if params.routed_experts and not self._routing_width:
            raise ValueError(f"routed_experts asked of a {type(self.model).__name__}, which has no MoE router: "
                             "routing replay is for mixtures of experts")
        seq = _Sequence(list(prompt_ids), params, Future())
        self._inbox.put(seq)
        self._wake.set()
        if self._error is not None or self._closed:  # the loop ended while we queued: nobody will serve it
            self._fail_queued()
        return seq.future

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Generation]:
        futures = [self.submit(p, params) for p in prompts]
        return [f.result() for f in futures]

    def update_weights(self, weights: Mapping[str, torch.Tensor] | WeightDelta, version: int,
                       timeout_s: float = 60.0) -> None:
        """Swap weights at the next step boundary; in-flight sequences resume under them. A
        `WeightDelta` is applied in place and must be against this engine's version."""
        self._check_alive()
        check_delta(weights, self._version)
        done = threading.Event()
        self._weights.put((weights, version, done))
        self._wake.set()
        if not done.wait(timeout_s):
            raise EngineError(f"weight update to version {version} not applied within {timeout_s} s; "
                              "the engine loop is stuck or dead")
        self._check_alive()

    def close(self) -> None:
        self._closed = True
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10)
        for seq in self._active + self._admitting + self._drain_queued():
            self._finish(seq, "aborted")
        self._active, self._admitting, self._cache, self._free = [], [], None, []
        while not self._weights.empty():
            self._weights.get_nowait()[2].set()  # their update_weights raise: the engine is closed

    def __enter__(self) -> LocalEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_alive(self) -> None:
        if self._error is not None:
            raise EngineError(f"engine loop died: {self._error!r}; build a new engine") from self._error
        if self._closed:
            raise EngineError("engine is closed; build a new one")

    # ---- the loop ----

    def _drain_inbox(self) -> list[_Sequence]:
        items = []
        while True:
            try:
                items.append(self._inbox.get_nowait())
            except queue.Empty:
                return items

    def _drain_queued(self) -> list[_Sequence]:
        """Every request not yet taken for admission (sorted ones first, then the inbox's)."""
        pending, self._pending = [seq for *_, seq in sorted(self._pending, key=lambda p: p[:2])], []
        return pending + self._drain_inbox()

    def _fail_queued(self) -> None:
        for seq in self._drain_queued():
            if self._error is not None:
                seq.future.set_exception(EngineError(f"engine loop died: {self._error!r}"))
            else:
                self._finish(seq, "aborted")

    def _loop(self) -> None:
        held = False  # this engine's thread count is in force (DECODE_THREADS)
        idle_waits = 0
        try:
            with torch.inference_mode():
                while not self._stop.is_set():
                    if not self._active and not self._pending and self._inbox.empty() and self._weights.empty():
                        idle_waits += 1
                        if held and idle_waits >= 2:  # idle for a while, not only between two turns
                            DECODE_THREADS.idle(self)
                            held = False
                        self._wake.wait(0.05)
                        self._wake.clear()
                        continue
                    idle_waits = 0
                    if not held:
                        DECODE_THREADS.busy(self, self.config.threads)
                        held = True
                    self._step()
        except BaseException as exc:  # noqa: BLE001 -- recorded: submitters and update_weights raise it loudly
            self._error = exc
            for seq in self._active + self._admitting + self._drain_queued():
                if not seq.future.done():
                    seq.future.set_exception(EngineError(f"engine loop died: {exc!r}"))
            if self._applying is not None:
                self._applying.set()
            while not self._weights.empty():
                self._weights.get_nowait()[2].set()
        finally:
            DECODE_THREADS.idle(self)

    def counters(self) -> dict[str, float]:
        """What the loop has done since the engine started, cumulative: seconds and tokens of
        prefills (`prefill_s`, `prefill_tokens`: tokens fed, not those reused from a kept session
        or an identical prompt), of decode steps (`decode_s`, `decode_tokens`: one per row per
        step, `decode_steps`), and of weight swaps (`swap_s`, KV rebuilt under the new weights
        included). The training loop reads them around each step (`flywheel.timing.delta`)."""
        return dict(self._counters)

    def _step(self) -> None:
        c = self._counters
        while not self._weights.empty():
            weights, version, done = self._weights.get_nowait()
            self._applying = done  # if loading fails, the handler in `_loop` releases its waiter
            with timed(c, "swap_s"):
                self._swap(weights, version)
            done.set()
            self._applying = None
        for seq in self._drain_inbox():
            heapq.heappush(self._pending, (seq.params.priority, next(self._arrivals), seq))
        admitted = self._admitting
        while (self._pending and len(self._active) - len(self._free) + len(admitted) < self.config.max_batch
               and len(admitted) < self.config.max_prefill_per_step):
            admitted.append(heapq.heappop(self._pending)[2])
        if admitted:
            with timed(c, "prefill_s"):
                self._admit(admitted)
            self._admitting = []
        if self._free or self._active:
            with timed(c, "decode_s"):
                self._compact()
                if self._active:
                    self._decode()

    def _swap(self, weights: Mapping[str, torch.Tensor] | WeightDelta, version: int) -> None:
        if isinstance(weights, WeightDelta):
            weights.apply(self.model.state_dict())
        else:
            self.model.load_state_dict(weights, strict=True)
        if self._lean is not None:
            self._lean.refresh()  # its fused weights are copies
        self._version = version
        self.swaps += 1
        self._prompts.clear()  # computed under the old weights; a new group's prompt starts fresh
        self._prompt_routing.clear()
        if self.config.kv_on_update == "recompute":
            self._sessions.clear()  # their KV was computed under the old weights
            self._compact()
            if self._active:
                self._rebuild_cache()

    def _forward(self, input_ids: torch.Tensor, cache: _BatchCache, positions: torch.Tensor,
                 mask: torch.Tensor | None = None, record: bool = False) -> torch.Tensor:
        """One model call appending to `cache`. input_ids, positions and mask (None: all real) [batch, new].
        Returns the last logits [batch, vocab]. A decode step (one new token, all real) goes through
        the lean decoder when there is one. record: keep each fed position's experts in
        `_last_routing` [batch, new, layers * k]."""
        new = input_ids.shape[1]
        cache.reserve(new)
        cache.mask[:, cache.width : cache.width + new] = 1 if mask is None else mask
        if self._lean is not None and new == 1 and mask is None:  # a decode step
            self._lean.routing = [] if record else None
            logits = self._lean.step(input_ids[:, 0], cache.layers, cache.mask[:, : cache.width + 1], positions[:, 0],
                                     cache.width)
            calls, self._lean.routing = self._lean.routing, None
        else:
            with record_routing(self.model) if record else _no_record() as calls:
                out = self.model(input_ids=input_ids, attention_mask=cache.mask[:, : cache.width + new],
                                 position_ids=positions,
                                 cache=cache.hf_cache(), use_cache=True, logits_to_keep=1)
            logits = out.logits[:, -1, :]
        if record:  # each call's ids are [batch * new, k], row-major
            self._last_routing = torch.cat([c.view(input_ids.shape[0], new, -1) for c in calls], dim=-1)
        cache.width += new
        cache.positions += new if mask is None else mask.sum(-1)
        return logits.float()

    def _prefill(self, rows: list[list[int]], kept: list[tuple[list[int], list]] | None = None,
                 record: bool = False) -> tuple[torch.Tensor, _BatchCache]:
        """Run left-padded `rows` through the model into a new cache of their own; with `kept`, on
        top of each row's kept KV (right-aligned before its new tokens, the padding between masked).
        record: as `_forward`'s."""
        pasts = kept or [([], [])] * len(rows)
        past = max(len(tokens) for tokens, _ in pasts)
        width = max(len(r) for r in rows)
        layers, buf_mask = _BatchCache.allocate(self._layer_shapes, len(rows), _capacity(past + width))
        for i, (tokens, kv) in enumerate(pasts):
            for (k, v), (pk, pv) in zip(layers, kv, strict=False):  # kv is empty for a row without a past
                k[i, :, past - len(tokens) : past] = pk
                v[i, :, past - len(tokens) : past] = pv
            buf_mask[i, past - len(tokens) : past] = 1
        cache = _BatchCache(layers, buf_mask, past)
        ids = torch.full((len(rows), width), self._pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, width - len(r) :] = torch.tensor(r)
            mask[i, width - len(r) :] = 1
        ids, mask = ids.to(self._device), mask.to(self._device)
        # [batch, width]: each row's positions continue from its past; padding gets a position but is masked
        positions = cache.positions.unsqueeze(1) + (mask.cumsum(-1) - 1).clamp(min=0)
        return self._forward(ids, cache, positions, mask, record), cache

    def _kept(self, seq: _Sequence) -> tuple[list[int], list[tuple[torch.Tensor, torch.Tensor]]] | None:
        """The session's kept KV if `seq`'s prompt extends its tokens (it is used up either way)."""
        if seq.params.session is None or seq.params.session not in self._sessions:
            return None
        tokens, layers = self._sessions.pop(seq.params.session)
        if len(seq.prompt) > len(tokens) and seq.prompt[: len(tokens)] == tokens:
            return tokens, layers
        return None

    def _same_prompt(self, seq: _Sequence) -> tuple[list[int], list[tuple[torch.Tensor, torch.Tensor]]] | None:
        """The kept KV of an identical earlier prompt: all its tokens but the last, which is fed anew
        for this request's own first logits. Shared, not used up: `_prefill` only copies from it."""
        entry = self._prompts.get(seq.prompt_key)
        if entry is not None:
            self._prompts.move_to_end(seq.prompt_key)
        return entry

    def _keep_prompts(self, seqs: list[_Sequence], cache: _BatchCache) -> None:
        """Keep the KV of freshly prefilled prompts (rows of `cache`, right-aligned) for their twins."""
        if not self.config.prompt_cache:
            return
        width = cache.width
        for row, s in enumerate(seqs):
            n = len(s.prompt) - 1
            if n < 1 or s.prompt_key in self._prompts:
                continue
            self._prompts[s.prompt_key] = (s.prompt[:-1], cache.row_kv(row, width - n - 1, width - 1))
            while len(self._prompts) > self.config.prompt_cache:
                gone, _ = self._prompts.popitem(last=False)
                self._prompt_routing.pop(gone, None)

    def _admit(self, seqs: list[_Sequence]) -> None:
        kept = [self._kept(s) for s in seqs]
        extended = [(s, k) for s, k in zip(seqs, kept, strict=True) if k is not None]
        # A prompt seen before (kept, or earlier in this admission: a group's other members) is
        # prefilled as its last token on top of the kept KV of the others.
        fresh, twins, firsts = [], [], set()
        for s, k in zip(seqs, kept, strict=True):
            if k is not None:
                continue
            if s.prompt_key in self._prompts or (self.config.prompt_cache and s.prompt_key in firsts):
                twins.append(s)
            else:
                fresh.append(s)
                firsts.add(s.prompt_key)
        # Separate prefills: a short new part beside a long fresh prompt would be padded to its width.
        parts, order = [], []
        record = any(s.params.routed_experts for s in seqs)
        if fresh:
            parts.append(self._prefill([s.prompt for s in fresh], record=record))
            self._keep_prompts(fresh, parts[-1][1])
            self._keep_routing(fresh, [0] * len(fresh))
            order += fresh
        shared = [(s, self._same_prompt(s)) for s in twins]
        alone = [s for s, k in shared if k is None]  # its twin's KV was not kept (a one-token prompt, or evicted)
        if alone:
            parts.append(self._prefill([s.prompt for s in alone], record=record))
            self._keep_routing(alone, [0] * len(alone))
            order += alone
        for group in (extended, [(s, k) for s, k in shared if k is not None]):
            if group:
                parts.append(self._prefill([s.prompt[len(k[0]) :] for s, k in group], [k for _, k in group],
                                           record=record))
                self._keep_routing([s for s, _ in group], [len(k[0]) for _, k in group])
                self.reused_tokens += sum(len(k[0]) for _, k in group)
                order += [s for s, _ in group]
        seqs = order  # the rows of the new cache, in order
        self._counters["prefill_tokens"] += sum(len(s.prompt) for s in seqs) - sum(
            len(k[0]) for group in (extended, shared) for _, k in group if k is not None)  # fed, not reused
        logits = torch.cat([p[0] for p in parts])
        cache = parts[0][1] if len(parts) == 1 else _BatchCache.from_parts([p[1] for p in parts])
        for s in seqs:
            s.tokens = list(s.prompt)
        free = self._free[: len(seqs)]
        live = len(self._active) - len(self._free)
        if live and len(free) == len(seqs) and self._cache is not None and cache.width <= self._cache.width:
            self._cache.place(cache, free)  # reuse finished rows' slots: no copy of the rest of the batch
            for i, s in zip(free, seqs, strict=True):
                self._active[i] = s
            self._free = self._free[len(seqs) :]
        else:
            self._compact()
            if not (self._active and self.config.rows_in_place and self._cache.append(cache)):
                self._cache = _BatchCache.from_parts([self._cache, cache]) if self._active else cache
            self._active.extend(seqs)
        self._sample(seqs, logits)

    def _rebuild_cache(self) -> None:
        """Recompute the KV cache of every active sequence under the current weights."""
        _, self._cache = self._prefill([s.tokens[:-1] for s in self._active])

    def _decode(self) -> None:
        assert self._cache is not None
        last = torch.tensor([[s.tokens[-1]] for s in self._active], device=self._device)  # [batch, 1]
        record = any(s.params.routed_experts for s in self._active)
        logits = self._forward(last, self._cache, self._cache.positions.unsqueeze(1), record=record)
        self.steps += 1
        self._counters["decode_steps"] += 1
        self._counters["decode_tokens"] += len(self._active)
        if record:
            for s, row in zip(self._active, self._last_routing[:, 0].tolist(), strict=True):
                if s.params.routed_experts:
                    s.routed.append(row)
        self._sample(self._active, logits)

    def _keep_routing(self, seqs: list[_Sequence], past: list[int]) -> None:
        """After a recording prefill of `seqs` (rows of `_last_routing`, left-padded), each asking one's
        routing of the positions it fed, from `past` (tokens whose KV it reused) on; a twin of a kept
        prompt takes that prompt's routing for the tokens it reused."""
        if not any(s.params.routed_experts for s in seqs):
            return
        rows = self._last_routing.tolist()  # [rows, width, layers * k]
        for s, start, row in zip(seqs, past, rows, strict=True):
            fed = len(s.prompt) - start
            s.routed, s.routed_from = row[len(row) - fed :], start
            earlier = self._prompt_routing.get(s.prompt_key) if start else None
            if earlier is not None and len(earlier) == start:
                s.routed, s.routed_from = earlier + s.routed, 0
            if start == 0 and s.prompt_key in self._prompts:  # its KV was kept for twins: its routing too
                self._prompt_routing.setdefault(s.prompt_key, s.routed[:-1])

    def _sample(self, seqs: list[_Sequence], logits: torch.Tensor) -> None:
        """Sample one token for each of `seqs` (rows of `logits`), then retire finished rows."""
        temperatures = [s.params.temperature for s in seqs]
        top_ps = [s.params.top_p for s in seqs]
        choice, logp = sample_tokens(logits, temperatures, top_ps, self._generator)
        choices, logps = choice.tolist(), logp.tolist()
        for i, s in enumerate(seqs):
            if s.generator is not None:  # a seeded request draws from its own stream, row by row
                own, own_lp = sample_tokens(logits[i : i + 1], temperatures[i : i + 1], top_ps[i : i + 1], s.generator)
                choices[i], logps[i] = own.item(), own_lp.item()
        for i, s in enumerate(seqs):
            if s.params.top_logprobs:  # [k] of the row's log_softmax(logits / T), as the sampled logprob
                t = temperatures[i] or 1.0
                values, ids = torch.log_softmax(logits[i] / t, dim=-1).topk(s.params.top_logprobs)
                s.top.append(list(zip(ids.tolist(), values.tolist(), strict=True)))
        for s, tok, lp in zip(seqs, choices, logps, strict=True):
            s.tokens.append(tok)
            s.logprobs.append(lp)
            s.versions.append(self._version)
            if s.params.on_token is not None:
                s.params.on_token(tok, lp)
        self._retire()

    def _retire(self) -> None:
        """Finish rows that hit a stop token or max_tokens; their slots are freed, not yet compacted."""
        free = set(self._free)
        for i, s in enumerate(self._active):
            if i in free:
                continue
            if s.future.cancelled():  # its requester left (a server's client disconnected): stop decoding it
                self._free.append(i)
                continue
            if s.tokens[-1] in s.params.stop_token_ids:
                reason = "stop"
            elif len(s.tokens) - len(s.prompt) >= s.params.max_tokens:
                reason = "length"
            else:
                continue
            self._keep(i, s)
            self._finish(s, reason)
            self._free.append(i)

    def _keep(self, row: int, seq: _Sequence) -> None:
        """Keep a finishing session's KV: every token but the newest, which was never fed."""
        if seq.params.session is None or not self.config.session_cache or self._cache is None:
            return
        cached = len(seq.tokens) - 1
        width = self._cache.width
        if (int(self._cache.mask[row, :width].sum()) != cached
                or int(self._cache.mask[row, width - cached : width].sum()) != cached):
            return  # not one contiguous run at the right (never expected): prefill it next time instead
        self._sessions[seq.params.session] = (seq.tokens[:-1], self._cache.row_kv(row, width - cached, width))
        self._sessions.move_to_end(seq.params.session)
        while len(self._sessions) > self.config.session_cache:
            self._sessions.popitem(last=False)

    def _compact(self) -> None:
        """Drop free rows (in place: `_BatchCache.drop`; or with `rows_in_place` off, one copy of the
        batch, leading padding trimmed too), and leading padding once it is a quarter of the width
        (one copy).

        Deferred from `_retire` so that a newcomer admitted in the next step takes a free slot in place."""
        if self._cache is None or (not self._free and self._cache.padding_columns() * 4 < self._cache.width):
            return
        if self._free and len(self._free) == len(self._active):
            self._active, self._cache, self._free = [], None, []
        elif self._free and self.config.rows_in_place:
            order = self._cache.drop(self._free)
            self._active, self._free = [self._active[i] for i in order], []
            if self._cache.padding_columns() * 4 >= self._cache.width:
                self._cache = self._cache.select(list(range(len(self._active))))
        else:
            free = set(self._free)
            keep = [i for i in range(len(self._active)) if i not in free]
            self._active = [self._active[i] for i in keep]
            self._cache = self._cache.select(keep)
            self._free = []

    def _finish(self, seq: _Sequence, reason: str) -> None:
        if not seq.future.done():
            seq.future.set_result(Generation(seq.generated, seq.logprobs, seq.versions, reason,
                                             seq.top if seq.params.top_logprobs else None,
                                             seq.routed if seq.params.routed_experts else None, seq.routed_from))


@contextmanager
def _no_record() -> Iterator[list[torch.Tensor]]:
    yield []


def sample_tokens(logits: torch.Tensor, temperatures: Sequence[float], top_ps: Sequence[float],
                  generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of `logits` [batch, vocab] and its logprob under log_softmax(logits / T).

    Temperature 0 is greedy (logprob at T=1). top_p keeps the smallest set of most likely tokens
    whose probability reaches top_p. Vectorized over rows: no per-row Python work or host syncs.

    Sampling inverts each row's cumulative distribution at one uniform draw (a binary search), which
    picks token i with probability p_i exactly as `torch.multinomial` does, at a fraction of its
    cost on CPU: multinomial was a third of a decode step of the embedded default at batch 32, and
    drawing one random number per vocabulary entry (an exponential race) costs as much again.
    """
    # [batch, 1]
    temps = torch.tensor([t or 1.0 for t in temperatures], dtype=logits.dtype, device=logits.device).unsqueeze(1)
    logp = torch.log_softmax(logits / temps, dim=-1)  # [batch, vocab]
    greedy = [t == 0 for t in temperatures]
    if all(greedy):
        choice = logits.argmax(-1)
    else:
        probs = logp.exp()
        if any(p < 1.0 for p in top_ps):
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            top_p = torch.tensor(top_ps, dtype=probs.dtype, device=probs.device).unsqueeze(1)
            sorted_probs[sorted_probs.cumsum(-1) - sorted_probs > top_p] = 0  # the most likely token always stays
            choice = order.gather(1, _inverse_cdf(sorted_probs, generator).unsqueeze(1)).squeeze(1)
        else:
            choice = _inverse_cdf(probs, generator)
        if any(greedy):
            choice = torch.where(torch.tensor(greedy, device=logits.device), logits.argmax(-1), choice)
    return choice, logp.gather(1, choice.unsqueeze(1)).squeeze(1)


def _inverse_cdf(weights: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One index per row of `weights` [batch, n] (non-negative, not necessarily normalized), drawn
    with probability proportional to its weight: the first index whose cumulative weight exceeds a
    uniform draw on [0, total). A zero-weight index is never chosen (its cumulative weight equals
    the previous one, which the draw did not exceed). The draws come from `generator` on the CPU
    whatever the device, so one seed samples the same tokens on any of them."""
    cdf = weights.cumsum(-1)  # [batch, n]
    draw = torch.rand((weights.shape[0], 1), generator=generator, dtype=cdf.dtype).to(cdf.device) * cdf[:, -1:]
    return torch.searchsorted(cdf, draw, right=True).squeeze(1).clamp(max=weights.shape[1] - 1)


def wait_all(futures: Sequence[Future[Generation]], timeout_s: float) -> list[Generation]:
    deadline = time.monotonic() + timeout_s
    return [f.result(timeout=max(0.0, deadline - time.monotonic())) for f in futures]
