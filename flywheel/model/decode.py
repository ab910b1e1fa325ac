"""The engine's decode step without the `transformers` module tree: one token per row, Qwen3 math.

A decode step of the embedded default is small work (32 rows, two layers of width 128) that the
`transformers` forward spreads over about 40 matmuls (each layer's experts one by one), a CPU
flash-attention kernel built for long queries, and a deep module tree. `LeanDecoder` computes the
same function with fewer, larger ops:

- q, k and v come from one matmul; the new key and value are written into the engine's cache
  buffers in place, and attention over them is two batched matmuls (grouped-query heads viewed,
  never copied);
- the experts: on a CPU, rows sorted by expert once and each expert's slice through two matmuls
  (decode there is bound by arithmetic, so only the chosen experts are computed); on an
  accelerator, densely, every row through all experts in one matmul weighted by its routing
  weights (zero outside its top-k): the same sum with no host sync for per-expert row counts.

It serves Qwen3 and Qwen3-MoE models (the embedded default and real Qwen3 checkpoints) with default
RoPE and SiLU; `LeanDecoder.supports` says whether a model is one, and the engine falls back to the
`transformers` forward otherwise. Prefills still use that forward: there the work is large enough
that its overhead matters less. The tests compare the two forwards' logits (tests/model/test_decode.py).

Measured on 2 cores (`bench/engine.py`, `speedup_lean_decode`): 32 whole agent conversations,
replayed with sessions, took 6.4 s instead of 8.4 s (1.32x). A decode step at batch 32 gains most
at short contexts (1.22x in tokens/s at 100 to 200 cached tokens, 1.06x at 500 to 1,000, where
reading the padded KV cache dominates both).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel


class LeanDecoder:
    """One decode step of a Qwen3(-MoE) model over the engine's KV buffers.

    Fused weights are copies: call `refresh` after the model's weights change (a weight swap)."""

    def __init__(self, model: PreTrainedModel, dense_experts: bool | None = None):
        if not self.supports(model):
            raise ValueError("LeanDecoder serves Qwen3 and Qwen3-MoE models with default RoPE, not "
                             f"{type(model).__name__}")
        self.model = model
        # None: dense on accelerators (no host sync for per-expert row counts), routed on a CPU
        self.dense_experts = next(model.parameters()).device.type != "cpu" if dense_experts is None else dense_experts
        config = model.config
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.scale = self.head_dim**-0.5
        self.eps = config.rms_norm_eps
        # a list: each MoE layer of the next `step` appends its top-k ids [rows, k] (the engine's
        # routing record, `flywheel.model.routing`); None: nothing kept
        self.routing: list[torch.Tensor] | None = None
        rotary = model.model.rotary_emb
        self.inv_freq, self.rope_scale = rotary.inv_freq.float(), float(rotary.attention_scaling)
        self.refresh()

    @staticmethod
    def supports(model: PreTrainedModel) -> bool:
        config = model.config
        rope = getattr(config, "rope_parameters", None) or {}
        return (getattr(config, "model_type", None) in ("qwen3", "qwen3_moe")
                and rope.get("rope_type", "default") == "default"
                and getattr(config, "hidden_act", None) == "silu"
                and not getattr(config, "attention_bias", False)
                and not getattr(config, "use_sliding_window", False))

    @torch.no_grad()
    def refresh(self) -> None:
        """Rebuild the fused weights from the model's current parameters."""
        self.layers = []
        for layer in self.model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            fused = {
                "norm_in": layer.input_layernorm.weight, "norm_post": layer.post_attention_layernorm.weight,
                "qkv": torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]),
                "q_norm": attn.q_norm.weight, "k_norm": attn.k_norm.weight, "o": attn.o_proj.weight,
            }
            if hasattr(mlp, "experts"):  # a sparse MoE block
                experts = mlp.experts
                num, inter = experts.gate_up_proj.shape[0], experts.gate_up_proj.shape[1] // 2
                fused.update(
                    router=mlp.gate.weight, top_k=mlp.gate.top_k, norm_topk=mlp.gate.norm_topk_prob, experts=num,
                    # [E, 2I, H], [E, H, I]
                    inter=inter, expert_gate_up=experts.gate_up_proj, expert_down=experts.down_proj)
                if self.dense_experts:
                    fused.update(
                        gate_up=experts.gate_up_proj.reshape(num * 2 * inter, -1),  # [E*2I, H]: expert e's rows e*2I..
                        # [H, E*I]: column e*I + i is expert e's down column i
                        down=experts.down_proj.permute(1, 0, 2).reshape(experts.down_proj.shape[1],
                                                                        num * inter).contiguous())
            else:  # a dense MLP
                fused.update(gate_up=torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), down=mlp.down_proj.weight,
                             inter=mlp.gate_proj.weight.shape[0])
            self.layers.append(fused)
        self.embed = self.model.model.embed_tokens.weight
        self.norm = self.model.model.norm.weight
        self.head = self.model.lm_head.weight

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        y = x.float()
        return weight * (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def _mlp(self, h: torch.Tensor, w: dict) -> torch.Tensor:
        inter = w["inter"]
        if "router" not in w:
            gate, up = F.linear(h, w["gate_up"]).split(inter, dim=-1)
            return F.linear(F.silu(gate) * up, w["down"])
        probs = torch.softmax(F.linear(h, w["router"]), dim=-1, dtype=torch.float32)
        top, index = torch.topk(probs, w["top_k"], dim=-1)  # [rows, k]
        if self.routing is not None:
            self.routing.append(index)
        if w["norm_topk"]:
            top = top / top.sum(-1, keepdim=True)
        top = top.to(h.dtype)
        if self.dense_experts:
            return self._dense_experts(h, w, torch.zeros_like(probs, dtype=h.dtype).scatter_(1, index, top))
        # routed: the (row, expert) pairs sorted by expert, each expert's rows in one slice
        order = torch.argsort(index.reshape(-1), stable=True)
        rows = order // w["top_k"]
        x = h.index_select(0, rows)
        outs, start = [], 0
        for e, n in enumerate(torch.bincount(index.reshape(-1), minlength=w["experts"]).tolist()):
            if n:
                gate, up = F.linear(x[start : start + n], w["expert_gate_up"][e]).split(inter, dim=-1)
                outs.append(F.linear(F.silu(gate) * up, w["expert_down"][e]))
                start += n
        weighted = torch.cat(outs) * top.reshape(-1).index_select(0, order).unsqueeze(-1)
        return torch.zeros_like(h).index_add_(0, rows, weighted)

    def _dense_experts(self, h: torch.Tensor, w: dict, weights: torch.Tensor) -> torch.Tensor:
        """Every row through every expert, weighted by `weights` [rows, E] (0 outside its top-k)."""
        rows, num, inter = h.shape[0], w["experts"], w["inter"]
        gate_up = F.linear(h, w["gate_up"]).view(rows, num, 2, inter)
        act = F.silu(gate_up[:, :, 0]) * gate_up[:, :, 1] * weights.unsqueeze(-1)  # [rows, E, I]
        return F.linear(act.reshape(rows, num * inter), w["down"])

    @torch.no_grad()
    def step(self, ids: torch.Tensor, kv: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor,
             positions: torch.Tensor, width: int) -> torch.Tensor:
        """Feed one token per row and return the next-token logits [batch, vocab].

        ids, positions: [batch]; kv: per layer (keys, values) [batch, kv_heads, capacity, head_dim],
        the new token's written at column `width` (< capacity); mask: [batch, width + 1], 1 = a real
        token (the new one included)."""
        rows, heads, kv_heads, dim = ids.shape[0], self.heads, self.kv_heads, self.head_dim
        x = F.embedding(ids, self.embed)
        freqs = positions.unsqueeze(-1).float() * self.inv_freq.to(x.device)
        angles = torch.cat((freqs, freqs), dim=-1)
        cos = (angles.cos() * self.rope_scale).to(x.dtype).unsqueeze(1)  # [rows, 1, dim]
        sin = (angles.sin() * self.rope_scale).to(x.dtype).unsqueeze(1)
        bias = torch.zeros(mask.shape, dtype=x.dtype, device=x.device).masked_fill_(mask == 0, torch.finfo(x.dtype).min)
        bias = bias[:, None, None, :]  # [rows, 1, 1, width + 1]
        for w, (keys, values) in zip(self.layers, kv, strict=True):
            h = self._rms(x, w["norm_in"])
            q, k, v = F.linear(h, w["qkv"]).split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
            q = self._rope(self._rms(q.view(rows, heads, dim), w["q_norm"]), cos, sin)
            keys[:, :, width] = self._rope(self._rms(k.view(rows, kv_heads, dim), w["k_norm"]), cos, sin)
            values[:, :, width] = v.view(rows, kv_heads, dim)
            # grouped-query attention: query head j reads kv head j // (heads // kv_heads)
            q = q.view(rows, kv_heads, heads // kv_heads, dim)
            scores = torch.matmul(q, keys[:, :, : width + 1].transpose(-1, -2)) * self.scale + bias
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(x.dtype)
            out = torch.matmul(probs, values[:, :, : width + 1]).reshape(rows, heads * dim)
            x = x + F.linear(out, w["o"])
            x = x + self._mlp(self._rms(x, w["norm_post"]), w)
        return F.linear(self._rms(x, self.norm), self.head)
