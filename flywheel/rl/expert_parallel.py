"""The expert-parallel MoE layer: a drop-in for transformers' `Qwen3MoeSparseMoeBlock` across ranks.

    x [tokens, hidden] on every rank (its own data)
      router           the block's own `Qwen3MoeTopKRouter` (softmax in float32, top-k, renormalised):
                       the same module, so routing is bit-for-bit the dense block's
      sort             the tokens x k assignments grouped by expert id; counts per expert [experts]
      dispatch         all_to_all_single of the counts (each rank learns how many rows it gets per
                       local expert), then of the rows (uneven splits, autograd): rank j receives the
                       rows routed to experts j*E/ep .. (j+1)*E/ep - 1 from every rank of its EP group
      experts          `LocalExperts`: grouped GEMMs over the local experts (gate_up, SiLU * up, down)
      combine          all_to_all_single back (the reverse splits), unsort, weight each row by its
                       routing weight, add the k rows of each token (index_add)

Expert weights keep transformers' layout and names (`experts.gate_up_proj` [E, 2I, H],
`experts.down_proj` [E, H, I], i.e. (experts, out, in)), sliced to the local experts, so a
checkpoint loads 1:1 and the slices concatenate back into the dense block's tensors.

The grouped GEMM: `torch._grouped_mm` runs on a CPU in bfloat16 but refuses float32 there
(torch 2.13: "Invalid strides/sizes"), so float32 weights take a loop over the local experts;
`precision = "bf16"` casts to bfloat16 and takes `torch._grouped_mm`; `precision = "mxfp8"`
takes torchao's MXFP8 grouped GEMM (`_to_mxfp8_then_scaled_grouped_mm`), which quantizes
activations and weights to float8_e4m3 with one e8m0 scale per 32 elements in the forward and in
both backward GEMMs: torchao's native kernels on sm100 (Blackwell), its emulation everywhere else
(a CPU, or Hopper, which has no MX instructions: the numerics of MXFP8, none of its speed).
`precision = "fp8"` is Hopper's (and Ada's) own low precision: torchao's rowwise FP8 grouped GEMM
(`_to_fp8_rowwise_then_scaled_grouped_mm`, one power-of-two scale per row, Triton quantization and
`torch._scaled_grouped_mm`), on a CUDA GPU of compute capability 8.9 or newer only; each expert's
rows are padded to a multiple of 16, as its GEMM requires. Master weights stay in their dtype
(float32 here); the GEMMs see bfloat16, FP8 or MXFP8 copies.

Load-balance statistics: `tokens_per_expert` [E] holds the rows this rank's tokens sent to each
expert (all experts, not only the local ones), summed over forwards until zeroed; the distributed
Learner zeroes it at each step, sums it over layers and ranks and reports the max/mean load ratio.

What it does not do: no capacity factor or token dropping (every routed row is computed, so the
output equals the dense block's exactly up to summation order); no auxiliary load-balancing loss
(the policy is trained with `output_router_logits=False`, as the single-process Learner is); no
overlap of the all-to-all with compute; no shared experts (Qwen3-MoE has none).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

# native: the weights' own dtype; bf16: bfloat16 GEMMs (torch._grouped_mm), the baseline the low
# precisions are measured against; fp8: torchao's rowwise FP8 grouped GEMMs (CUDA, sm89+);
# mxfp8: torchao's MXFP8 grouped GEMMs (native on sm100, emulated elsewhere)
ExpertPrecision = Literal["native", "bf16", "fp8", "mxfp8"]

FP8_ROW_ALIGN = 16  # rows per group of torch._scaled_grouped_mm's FP8 operands, and its K and N


def mx_kernels(device: torch.device) -> bool:
    """Whether `device` runs torchao's native MXFP8 kernels (sm100 and later); elsewhere they are emulated."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 10


