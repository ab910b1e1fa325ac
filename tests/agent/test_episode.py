"""Episodes: real sandboxes, real tools, real grading; the engine scripted or a real tiny model."""

from __future__ import annotations

import json
from concurrent.futures import Future

import pytest
import torch

from flywheel.agent.episode import EpisodeConfig, EpisodeState, initial_prompt, run_episode
from flywheel.agent.trajectory import Status, Trajectory
from flywheel.env.families import generate
from flywheel.env.pool import PoolConfig, SandboxPool
from flywheel.model.chat import IM_END, render_messages, tool_schemas
from flywheel.model.engine import EngineConfig, Generation, LocalEngine, SamplingParams
from flywheel.model.factory import ModelConfig, build_model
from flywheel.model.routing import record_routing
from flywheel.model.tokenizer import train_tokenizer


class ScriptedEngine:
    """An Engine that answers each turn with the next scripted text (to test the runner's bookkeeping)."""

    def __init__(self, tokenizer, turns: list[str], version: int = 3):
        self.tokenizer, self.turns, self._version, self.prompts = tokenizer, list(turns), version, []

    @property
    def version(self) -> int:
        return self._version

    def submit(self, prompt_ids, params: SamplingParams) -> Future:
        self.prompts.append(list(prompt_ids))
        ids = self.tokenizer(self.turns.pop(0), add_special_tokens=False)["input_ids"][: params.max_tokens]
        stop = bool(ids) and ids[-1] in params.stop_token_ids
        future: Future = Future()
        future.set_result(Generation(ids, [-0.5] * len(ids), [self._version] * len(ids), "stop" if stop else "length"))
        return future

    def update_weights(self, weights, version, timeout_s=60.0) -> None:
        self._version = version

    def close(self) -> None:
        pass


def call(name: str, **arguments) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'


@pytest.fixture(scope="module")
def task():
    return generate("bugfix", "train", 1, seed=5, difficulty=1)[0]


@pytest.fixture(scope="module")
def tokenizer(task):
    corpus = [initial_prompt(task), call("read_file", path="a.py") + IM_END] * 10
    corpus += [render_messages([{"role": "user", "content": t.instruction}]) for t in generate("bugfix", "train", 20)]
    return train_tokenizer(corpus, vocab_size=800)


@pytest.fixture(scope="module")
def pool():
    with SandboxPool(PoolConfig(max_active=8, warm=2)) as p:
        yield p


def test_expert_like_script_solves_and_records_every_token(task, tokenizer, pool):
    (edit,) = task.reference_edits
    turns = [
        "Looking.\n" + call("read_file", path=edit.path) + IM_END,
        call("edit_file", path=edit.path, old=edit.old, new=edit.new) + IM_END,
        call("run_command", command=task.test_command) + IM_END,
        call("finish", summary="fixed") + IM_END,
    ]
    engine = ScriptedEngine(tokenizer, turns)
    traj = run_episode(task, engine, tokenizer, pool)
    assert traj.status == Status.FINISHED and traj.turns == 4 and traj.tool_calls == 4
    assert traj.all_passed and traj.reward == pytest.approx(1.0)
    assert len(traj.tokens) == len(traj.loss_mask) == len(traj.logprobs) == len(traj.versions)
    # Token in, token out: each prompt the engine saw is a prefix of the final sequence,
    # and every generated token sits in the sequence with mask 1 and the engine's version.
    for prompt in engine.prompts:
        assert traj.tokens[: len(prompt)] == prompt
    generated = [t for t, m in zip(traj.tokens, traj.loss_mask, strict=True) if m]
    assert tokenizer.decode(generated).count("<tool_call>") == 4
    assert {v for v, m in zip(traj.versions, traj.loss_mask, strict=True) if m} == {3}
    assert traj.prompt_len == len(engine.prompts[0])


