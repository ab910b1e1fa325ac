"""Run under torchrun by tests/rl/test_distributed.py: the checks that need several processes.

    torchrun --nproc-per-node N tests/rl/dist_worker.py OUT_DIR CHECK [CHECK ...]

Each check measures and rank 0 writes OUT_DIR/<check>.json; the test asserts on the figures, so a
failure names the mesh and the size of the difference. Checks:

    step:<R>x<S>[ep<E>]   one DistributedLearner step vs the single-process Learner on the same batch
    ppo_step:<mesh>      the same with ppo_epochs = minibatches = 2, a KL reference and narrow clipping
    mxfp8_step:<mesh>    the same with MXFP8 expert GEMMs (against the float32 Learner: close, not equal)
    nan_step:<mesh>      a NaN in one rank's share: the step is skipped on every rank, weights unchanged
    ep_layer:<label>     ExpertParallelMoE vs Qwen3MoeSparseMoeBlock: output, input / router / expert grads
    save:<mesh>          one step under <mesh>, then a DCP checkpoint in OUT_DIR/ckpt; the process then ends
    resume:<mesh>        load OUT_DIR/ckpt under <mesh>, one more step, vs two single-process steps;
                         the weights gathered on rank 0 into a LocalEngine; exports OUT_DIR/hf (the
                         HF folder) and OUT_DIR/reference.pt (expected weights)
    same_mesh:<mesh>     two steps straight vs one, checkpoint, a new learner loads it, one more: bit-exact
"""

from __future__ import annotations

import copy
import json
import re
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from flywheel.agent.trajectory import Trajectory
from flywheel.model.engine import LocalEngine
from flywheel.model.factory import ModelConfig, build_model
from flywheel.model.tokenizer import train_tokenizer
from flywheel.rl.distributed import DistConfig, DistributedLearner
from flywheel.rl.expert_parallel import ExpertParallelMoE
from flywheel.rl.learner import Learner, LearnerConfig, token_logprobs
from flywheel.rl.loss import LossConfig

TINY = ModelConfig(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16, num_experts=8,
                   experts_per_token=2, moe_intermediate_size=32)
# lr large enough that one step moves the weights well above float32 noise; micro-batches small so
# ranks run different numbers of them (the padding path)
LEARNER = LearnerConfig(lr=1e-3, micro_batch_tokens=96)
# Four optimizer steps per batch against a KL reference, clip ranges narrow enough that the later
# steps' ratios leave them: the clipped, KL-weighted path of the loss
PPO = LEARNER.model_copy(update={"ppo_epochs": 2, "minibatches": 2,
                                 "loss": LossConfig(kl_coef=0.1, clip_low=0.002, clip_high=0.002)})


def tokenizer():
    return train_tokenizer(["def add(a, b):\n    return a + b\n", "for x in items:\n    print(x)\n"] * 10,
                           vocab_size=300)


def batch(model, seed: int) -> tuple[list[Trajectory], list[float]]:
    """Seven trajectories of uneven length (ranks get uneven shares), behaviour logprobs near the model's."""
    g = torch.Generator().manual_seed(seed)
    out, advantages = [], []
    for i in range(7):
        length = 16 + 7 * i
        tokens = torch.randint(0, model.config.vocab_size, (length,), generator=g).tolist()
        mask = [0] * 5 + [1] * (length - 5)
        ids = torch.tensor([tokens])
        with torch.no_grad():
            logp, _ = token_logprobs(model, ids, torch.ones_like(ids))
        noise = 0.1 * torch.randn(length, generator=g)
        out.append(Trajectory(task_id=f"t{i}", family="f", tokens=tokens, loss_mask=mask,
                              logprobs=[float(lp + n) if m else 0.0 for lp, n, m in
                                        zip(logp[0], noise, mask, strict=True)],
                              versions=[0 if m else -1 for m in mask], prompt_len=5, status="finished", reward=0.0,
                              reward_parts={}, turns=1, tool_calls=0, invalid_tool_calls=0, asked_question=False,
                              group_id="g"))
        advantages.append(float(i % 3) - 1.0)
    return out, advantages


def mesh(spec: str) -> DistConfig:
    found = re.fullmatch(r"(\d+)x(\d+)(?:ep(\d+))?", spec)
    if not found:
        raise ValueError(f"mesh {spec!r}: write RxS or RxSepE")
    r, s, e = found.groups()
    return DistConfig(dp_replicate=int(r), dp_shard=int(s), ep=int(e or 1))


def reference(tok, steps: int, config: LearnerConfig = LEARNER) -> tuple[dict[str, torch.Tensor],
                                                                          list[dict[str, float]]]:
    model = build_model(TINY, tok)
    learner = Learner(model, config, ref_model=build_model(TINY, tok) if config.loss.kl_coef else None)
    probe = build_model(TINY, tok)  # batches from the initial weights, as `run_steps` builds them
    metrics = []
    for step in range(steps):
        trajectories, advantages = batch(probe, seed=step)
        metrics.append(learner.train_step(trajectories, advantages))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, metrics


