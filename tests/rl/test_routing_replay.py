"""Routing replay against a real tiny Qwen3-MoE (CPU, float32): what the engine records, and the
Learner's forward under replay.

The Learner's copy gets its routers nudged (as a bf16 or other-kernel Learner would score them), so
that some of its own top-k choices differ from the engine's: replay must bring those positions back
to the engine's experts, and the engine/Learner logprob mismatch down with them."""

from __future__ import annotations

import copy

import pytest
import torch

from flywheel.agent.episode import _Recorder
from flywheel.agent.trajectory import Status, Trajectory
from flywheel.model.engine import EngineConfig, LocalEngine, SamplingParams
from flywheel.model.factory import ModelConfig, build_model
from flywheel.model.routing import moe_routers, record_routing, replay_routing, routing_width
from flywheel.model.tokenizer import train_tokenizer
from flywheel.rl.learner import Learner, LearnerConfig, token_logprobs
from flywheel.rl.loss import LossConfig

TINY = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, num_experts=8,
            experts_per_token=2, moe_intermediate_size=32)


@pytest.fixture(scope="module")
def model():
    tokenizer = train_tokenizer(["def add(a, b):\n    return a + b\n", "import os\nprint(os.getcwd())\n"] * 8,
                                vocab_size=300)
    model = build_model(ModelConfig(**TINY), tokenizer)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)
    return model


@pytest.fixture(scope="module")
def generations(model):
    """{lean decode: [(prompt, Generation)]}: 4 sampled rows, two of them one prompt (the prompt cache's
    twins), then a second turn of a session on top of the first row; routing recorded."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 290, (n,), generator=g).tolist() for n in (5, 11, 3)]
    prompts.append(prompts[1])
    out = {}
    for lean in (True, False):
        with LocalEngine(copy.deepcopy(model), EngineConfig(lean_decode=lean, seed=1)) as engine:
            first = [engine.submit(p, SamplingParams(max_tokens=12, routed_experts=True, session=f"s{i}"))
                     for i, p in enumerate(prompts)]
            gens = [f.result() for f in first]
            turn = prompts[0] + gens[0].token_ids + [7, 8, 9]
            gens.append(engine.submit(turn, SamplingParams(max_tokens=6, routed_experts=True, session="s0")).result())
        out[lean] = list(zip(prompts + [turn], gens, strict=True))
    return out


def nudged(model, scale: float = 0.15):
    """A copy whose routers differ a little: the Learner's view of the engine's model."""
    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for r in moe_routers(other):
            r.weight.add_(torch.randn(r.weight.shape, generator=g) * scale * r.weight.std())
    return other


def trajectory(prompt, gen) -> Trajectory:
    n = len(gen.token_ids)
    assert gen.routed_from == 0
    return Trajectory(task_id="t", family="f", tokens=prompt + gen.token_ids, loss_mask=[0] * len(prompt) + [1] * n,
                      logprobs=[0.0] * len(prompt) + gen.logprobs, versions=[-1] * len(prompt) + gen.versions,
                      prompt_len=len(prompt), status=Status.FINISHED, reward=0.0, reward_parts={}, turns=1,
                      tool_calls=0, invalid_tool_calls=0, asked_question=False,
                      routed_experts=gen.routed_experts + [[]])


def per_layer(routing) -> torch.Tensor:
    """[positions, layers, k] sorted within each layer's top-k (their order may differ at ties)."""
    return torch.as_tensor(routing).view(-1, 2, 2).sort(-1).values


def test_the_engine_records_the_experts_of_every_position_it_fed(model, generations):
    assert routing_width(model) == 4  # 2 layers x top-2
    for lean, rows in generations.items():
        for i, (prompt, gen) in enumerate(rows):
            tokens = prompt + gen.token_ids
            # the prompt cache's twin has its prompt's routing; the session's next turn starts after the
            # KV it reused (the first turn's tokens but its newest)
            assert gen.routed_from == (len(rows[0][0]) + len(rows[0][1].token_ids) - 1 if i == 4 else 0)
            assert gen.routed_from + len(gen.routed_experts) == len(tokens) - 1
            with torch.no_grad(), record_routing(model) as calls:
                model(input_ids=torch.tensor([tokens[:-1]]))
            want = torch.cat(calls, dim=-1)[gen.routed_from :]  # [positions, layers * k] of a plain forward
            assert torch.equal(per_layer(gen.routed_experts), per_layer(want)), (lean, i)


