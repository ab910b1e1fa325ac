"""What the Tinker server does, without HTTP: sessions, training models, checkpoints, samplers, futures.

    client (tinker SDK)                      TinkerService
    create_session ─────────────────────────> session id, owned by the caller's key
    create_model / forward_backward / ... ──> a request id at once; the work queued on ONE worker
    retrieve_future(request id) ────────────> try_again until done, then the result or its error
    create_sampling_session / asample ──────> samples from an engine of its own per sampler

What unblocks what: the worker runs training requests one at a time in arrival order (the SDK sends
a training client's requests in its seq_id order, one after another, so arrival order is that
order). Samples do not wait for the worker: each sampler's LocalEngine decodes on its own thread,
so several clients sample while another trains.

Isolation: every session, model, checkpoint and sampler belongs to the key that made it (by the
key's SHA-256); another key is told it does not exist (404). Each model has its own adapter and
AdamW moments (flywheel/tinker/trainer.py); its checkpoints live under its own folder
(`root/<model id>/weights/<name>.pt`) and carry the owner, so a restarted server still refuses them
to other keys.

Registry: a named `save_weights_for_sampler` registers the adapter as a Registry version (`base`
set, no organization), which `Registry.load` gives merged onto its base: the gate, `flywheel serve`
and the live cycle's A/B take it as any version. Unnamed saves
(`save_weights_and_get_sampling_client`, once per RL step) are kept, the newest `max_snapshots` of
them (an older one answers 404: its loop has long moved on). Sessions, models and samplers are
written to disk before they are acknowledged and read back after a restart (flywheel/tinker/records.py).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import re
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from flywheel.model.adapters import delta_view, load_adapted, lora_deltas, shared_copy
from flywheel.model.engine import EngineConfig, LocalEngine, SamplingParams
from flywheel.model.registry import CheckpointNotFound, Registry
from flywheel.store.files import write_atomic
from flywheel.tinker.losses import LossInputError, check_loss
from flywheel.tinker.records import ClientRecords, model_folder
from flywheel.tinker.trainer import AdapterModel, LoraSpec
from flywheel.tinker.wire import FwdBwdRequest, WireError, encode_forward_backward, encode_sample

log = logging.getLogger(__name__)
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class UserError(ValueError):
    """The caller asked for something wrong or unsupported: the future fails with category "user"."""


class NotFound(LookupError):
    """No such session, model, checkpoint or sampler for this key (HTTP 404)."""


@dataclass
class Outcome:
    """A finished request: JSON (`body` a dict), protobuf (`body` bytes), or an error."""
    body: dict[str, Any] | bytes | None = None
    error: str | None = None
    category: str = "user"  # "user" | "server", the SDK's RequestErrorCategory values


@dataclass
class TrainingEntry:
    owner: str
    base_name: str
    base_version: int
    model: AdapterModel
    rank: int
    lock: threading.Lock = field(default_factory=threading.Lock)
    seq: int = 0  # the SDK's seq_id of the last forward_backward / optim_step applied (records.py: resends)
    last_optim: dict[str, Any] | None = None  # what that optim_step answered, for its resend


@dataclass
class SamplerEntry:
    owner: str
    base_name: str
    base_version: int
    deltas: dict[str, torch.Tensor] | None  # None: the base itself
    model_path: str | None = None


def owner_of(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class TinkerService:
    def __init__(self, registry: Registry, root: str | Path, models: dict[str, str] | None = None,
                 micro_batch_tokens: int = 4096, max_engines: int = 4, engine: EngineConfig | None = None,
                 keep_results: int = 10_000, sampling_threads: int = 16, max_snapshots: int = 64):
        self.registry = registry
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.names = dict(models or {})
        self.micro_batch_tokens = micro_batch_tokens
        self.max_engines = max_engines
        self.engine_config = engine or EngineConfig()
        self.keep_results = keep_results
        self.max_snapshots = max_snapshots
        self._lock = threading.Lock()  # the tables below; held for lookups and inserts only
        self._base_lock = threading.Lock()  # loading a base model (seconds): not under `_lock`
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tinker-worker")
        # Samples waiting on their engines: bounded, so a client flooding asample queues its own
        # requests instead of starting a thread each (the engines batch whatever is submitted).
        self._sampling = ThreadPoolExecutor(max_workers=sampling_threads, thread_name_prefix="tinker-sample")
        self._bases: dict[int, tuple[PreTrainedModel, PreTrainedTokenizerBase]] = {}
        self._sessions: dict[str, str] = {}  # session id -> owner
        self._models: dict[str, TrainingEntry] = {}
        self._samplers: dict[str, SamplerEntry] = {}
        self._snapshots: list[str] = []  # unnamed sampler saves, oldest first
        self._engines: OrderedDict[str, LocalEngine] = OrderedDict()
        self._engine_lock = threading.Lock()
        self._results: OrderedDict[str, tuple[str, Future[Outcome]]] = OrderedDict()  # request id -> (owner, ...)
        self.records = ClientRecords(self.root)  # sessions and models, read back after a restart
        self._restore_lock = threading.Lock()  # one restore of a model at a time (it loads its base)

    # ---- names, bases, ownership

    def base_names(self) -> list[str]:
        if self.names:
            return sorted(self.names)
        full = [c for c in self.registry.list() if c.base is None]
        return sorted({f"v{c.version}" for c in full} | {a for c in full for a in c.aliases})

    def resolve_base(self, name: str) -> int:
        ref = self.names.get(name, name) if self.names else name
        if self.names and name not in self.names:
            raise NotFound(f"base model {name!r} is not served here; use one of {sorted(self.names)}")
        try:
            checkpoint = self.registry.get(ref)
        except (CheckpointNotFound, TypeError) as exc:
            raise NotFound(f"base model {name!r}: {exc}; use one of {self.base_names()}") from exc
        if checkpoint.base is not None:
            raise UserError(f"{name!r} is a LoRA adapter version; train from a full version (its base "
                            f"v{checkpoint.base}) or load its checkpoint")
        return checkpoint.version

    def base(self, version: int) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
        with self._base_lock:
            if version not in self._bases:
                model, tokenizer = self.registry.load(version)
                for p in model.parameters():
                    p.requires_grad_(False)
                self._bases[version] = (model.eval(), tokenizer)
            return self._bases[version]

    def _owned(self, table: dict[str, Any], key: str, owner: str, what: str) -> Any:
        entry = table.get(key)
        if entry is None or (entry if isinstance(entry, str) else entry.owner) != owner:
            raise NotFound(f"no {what} {key!r} for this API key")
        return entry

    def model(self, model_id: str, owner: str) -> TrainingEntry:
        """The model, read back from its record the first time it is named after a restart (seconds:
        it may load the base; the HTTP routes call this off their event loop)."""
        if model_id not in self._models:
            self._restore_model(model_id)
        return self._owned(self._models, model_id, owner, "training model")

    def _restore_model(self, model_id: str) -> None:
        with self._restore_lock:
            record = None if model_id in self._models else self.records.read_model(model_id)
            if record is None:
                return
            spec = LoraSpec(**record["state"]["spec"])
            adapter = AdapterModel(self.base(record["base_version"])[0], spec, 0, self.micro_batch_tokens)
            adapter.load_state(record["state"], optimizer=True)
            adapter.set_pending_gradients(record["grads"])
            entry = TrainingEntry(record["owner"], record["base_name"], record["base_version"], adapter, spec.rank,
                                  seq=record["seq"], last_optim=record["last_optim"])
            with self._lock:
                self._models[model_id] = entry
        log.info("restored training model %s at step %d from its record", model_id, adapter.steps)

    def _write_record(self, model_id: str, entry: TrainingEntry) -> None:
        """The model as it is now, on disk before the request that changed it is acknowledged.
        Called with `entry.lock` held."""
        self.records.write_model(model_id, {
            "owner": entry.owner, "base_name": entry.base_name, "base_version": entry.base_version,
            "state": entry.model.state(), "grads": entry.model.pending_gradients(), "seq": entry.seq,
            "last_optim": entry.last_optim})

    def sampler(self, sampler_id: str, owner: str) -> SamplerEntry:
        """The sampler, rebuilt from its record the first time it is named after a restart (seconds:
        it may load the base; the HTTP routes call this off their event loop)."""
        if sampler_id not in self._samplers:
            self._restore_sampler(sampler_id)
        return self._owned(self._samplers, sampler_id, owner, "sampling session")

    def _restore_sampler(self, sampler_id: str) -> None:
        with self._restore_lock:
            record = None if sampler_id in self._samplers else self.records.read_sampler(sampler_id)
            if record is None:
                return
            deltas = None
            if record["model_path"] is not None:  # a named save: the Registry holds its adapter
                deltas = self._named_sampler(record["owner"], record["model_path"]).deltas
            elif record["adapter"] is not None:  # an unnamed snapshot: its LoRA weights on the base
                spec = LoraSpec(**record["adapter"]["spec"])
                snapshot = AdapterModel(self.base(record["base_version"])[0], spec, 0, self.micro_batch_tokens)
                snapshot.load_state(record["adapter"], optimizer=False)
                deltas = snapshot.deltas()
            entry = SamplerEntry(record["owner"], record["base_name"], record["base_version"], deltas,
                                 record["model_path"])
            with self._lock:
                self._samplers[sampler_id] = entry
                if record["adapter"] is not None:
                    self._snapshots.append(sampler_id)
        log.info("restored sampler %s from its record", sampler_id)

    def _keep_sampler(self, sampler_id: str, entry: SamplerEntry, adapter: dict[str, Any] | None) -> None:
        """Write the sampler's record, then serve it (`adapter`: an unnamed snapshot's LoRA state)."""
        self.records.write_sampler(sampler_id, {"owner": entry.owner, "base_name": entry.base_name,
                                                "base_version": entry.base_version, "model_path": entry.model_path,
                                                "adapter": adapter})
        evicted = []
        with self._lock:
            self._samplers[sampler_id] = entry
            if adapter is not None:
                self._snapshots.append(sampler_id)
                while len(self._snapshots) > self.max_snapshots:  # an RL loop makes one per step
                    evicted.append(self._snapshots.pop(0))
                    self._samplers.pop(evicted[-1], None)
        for old in evicted:
            self.records.drop_sampler(old)

    # ---- futures

    def submit(self, owner: str, work: Callable[[], dict[str, Any] | bytes], on_worker: bool = True) -> str:
        """Run `work` (on the worker, in arrival order, or on the sampling pool) as a future; its id."""
        request_id = uuid.uuid4().hex

        def run() -> Outcome:
            try:
                return Outcome(body=work())
            except (UserError, LossInputError, WireError, NotFound, ValueError) as exc:
                return Outcome(error=str(exc), category="user")
            # A bug or a resource failure: logged with its traceback, the client told (category
            # "server"), and the worker goes on with the next request.
            except Exception as exc:  # noqa: BLE001
                log.exception("tinker request %s failed", request_id)
                return Outcome(error=f"{type(exc).__name__}: {exc}", category="server")

        future = (self._worker if on_worker else self._sampling).submit(run)
        with self._lock:
            self._results[request_id] = (owner, future)
            while len(self._results) > self.keep_results:
                oldest, (_, done) = next(iter(self._results.items()))
                if not done.done():
                    break
                del self._results[oldest]
        return request_id

    def result(self, request_id: str, owner: str) -> Future[Outcome]:
        with self._lock:
            found = self._results.get(request_id)
        if found is None or found[0] != owner:
            raise NotFound(f"no request {request_id!r} for this API key (results are kept for the last "
                           f"{self.keep_results} requests)")
        return found[1]

    # ---- sessions and models

    def create_session(self, owner: str) -> str:
        session_id = f"session-{uuid.uuid4().hex[:12]}"
        self.records.write_session(session_id, owner)
        with self._lock:
            self._sessions[session_id] = owner
        return session_id

    def check_session(self, session_id: str, owner: str) -> None:
        if session_id not in self._sessions:
            restored = self.records.read_session(session_id)
            if restored is not None:
                with self._lock:
                    self._sessions[session_id] = restored
        self._owned(self._sessions, session_id, owner, "session")

    def create_model(self, owner: str, session_id: str, seq: int, base_name: str, rank: int, seed: int | None,
                     train_attn: bool, train_mlp: bool) -> dict[str, Any]:
        version = self.resolve_base(base_name)
        model_id = f"{session_id}:train:{seq}"
        if model_id in self._models or self.records.has_model(model_id):
            raise UserError(f"model {model_id} exists already (model_seq_id {seq} was used in this session)")
        if not 1 <= rank <= 1024:
            raise UserError(f"LoRA rank must be between 1 and 1024, got {rank}")
        base, _ = self.base(version)
        adapter = AdapterModel(base, LoraSpec(rank, train_attn, train_mlp), seed, self.micro_batch_tokens)
        entry = TrainingEntry(owner, base_name, version, adapter, rank)
        with entry.lock:
            self._write_record(model_id, entry)
        with self._lock:
            self._models[model_id] = entry
        return {"model_id": model_id, "type": "create_model"}

    def info(self, model_id: str, owner: str) -> dict[str, Any]:
        entry = self.model(model_id, owner)
        path = self.registry.get(entry.base_version).path
        return {"type": "get_info", "model_id": model_id, "is_lora": True, "lora_rank": entry.rank,
                "model_name": entry.base_name,
                "model_data": {"arch": type(self.base(entry.base_version)[0]).__name__,
                               "model_name": entry.base_name, "tokenizer_id": str(path)}}

    def forward_backward(self, owner: str, request: FwdBwdRequest) -> bytes:
        entry = self.model(request.model_id, owner)
        config = check_loss(request.loss_fn, request.loss_fn_config)
        if not request.data:
            raise UserError("no data: give at least one datum")
        with entry.lock:
            resent = 0 < request.seq_id <= entry.seq  # applied before a restart or a lost answer: not again
            backward = not request.forward_only and not resent
            outputs, loss = entry.model.forward_backward(request.data, request.loss_fn, config, backward=backward)
            if backward:
                entry.seq = max(entry.seq, request.seq_id)
                self._write_record(request.model_id, entry)
        return encode_forward_backward(outputs, {"loss:sum": loss})

    def optim_step(self, owner: str, model_id: str, seq_id: int | None, params: dict[str, float]) -> dict[str, Any]:
        entry = self.model(model_id, owner)
        with entry.lock:
            if seq_id and seq_id <= entry.seq and entry.last_optim is not None:
                return entry.last_optim  # a resend of the step the record holds
            metrics = entry.model.optim_step(**params)
            entry.seq = max(entry.seq, seq_id or 0)
            entry.last_optim = {"type": "optim_step", "metrics": {f"optim/{k}": v for k, v in metrics.items()}}
            self._write_record(model_id, entry)
        return entry.last_optim

    # ---- checkpoints

    def _checkpoint_file(self, model_id: str, kind: str, name: str, suffix: str) -> Path:
        if not NAME.fullmatch(name):
            raise UserError(f"checkpoint name {name[:80]!r} must be letters, digits, '.', '_' or '-' (at most 128)")
        return model_folder(self.root, model_id) / kind / f"{name}{suffix}"

    def save_state(self, owner: str, model_id: str, name: str, overwrite: bool) -> dict[str, Any]:
        entry = self.model(model_id, owner)
        path = self._checkpoint_file(model_id, "weights", name, ".pt")
        if path.exists() and not overwrite:
            raise UserError(f"checkpoint {name!r} exists for {model_id}; pass overwrite=True or another name")
        with entry.lock:
            state = entry.model.state()
        path.parent.mkdir(parents=True, exist_ok=True)
        buffer = io.BytesIO()
        torch.save({"owner": owner, "base_name": entry.base_name, "base_version": entry.base_version, **state}, buffer)
        write_atomic(path, buffer.getvalue())  # fsynced, then renamed: a checkpoint is whole or absent
        return {"type": "save_weights", "path": f"tinker://{model_id}/weights/{name}"}

    def _read_state(self, owner: str, tinker_path: str) -> dict[str, Any]:
        model_id, kind, name = parse_path(tinker_path)
        if kind != "weights":
            raise UserError(f"{tinker_path} is a sampler checkpoint; load_state takes a save_state path "
                            "(tinker://<model>/weights/<name>)")
        path = self._checkpoint_file(model_id, "weights", name, ".pt")
        if not path.is_file():
            raise NotFound(f"no checkpoint {tinker_path} for this API key")
        state = torch.load(path, weights_only=False)
        if state.get("owner") != owner:
            raise NotFound(f"no checkpoint {tinker_path} for this API key")
        return state

    def load_state(self, owner: str, model_id: str, tinker_path: str, optimizer: bool) -> dict[str, Any]:
        entry = self.model(model_id, owner)
        state = self._read_state(owner, tinker_path)
        if state["base_version"] != entry.base_version:
            raise UserError(f"{tinker_path} was trained on v{state['base_version']}, this model is on "
                            f"v{entry.base_version}")
        with entry.lock:
            entry.model.load_state(state, optimizer)
            self._write_record(model_id, entry)
        return {"type": "load_weights", "path": tinker_path, "model_id": model_id}

    def create_from_state(self, owner: str, session_id: str, seq: int, tinker_path: str,
                          optimizer: bool) -> dict[str, Any]:
        state = self._read_state(owner, tinker_path)
        spec = state["spec"]
        created = self.create_model(owner, session_id, seq, state["base_name"], spec["rank"], 0,
                                    spec["train_attn"], spec["train_mlp"])
        entry = self._models[created["model_id"]]
        with entry.lock:
            entry.model.load_state(state, optimizer)
            self._write_record(created["model_id"], entry)
        return {"type": "load_weights", "path": tinker_path, "model_id": created["model_id"]}

    def save_for_sampler(self, owner: str, model_id: str, name: str | None, session_id: str | None,
                         sampler_seq: int | None) -> dict[str, Any]:
        entry = self.model(model_id, owner)
        if name is None:
            with entry.lock:
                deltas = entry.model.deltas()
                state = entry.model.state()
            adapter = {"spec": state["spec"], "adapter": state["adapter"]}  # the LoRA weights, not the optimizer
            sampler_id = f"{session_id}:sample:{sampler_seq}"
            self._keep_sampler(sampler_id, SamplerEntry(owner, entry.base_name, entry.base_version, deltas), adapter)
            return {"type": "save_weights_for_sampler", "sampling_session_id": sampler_id}
        marker = self._checkpoint_file(model_id, "sampler_weights", name, ".json")
        tinker_path = f"tinker://{model_id}/sampler_weights/{name}"
        _, tokenizer = self.base(entry.base_version)
        with entry.lock:
            checkpoint = self.registry.register(
                entry.model.adapter, tokenizer, parent=entry.base_version, base=entry.base_version,
                note=f"tinker {tinker_path}", metadata={"tinker": {"path": tinker_path, "steps": entry.model.steps}})
        marker.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(marker, json.dumps({"owner": owner, "version": checkpoint.version, "base_name": entry.base_name,
                                    "base_version": entry.base_version}))
        return {"type": "save_weights_for_sampler", "path": tinker_path, "registry_version": checkpoint.version}

    # ---- sampling

    def create_sampler(self, owner: str, session_id: str, seq: int, base_name: str | None,
                       model_path: str | None) -> str:
        sampler_id = f"{session_id}:sample:{seq}"
        if model_path is not None:
            entry = self._named_sampler(owner, model_path)
        elif base_name is not None:
            entry = SamplerEntry(owner, base_name, self.resolve_base(base_name), None)
        else:
            raise UserError("give base_model or model_path")
        self._keep_sampler(sampler_id, entry, None)
        return sampler_id

    def _named_sampler(self, owner: str, model_path: str) -> SamplerEntry:
        """A sampler of a named `save_weights_for_sampler` (its adapter is a Registry version)."""
        model_id, kind, name = parse_path(model_path)
        if kind != "sampler_weights":
            raise UserError(f"{model_path} is not a sampler checkpoint; save one with save_weights_for_sampler")
        marker = self._checkpoint_file(model_id, "sampler_weights", name, ".json")
        record = json.loads(marker.read_text()) if marker.is_file() else None
        if record is None or record["owner"] != owner:
            raise NotFound(f"no sampler checkpoint {model_path} for this API key")
        adapter, _ = load_adapted(self.registry, record["version"])
        return SamplerEntry(owner, record["base_name"], record["base_version"], lora_deltas(adapter), model_path)

    def engine(self, sampler_id: str, entry: SamplerEntry) -> LocalEngine:
        with self._engine_lock:  # one build per sampler, however many of its samples arrive at once
            with self._lock:
                engine = self._engines.get(sampler_id)
                if engine is not None:
                    self._engines.move_to_end(sampler_id)
                    return engine
            base, _ = self.base(entry.base_version)
            view = shared_copy(base) if entry.deltas is None else delta_view(base, entry.deltas)
            engine = LocalEngine(view, self.engine_config)
            with self._lock:
                self._engines[sampler_id] = engine
                evicted = [self._engines.popitem(last=False)[1]
                           for _ in range(len(self._engines) - self.max_engines)]
        for old in evicted:  # its sampler stays; a later sample builds its engine again
            old.close()
        return engine

    def sample(self, owner: str, sampler_id: str, prompt: list[int], num_samples: int, params: SamplingParams,
               prompt_logprobs: bool) -> bytes:
        entry = self.sampler(sampler_id, owner)
        engine = self.engine(sampler_id, entry)
        seeds = [None if params.seed is None else params.seed + i for i in range(num_samples)]
        futures = [engine.submit(prompt, SamplingParams(**{**vars(params), "seed": s})) for s in seeds]
        sequences = []
        for future in futures:
            generation = future.result()
            if generation.finish_reason not in ("stop", "length"):
                raise RuntimeError(f"sampling ended as {generation.finish_reason!r}")
            sequences.append((generation.token_ids, generation.logprobs, generation.finish_reason))
        scored = self._prompt_logprobs(engine.model, prompt) if prompt_logprobs else None
        return encode_sample(sequences, scored)

    @staticmethod
    def _prompt_logprobs(model: PreTrainedModel, prompt: list[int]) -> list[float]:
        with torch.no_grad():
            ids = torch.tensor([prompt])
            logits = model(input_ids=ids).logits[0, :-1].float()  # [len - 1, vocab]: position t predicts t + 1
            logp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:].unsqueeze(-1)).squeeze(-1)
        return [float("nan"), *logp.tolist()]

    def close(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)
        self._sampling.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            engines, self._engines = list(self._engines.values()), OrderedDict()
        for engine in engines:
            engine.close()


def parse_path(tinker_path: str) -> tuple[str, str, str]:
    """tinker://<model id>/<weights | sampler_weights>/<name> -> its three parts."""
    parts = tinker_path.removeprefix("tinker://").split("/") if tinker_path.startswith("tinker://") else []
    if len(parts) != 3 or parts[1] not in ("weights", "sampler_weights"):
        raise UserError(f"{tinker_path[:200]!r} is not a tinker path (tinker://<model>/weights/<name>)")
    return parts[0], parts[1], parts[2]