def compare(full: dict[str, torch.Tensor], expected: dict[str, torch.Tensor],
            start: dict[str, torch.Tensor]) -> dict[str, float]:
    diff = max(float((full[k] - expected[k]).abs().max()) for k in expected)
    update = max(float((expected[k] - start[k]).abs().max()) for k in expected)
    return {"max_weight_diff": diff, "max_update": update, "same_keys": float(set(full) == set(expected))}


def run_steps(learner: DistributedLearner, tok, steps: range) -> list[dict[str, float]]:
    metrics = []
    probe = build_model(TINY, tok)  # the batch is built from the initial weights, as in `reference`
    for step in steps:
        trajectories, advantages = batch(probe, seed=step)
        metrics.append(learner.train_step(trajectories, advantages))
    return metrics


def metric_diffs(got: dict[str, float], expected: dict[str, float]) -> dict[str, float]:
    """Loss difference, and the grad norm's relative one: AdamW's first step is nearly blind to the
    gradient's scale, so a wrong reduction (a mean for a sum) shows in the norm, not in the weights.
    A step whose groups all tied has no gradient (norm 0): there the difference itself is compared."""
    norm_diff = abs(got["grad_norm"] - expected["grad_norm"])
    return {"loss_diff": abs(got["loss"] - expected["loss"]),
            "grad_norm_rel_diff": norm_diff / expected["grad_norm"] if expected["grad_norm"] else norm_diff}


def check_step(spec: str, tok, precision: str = "native", learner_config: LearnerConfig = LEARNER) -> dict[str, float]:
    start = {k: v.clone() for k, v in build_model(TINY, tok).state_dict().items()}
    expected, ref_metrics = reference(tok, 1, learner_config)
    config = mesh(spec).model_copy(update={"expert_precision": precision})
    ref_model = build_model(TINY, tok) if learner_config.loss.kl_coef else None
    learner = DistributedLearner(build_model(TINY, tok), learner_config, config, ref_model=ref_model)
    metrics = run_steps(learner, tok, range(1))
    full = learner.full_state_dict()
    if full is None:
        return {}
    got, want = metrics[0], ref_metrics[0]
    same = ("optimizer_steps", "loss_tokens", "kl", "clip_low_frac", "clip_high_frac", "is_weight_max", "entropy")
    return compare(full, expected, start) | metric_diffs(got, want) | {
        "moe_load_max_over_mean": got["moe_load_max_over_mean"], "optimizer_steps": got["optimizer_steps"],
        "metric_diff": max(abs(got[k] - want[k]) for k in same), "kl": got["kl"],
        "clip_frac": got["clip_low_frac"] + got["clip_high_frac"]}


def check_nan_step(spec: str, tok) -> dict[str, float]:
    """A NaN behaviour logprob in the last rank's share: every rank skips, no weight moves."""
    learner = DistributedLearner(build_model(TINY, tok), LEARNER, mesh(spec))
    before = learner.full_state_dict()
    trajectories, advantages = batch(build_model(TINY, tok), seed=0)
    last = trajectories[-1]
    logprobs = list(last.logprobs)
    logprobs[-1] = float("nan")
    trajectories[-1] = last.model_copy(update={"logprobs": logprobs})
    metrics = learner.train_step(trajectories, advantages)
    after = learner.full_state_dict()
    if after is None:
        return {}
    return {"skipped": metrics["skipped_steps"], "version": float(learner.version),
            "max_weight_change": max(float((after[k] - before[k]).abs().max()) for k in before)}


