"""Weight deltas: push only the blocks of weights that changed since the engine's last update.

An RL step moves few weights by a whole representable step: Composer 2's inference partner reports
over 98% of bf16 weights bit-identical between consecutive steps, and in a mixture of experts the
experts and embedding rows a batch never reached keep their exact bits whenever the optimizer has
no momentum for them. A full push copies (and, between processes, serialises and sends) every
weight anyway. `diff_weights` compares the new weights with the ones the engine holds, bit for bit:
an unchanged tensor is not sent, and a changed one is sent as whichever is smallest of its changed
elements with their indices (a 4-byte index each: pays where a few scattered elements changed, the
bf16 case), its changed blocks of `block` elements with their indices (contiguous changes: a few
embedding rows), or the whole tensor. `WeightDelta.apply` writes them in place, so
the engine's weights after a delta are bit-identical to those after a full push (tested).

`DeltaSender` keeps a copy of what it last sent (one model's worth of memory on the sender) and
the version it was, so that each delta states the version it applies to: an engine at another
version (restarted, or its update lost) refuses it, and the sender sends a full update instead.

Measured (`bench/engine.py --weight-deltas`, docs/moe-rl.md): bf16 at lr 1e-6 sends 5.7% of the bytes;
float32 AdamW moves every weight, and on one host the comparison costs more than the copy it saves.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

BLOCK = 1024  # elements per block of the block encoding; single elements are the other sparse encoding

_BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16,
         torch.float64: torch.int64}


@dataclass
class WeightDelta:
    """Changed weights since `base_version` (None: a full update, applies whatever the engine holds).

    full: name -> the whole tensor; blocks: name -> (block size b, block indices [n] int32, their
    values [n, b], the tensor's last block padded with zeros); b = 1: changed elements one by one."""
    version: int
    base_version: int | None
    full: dict[str, torch.Tensor] = field(default_factory=dict)
    blocks: dict[str, tuple[int, torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data it carries (what a process boundary serialises, indices included)."""
        return (sum(t.numel() * t.element_size() for t in self.full.values())
                + sum(i.numel() * i.element_size() + v.numel() * v.element_size() for _, i, v in self.blocks.values()))

    @torch.no_grad()
    def apply(self, target: Mapping[str, torch.Tensor]) -> None:
        """Write the changes into `target`'s tensors in place (a state dict: a model's shares its storage)."""
        unknown = (self.full.keys() | self.blocks.keys()) - target.keys()
        if unknown:
            raise ValueError(f"weight delta names {sorted(unknown)[:3]} that the model does not have: it was made for "
                             "another architecture")
        for name, value in self.full.items():
            target[name].copy_(value)
        for name, (block, index, values) in self.blocks.items():
            flat = target[name].view(-1)
            positions = (index.long().unsqueeze(1) * block + torch.arange(block)).reshape(-1)  # [n * block]
            inside = positions < flat.numel()  # the last block's padding
            flat[positions[inside].to(flat.device)] = values.reshape(-1)[inside].to(flat.device, flat.dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as integers, flattened: equal bits compare equal (NaN, -0.0 included)."""
    t = t.detach().contiguous().reshape(-1)
    return t.view(_BITS[t.dtype]) if t.dtype in _BITS else t


@torch.no_grad()
def diff_weights(previous: Mapping[str, torch.Tensor], current: Mapping[str, torch.Tensor], version: int,
                 base_version: int, block: int = BLOCK) -> WeightDelta:
    """What turns `previous` (the engine's weights, at `base_version`) into `current` (`version`)."""
    delta = WeightDelta(version, base_version)
    for name, cur in current.items():
        prev = previous.get(name)
        if prev is None or prev.shape != cur.shape or prev.dtype != cur.dtype:
            delta.full[name] = cur.detach().clone()
            continue
        changed = _bits(prev).to(cur.device) != _bits(cur)  # [n]
        elements = int(changed.sum())
        if elements == 0:
            continue
        n, size = changed.numel(), cur.element_size()
        count = math.ceil(n / block)
        pad = count * block - n
        changed_blocks = torch.nn.functional.pad(changed, (0, pad)).view(count, block).any(1)  # [blocks]
        blocks = int(changed_blocks.sum())
        cost = {"full": n * size, "elements": elements * (4 + size), "blocks": blocks * (4 + block * size)}
        choice = min(cost, key=cost.get)
        if choice == "full":
            delta.full[name] = cur.detach().clone()
        elif choice == "elements":
            index = changed.nonzero().squeeze(1)
            delta.blocks[name] = (1, index.to(torch.int32).cpu(), cur.detach().reshape(-1)[index].unsqueeze(1).clone())
        else:
            index = changed_blocks.nonzero().squeeze(1)
            values = torch.nn.functional.pad(cur.detach().reshape(-1), (0, pad)).view(count, block)[index].clone()
            delta.blocks[name] = (block, index.to(torch.int32).cpu(), values)
    return delta


def weights_digest(weights: Mapping[str, torch.Tensor]) -> str:
    """A hash of the weights' names, shapes, dtypes and bits: two engines with the same digest hold the
    same weights bit for bit (what a delta must leave an engine with: the full push's)."""
    h = hashlib.sha256()
    for name in sorted(weights):
        t = weights[name].detach().cpu().contiguous().reshape(-1)
        h.update(f"{name}:{tuple(weights[name].shape)}:{t.dtype};".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class DeltaSender:
    """Turns each new set of weights into a `WeightDelta` against the last one sent.

    `delta(weights, version)`: a full update the first time (and after `reset`, e.g. when an engine
    refused a delta), then only the changes. Keeps a copy of the last weights sent."""

    def __init__(self, block: int = BLOCK):
        self.block = block
        self._last: dict[str, torch.Tensor] | None = None
        self._version: int | None = None

    def reset(self) -> None:
        self._last, self._version = None, None

    @property
    def version(self) -> int | None:
        """The version of the last weights sent (None: nothing sent since the start or a reset)."""
        return self._version

    @property
    def weights(self) -> dict[str, torch.Tensor] | None:
        """The sender's copy of the last weights sent (a full update of them needs no other copy);
        the next `delta` changes it in place."""
        return self._last

    def delta(self, weights: Mapping[str, torch.Tensor], version: int) -> WeightDelta:
        if self._last is None:
            out = WeightDelta(version, None, full={k: v.detach().clone() for k, v in weights.items()})
            self._last = {k: v.detach().clone() for k, v in weights.items()}
        else:
            out = diff_weights(self._last, weights, version, self._version, self.block)
            out.apply(self._last)
        self._version = version
        return out


class DeltaPush:
    """An Engine whose `update_weights` sends `WeightDelta`s to the engine it wraps (a LocalEngine
    or ProcessEngine); everything else is the wrapped engine's. An engine that refuses a delta (its
    version is not the one the delta is against) gets the whole weights instead.

    `last_update_bytes`: the tensor bytes of the last update sent; `full_bytes`: a full update's."""

    def __init__(self, engine, block: int = BLOCK):
        self._engine = engine
        self._sender = DeltaSender(block)
        self.last_update_bytes = 0
        self.full_bytes = 0

    def update_weights(self, weights: Mapping[str, torch.Tensor], version: int, timeout_s: float = 60.0) -> None:
        delta = self._sender.delta(weights, version)
        try:
            self._engine.update_weights(delta, version, timeout_s=timeout_s)
        except ValueError:
            if delta.base_version is None:
                raise
            self._sender.reset()
            delta = self._sender.delta(weights, version)
            self._engine.update_weights(delta, version, timeout_s=timeout_s)
        self.last_update_bytes = delta.nbytes
        self.full_bytes = sum(t.numel() * t.element_size() for t in weights.values())

    def __getattr__(self, name: str):
        return getattr(self._engine, name)
