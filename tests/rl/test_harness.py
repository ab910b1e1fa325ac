"""Harness rollouts: each preset of `[rollout.harness]` (mini-swe-agent, the OpenAI Agents SDK),
unmodified, plays flywheel episodes through the per-episode endpoint; its commands run in the
episode's real sandbox; the trajectory holds exactly the tokens the engine saw and sampled; the
Learner trains on it. The config refuses what it cannot run. And the token ledger on its own: an
identical resend extends one segment, a rewritten history starts a new one and is counted."""

from __future__ import annotations

import base64
import json
import os

import pytest
import torch

from flywheel.agent.episode import initial_prompt
from flywheel.agent.trajectory import Status, Trajectory
from flywheel.env.families import generate
from flywheel.env.pool import PoolConfig, SandboxPool
from flywheel.model.chat import IM_END, SYSTEM_PROMPT
from flywheel.model.conversation import ConversationEncoder
from flywheel.model.engine import EngineConfig, Generation, LocalEngine
from flywheel.model.factory import ModelConfig, build_model
from flywheel.model.tokenizer import train_tokenizer
from flywheel.rl.harness.program import HarnessProgram, run_harness_episode
from flywheel.rl.harness.sandbox_exec import parse_bwrap_args
from flywheel.rl.harness.server import HarnessConfig, HarnessServer, TokenLedger
from flywheel.rl.learner import Learner, LearnerConfig
from tests.agent.test_episode import call
from tests.live.tiny_serving import TINY, corpus

try:
    import minisweagent  # noqa: F401  (the third-party harness under test: the dev extra installs it)

    HAVE_MINI = True
except ImportError:
    HAVE_MINI = False
needs_mini = pytest.mark.skipif(not HAVE_MINI and os.environ.get("FLYWHEEL_CI") != "1",
                                reason="mini-swe-agent is not installed: pip install -e '.[dev]'")
MINI = HarnessProgram(preset="mini-swe-agent")


@pytest.fixture(scope="module")
def task():
    return generate("bugfix", "train", 1, seed=5, difficulty=1)[0]


@pytest.fixture(scope="module")
def tokenizer(task):
    """A tokenizer whose model reads tool schemas (the client's `bash` is rendered in the prompt)."""
    return train_tokenizer([initial_prompt(task), call("bash", command="ls") + IM_END] * 10 + corpus(), vocab_size=600)


@pytest.fixture(scope="module")
def pool():
    with SandboxPool(PoolConfig(max_active=4, warm=0)) as p:
        yield p


class ScriptedEngine:
    """Answers each turn with the next scripted text, and remembers every prompt it was given."""

    def __init__(self, tokenizer, turns: list[str], version: int = 3):
        self.tokenizer, self.turns, self.version, self.prompts, self.sampled = tokenizer, list(turns), version, [], []

    def submit(self, prompt_ids, params):
        from concurrent.futures import Future  # noqa: PLC0415

        self.prompts.append(list(prompt_ids))
        ids = self.tokenizer(self.turns.pop(0), add_special_tokens=False)["input_ids"][: params.max_tokens]
        self.sampled.append(ids)
        future: Future = Future()
        future.set_result(Generation(ids, [-0.5 - 0.01 * i for i in range(len(ids))], [self.version] * len(ids),
                                     "stop" if ids and ids[-1] in params.stop_token_ids else "length"))
        return future


# ---- the ledger alone


def _served(content: str, calls: list[tuple[str, dict]] = ()) -> dict:
    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [{"id": f"c{i}", "type": "function",
                                  "function": {"name": n, "arguments": json.dumps(a)}}
                                 for i, (n, a) in enumerate(calls)]
    return message


def _generate(tokenizer, text: str) -> Generation:
    ids = tokenizer(text + IM_END, add_special_tokens=False)["input_ids"]
    return Generation(ids, [-0.1] * len(ids), [0] * len(ids), "stop")