def check_ep_layer(tok) -> dict[str, float]:
    """The EP layer on each rank's own tokens against the dense block; gradients summed over ranks."""
    world, rank = dist.get_world_size(), dist.get_rank()
    model = build_model(TINY, tok)
    with torch.no_grad():  # the router starts at zero; random weights make routing non-trivial
        for p in model.parameters():
            p.normal_(0, 0.2)
    dense = model.model.layers[0].mlp
    ep = ExpertParallelMoE(copy.deepcopy(dense), dist.group.WORLD, rank, world)
    x = torch.randn(3, 11 + 4 * rank, TINY.hidden_size, generator=torch.Generator().manual_seed(rank))
    x_dense, x_ep = x.clone().requires_grad_(), x.clone().requires_grad_()
    probe = torch.randn_like(x)
    out_dense, out_ep = dense(x_dense), ep(x_ep)
    (out_dense * probe).sum().backward()
    (out_ep * probe).sum().backward()
    grads_dense = {"gate": dense.gate.weight.grad, "gate_up": dense.experts.gate_up_proj.grad,
                   "down": dense.experts.down_proj.grad}
    for g in grads_dense.values():
        dist.all_reduce(g)  # the dense block's gradient over all ranks' tokens
    router = ep.gate.weight.grad.clone()
    dist.all_reduce(router)
    sl = slice(ep.first, ep.first + ep.local)
    diffs = torch.tensor([float((out_ep - out_dense).detach().abs().max()),
                          float((x_ep.grad - x_dense.grad).abs().max()),
                          float((router - grads_dense["gate"]).abs().max()),
                          float((ep.experts.gate_up_proj.grad - grads_dense["gate_up"][sl]).abs().max()),
                          float((ep.experts.down_proj.grad - grads_dense["down"][sl]).abs().max())])
    dist.all_reduce(diffs, op=dist.ReduceOp.MAX)
    scale = float(out_dense.detach().abs().max())
    grad_scale = float(grads_dense["gate_up"].abs().max())
    load = ep.tokens_per_expert.clone()
    dist.all_reduce(load)
    return {"output": float(diffs[0]), "input_grad": float(diffs[1]), "router_grad": float(diffs[2]),
            "gate_up_grad": float(diffs[3]), "down_grad": float(diffs[4]), "output_scale": scale,
            "expert_grad_scale": grad_scale,
            "experts_hit": float((load > 0).sum()), "world": float(world)}


def check_save(spec: str, tok, out: Path) -> dict[str, float]:
    learner = DistributedLearner(build_model(TINY, tok), LEARNER, mesh(spec))
    metrics = run_steps(learner, tok, range(1))
    learner.save_checkpoint(out / "ckpt")
    return {"loss": metrics[0]["loss"], "world": float(dist.get_world_size())}


def check_resume(spec: str, tok, out: Path) -> dict[str, float]:
    start = {k: v.clone() for k, v in build_model(TINY, tok).state_dict().items()}
    expected, ref_metrics = reference(tok, 2)
    learner = DistributedLearner(build_model(TINY, tok), LEARNER, mesh(spec))
    learner.load_checkpoint(out / "ckpt")
    version = learner.version
    metrics = run_steps(learner, tok, range(1, 2))
    full = learner.weights()
    learner.export_hf(out / "hf", tok)
    if full is None:
        return {}
    torch.save(expected, out / "reference.pt")
    engine = LocalEngine(build_model(TINY, tok))  # the simple path: rank 0's in-process engine
    engine.update_weights(full, learner.version)
    engine_diff = max(float((v - expected[k]).abs().max()) for k, v in engine.model.state_dict().items())
    engine_version = engine.version
    engine.close()
    return compare(full, expected, start) | metric_diffs(metrics[0], ref_metrics[1]) | {
        "version_after_load": float(version), "version": float(learner.version), "engine_weight_diff": engine_diff,
        "engine_version": float(engine_version)}


def check_same_mesh(spec: str, tok) -> dict[str, float]:
    straight = DistributedLearner(build_model(TINY, tok), LEARNER, mesh(spec))
    run_steps(straight, tok, range(2))
    expected = straight.full_state_dict()
    first = DistributedLearner(build_model(TINY, tok), LEARNER, mesh(spec))
    run_steps(first, tok, range(1))
    with tempfile.TemporaryDirectory() as tmp:
        folder = [tmp]
        dist.broadcast_object_list(folder)  # one folder for all ranks: rank 0's
        first.save_checkpoint(folder[0])
        resumed = DistributedLearner(build_model(TINY, tok), LEARNER, mesh(spec))
        resumed.load_checkpoint(folder[0])
        dist.barrier()  # rank 0 removes its folder on exit; everyone has read it
    run_steps(resumed, tok, range(1, 2))
    full = resumed.full_state_dict()
    if full is None:
        return {}
    return {"max_weight_diff": max(float((full[k] - expected[k]).abs().max()) for k in expected)}


def main() -> None:
    out, checks = Path(sys.argv[1]), sys.argv[2:]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    tok = tokenizer()
    for check in checks:
        name, _, spec = check.partition(":")
        if name == "step":
            result = check_step(spec, tok)
        elif name == "ppo_step":
            result = check_step(spec, tok, learner_config=PPO)
        elif name == "nan_step":
            result = check_nan_step(spec, tok)
        elif name == "mxfp8_step":
            result = check_step(spec, tok, "mxfp8")
        elif name == "ep_layer":
            result = check_ep_layer(tok)
        elif name == "save":
            result = check_save(spec, tok, out)
        elif name == "resume":
            result = check_resume(spec, tok, out)
        elif name == "same_mesh":
            result = check_same_mesh(spec, tok)
        else:
            raise ValueError(f"unknown check {check!r}; see the module docstring")
        if dist.get_rank() == 0:
            (out / f"{check.replace(':', '_')}.json").write_text(json.dumps(result))
    dist.barrier()  # no process tears its connections down while a peer still uses them
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