def test_invalid_calls_are_answered_counted_and_penalized(task, tokenizer, pool):
    turns = [
        '<tool_call>\n{"name": "read_file", "arguments": {"path": 1}\n</tool_call>' + IM_END,  # bad JSON
        call("delete_repo") + IM_END,  # unknown tool
        call("finish") + IM_END,
    ]
    engine, saved = ScriptedEngine(tokenizer, turns), []
    traj = run_episode(task, engine, tokenizer, pool, on_turn=saved.append)
    assert traj.status == Status.FINISHED and traj.invalid_tool_calls == 2
    assert traj.invalid_tool_calls == 2 and traj.reward_parts["invalid_call_penalty"] == pytest.approx(-0.2)
    assert traj.reward == pytest.approx(-0.2)  # the untouched workspace fails, and the broken calls cost
    second_prompt = tokenizer.decode(engine.prompts[1])
    assert "error: invalid tool call: bad JSON" in second_prompt  # the model was told
    # The tokens that made each broken call: the first two turns, not the finish.
    assert [n for _, _, n in traj.broken_turns] == [1, 1]
    spans = [tokenizer.decode(traj.tokens[start:end]) for start, end, _ in traj.broken_turns]
    assert spans[0].startswith("<tool_call>") and '"path": 1' in spans[0] and spans[0].endswith(IM_END)
    assert "delete_repo" in spans[1] and "finish" not in "".join(spans)
    assert all(traj.loss_mask[start:end] == [1] * (end - start) for start, end, _ in traj.broken_turns)
    assert saved[-1].broken_turns == traj.broken_turns  # a resumed episode keeps them


def test_calls_the_tools_refuse_are_recorded_by_turn_and_cost_no_reward(task, tokenizer, pool):
    (edit,) = task.reference_edits
    turns = [
        call("edit_file", path="nowhere/" + edit.path, old=edit.old, new=edit.new) + IM_END,  # no such file
        call("read_file", path=edit.path) + call("edit_file", path=edit.path, old="not in the file", new="x")
        + call("read_file", path="missing.py") + IM_END,  # one good call, two refused
        call("edit_file", path=edit.path, old=edit.old, new=edit.new) + IM_END,
        call("finish") + IM_END,
    ]
    engine, saved = ScriptedEngine(tokenizer, turns), []
    traj = run_episode(task, engine, tokenizer, pool, on_turn=saved.append)
    assert traj.status == Status.FINISHED and traj.invalid_tool_calls == 0 and not traj.broken_turns
    assert traj.all_passed and traj.reward == pytest.approx(1.0)  # recovered: nothing lost
    assert [n for _, _, n in traj.failed_turns] == [1, 2] and traj.failed_tool_calls == 3
    spans = [tokenizer.decode(traj.tokens[start:end]) for start, end, _ in traj.failed_turns]
    assert "nowhere/" in spans[0] and "not in the file" in spans[1] and "missing.py" in spans[1]
    assert all(traj.loss_mask[start:end] == [1] * (end - start) for start, end, _ in traj.failed_turns)
    assert "error: no such file or folder: nowhere/" in tokenizer.decode(engine.prompts[1])
    assert saved[-1].failed_turns == traj.failed_turns  # a resumed episode keeps them
    resumed = run_episode(task, ScriptedEngine(tokenizer, [call("finish") + IM_END]), tokenizer, pool, resume=saved[1])
    assert resumed.failed_turns == traj.failed_turns


def test_only_invalid_calls_end_in_tool_error(task, tokenizer, pool):
    engine = ScriptedEngine(tokenizer, ["<tool_call>\nnot json\n</tool_call>" + IM_END] * 5)
    traj = run_episode(task, engine, tokenizer, pool, EpisodeConfig(max_invalid_turns=3))
    assert traj.status == Status.TOOL_ERROR and traj.turns == 3 and traj.invalid_tool_calls == 3
    assert traj.reward < 0


def test_a_question_gets_the_user_answer_and_costs_a_turn(tokenizer, pool):
    ambiguous = generate("ambiguous", "train", 1, seed=2, difficulty=1)[0]
    engine = ScriptedEngine(tokenizer, ["Which format do you want?" + IM_END, call("finish") + IM_END])
    traj = run_episode(ambiguous, engine, tokenizer, pool)
    assert traj.asked_question and traj.turns == 2
    assert ambiguous.metadata.clarification in tokenizer.decode(engine.prompts[1])


def test_running_out_of_turns_or_tokens_is_truncated(task, tokenizer, pool):
    engine = ScriptedEngine(tokenizer, [call("list_dir") + IM_END] * 3)
    traj = run_episode(task, engine, tokenizer, pool, EpisodeConfig(max_turns=3))
    assert traj.status == Status.TRUNCATED and traj.turns == 3 and traj.outcome is not None
    engine = ScriptedEngine(tokenizer, ["x" * 5000 + IM_END])
    traj = run_episode(task, engine, tokenizer, pool, EpisodeConfig(max_tokens_per_turn=50, truncated_reward=-1.0))
    assert traj.status == Status.TRUNCATED and traj.generated_tokens == 50 and traj.reward == -1.0