def test_identical_resend_extends_one_segment_with_exactly_the_served_tokens(tokenizer):
    encoder = ConversationEncoder(tokenizer)
    ledger = TokenLedger(encoder)
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "Fix it."}]
    served_ids = []
    for turn in range(3):
        plan = ledger.prompt(messages, None)
        if turn:  # the prompt is the tokens served so far plus only the new tool result
            assert plan.prompt_ids[: len(ledger.segments[0].tokens)] == ledger.segments[0].tokens
            assert plan.new_context == encoder.tool_reply([f"output {turn - 1}"])
        text = call("bash", command=f"ls {turn}")
        generation = _generate(tokenizer, text)
        served = _served("", [("bash", {"command": f"ls {turn}"})])
        ledger.record(plan, generation, messages, served, [])
        served_ids.append(generation.token_ids)
        # The harness echoes the answer in its own serialisation (other id, spacing, null content).
        args = f'{{"command":"ls {turn}"}}'
        echoed = {"role": "assistant", "content": None, "tool_calls": [
            {"id": "other", "type": "function", "function": {"name": "bash", "arguments": args}}]}
        messages = [*messages, echoed, {"role": "tool", "content": f"output {turn}", "tool_call_id": "other"}]
    assert len(ledger.segments) == 1 and ledger.breaks == []
    segment = ledger.segments[0]
    generated = [t for t, m in zip(segment.tokens, segment.mask, strict=True) if m]
    assert generated == [i for ids in served_ids for i in ids]
    assert segment.prompt_len == len(encoder.encode(messages[:2], None))


@pytest.mark.parametrize(("rewrite", "kind", "at"), [
    (lambda m: [*m[:2], {**m[2], "content": "I looked (summarised)."}, *m[3:]], "rewritten", 2),
    (lambda m: [{**m[0], "content": "A shorter system prompt."}, *m[1:]], "rewritten", 0),
    (lambda m: m[:2], "truncated", 2),
])
def test_rewritten_history_starts_a_new_segment_and_is_counted(tokenizer, rewrite, kind, at):
    encoder = ConversationEncoder(tokenizer)
    ledger = TokenLedger(encoder)
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "Fix it."}]
    plan = ledger.prompt(messages, None)
    ledger.record(plan, _generate(tokenizer, "Looking."), messages, _served("Looking."), [])
    history = [*messages, {"role": "assistant", "content": "Looking."}, {"role": "user", "content": "go on please"}]
    plan = ledger.prompt(rewrite(history), None)
    assert plan.broke is not None and plan.broke.kind == kind and plan.broke.at_message == at
    assert plan.prompt_ids == encoder.encode(rewrite(history), None)  # rendered afresh, not spliced
    ledger.record(plan, _generate(tokenizer, "Again."), rewrite(history), _served("Again."), [])
    assert len(ledger.segments) == 2 and len(ledger.breaks) == 1
    # The first segment keeps exactly what was served; nothing of it is re-tokenized.
    assert ledger.segments[0].mask.count(1) == len(_generate(tokenizer, "Looking.").token_ids)


def test_sandbox_exec_reads_the_command_and_env_from_bwrap_arguments():
    args = ["--unshare-user-try", "--ro-bind", "/usr", "/usr", "--tmpfs", "/tmp", "--bind", "/w", "/w", "--chdir",
            "/w", "--setenv", "PAGER", "cat", "bash", "-c", "ls -la | head"]
    assert parse_bwrap_args(args) == ("bash", "ls -la | head", {"PAGER": "cat"})
    with pytest.raises(ValueError, match="bash -c COMMAND"):
        parse_bwrap_args(["--new-session", "python3", "x.py"])


# ---- mini-swe-agent end to end


