"""Per-organization specialization: a LoRA adapter per organization with enough traffic, on the
shared production base, trained on that organization's own on-policy data.

    orgs = orgs_with_traffic(completions, rewards, version=production, min_completions=cfg.min_completions)
    adapter, metrics = train_org_adapter(base_model, batch, learner_config, cfg)        # peft LoRA
    checkpoint = register_adapter(registry, adapter, tokenizer, base=production, org_id="acme")
    decision = gate_decision(org_run, general_run)       # the org's battery AND the general one

Why an adapter and not a full copy: every organization shares the production base, so an adapter
of rank r on the attention projections is a few hundred KB per organization (the base is the same
file for all), trains on little data without forgetting the general distribution as much, and can
be dropped (rolled back) without touching anyone else's model.

What an organization's traffic is: completions whose `org_id` (the API key's, flywheel/live/server.py)
names it. "Enough traffic": `min_completions` trainable on-policy completions of the version its
requests are served by (the base, or its deployed adapter) in the cycle's window. Organizations
below it are served by the base and trained with everyone else's traffic.

The gate. An adapter must pass two batteries, each with the gate's paired non-inferiority checks
(flywheel/live/gate.py): the organization's own eval tasks (its conventions) and the general
battery. It passes only when neither shows a significant regression (`gate_decision`): an adapter
that learnt the house style by forgetting how to fix bugs is rejected.

Registry. An adapter is a Registry version like any checkpoint (`register_adapter`): its folder
holds peft's adapter_model.safetensors + adapter_config.json and the tokenizer, and flywheel.json
records `base` (the base version it applies on) and `org_id`. `parent` is the organization's previous
adapter, or the base for its first. Aliases per organization: `production-<org>` and
`candidate-<org>` (`org_alias`), so promotion and rollback of one organization move only its own.
`load_adapted(registry, version)` loads the base and applies the adapter (peft), and `merged(...)`
folds it into plain weights for an engine (flywheel/model/adapters.py, which every LoRA adapter shares).

Serving several adapters without reloading the base: `adapter_view(base, adapter)` is a plain
model (any engine runs it, the lean decoder included) whose every tensor the adapter does not
touch IS the base's tensor (same storage), and whose adapted projections hold base + the LoRA
delta, merged once. That is the "merged-weights cache per adapter, base shared" design, chosen over
per-request adapter selection inside the engine's batch: the engine's batched decode and its lean
decoder stay as they are (no per-row adapter matmuls), and an adapter costs the memory of its
adapted projections only (on the tiny model, the attention projections: experts and embeddings,
most of an MoE's weights, are shared). Its cost: one engine (a batch of its own) per served adapter.

Routing (flywheel/live/server.py): `LiveServer.set_org_deployment(org, Deployment(production=a1,
candidate=a2, candidate_fraction=f))` gives the organization a Router of its own over adapter
versions, loaded by `adapter_loader` on the tensors of the base the main Router serves; its requests
(the key's org) go there, A/B split by session within that organization's traffic; `None` rolls
the organization back to the shared deployment. Everyone else is untouched.

The live cycle drives all of this per organization (flywheel/live/cycle.py, `orgs`): gather its
traffic, train, gate on both batteries, deploy, A/B, decide. An organization's deployment may name
a full checkpoint as its production: the base its first adapter is A/B tested against.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from flywheel.live.batch import OnPolicyBatch
from flywheel.live.deploy import PINNED, Deployment
from flywheel.live.gate import GateRun
from flywheel.live.records import Completion
from flywheel.live.rewards import Reward
from flywheel.model.adapters import LoraConfig, adapter_view, load_adapted, lora_model, shared_copy
from flywheel.model.engine import EngineConfig, LocalEngine
from flywheel.model.registry import CANDIDATE, METADATA_FILE, PRODUCTION, Checkpoint, CheckpointNotFound, Registry
from flywheel.model.tokenizer import load_tokenizer
from flywheel.rl.learner import Learner, LearnerConfig

_ORG = re.compile(r"[a-z0-9_-]{1,40}")


class OrgAdapterConfig(LoraConfig):
    """An organization's adapter: the LoRA settings (flywheel/model/adapters.py) and when it gets one."""

    # Trainable on-policy completions of an organization per cycle before it gets (or retrains) its
    # adapter. Lower specializes smaller customers sooner, on noisier batches.
    min_completions: int = Field(64, ge=2)


def check_org_id(org_id: str) -> str:
    """An organization id that can name aliases and folders: [a-z0-9_-]{1,40}."""
    if not _ORG.fullmatch(org_id):
        raise ValueError(f"organization id {org_id!r} must match [a-z0-9_-]{{1,40}} to have its own adapter; "
                         "use e.g. its slug")
    return org_id


def org_alias(alias: str, org_id: str) -> str:
    """The Registry alias of one organization's `production` / `candidate` adapter."""
    return f"{alias}-{check_org_id(org_id)}"


