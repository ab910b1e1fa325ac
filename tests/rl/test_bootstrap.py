"""A bootstrap on a tiny budget, through the real CLI: demonstrations in real sandboxes, tokenizer,
tiny MoE, SFT, eval episodes, registry. Its checkpoint must already speak the tool format."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from flywheel.model.registry import Registry


@pytest.mark.slow  # 600 s on the shared 2-core machine (load ~10)
def test_tiny_bootstrap_registers_a_policy_that_emits_valid_tool_calls(tmp_path: Path):
    run, registry = tmp_path / "run", tmp_path / "registry"
    # A fixed number of steps (4 epochs of 160 demonstrations, about 80 s), not a time budget: on a
    # busy machine a time budget buys fewer steps, and the result would depend on the load.
    overrides = ["train_tasks_per_family=40", "sft.epochs=4", "sft_time_budget_s=900", "eval_tasks_per_family=3",
                 "episode.temperature=0.0", f"run_dir={run}", f"registry_root={registry}"]
    done = subprocess.run([sys.executable, "-m", "flywheel.cli", "bootstrap",
                           *[a for o in overrides for a in ("--set", o)]],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((run / "eval.json").read_text())
    assert report["episodes"] == 12 and report["tool_calls"] >= 12  # it acts through tools, about once a turn
    assert report["valid_tool_call_rate"] >= 0.6, report
    with Registry(registry) as reg:
        checkpoint = reg.get("production")
    assert checkpoint.version == 0 and checkpoint.metrics["eval_valid_tool_call_rate"] == report["valid_tool_call_rate"]


def _tiny_bootstrap(root: Path) -> tuple[bytes, dict]:
    """A bootstrap small enough to run twice in a test: demonstrations from real sandboxes, the
    tokenizer, model init, SFT's batch order and the greedy eval all come from the config's seeds."""
    from flywheel.env.pool import SandboxPool  # noqa: PLC0415
    from flywheel.rl.bootstrap import BootstrapConfig, bootstrap  # noqa: PLC0415
    from flywheel.rl.sft import SFTConfig  # noqa: PLC0415
    from flywheel.sim.expert import bootstrap_demonstrations  # noqa: PLC0415

    config = BootstrapConfig(train_tasks_per_family=8, eval_tasks_per_family=1, run_dir=root / "run",
                             registry_root=root / "registry", sft=SFTConfig(steps=20, copy_weight=5.0))
    with SandboxPool(config.pool) as pool:
        demos = bootstrap_demonstrations(config, pool)
    checkpoint = bootstrap(config, demos, log=lambda *_: None)
    report = json.loads((config.run_dir / "eval.json").read_text())
    return (Path(checkpoint.path) / "model.safetensors").read_bytes(), report["per_task"]


@pytest.mark.slow  # 123 s on the shared 2-core machine (load ~10)
def test_two_bootstraps_with_one_config_give_the_same_version_zero(tmp_path: Path):
    """Version 0 is a function of its config: the demo's figures and headroom hold for every fresh run."""
    first, second = _tiny_bootstrap(tmp_path / "a"), _tiny_bootstrap(tmp_path / "b")
    assert first[0] == second[0], "two bootstraps of one config registered different weights"
    assert first[1] == second[1], "the same weights played the held-out tasks differently"