def test_replay_puts_the_engines_experts_in_the_learners_forward_and_trains_the_router(model, generations):
    learner_model = nudged(model)
    rows = generations[True]
    diffs = {False: [], True: []}
    flipped = 0
    for prompt, gen in rows[:4]:
        t = trajectory(prompt, gen)
        ids = torch.tensor([t.tokens])
        recorded = torch.tensor(gen.routed_experts)
        experts = torch.full((1, len(t.tokens), 4), -1, dtype=torch.long)
        for replay in (False, True):
            experts[0, :-1] = recorded if replay else -1
            with torch.no_grad(), replay_routing(learner_model, experts):
                with record_routing(learner_model) as used:  # registered after replay's hooks: sees their choice
                    logp, _ = token_logprobs(learner_model, ids, torch.ones_like(ids))
            diffs[replay].append((logp[0, len(prompt):] - torch.tensor(gen.logprobs)).abs())
            mine = per_layer(torch.cat(used, -1)[:-1])
            if replay:  # every position used the engine's experts
                assert torch.equal(mine, per_layer(recorded))
            else:  # the nudged routers' own top-k differs from the engine's at some positions
                flipped += int((mine != per_layer(recorded)).any(-1).any(-1).sum())
    assert flipped > 0
    # what is left with replay: the nudged routers' weights of the kept experts
    mean = {k: torch.cat(v).mean().item() for k, v in diffs.items()}
    assert mean[True] < mean[False] / 2, mean

    # the router still learns: a loss through replayed routing reaches the router's weights
    prompt, gen = rows[0]
    ids = torch.tensor([prompt + gen.token_ids])
    forced = torch.zeros((1, ids.shape[1], 4), dtype=torch.long)
    forced[..., 1::2] = 1  # every position to experts 0 and 1 in both layers
    learner_model.zero_grad()
    with replay_routing(learner_model, forced):
        logp, _ = token_logprobs(learner_model, ids, torch.ones_like(ids))
    logp.sum().backward()
    assert all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0 for r in moe_routers(learner_model))
    with torch.no_grad():
        own_logp, _ = token_logprobs(learner_model, ids, torch.ones_like(ids))
    assert not torch.allclose(logp.detach(), own_logp)  # forced experts are another function
    with pytest.raises(ValueError, match="layers x top-k"):
        with replay_routing(learner_model, forced[..., :2]):
            pass


def test_the_learner_replays_recorded_routing_and_refuses_trajectories_without_it(model, generations):
    batch = [trajectory(p, g) for p, g in generations[True][:4]]
    mismatch = {}
    for replay in (False, True):
        learner = Learner(nudged(model).train(), LearnerConfig(loss=LossConfig(routing_replay=replay)))
        metrics = learner.train_step(batch, [1.0, -1.0, 0.5, -0.5])
        assert metrics["optimizer_steps"] == 1
        mismatch[replay] = metrics["engine_logprob_mismatch_mean"]
    assert mismatch[True] < mismatch[False] / 2, mismatch
    with pytest.raises(ValueError, match="episode.routed_experts"):
        learner.train_step([batch[0].model_copy(update={"routed_experts": None})], [1.0])
    # a record is checked like the other per-token arrays
    record = trajectory(*generations[True][0]).model_dump()
    assert Trajectory.model_validate_json(Trajectory(**record).model_dump_json()).routed_experts == record[
        "routed_experts"]  # saved and read back with the run's records
    for routed, error in (([[0, 1, 2, 3]], "routed_experts has"),
                          ([[0, 1, 2, -1]] + record["routed_experts"][1:], "below 0"),
                          (record["routed_experts"][:-1] + [[0, 1]], "widths")):
        with pytest.raises(ValueError, match=error):
            Trajectory.model_validate(record | {"routed_experts": routed})
    # an engine that returns no routing is refused where episodes ask for it
    recorder = _Recorder(routed=True)
    recorder.context([1, 2, 3])
    with pytest.raises(ValueError, match="routed experts for no positions"):
        recorder.generated([5, 6], [-1.0, -1.0], [0, 0], None)


@pytest.mark.slow  # a subprocess that builds the default model, samples and scores: 12 s on 2 cores
def test_the_mismatch_bench_in_its_quick_mode_reports_replay_removing_the_routing_mismatch():
    """bench/routing_replay.py --quick (float32 and bfloat16 on both sides): the script runs, every
    row has both routings, and replay's top-k difference is 0 (measured after replay's hooks) with
    a KL no larger than the Learner's own routing's."""
    import json  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    script = Path(__file__).resolve().parents[2] / "bench" / "routing_replay.py"
    run = subprocess.run([sys.executable, str(script), "--quick"], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    settings = json.loads(run.stdout)["settings"]
    assert set(settings) == {"float32", "bfloat16"}
    for name, row in settings.items():
        own, replayed = row["own_routing"], row["replay"]
        assert own["tokens"] == replayed["tokens"] > 0
        assert replayed["topk_differs_frac"] == 0.0, name
        assert replayed["kl"] <= own["kl"] + 1e-9, (name, row)
    assert settings["float32"]["replay"]["abs_logprob_diff_max"] < 1e-3  # float noise once routing agrees