@pytest.mark.slow  # 22 s on the shared 2-core machine (load ~10)
@needs_mini
def test_mini_swe_agent_solves_a_task_in_the_sandbox_in_one_exact_segment(task, tokenizer, pool, tmp_path):
    (edit,) = task.reference_edits
    fixed = task.files[edit.path].replace(edit.old, edit.new)
    write = f"echo {base64.b64encode(fixed.encode()).decode()} | base64 -d > {edit.path}"
    turns = ["Looking.\n" + call("bash", command="ls; whoami; pwd") + IM_END, call("bash", command=write) + IM_END,
             call("bash", command=task.test_command) + IM_END,
             call("bash", command="echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT") + IM_END]
    engine = ScriptedEngine(tokenizer, turns)
    server = HarnessServer(engine, tokenizer, pool, HarnessConfig(max_tokens_per_turn=2048, max_tokens=16384))
    with server.serve():
        result = run_harness_episode(server, task, MINI, tmp_path, max_turns=6)
    assert result.harness_exit_code == 0, result.harness_output
    # Every command ran in the episode's jail (its workspace is /workspace), and the fix was graded there.
    observations = [m["content"] for m in json.loads((tmp_path / "mini.traj.json").read_text())["messages"]
                    if m["role"] == "tool"]
    assert "/workspace" in observations[0] and "run_tests.py" in observations[0]
    assert result.commands == 4 and result.breaks == 0
    (traj,) = result.trajectories
    assert traj.status == Status.FINISHED and traj.all_passed and traj.reward == pytest.approx(1.0)
    assert traj.turns == 4 and traj.tool_calls == 4 and traj.invalid_tool_calls == 0
    # Token in, token out: each prompt the engine saw is the trajectory's prefix, and the generated
    # tokens are exactly the sampled ones, with their logprobs and version.
    for prompt in engine.prompts:
        assert traj.tokens[: len(prompt)] == prompt
    generated = [(t, lp, v) for t, m, lp, v in zip(traj.tokens, traj.loss_mask, traj.logprobs, traj.versions,
                                                    strict=True) if m]
    assert [t for t, _, _ in generated] == [i for ids in engine.sampled for i in ids]
    assert [lp for _, lp, _ in generated] == [-0.5 - 0.01 * i for ids in engine.sampled for i in range(len(ids))]
    assert {v for _, _, v in generated} == {3}
    assert [c["completion_ids"] for c in result.completions] == engine.sampled


@pytest.mark.slow  # 14-36 s on the shared 2-core machine (load ~15): the SDK's imports in its program
def test_the_openai_agents_sdk_preset_solves_a_task_in_the_sandbox_in_one_exact_segment(task, tokenizer, pool,
                                                                                        tmp_path):
    pytest.importorskip("agents", reason="the OpenAI Agents SDK (openai-agents, the dev extra)")
    (edit,) = task.reference_edits
    fixed = task.files[edit.path].replace(edit.old, edit.new)
    write = f"echo {base64.b64encode(fixed.encode()).decode()} | base64 -d > {edit.path}"
    turns = [call("bash", command="pwd; ls") + IM_END, call("bash", command=write) + IM_END,
             call("bash", command=task.test_command) + IM_END, "Fixed: the tests pass." + IM_END]
    engine = ScriptedEngine(tokenizer, turns)
    server = HarnessServer(engine, tokenizer, pool, HarnessConfig(max_tokens_per_turn=2048, max_tokens=16384))
    with server.serve():
        result = run_harness_episode(server, task, HarnessProgram(preset="openai-agents"), tmp_path, max_turns=6)
    assert result.harness_exit_code == 0, result.harness_output
    assert json.loads((tmp_path / "agents_sdk.json").read_text()) == {"exit_status": "Finished"}
    assert result.commands == 3 and result.breaks == 0
    (traj,) = result.trajectories
    assert traj.status == Status.FINISHED and traj.all_passed and traj.reward == pytest.approx(1.0)
    assert traj.turns == 4 and traj.tool_calls == 3 and traj.invalid_tool_calls == 0
    # The commands ran in the jail: the first one's output, as the SDK sent it back, names /workspace.
    assert "/workspace" in tokenizer.decode(engine.prompts[1][len(engine.prompts[0]):])
    for prompt in engine.prompts:  # token in, token out, as for mini-swe-agent
        assert traj.tokens[: len(prompt)] == prompt
    assert [t for t, m in zip(traj.tokens, traj.loss_mask, strict=True) if m] == [i for ids in engine.sampled
                                                                                  for i in ids]
    assert {v for v, m in zip(traj.versions, traj.loss_mask, strict=True) if m} == {3}


