"""One Tinker training model: a LoRA adapter on a shared base, its own AdamW, its own checkpoints.

Tinker splits a learning step into calls the client makes: `forward_backward` (any number, each
ADDS its gradient), then `optim_step(AdamParams)`, which applies the sum with the hyperparameters
of that call and clears it. This class does exactly that on a peft adapter:

    model = AdapterModel(base, LoraSpec(rank=8), seed=0)
    outputs, loss = model.forward_backward(datums, "cross_entropy", {}, backward=True)
    metrics = model.optim_step(AdamParams-like fields)
    model.state() / model.load_state(state, optimizer=True)       save_state / load_state
    model.deltas()                                                a snapshot to sample from

Several models train on one base at once: each adapter wraps `shared_copy(base)`, a module tree of
its own whose weights ARE the base's tensors (frozen), so a model costs its adapter, its optimizer
moments and its activations, not another copy of the base.

Departures from Tinker's service:
- LoRA targets: `train_attn` adapts q/k/v/o_proj, `train_mlp` gate/up/down_proj where the base has
  them as linear layers (a dense model such as SmolLM2; a mixture-of-experts' fused experts are not
  adapted). `train_unembed` is not applied: flywheel's adapters leave the (often tied) output head
  alone. LoRA alpha is 32 at every rank (Tinker's convention), so lr scales as it does there.
- A non-finite loss fails its request before its backward and clears the gradients accumulated
  since the last optim_step; a non-finite gradient norm at optim_step skips the step and clears
  them. Either way no NaN reaches the weights.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedModel

from flywheel.model.adapters import LoraConfig, lora_deltas, lora_model, shared_copy
from flywheel.rl.training import pack_batches
from flywheel.tinker.losses import INPUTS, LossInputError, token_losses
from flywheel.tinker.wire import Datum

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
LORA_ALPHA = 32.0


@dataclass(frozen=True)
class LoraSpec:
    rank: int
    train_attn: bool = True
    train_mlp: bool = True

    def targets(self, base: PreTrainedModel) -> list[str]:
        """The module names to adapt that `base` has as linear layers."""
        wanted = (ATTENTION if self.train_attn else ()) + (MLP if self.train_mlp else ())
        linear = {name.rsplit(".", 1)[-1] for name, m in base.named_modules() if isinstance(m, torch.nn.Linear)}
        found = [name for name in wanted if name in linear]
        if not found:
            raise LossInputError(f"{type(base).__name__} has none of {list(wanted)} as linear layers to adapt; "
                                 "set train_attn=True")
        return found


class AdapterModel:
    def __init__(self, base: PreTrainedModel, spec: LoraSpec, seed: int | None = None,
                 micro_batch_tokens: int = 4096):
        self.spec = spec
        config = LoraConfig(rank=spec.rank, alpha=LORA_ALPHA, target_modules=spec.targets(base))
        with torch.random.fork_rng():  # the adapter's init from `seed`, leaving the process's stream alone
            torch.manual_seed(random.randrange(2**31) if seed is None else seed)
            self.adapter = lora_model(shared_copy(base), config, copy_base=False)
        self.adapter.train()
        self.params = [p for p in self.adapter.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=1e-4)
        self.micro_batch_tokens = micro_batch_tokens
        self.steps = 0
        self.skipped_steps = 0

    def forward_backward(self, data: Sequence[Datum], loss_fn: str, config: dict[str, float],
                         backward: bool) -> tuple[list[dict[str, np.ndarray]], float]:
        """Per datum {logprobs, elementwise_loss} ([tokens] float32), and the loss summed over the data.
        With `backward`, the loss's gradient is added to what earlier calls accumulated."""
        for i, datum in enumerate(data):
            needed = {"target_tokens", *INPUTS[loss_fn]} - set(datum.inputs)
            if needed:
                raise LossInputError(f"datum {i}: {loss_fn} needs loss_fn_inputs {sorted(needed)}")
        vocab = self.adapter.get_input_embeddings().num_embeddings
        for i, datum in enumerate(data):
            ids = [*datum.tokens, *datum.inputs["target_tokens"].tolist()]
            if not datum.tokens or min(ids) < 0 or max(ids) >= vocab:
                raise LossInputError(f"datum {i}: token ids must be in [0, {vocab}) and the input non-empty")
        outputs: list[dict[str, np.ndarray]] = [{} for _ in data]
        total = 0.0
        batches = pack_batches([len(d.tokens) for d in data], self.micro_batch_tokens, random.Random(0))
        with torch.set_grad_enabled(backward):
            for rows in batches:
                losses = self._micro_batch([data[i] for i in rows], loss_fn, config)
                loss = sum(loss_sum for loss_sum, _, _ in losses)
                if not torch.isfinite(loss):
                    self.optimizer.zero_grad(set_to_none=True)
                    raise LossInputError(f"the {loss_fn} loss is not finite ({float(loss)}); the gradients "
                                         "accumulated since the last optim_step were cleared")
                if backward:
                    loss.backward()
                total += float(loss.detach())
                for i, (_, logp, elementwise) in zip(rows, losses, strict=True):
                    outputs[i] = {"logprobs": logp, "elementwise_loss": elementwise}
        return outputs, total

    def _micro_batch(self, data: list[Datum], loss_fn: str,
                     config: dict[str, float]) -> list[tuple[torch.Tensor, np.ndarray, np.ndarray]]:
        width = max(len(d.tokens) for d in data)
        ids = torch.zeros((len(data), width), dtype=torch.long)  # [batch, seq], right-padded
        attention = torch.zeros_like(ids)
        for row, datum in enumerate(data):
            ids[row, : len(datum.tokens)] = torch.tensor(datum.tokens)
            attention[row, : len(datum.tokens)] = 1
        logits = self.adapter(input_ids=ids, attention_mask=attention).logits.float()  # [batch, seq, vocab]
        logz = torch.logsumexp(logits, dim=-1)  # [batch, seq]
        out = []
        for row, datum in enumerate(data):
            n = len(datum.tokens)
            targets = torch.from_numpy(datum.inputs["target_tokens"].astype(np.int64))
            logp = logits[row, :n].gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logz[row, :n]  # [tokens]
            inputs = {k: torch.from_numpy(v.astype(np.float32))
                      for k, v in datum.inputs.items() if k != "target_tokens"}
            terms = token_losses(loss_fn, logp, inputs, config)  # [tokens]
            out.append((terms.sum(), logp.detach().numpy().copy(), terms.detach().numpy().astype(np.float32)))
        return out

    def optim_step(self, learning_rate: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                   grad_clip_norm: float) -> dict[str, float]:
        """AdamW on the accumulated gradients with this call's hyperparameters; the gradients are cleared."""
        for group in self.optimizer.param_groups:
            group.update(lr=learning_rate, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay)
        grads = [p.grad for p in self.params if p.grad is not None]
        norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))) \
            if grads else 0.0
        if not np.isfinite(norm):
            self.skipped_steps += 1
            self.optimizer.zero_grad(set_to_none=True)
            return {"grad_norm": norm, "skipped": 1.0}
        if grad_clip_norm > 0:
            torch.nn.utils.clip_grad_norm_(self.params, grad_clip_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        return {"grad_norm": norm, "skipped": 0.0}

    def deltas(self) -> dict[str, torch.Tensor]:
        """The adapter's current delta per adapted base weight: what a sampler snapshot keeps."""
        return lora_deltas(self.adapter)

    def state(self) -> dict[str, Any]:
        from peft import get_peft_model_state_dict  # noqa: PLC0415

        adapter = {k: v.detach().clone() for k, v in get_peft_model_state_dict(self.adapter).items()}
        return {"spec": dict(vars(self.spec)), "adapter": adapter, "optimizer": self.optimizer.state_dict(),
                "steps": self.steps, "skipped_steps": self.skipped_steps}

    def pending_gradients(self) -> list[torch.Tensor | None]:
        """The gradient accumulated since the last optim_step, per trainable weight (None: none yet)."""
        return [None if p.grad is None else p.grad.detach().clone() for p in self.params]

    def set_pending_gradients(self, grads: list[torch.Tensor | None]) -> None:
        if len(grads) != len(self.params):
            raise ValueError(f"{len(grads)} gradients for {len(self.params)} trainable weights")
        for p, g in zip(self.params, grads, strict=True):
            p.grad = None if g is None else g.clone()

    def load_state(self, state: dict[str, Any], optimizer: bool) -> None:
        from peft import set_peft_model_state_dict  # noqa: PLC0415

        if state["spec"] != vars(self.spec):
            raise LossInputError(f"the checkpoint's LoRA {state['spec']} differs from this model's {vars(self.spec)}; "
                                 "create a training client from the checkpoint instead")
        set_peft_model_state_dict(self.adapter, state["adapter"])
        if optimizer:
            self.optimizer.load_state_dict(state["optimizer"])
            self.steps, self.skipped_steps = int(state["steps"]), int(state["skipped_steps"])
        self.optimizer.zero_grad(set_to_none=True)

