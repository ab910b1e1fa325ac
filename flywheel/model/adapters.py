"""LoRA adapters of a pretrained model (peft): made, loaded, merged, served and exported.

A pretrained model is trained through LoRA rather than in full: on 2 CPU cores a full AdamW step on
SmolLM2-135M moves 135M weights and keeps two moments of each; an adapter of rank 8 on the attention
projections is about 1% of that, and it is the usual way to specialize a checkpoint one did not
pretrain. The same Learner step trains it (flywheel/rl/lora.py: `LoraLearner`, simulated RL and the
live cycle; flywheel/rl/sft.py for SFT); an organization's adapter is one too (flywheel/live/orgs.py).

    lora_model(base, config)         base (a copy) with a fresh adapter; only the adapter trains
    start_lora(registry, ref, cfg)   the adapter to train from a Registry version: a fresh one on a full
                                     version, or that version's own adapter continued (trainable)
    load_adapted(registry, v)        an adapter version on its base (a PeftModel)
    merged(adapter)                  plain weights, base + delta, a copy (the gate, an engine)
    merged_weights(adapter)          base + delta as a plain model's state_dict, keyed as the base is:
                                     what an engine's `update_weights` takes after every Learner step
    adapter_view(base, adapter)      a plain model sharing every tensor the adapter leaves alone with
                                     `base` (several served adapters over one base in memory)
    export_merged(registry, v, out)  a plain HF folder of base + adapter, for any tool that loads one

A Registry version may be an adapter (its folder: peft's adapter files and the tokenizer; its record:
`base`, and `org_id` for an organization's). `Registry.load` gives a general adapter version (no
organization) merged onto its base, so `eval`, `serve`, the gate and `train` take it as any version.

Engines serve base + adapter as merged weights: the engine's batched decode and its lean decoder stay
as they are, and vLLM takes them through its ordinary weight update (flywheel/model/vllm_engine.py).
vLLM's own LoRA serving (`--enable-lora`, an adapter per request) is not used: it loads adapters from
files, so every Learner step would be a new adapter to write and load, where a weight update is one
copy; and its CPU build has no LoRA kernels.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from pydantic import BaseModel, ConfigDict, Field
from transformers import PreTrainedModel, PreTrainedTokenizerBase

if TYPE_CHECKING:
    from flywheel.model.registry import Checkpoint, Registry


class LoraConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # Rank and scale: rank 8 on the attention projections is 0.5% of the tiny model's weights, 1.1%
    # of SmolLM2-135M's. Higher ranks fit the batch more closely and forget more of the base.
    rank: int = Field(8, ge=1)
    alpha: float = Field(16.0, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    # Module names of the base to adapt (Llama, Qwen2/3, Mistral name their attention projections so).
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
                                      min_length=1)


def lora_model(base: PreTrainedModel, config: LoraConfig, copy_base: bool = True) -> Any:
    """`base` (a copy, unless `copy_base` is False: then base itself gets the LoRA layers) with a fresh
    LoRA adapter; only it trains."""
    from peft import LoraConfig as PeftLoraConfig  # noqa: PLC0415  (peft imports accelerate)
    from peft import get_peft_model  # noqa: PLC0415

    lora = PeftLoraConfig(r=config.rank, lora_alpha=config.alpha, lora_dropout=config.dropout,
                          target_modules=list(config.target_modules), bias="none")
    model = get_peft_model(copy.deepcopy(base) if copy_base else base, lora)
    if sum(p.numel() for p in model.parameters() if p.requires_grad) == 0:
        raise ValueError("the adapter has no trainable weights; check that lora.target_modules names modules of "
                         f"{type(base).__name__}")
    return model


def load_adapted(registry: Registry, version: int | str, trainable: bool = False,
                 dtype: torch.dtype | str | None = None) -> tuple[Any, PreTrainedTokenizerBase]:
    """The adapter version's base with the adapter applied (a PeftModel), and its tokenizer;
    `trainable`: its LoRA weights train (continuing it)."""
    from peft import PeftModel  # noqa: PLC0415

    checkpoint = registry.get(version)
    if checkpoint.base is None:
        raise ValueError(f"v{checkpoint.version} is a full checkpoint, not an adapter; load it with Registry.load")
    base, tokenizer = registry.load(checkpoint.base, dtype=dtype)
    model = PeftModel.from_pretrained(base, str(checkpoint.path), is_trainable=trainable)
    return (model.train() if trainable else model.eval()), tokenizer


def start_lora(registry: Registry, ref: int | str, config: LoraConfig,
               dtype: torch.dtype | str | None = None) -> tuple[Any, PreTrainedTokenizerBase, Checkpoint]:
    """(the adapter to train, the tokenizer, the full version it applies on) for training from
    Registry version `ref`: a fresh adapter on a full version, or an adapter version continued (its
    own rank and modules; `config` then only checks that it is one of flywheel's general adapters)."""
    checkpoint = registry.get(ref)
    if checkpoint.base is None:
        model, tokenizer = registry.load(checkpoint.version, dtype=dtype)
        return lora_model(model, config, copy_base=False), tokenizer, checkpoint
    if checkpoint.org_id:
        raise ValueError(f"v{checkpoint.version} is organization {checkpoint.org_id!r}'s adapter; train it in the "
                         f"live cycle's organization stage, or start from its base v{checkpoint.base}")
    model, tokenizer = load_adapted(registry, checkpoint.version, trainable=True, dtype=dtype)
    return model, tokenizer, registry.get(checkpoint.base)


def merged(adapter: Any) -> PreTrainedModel:
    """Plain weights with the adapter folded in (a copy), for an engine or the gate."""
    return copy.deepcopy(adapter).merge_and_unload().eval()


def lora_deltas(adapter: Any) -> dict[str, torch.Tensor]:
    """{base parameter name: its LoRA delta (B @ A * scale)} for every adapted weight."""
    from peft.tuners.lora import LoraLayer  # noqa: PLC0415

    deltas: dict[str, torch.Tensor] = {}
    for name, module in adapter.named_modules():
        if isinstance(module, LoraLayer) and module.active_adapters:
            with torch.no_grad():
                delta = sum(module.get_delta_weight(a) for a in module.active_adapters if a in module.lora_A)
            deltas[name.removeprefix("base_model.model.") + ".weight"] = delta
    return deltas


def merged_weights(adapter: Any) -> dict[str, torch.Tensor]:
    """The base's state_dict with each adapted weight replaced by base + delta, keyed as the plain
    model's (no `base_layer`, no LoRA tensors): copies, tied tensors kept one tensor."""
    deltas = lora_deltas(adapter)
    inner = adapter.get_base_model()
    copies: dict[tuple[int, tuple[int, ...], torch.dtype], torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in inner.state_dict().items():
        if ".lora_" in name:
            continue
        plain = name.replace(".base_layer.", ".")
        if plain in deltas:
            out[plain] = (tensor + deltas[plain].to(tensor.dtype)).detach()
            continue
        key = (tensor.data_ptr(), tuple(tensor.shape), tensor.dtype)
        if key not in copies:
            copies[key] = tensor.detach().clone()
        out[plain] = copies[key]
    return out


def adapter_view(base: PreTrainedModel, adapter: Any) -> PreTrainedModel:
    """`base` with `adapter` merged into the modules it adapts, sharing every other tensor with
    `base` (module docstring). `base` is not changed; the view's shared tensors must not be trained."""
    deltas = lora_deltas(adapter)
    params = dict(base.named_parameters())
    missing = sorted(set(deltas) - set(params))
    if missing:
        raise ValueError(f"the adapter adapts {missing[:3]}, which {type(base).__name__} lacks; pass the base it "
                         "was trained on")
    # deepcopy with a memo: every tensor named in it is taken as is (shared), the rest is copied.
    memo: dict[int, Any] = {id(t): t for n, t in params.items() if n not in deltas}
    memo |= {id(b): b for _, b in base.named_buffers()}
    view = copy.deepcopy(base, memo)
    with torch.no_grad():
        for name, delta in deltas.items():
            view.get_parameter(name).data = params[name].data + delta.to(params[name].dtype)
    return view.eval()


def shared_copy(base: PreTrainedModel) -> PreTrainedModel:
    """A module of its own (an engine may set attributes on it) whose every tensor IS `base`'s."""
    memo: dict[int, Any] = {id(t): t for t in [*base.parameters(), *base.buffers()]}
    return copy.deepcopy(base, memo).eval()


def export_merged(registry: Registry, ref: int | str, out: str | Path) -> Path:
    """Registry version `ref` as a plain HF folder at `out` (an adapter merged onto its base; full
    weights as they are): `AutoModelForCausalLM.from_pretrained(out)` loads it with no peft."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} exists and is not empty; give a new folder")
    checkpoint = registry.get(ref)
    if checkpoint.base is not None:
        adapter, tokenizer = load_adapted(registry, checkpoint.version)
        model = adapter.merge_and_unload().eval()
    else:
        model, tokenizer = registry.load(checkpoint.version)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out