def test_a_harness_config_is_checked_when_read():
    from flywheel.rl.train import TrainConfig  # noqa: PLC0415

    # A command of your own: its templates filled per episode; the preset's fields overridden one by one.
    own = HarnessProgram(command=["{python}", "agent.py", "--url", "{base_url}", "--turns", "{max_turns}"],
                         env={"HOME": "{workdir}"}, tool_aliases={"shell": "run_command"})
    argv, env = own.argv_env({"python": "py", "base_url": "http://h/v1", "max_turns": "3", "workdir": "/w"})
    assert argv == ["py", "agent.py", "--url", "http://h/v1", "--turns", "3"] and env["HOME"] == "/w"
    mini = HarnessProgram(preset="mini-swe-agent", tool_aliases={"sh": "run_command"})
    assert mini.command == MINI.command and mini.tool_aliases == {"sh": "run_command"}
    # The short form names a preset; "builtin" is no harness.
    short = TrainConfig.model_validate({"rollout": {"harness": "openai-agents"}}).rollout.harness
    assert short.preset == "openai-agents" and short.status_file == "agents_sdk.json"
    assert TrainConfig.model_validate({"rollout": {"harness": "builtin"}}).rollout.harness is None
    with pytest.raises(ValueError, match="names \\['base_ur'\\].*placeholders are base_url"):
        HarnessProgram(command=["agent", "{base_ur}"])
    with pytest.raises(ValueError, match="needs a command"):
        HarnessProgram()
    with pytest.raises(ValueError, match="preset"):
        HarnessProgram(preset="aider")
    with pytest.raises(ValueError, match="cluster.backend = 'local'"):
        TrainConfig.model_validate({"rollout": {"harness": "mini-swe-agent"}, "cluster": {"backend": "ray"}})


@pytest.mark.slow  # 10 s on the shared 2-core machine (load ~10)
@needs_mini
def test_mini_swe_agent_with_the_embedded_model_yields_exact_records_the_learner_trains_on(task, pool, tmp_path):
    torch.manual_seed(0)
    embedded = train_tokenizer([initial_prompt(task, with_tools=False)] * 10 + corpus(), vocab_size=600,
                               tools_in_prompt=False)
    model = build_model(ModelConfig(**TINY, seed=0), embedded)
    engine = LocalEngine(model, EngineConfig(), version=0)
    server = HarnessServer(engine, embedded, pool, HarnessConfig(max_tokens_per_turn=24))
    try:
        with server.serve():
            result = run_harness_episode(server, task, MINI, tmp_path, max_turns=3)
    finally:
        engine.close()
    assert result.completions, result.harness_output
    # The untrained model writes no `bash` call: mini-swe-agent drops each answer and appends a format
    # error, a rewritten history, so each turn is a segment of its own and every break is counted.
    assert len(result.trajectories) == result.breaks + 1 == len({c["segment"] for c in result.completions})
    mini_turns = json.loads((tmp_path / "mini.traj.json").read_text())["messages"]
    assert not any(m["role"] == "assistant" for m in mini_turns)  # it kept none of the answers
    assert result.breaks == len(result.completions) - 1 and any(m["role"] == "user" for m in mini_turns[2:])
    # Three unparseable answers in a row end mini-swe-agent (RepeatedFormatError), as repeated invalid
    # turns end a built-in episode: its status says so, and the workspace is graded all the same.
    assert {t.status for t in result.trajectories} == {Status.TOOL_ERROR}
    assert all(t.outcome is not None for t in result.trajectories)
    for completion in result.completions:
        traj = result.trajectories[completion["segment"]]
        n = len(completion["prompt_ids"])
        ids = completion["completion_ids"]
        assert traj.tokens[:n] == completion["prompt_ids"] and traj.tokens[n:n + len(ids)] == ids
        assert traj.loss_mask[:n] == [0] * n and traj.loss_mask[n:n + len(ids)] == [1] * len(ids)
        assert traj.logprobs[n:n + len(ids)] == completion["logprobs"] and set(traj.versions[n:n + len(ids)]) == {0}
    learner = Learner(model, LearnerConfig(threads=1))
    before = [p.detach().clone() for p in model.parameters()]
    metrics = learner.train_step(result.trajectories, [1.0] * len(result.trajectories))
    assert metrics["optimizer_steps"] == 1 and metrics["loss_tokens"] == sum(t.generated_tokens
                                                                            for t in result.trajectories)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_the_endpoint_refuses_a_wrong_key_and_an_unknown_episode(task, tokenizer, pool):
    import httpx  # noqa: PLC0415

    server = HarnessServer(ScriptedEngine(tokenizer, []), tokenizer, pool)
    with server.serve():
        episode = server.start(task)
        body = {"model": "flywheel", "messages": [{"role": "user", "content": "hi"}]}
        wrong = httpx.post(f"{episode.url}/v1/chat/completions", json=body, headers={"authorization": "Bearer nope"})
        missing = httpx.post(f"{server.base_url}/episodes/none/exec", json={"command": "true"},
                             headers={"authorization": f"Bearer {episode.key}"})
        ran = httpx.post(f"{episode.url}/exec", json={"command": "echo hi > f.txt; cat f.txt"},
                         headers={"authorization": f"Bearer {episode.key}"})
        result = server.finish(episode.id)
    assert wrong.status_code == 401 and "key" in wrong.json()["error"]["message"]
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "episode_not_found"
    assert ran.json() == {"output": "hi\n", "exit_code": 0, "timed_out": False}
    assert result.trajectories == [] and result.commands == 1


