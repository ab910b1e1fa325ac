"""What the cycle and scenario tests share: a tiny policy that does something, and a live world around it.

`start_checkpoint()` SFT-trains the scenario world's start policy once per test session (a tiny
model that edits, asks or breaks its tool calls on one-line tasks; flywheel/sim/scenario.py) and
saves it; `make_registry` registers it as v0 production in a fresh Registry. `LiveWorld` serves a
registry in this process with the simulated users working on the world's tasks in the background.
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from flywheel.env.pool import PoolConfig, SandboxPool
from flywheel.live.monitors import MonitorConfig
from flywheel.live.rewards import RewardConfig
from flywheel.live.server import LiveServer, ServeConfig, serve_in_thread
from flywheel.live.settings import LoopConfig
from flywheel.model.factory import load_pretrained
from flywheel.model.registry import PRODUCTION, Registry
from flywheel.rl.sft import SFTConfig
from flywheel.sim.scenario import BackgroundUsers, StartPolicyConfig, start_policy
from flywheel.sim.users import Population, UserProfile

REPO = Path(__file__).resolve().parents[2]
KEY = "cycle-test-key"
# Small enough to train in ~20 s on one idle thread; greedy answers edit, mostly right on easy tasks.
# Bounded by steps, not time (epochs; the budget is only a backstop), so a busy machine trains the
# same policy, later.
POLICY = StartPolicyConfig(easy_tasks=4, hard_tasks=2, demos_per_task=9, sft_time_budget_s=300.0,
                           sft=SFTConfig(epochs=60.0, lr=3e-3, warmup_steps=5, batch_tokens=2048))
POPULATION = Population(users=4, concurrency=4, max_tokens=64, temperature=1.0,
                        profiles=[UserProfile(name="dev", patience=2, followup_propensity=1.0, thumbs_propensity=0.0)])


@functools.cache
def start_checkpoint() -> Path:
    """A folder holding the trained start policy (model + tokenizer), made once per session."""
    torch.set_num_threads(1)
    folder = Path(tempfile.mkdtemp(prefix="flywheel-start-policy-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    with SandboxPool(PoolConfig(max_active=4, warm=1)) as pool:
        model, tokenizer, _ = start_policy(POLICY, pool, log=lambda message: None)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def make_registry(root: Path) -> Registry:
    """A Registry at `root` with the start policy as v0 production."""
    model, tokenizer = load_pretrained(start_checkpoint())
    registry = Registry(root)
    registry.register(model, tokenizer, aliases=[PRODUCTION], note="start policy")
    return registry


@dataclass
class LiveWorld:
    server: LiveServer
    url: str
    registry_root: Path
    serve: ServeConfig
    users: BackgroundUsers | None


def world_loop(root: Path) -> LoopConfig:
    """The live loop's settings the world's server and the cycles run against it share: feedback
    final 3 s after an answer (the simulated users report edits as their session ends), 30 s windows."""
    return LoopConfig.at(root / "live" / "live.sqlite", root / "registry", rewards=RewardConfig(feedback_window_s=3.0),
                         monitor=MonitorConfig(window_s=30.0, min_rate_count=10))


@contextmanager
def live_world(root: Path, users: bool = True, candidate_fraction: float = 0.5,
               population: Population = POPULATION) -> Iterator[LiveWorld]:
    """v0 served in this process (keys: KEY has every scope), simulated users running while inside."""
    make_registry(root / "registry").close()
    serve = ServeConfig(loop=world_loop(root), keys={KEY: ["inference", "events", "admin"]},
                        candidate_fraction=candidate_fraction, threads=1)
    server = LiveServer.from_config(serve)
    try:
        with serve_in_thread(server) as running, SandboxPool(PoolConfig(max_active=8, warm=2)) as pool:
            if not users:
                yield LiveWorld(server, running.url, serve.loop.store.registry_root, serve, None)
                return
            with BackgroundUsers(running.url, KEY, population, POLICY.workload(), pool) as background:
                yield LiveWorld(server, running.url, serve.loop.store.registry_root, serve, background)
    finally:
        server.close()
