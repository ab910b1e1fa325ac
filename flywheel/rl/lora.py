"""The Learner over a LoRA adapter: a pretrained model trained by the same step as the embedded
default, with only the adapter's weights moving.

    learner = LoraLearner(adapter, config)     # adapter: a PeftModel (flywheel/model/adapters.py)
    learner.train_step(trajectories, advantages)
    engine.update_weights(learner.weights(), learner.version)   # base + delta, plain names

What changes from `Learner` and why:
- the optimizer holds the adapter's weights only (its moments too: ~1% of a full model's);
- `weights()`, what the engine loads after a step, is the merged model (base + the LoRA delta of
  each adapted projection) keyed as the plain model, so the engine (and vLLM) keep serving a plain
  model and need nothing of peft;
- `state()` / `load_state()`, what a run checkpoints and resumes, hold the adapter and its
  optimizer, not the frozen base, which the run reloads from the Registry.
The loss, the micro-batching, the proximal pass and the non-finite guard are the Learner's.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
from transformers import PreTrainedModel

from flywheel.model.adapters import merged_weights
from flywheel.rl.learner import Learner, LearnerConfig


class LoraLearner(Learner):
    def __init__(self, adapter: Any, config: LearnerConfig, ref_model: PreTrainedModel | None = None,
                 version: int = 0):
        self.adapter = adapter
        # The Learner scores through the HF model's own parts (base_model + lm_head); peft injected
        # the LoRA layers into that very model, so a step trains the adapter through it.
        super().__init__(adapter.get_base_model().train(), config, ref_model=ref_model, version=version)

    def _parameter_groups(self) -> Any:
        return [p for p in self.model.parameters() if p.requires_grad]

    def weights(self) -> dict[str, torch.Tensor]:
        return merged_weights(self.adapter)

    def adapter_weights(self) -> dict[str, torch.Tensor]:
        from peft import get_peft_model_state_dict  # noqa: PLC0415

        return {k: v.detach().clone() for k, v in get_peft_model_state_dict(self.adapter).items()}

    def state(self) -> dict[str, Any]:
        return {"version": self.version, "adapter": self.adapter_weights(),
                "optimizer": copy.deepcopy(self.optimizer.state_dict()),
                "optimizer_steps": self.optimizer_steps, "skipped_steps": self.skipped_steps}

    def load_state(self, state: Mapping[str, Any]) -> None:
        from peft import set_peft_model_state_dict  # noqa: PLC0415

        missing = {"version", "adapter", "optimizer", "optimizer_steps", "skipped_steps"} - set(state)
        if missing:
            raise ValueError(f"LoRA learner state lacks {sorted(missing)}; the run was checkpointed without "
                             "lora (a full-weights run): resume it without [lora], or start a new run_dir")
        result = set_peft_model_state_dict(self.adapter, state["adapter"])
        if getattr(result, "unexpected_keys", None):
            raise ValueError(f"the checkpointed adapter does not fit this one: {result.unexpected_keys[:3]}")
        self.optimizer.load_state_dict(state["optimizer"])
        self.version = int(state["version"])
        self.optimizer_steps = int(state["optimizer_steps"])
        self.skipped_steps = int(state["skipped_steps"])