def test_the_embedded_model_calls_its_own_tool_for_a_declared_alias_and_names_unknown_tools(task, pool):
    import httpx  # noqa: PLC0415

    embedded = train_tokenizer([initial_prompt(task, with_tools=False)] * 10 + corpus(), vocab_size=600,
                               tools_in_prompt=False)
    turns = [call("run_command", command="echo aliased > out.txt") + IM_END, call("read_file", path="a.py") + IM_END]
    engine = ScriptedEngine(embedded, turns)
    server = HarnessServer(engine, embedded, pool)
    tools = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object", "properties": {
        "command": {"type": "string"}}}}}, {"type": "function", "function": {"name": "browse"}}]
    with server.serve():
        episode = server.start(task)
        auth = {"authorization": f"Bearer {episode.key}"}
        messages = [{"role": "user", "content": "Fix it."}]
        first = httpx.post(f"{episode.url}/v1/chat/completions", headers=auth,
                           json={"model": "flywheel", "messages": messages, "tools": tools}).json()
        (bash,) = first["choices"][0]["message"]["tool_calls"]
        second = httpx.post(f"{episode.url}/v1/chat/completions", headers=auth, json={
            "model": "flywheel", "tools": tools, "messages": [*messages, first["choices"][0]["message"],
                                                              {"role": "tool", "content": "ok", "tool_call_id": "x"}]})
        result = server.finish(episode.id)
    # The model's own `run_command` comes back as the declared `bash`, with its arguments; the schemas
    # never entered the prompt (the model was trained without them).
    assert bash["function"] == {"name": "bash", "arguments": '{"command": "echo aliased > out.txt"}'}
    assert "browse" not in embedded.decode(engine.prompts[0])
    assert first["flywheel"]["unknown_tools"] == ["browse"]
    # A call of a tool the request did not declare is text to the client (no standard client could
    # dispatch it), and an invalid call in the ledger.
    answer = second.json()["choices"][0]
    assert answer["message"].get("tool_calls") is None and answer["finish_reason"] == "stop"
    assert '"name": "read_file"' in answer["message"]["content"]
    (traj,) = result.trajectories
    assert result.breaks == 0 and traj.turns == 2 and traj.invalid_tool_calls == 1 and len(traj.broken_turns) == 1


# ---- harness episodes in `flywheel train`