def check_fp8(device: torch.device) -> None:
    """Rowwise FP8 GEMMs need FP8 tensor cores: a CUDA GPU of compute capability 8.9 (Ada) or newer."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
        where = "a CPU" if device.type != "cuda" else f"sm{''.join(map(str, torch.cuda.get_device_capability(device)))}"
        raise ValueError(f"expert precision 'fp8' (rowwise FP8 grouped GEMMs) needs a CUDA GPU of compute capability "
                         f"8.9 or newer (Ada, Hopper, Blackwell), not {where}; use 'mxfp8' (emulated there) or 'bf16'")


def fp8_grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """`grouped_linear` in rowwise FP8: each group's rows padded to FP8_ROW_ALIGN with zeros (which
    add nothing to the weight gradient), the GEMM, the padding dropped."""
    from torchao.prototype.moe_training.fp8_grouped_mm import (  # noqa: PLC0415  (optional dep)
        _to_fp8_rowwise_then_scaled_grouped_mm,
    )

    check_fp8(x.device)
    if weight.shape[1] % FP8_ROW_ALIGN or weight.shape[2] % FP8_ROW_ALIGN:
        raise ValueError(f"expert precision 'fp8' needs expert widths that are multiples of {FP8_ROW_ALIGN}, "
                         f"not {tuple(weight.shape[1:])} (out, in)")
    if not x.shape[0]:
        return x.new_zeros((0, weight.shape[1]), dtype=torch.bfloat16)
    sizes = torch.tensor(counts, dtype=torch.long, device=x.device)
    padded = (sizes + FP8_ROW_ALIGN - 1) // FP8_ROW_ALIGN * FP8_ROW_ALIGN
    ends = padded.cumsum(0)
    # where each real row sits in the padded operand: its own index, shifted by the padding of the
    # groups before it (a group's padded start less its unpadded one)
    shift = (ends - padded) - (sizes.cumsum(0) - sizes)
    rows = torch.arange(x.shape[0], device=x.device) + shift.repeat_interleave(sizes, output_size=x.shape[0])
    total = sum(-(-c // FP8_ROW_ALIGN) * FP8_ROW_ALIGN for c in counts)  # from the list: no host sync
    operand = x.new_zeros((total, x.shape[1]), dtype=torch.bfloat16).index_copy(0, rows, x.to(torch.bfloat16))
    offsets = ends.to(torch.int32)
    out = _to_fp8_rowwise_then_scaled_grouped_mm(operand, weight.to(torch.bfloat16).transpose(-2, -1), offs=offsets,
                                                 out_dtype=torch.bfloat16, pad_token_groups_for_grouped_mm=False)
    return out.index_select(0, rows)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: list[int],
                   precision: ExpertPrecision = "native") -> torch.Tensor:
    """Row group g of x [rows, in] times weight[g] [out, in] transposed: [rows, out].

    counts: rows per group (sums to rows; zeros allowed)."""
    if precision == "mxfp8":
        from torchao.prototype.moe_training import _to_mxfp8_then_scaled_grouped_mm  # noqa: PLC0415  (optional dep)
        from torchao.prototype.moe_training.config import KernelPreference  # noqa: PLC0415

        offsets = torch.tensor(counts, dtype=torch.int32, device=x.device).cumsum(0, dtype=torch.int32)
        kernel = KernelPreference.AUTO if mx_kernels(x.device) else KernelPreference.EMULATED
        # weight.transpose: [groups, in, out] with per-group column-major strides, torchao's B_t layout
        return _to_mxfp8_then_scaled_grouped_mm(x.to(torch.bfloat16), weight.to(torch.bfloat16).transpose(-2, -1),
                                                offs=offsets, out_dtype=torch.bfloat16, kernel_preference=kernel,
                                                pad_token_groups_for_grouped_mm=True)
    if precision == "fp8":
        return fp8_grouped_linear(x, weight, counts)
    if precision == "bf16" or x.dtype == torch.bfloat16:
        x, weight = x.to(torch.bfloat16), weight.to(torch.bfloat16)
        offsets = torch.tensor(counts, dtype=torch.int32, device=x.device).cumsum(0, dtype=torch.int32)
        return torch._grouped_mm(x, weight.transpose(-2, -1), offs=offsets)
    # float32 on a CPU: one GEMM per expert (torch._grouped_mm refuses float32 there)
    pieces = [chunk @ weight[g].T for g, chunk in enumerate(x.split(counts))]
    return torch.cat(pieces) if pieces else x.new_zeros((0, weight.shape[1]))


class LocalExperts(nn.Module):
    """The experts one rank holds: transformers' tensors sliced to experts [first, first + count)."""

    def __init__(self, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, act_fn: nn.Module,
                 precision: ExpertPrecision = "native"):
        super().__init__()
        self.gate_up_proj = nn.Parameter(gate_up_proj.detach().clone())  # [local, 2 * inter, hidden]
        self.down_proj = nn.Parameter(down_proj.detach().clone())  # [local, hidden, inter]
        self.act_fn = act_fn
        self.precision = precision

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x [rows, hidden], grouped by local expert, counts[g] rows for expert g: [rows, hidden]."""
        gate, up = grouped_linear(x, self.gate_up_proj, counts, self.precision).chunk(2, dim=-1)
        return grouped_linear(self.act_fn(gate) * up, self.down_proj, counts, self.precision).to(x.dtype)


class ExpertParallelMoE(nn.Module):
    """`Qwen3MoeSparseMoeBlock` with its experts spread over the ranks of `group` (see the module doc)."""

    def __init__(self, block: Qwen3MoeSparseMoeBlock, group: dist.ProcessGroup | None, ep_rank: int, ep_size: int,
                 precision: ExpertPrecision = "native"):
        super().__init__()
        experts = block.experts
        self.num_experts = experts.num_experts
        if self.num_experts % ep_size:
            raise ValueError(f"{self.num_experts} experts do not split over ep={ep_size} ranks; "
                             f"set dist.ep to a divisor of {self.num_experts}")
        self.local = self.num_experts // ep_size
        self.first = ep_rank * self.local
        self.ep_size = ep_size
        self.group = group
        self.gate = block.gate  # the router itself: same semantics, same parameter name
        self.top_k = block.gate.top_k
        sl = slice(self.first, self.first + self.local)
        self.experts = LocalExperts(experts.gate_up_proj[sl], experts.down_proj[sl], experts.act_fn, precision)
        self.register_buffer("tokens_per_expert", torch.zeros(self.num_experts, dtype=torch.long), persistent=False)
        # Bytes this rank's forwards sent to other ranks (dispatch + combine), summed until reset; the
        # backward sends as many again (each all-to-all's gradient is the reverse all-to-all).
        self.sent_bytes = 0

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = hidden_states.shape
        x = hidden_states.reshape(-1, hidden)  # [tokens, hidden]
        _, weights, chosen = self.gate(x)  # [tokens, k] each
        flat = chosen.reshape(-1)  # [tokens * k]
        order = torch.argsort(flat, stable=True)  # assignments grouped by expert
        token_of = order // self.top_k  # [tokens * k]: the token each sorted row came from
        counts = torch.bincount(flat, minlength=self.num_experts)  # [experts]
        self.tokens_per_expert += counts
        rows = x[token_of]  # [tokens * k, hidden]

        if self.ep_size == 1:
            out = self.experts(rows, counts.tolist())
        else:
            out = self._dispatch_compute_combine(rows, counts)
        weighted = out * weights.reshape(-1)[order].unsqueeze(1).to(out.dtype)  # [tokens * k, hidden]
        combined = torch.zeros_like(x).index_add_(0, token_of, weighted.to(x.dtype))
        return combined.reshape(batch, seq, hidden)

    def _dispatch_compute_combine(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        send_counts = counts.view(self.ep_size, self.local)  # [dest rank, its local expert]
        recv_counts = torch.empty_like(send_counts)  # [source rank, my local expert]
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        send_splits = send_counts.sum(1).tolist()
        recv_splits = recv_counts.sum(1).tolist()
        me = dist.get_rank(self.group)
        row_bytes = rows.shape[1] * rows.element_size()
        self.sent_bytes += (sum(send_splits) - send_splits[me] + sum(recv_splits) - recv_splits[me]) * row_bytes
        # one host sync for the splits (the all-to-all needs them as Python ints)
        received = all_to_all_single_autograd(rows, recv_splits, send_splits, self.group)
        # [received, hidden], grouped [source][expert]
        expert_of_row = torch.arange(self.local, device=rows.device).repeat(self.ep_size).repeat_interleave(
            recv_counts.reshape(-1))  # [received]
        regroup = torch.argsort(expert_of_row, stable=True)  # grouped [expert][source]
        computed = self.experts(received[regroup], recv_counts.sum(0).tolist())
        back = computed[torch.argsort(regroup)]  # grouped [source][expert] again
        return all_to_all_single_autograd(back, send_splits, recv_splits, self.group)


def use_grouped_experts(model: nn.Module, precision: ExpertPrecision) -> nn.Module:
    """Swap a single-process model's MoE blocks for `ExpertParallelMoE` over one rank (no collectives),
    so the single-process Learner trains with the chosen expert GEMMs; names and shapes stay HF's."""
    for layer in model.model.layers:
        if isinstance(layer.mlp, Qwen3MoeSparseMoeBlock):
            layer.mlp = ExpertParallelMoE(layer.mlp, None, 0, 1, precision)
    return model