def test_real_model_episode_logprobs_match_one_forward_pass_over_the_trajectory(task, tokenizer, pool):
    """Token in, token out with a real model: recomputing the whole trajectory in one forward pass
    reproduces every generated token's logprob, so nothing was re-tokenized between turns."""
    config = ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                         num_experts=4, experts_per_token=2, moe_intermediate_size=64)
    model = build_model(config, tokenizer)
    saved = []
    with LocalEngine(model, EngineConfig(max_batch=4)) as engine:
        traj = run_episode(task, engine, tokenizer, pool,
                           EpisodeConfig(max_turns=3, max_tokens_per_turn=40, routed_experts=True),
                           on_turn=saved.append)
    assert traj.generated_tokens > 0 and len(traj.tokens) <= EpisodeConfig().max_tokens
    with torch.no_grad(), record_routing(model) as routing:
        logits = model(input_ids=torch.tensor([traj.tokens])).logits[0]
    # every position the engine fed (over the turns of one session, when there are several) was routed as in one
    # forward (routing replay); the last token was never fed
    assert traj.routed_experts[-1] == []
    want = torch.cat(routing, -1)[:-1].view(-1, 2, 2).sort(-1).values
    assert torch.equal(torch.tensor(traj.routed_experts[:-1]).view(-1, 2, 2).sort(-1).values, want)
    for state in saved:  # what a resumed episode starts from, as run/inflight/ holds it (packed)
        state = EpisodeState.model_validate_json(state.model_dump_json())
        assert all(e == traj.routed_experts[i] for i, e in enumerate(state.routed_experts) if e)
    assert Trajectory.model_validate_json(traj.model_dump_json()).routed_experts == traj.routed_experts
    logp = torch.log_softmax(logits.float(), -1)
    positions = [i for i, m in enumerate(traj.loss_mask) if m]
    recomputed = torch.stack([logp[i - 1, traj.tokens[i]] for i in positions])
    assert torch.allclose(recomputed, torch.tensor([traj.logprobs[i] for i in positions]), atol=1e-3)
    assert set(tool_schemas()[0]["function"]) >= {"name", "parameters"}


def test_an_episode_resumed_from_its_saved_state_ends_as_if_never_stopped(task, tokenizer, pool):
    (edit,) = task.reference_edits
    turns = [
        call("read_file", path=edit.path) + IM_END,
        call("edit_file", path=edit.path, old=edit.old, new=edit.new) + IM_END,
        call("run_command", command=task.test_command) + IM_END,
        call("finish", summary="fixed") + IM_END,
    ]
    whole = run_episode(task, ScriptedEngine(tokenizer, turns), tokenizer, pool)

    class Killed(Exception):
        pass

    saved: list[str] = []

    def save_then_die_after_the_edit(state: EpisodeState) -> None:
        saved.append(state.model_dump_json())  # what the Orchestrator writes to disk
        if state.turns == 2:
            raise Killed

    with pytest.raises(Killed):
        run_episode(task, ScriptedEngine(tokenizer, turns), tokenizer, pool, group_id="g7",
                    on_turn=save_then_die_after_the_edit)
    state = EpisodeState.model_validate_json(saved[-1])
    # the edit is in the saved workspace
    assert state.turns == 2 and state.files()[edit.path].decode() != task.files[edit.path]
    rest = ScriptedEngine(tokenizer, turns[2:], version=4)
    resumed = run_episode(task, rest, tokenizer, pool, resume=state)
    assert resumed.tokens == whole.tokens and resumed.loss_mask == whole.loss_mask
    assert resumed.status == Status.FINISHED and resumed.reward == whole.reward == pytest.approx(1.0)
    assert resumed.turns == 4 and resumed.tool_calls == 4 and resumed.group_id == "g7"
    assert rest.prompts[0] == state.tokens  # generation continued from exactly the saved tokens
    generated_versions = [v for v, m in zip(resumed.versions, resumed.loss_mask, strict=True) if m]
    assert generated_versions[0] == 3 and generated_versions[-1] == 4  # each token keeps the version that made it