@pytest.mark.slow  # 14 s each on the shared 2-core machine (load ~10)
@pytest.mark.parametrize("preset", [pytest.param("mini-swe-agent", marks=needs_mini), "openai-agents"])
def test_flywheel_train_plays_harness_episodes_under_the_staleness_bound(tmp_path, preset):
    """`[rollout.harness] preset = ...`, each preset: the Orchestrator admits, bounds and trains harness
    episodes as it does built-in ones; their records are the exact tokens the engine sampled (the
    Learner rescores the start policy's tokens to the engine's logprobs), every token keeps the
    version that sampled it, and the episodes in flight at the end are stopped, not left running."""
    from flywheel.cli import main  # noqa: PLC0415
    from flywheel.env.families import task_set  # noqa: PLC0415
    from flywheel.model.registry import Registry  # noqa: PLC0415

    torch.manual_seed(0)
    tasks = task_set(["bugfix"], "train", 1, seed=100, difficulty=1)  # what `train` draws (train_tasks)
    embedded = train_tokenizer([initial_prompt(t, with_tools=False) for t in tasks] * 10 + corpus(), vocab_size=600,
                               tools_in_prompt=False)
    with Registry(tmp_path / "registry") as registry:
        registry.register(build_model(ModelConfig(**TINY, seed=0), embedded), embedded, parent=None,
                          aliases=["production"])
    config = tmp_path / "train.toml"
    config.write_text(f'''
registry_root = "{tmp_path / 'registry'}"
run_dir = "{tmp_path / 'run'}"
families = ["bugfix"]
train_tasks_per_family = 1
eval_tasks_per_family = 1
eval_at_start = false
threads = 1

[rollout.harness]
preset = "{preset}"

[orchestrator]
group_size = 2
groups_per_step = 1
max_staleness = 1
concurrency = 2
max_steps = 1
filter_zero_signal = false

[orchestrator.episode]
max_turns = 2
max_tokens_per_turn = 12
''')
    assert main(["train", "--config", str(config)]) == 0
    run = tmp_path / "run"
    (step,) = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert step["policy_version"] == 1 and step["episodes_trained"] == 2 and step["harness_episodes"] >= 2
    # Token in, token out: the Learner scores the start policy's tokens as the engine sampled them.
    assert step["engine_logprob_mismatch_max"] < 1e-4
    # Two groups were admitted at policy 0 (max_staleness 1): g1 played on while the Learner stepped.
    groups = {json.loads(line)["group"]: json.loads(line)["version"]
              for line in (run / "groups.jsonl").read_text().splitlines()}
    assert groups["g0"] == groups["g1"] == 0
    records = [json.loads(line) for line in (run / "trajectories.jsonl").read_text().splitlines()]
    assert sorted(r["episode"] for r in records if r["episode"].startswith("g0/")) == ["g0/0", "g0/1"]
    for record in records:
        traj = Trajectory.model_validate(record["trajectory"])
        assert traj.group_id == record["episode"].split("/")[0] and traj.generated_tokens > 0
        versions = [v for v, m in zip(traj.versions, traj.loss_mask, strict=True) if m]
        assert versions == sorted(versions) and versions[0] >= groups[traj.group_id]  # each keeps its sampler's
        assert {v for v, m in zip(traj.versions, traj.loss_mask, strict=True) if not m} == {-1}
        if traj.group_id == "g0":  # trained at step 1: sampled by policy 0 alone; out of its 2 steps
            assert set(versions) == {0} and traj.outcome is not None
            # mini-swe-agent plays until the turn limit; the Agents SDK's run ends at an answer without a call
            assert traj.status == Status.TRUNCATED if preset == "mini-swe-agent" else traj.status in (
                Status.TRUNCATED, Status.FINISHED)
    # The run stopped the episodes still playing at its end (none saved a state to resume: a harness
    # program restarts instead); each mini-swe-agent kept its own record in the run folder.
    assert not list((run / "inflight").glob("*.json"))
    if preset == "mini-swe-agent":
        assert len(list((run / "harness").glob("g0-*/mini.traj.json"))) == 2
