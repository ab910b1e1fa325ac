"""What a restart of `flywheel tinker serve` keeps of its clients: sessions, training models, samplers.

A Tinker script holds a session and training clients for hours; the server process may die under
it (a kill -9, a deploy). So every session and every training model is written to the server's
folder (`root`) the moment the server acknowledges a change to it, and read back the first time a
request names it after a restart: the SDK's existing client object (same session, same model_id)
goes on where the last acknowledged request left it.

    root/sessions/<session id>.json        {"owner"}                       at create_session
    root/<model folder>/client.pt          owner, base, LoRA shape,        at create_model, at every
                                           adapter + AdamW state,          forward_backward, optim_step
                                           the gradient accumulated        and load_state, before its
                                           since the last optim_step,      result is acknowledged
                                           the last applied seq_id
    root/samplers/<sampler id>.pt          owner, base, and what it        at create_sampling_session
                                           samples: the base, a named      and at every unnamed
                                           sampler save's path, or an      save_weights_for_sampler,
                                           unnamed snapshot's LoRA         before its id is answered
                                           weights (not its dense deltas)

Each write replaces the whole record atomically (flywheel/store/files.py): a record is the old one
or the new one, never half. One record per model, rewritten at each change, instead of the last
save_state plus a journal of requests: a restart reads one file and replays nothing. It costs a
write of adapter + moments + gradient per training request (a few MB for a rank-16 adapter of a
135M model; a fsync of ~20 ms on this project's VM), small next to the request's forward and backward.

Resends: the SDK resends a request whose POST lost its connection, and after a kill it cannot know
whether the dead server had applied it. The record keeps the seq_id (the SDK's per-client request
counter) of the last request applied into it; a forward_backward or optim_step whose seq_id is not
above it is a resend: the forward_backward is answered without adding its gradient again, the
optim_step with the metrics the applied one returned. Nothing is applied twice.

A sampler comes back like a model: the first request that names it after a restart (a sample, a
join, a lookup) rebuilds it from its record, so an RL loop's `SamplingClient` from
`save_weights_and_get_sampling_client` samples the same weights as before the kill. The newest
`max_snapshots` unnamed snapshots keep a record (an evicted one's record is deleted with it).

What a restart still loses: requests in flight (their futures answer 404 and fail on the client;
the client's next requests are served).
"""

from __future__ import annotations

import io
import json
import re
from pathlib import Path
from typing import Any

import torch

from flywheel.store.files import write_atomic

SESSION_ID = re.compile(r"session-[0-9a-f]{12}")
MODEL_ID = re.compile(r"(session-[0-9a-f]{12}):train:([0-9]{1,9})")
SAMPLER_ID = re.compile(r"(session-[0-9a-f]{12}):sample:([0-9]{1,9})")


def model_folder(root: Path, model_id: str) -> Path:
    """The folder of a model's record and checkpoints (`:` is not allowed in every file system)."""
    return root / model_id.replace(":", "_")


class ClientRecords:
    def __init__(self, root: Path):
        self.root = root
        (root / "sessions").mkdir(parents=True, exist_ok=True)
        (root / "samplers").mkdir(parents=True, exist_ok=True)

    def write_session(self, session_id: str, owner: str) -> None:
        write_atomic(self.root / "sessions" / f"{session_id}.json", json.dumps({"owner": owner}))

    def read_session(self, session_id: str) -> str | None:
        """The session's owner, or None where there is no such record (or the id is not one of ours)."""
        path = self.root / "sessions" / f"{session_id}.json"
        if not SESSION_ID.fullmatch(session_id) or not path.is_file():
            return None
        return json.loads(path.read_text())["owner"]

    def write_model(self, model_id: str, record: dict[str, Any]) -> None:
        folder = model_folder(self.root, model_id)
        folder.mkdir(parents=True, exist_ok=True)
        _save(folder / "client.pt", record)

    def read_model(self, model_id: str) -> dict[str, Any] | None:
        path = model_folder(self.root, model_id) / "client.pt"
        if not MODEL_ID.fullmatch(model_id) or not path.is_file():
            return None
        return torch.load(path, weights_only=False)

    def write_sampler(self, sampler_id: str, record: dict[str, Any]) -> None:
        _save(self._sampler_path(sampler_id), record)

    def read_sampler(self, sampler_id: str) -> dict[str, Any] | None:
        """The sampler's record, or None where there is none (or the id is not one of ours)."""
        if not SAMPLER_ID.fullmatch(sampler_id) or not self._sampler_path(sampler_id).is_file():
            return None
        return torch.load(self._sampler_path(sampler_id), weights_only=False)

    def drop_sampler(self, sampler_id: str) -> None:
        self._sampler_path(sampler_id).unlink(missing_ok=True)

    def _sampler_path(self, sampler_id: str) -> Path:
        return self.root / "samplers" / f"{sampler_id.replace(':', '_')}.pt"

    def has_model(self, model_id: str) -> bool:
        return (model_folder(self.root, model_id) / "client.pt").is_file()


def _save(path: Path, record: dict[str, Any]) -> None:
    """`record` as one torch file, replaced atomically (the old record or the new, never half)."""
    buffer = io.BytesIO()
    torch.save(record, buffer)
    write_atomic(path, buffer.getvalue())
