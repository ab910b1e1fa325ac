"""The Tinker API's built-in losses that flywheel implements, on one datum's per-token logprobs.

Tinker defines each loss as a SUM over the datum's tokens (no normalization: the client weights
tokens itself, e.g. the cookbook divides advantages or weights by the batch's token count). Per
token t, with `logp` the trained model's logprob of target_tokens[t] and the datum's inputs:

    cross_entropy         -weights_t * logp_t
    importance_sampling   -exp(logp_t - sampler_logp_t) * advantages_t
    ppo                   -min(r_t A_t, clip(r_t, clip_low_threshold, clip_high_threshold) A_t),
                          r_t = exp(logp_t - sampler_logp_t); thresholds default 0.8 and 1.2

Refused (the SDK names them, flywheel does not implement them): cispo, dro, gspo,
stable_reinforce, and "custom" (a loss uploaded to run on the server). `forward_backward_custom`
with a Python loss needs none of them: the SDK runs the loss on the client and sends its gradient
as cross_entropy weights.

Departure from flywheel's own RL loss (flywheel/rl/loss.py): that one is decoupled PPO with a
token-mean; these are Tinker's definitions, kept exactly so that a Tinker script's learning rate
means the same here. Log-ratios are clamped to +-MAX_LOG_RATIO before exponentiating, as there.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from flywheel.rl.loss import MAX_LOG_RATIO

# loss name -> the loss_fn_inputs it needs besides target_tokens
INPUTS = {"cross_entropy": ("weights",), "importance_sampling": ("logprobs", "advantages"),
          "ppo": ("logprobs", "advantages")}
CONFIG = {"cross_entropy": {}, "importance_sampling": {},
          "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}}
UNSUPPORTED = ("cispo", "dro", "gspo", "stable_reinforce", "custom")


class LossInputError(ValueError):
    """The request names a loss flywheel does not implement, or gives it the wrong inputs."""


def check_loss(name: str, config: Mapping[str, float | str] | None) -> dict[str, float]:
    """The loss's config with defaults filled in, or LossInputError saying what is supported."""
    if name not in INPUTS:
        why = "is not implemented by flywheel" if name in UNSUPPORTED else "is not a Tinker loss"
        raise LossInputError(f"loss_fn {name!r} {why}; use one of {sorted(INPUTS)}, or forward_backward_custom "
                             "with a Python loss (docs/tinker.md)")
    known = CONFIG[name]
    given = dict(config or {})
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise LossInputError(f"loss_fn_config keys {unknown} are not options of {name!r} (it takes {sorted(known)})")
    out = dict(known)
    for key, value in given.items():
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise LossInputError(f"loss_fn_config[{key!r}] must be a number, got {value!r}")
        out[key] = float(value)
    return out


def token_losses(name: str, logp: torch.Tensor, inputs: Mapping[str, torch.Tensor],
                 config: Mapping[str, float]) -> torch.Tensor:
    """Each token's term of the datum's loss, [tokens] (the loss is their sum; the SDK reports them as
    `elementwise_loss`). logp: [tokens] float32, with a graph when the loss is to be differentiated."""
    if name == "cross_entropy":
        return -(inputs["weights"] * logp)
    log_ratio = (logp - inputs["logprobs"]).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    advantages = inputs["advantages"]
    if name == "importance_sampling":
        return -(ratio * advantages)
    clipped = ratio.clamp(config["clip_low_threshold"], config["clip_high_threshold"])
    return -torch.minimum(ratio * advantages, clipped * advantages)