def sync_org_aliases(registry: Registry, org_id: str, deployment: Deployment | None) -> None:
    """Point `production-<org>` / `candidate-<org>` at the organization's deployment (the shared
    `deploy.sync_aliases`, per organization); None removes both: it is served the shared base."""
    for alias, version in ((PRODUCTION, deployment.production if deployment else None),
                           (CANDIDATE, deployment.candidate if deployment else None)):
        if version is not None:
            registry.set_alias(org_alias(alias, org_id), version)
            continue
        try:
            registry.remove_alias(org_alias(alias, org_id))
        except CheckpointNotFound:
            pass  # there was none to remove


def orgs_with_traffic(completions: Sequence[Completion], rewards: dict[str, Reward], version: int,
                      min_completions: int) -> dict[str, list[Completion]]:
    """Organizations with at least `min_completions` trainable user-routed completions of `version`,
    and those completions (in the order given). Completions without an org are nobody's."""
    by_org: dict[str, list[Completion]] = {}
    for c in completions:
        r = rewards.get(c.id)
        if c.org_id and c.version == version and c.arm != PINNED and r is not None and r.trainable:
            by_org.setdefault(c.org_id, []).append(c)
    return {org: cs for org, cs in sorted(by_org.items()) if len(cs) >= min_completions}


def train_org_adapter(base: PreTrainedModel, batch: OnPolicyBatch, learner_config: LearnerConfig,
                      config: OrgAdapterConfig, adapter: Any = None) -> tuple[Any, dict[str, float]]:
    """One cycle's update of an organization's adapter on its on-policy batch: the same Learner step
    as the shared model's, with only the LoRA weights trainable. `adapter`: its current adapter
    (a PeftModel) to continue, else a fresh one on `base`."""
    model = adapter if adapter is not None else lora_model(base, config)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if trainable == 0:
        raise ValueError("the adapter has no trainable weights; check target_modules names modules of the model")
    # The Learner scores through the HF model's own parts (base_model + lm_head); peft injected the
    # LoRA layers into that very model, so it trains the adapter through it.
    learner = Learner(model.get_base_model().train(), learner_config)
    metrics = learner.train_step(batch.trajectories, batch.advantages())
    return model.eval(), {**{k: float(v) for k, v in metrics.items()}, "trainable_params": float(trainable)}


def register_adapter(registry: Registry, adapter: Any, tokenizer: PreTrainedTokenizerBase, base: int, org_id: str,
                     parent: int | None = None, metrics: dict[str, float] | None = None, aliases: Sequence[str] = (),
                     note: str = "") -> Checkpoint:
    """Register `adapter` (a PeftModel on version `base`) as the next Registry version (module docstring)."""
    check_org_id(org_id)
    base_checkpoint = registry.get(base)
    if base_checkpoint.base is not None:
        raise ValueError(f"v{base} is itself an adapter (of v{base_checkpoint.base}); adapters apply on a full "
                         "checkpoint: pass its base")
    return registry.register(adapter, tokenizer, parent=base if parent is None else parent, metrics=metrics,
                             aliases=aliases, note=note or f"adapter of {org_id} on v{base}",
                             base=base, org_id=org_id)


def adapter_loader(registry: Registry, served_base: Callable[[int], PreTrainedModel | None],
                   engine_config: EngineConfig) -> Callable[[int], tuple[LocalEngine, PreTrainedTokenizerBase]]:
    """An EngineLoader for adapter versions: each is an `adapter_view` on its base's weights as
    `served_base(base)` holds them (the main Router's engine), or loaded once here if none is served."""
    bases: dict[int, PreTrainedModel] = {}

    def load(version: int) -> tuple[LocalEngine, PreTrainedTokenizerBase]:
        checkpoint = registry.get(version)
        root = checkpoint.base if checkpoint.base is not None else version
        base = served_base(root)
        if base is None:
            base = bases.get(root) or bases.setdefault(root, registry.load(root)[0])
        if checkpoint.base is None:  # the base itself: the production arm of an organization's first A/B test
            return LocalEngine(shared_copy(base), engine_config, version=version), load_tokenizer(checkpoint.path)
        adapter, tokenizer = load_adapted(registry, version)
        return LocalEngine(adapter_view(base, adapter), engine_config, version=version), tokenizer

    return load


def adapter_metadata(path: Path) -> dict[str, Any]:
    return json.loads((path / METADATA_FILE).read_text())


class OrgGateDecision(BaseModel):
    passed: bool
    org: dict[str, bool]  # check -> passed, on the organization's battery
    general: dict[str, bool]  # check -> passed, on the general battery
    reason: str


def gate_decision(org_run: GateRun, general_run: GateRun) -> OrgGateDecision:
    """Pass only if neither battery shows a significant regression (module docstring)."""
    failed = [f"{where}: {name}: {run.decision.checks[name].reason}"
              for where, run in (("org battery", org_run), ("general battery", general_run))
              for name in run.decision.failed]
    return OrgGateDecision(passed=not failed, org={n: r.passed for n, r in org_run.decision.checks.items()},
                           general={n: r.passed for n, r in general_run.decision.checks.items()},
                           reason="; ".join(failed) or "no regression on the organization's battery or the general one")


def traffic_by_org(completions: Sequence[Completion]) -> dict[str, int]:
    """Completions per organization ("" = none), for reports."""
    return dict(Counter(c.org_id for c in completions))
