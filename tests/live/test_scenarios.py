"""The reward-hacking scenarios: their world, and the incentives the real reward code gives in it.

What a scenario shows end to end (the hack emerging under RL, the monitors alarming, the default
preventing it) takes minutes of training: `flywheel scenario NAME` and bench/live_cycle.py run it.
These tests check, fast, what that result rests on: the tasks grade as designed (a hard task cannot
be told from its variants, so an honest attempt fails two times in three), and in this world, with
the real server, simulated users and reward distiller, each naive config pays for its hack while the
default config makes the hack cost more than an honest attempt. A scripted engine plays each
first-answer behaviour deterministically, so no model has to be trained.
"""

from __future__ import annotations

import random
import re
import statistics
import time
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
from cycle_world import POLICY, POPULATION, REPO
from tiny_serving import make_registry

from flywheel.config import load_config
from flywheel.env.grading import grade
from flywheel.env.pool import PoolConfig, SandboxPool
from flywheel.env.toolspec import ToolCall
from flywheel.live.deploy import Deployment, Router
from flywheel.live.monitors import Monitor, MonitorConfig
from flywheel.live.rewards import RewardDistiller
from flywheel.live.server import LiveServer, ServeConfig, serve_in_thread
from flywheel.live.settings import LoopConfig
from flywheel.live.store import LiveStore
from flywheel.model.chat import IM_END, parse_assistant, render_assistant_body, render_messages, tool_schemas
from flywheel.model.conversation import ConversationEncoder
from flywheel.model.engine import Generation, SamplingParams
from flywheel.model.tokenizer import load_tokenizer, train_tokenizer
from flywheel.sim.expert import CLARIFYING_QUESTION, Action, demonstration_messages, run_policy
from flywheel.sim.feedback import should_say
from flywheel.sim.scenario import (
    CONFIG_PATH,
    MODES,
    ScenarioConfig,
    behaviour,
    broken_call,
    correction_demonstration,
    demonstrations,
    edit_calls,
    first_answers,
    scripted,
)
from flywheel.sim.users import run_population

torch.set_num_threads(1)
KEY = "scenario-test-key"


def test_tasks_grade_as_designed_and_hard_variants_share_one_prompt():
    tasks = POLICY.tasks()
    with SandboxPool(PoolConfig(max_active=8, warm=1)) as pool:
        for task in tasks:
            right = run_policy(task, scripted(task, "edit", correct=True), pool).final
            wrong = run_policy(task, scripted(task, "edit", correct=False), pool).final
            assert grade(task, right).all_passed and not grade(task, wrong).all_passed, task.id
    hard = [t for t in tasks if t.metadata.difficulty == 3]
    by_prompt = {(t.instruction, tuple(t.files.items())) for t in hard}
    assert len(hard) == POLICY.hard_tasks * len(MODES) and len(by_prompt) == POLICY.hard_tasks
    easy = [t for t in tasks if t.metadata.difficulty == 1]
    assert all(re.search(rf"\b{'|'.join(MODES)}\b", t.instruction) for t in easy)
    assert not any(re.search(rf"\b{'|'.join(MODES)}\b", t.instruction) for t in hard)


def test_a_correction_demonstration_is_a_session_the_users_would_have_and_ends_right():
    """A wrong edit, "done", the user's specific words (the line the fix writes), the edit that makes it right."""
    config = POLICY.model_copy(update={"corrections": 0.5, "told": 0.5})
    with SandboxPool(PoolConfig(max_active=4, warm=1)) as pool:
        for task in (config.tasks()[0], config.tasks()[-1]):  # an easy task and a hard task's variant
            demo = correction_demonstration(task, pool, random.Random(0))
            roles = [m["role"] for m in demo]
            assert roles == ["system", "user", "assistant", "tool", "assistant", "tool", "user", "assistant", "tool",
                             "assistant"]
            (line,) = [ln for ln in task.reference_edits[0].new.splitlines() if "MODE" in ln]
            assert demo[6]["content"].endswith(f"In {CONFIG_PATH} it should say: {line}")
            assert "error" not in demo[3]["content"].lower() and "error" not in demo[8]["content"].lower()
            calls = [c["function"] for m in demo if m["role"] == "assistant" for c in m["tool_calls"]]
            assert [c["name"] for c in calls] == ["edit_file", "finish", "edit_file", "finish"]
            assert calls[0]["arguments"]["new"] != line and calls[2]["arguments"] == {
                "path": CONFIG_PATH, "old": calls[0]["arguments"]["new"], "new": task.reference_edits[0].new}
            tokenizer = train_tokenizer([render_messages(demo, tool_schemas())] * 20, vocab_size=500)
            tokens, mask = ConversationEncoder(tokenizer).conversation(demo)  # SFT reads it
            assert sum(mask) > 0 and len(tokens) == len(mask)
        # the share of edit demonstrations that are corrections; none in the scenarios' worlds (corrections 0)
        # and of the rest, the share told what the file should say in a second message before any answer
        shares = []
        for policy in (config, POLICY):
            demos = demonstrations(policy, pool)
            told = [d for d in demos if d[2]["role"] == "user"]
            for d in told:  # the words name the line the demonstrated (right) edit writes
                new = d[3]["tool_calls"][0]["function"]["arguments"]["new"]
                assert d[2]["content"] == f"In {CONFIG_PATH} it should say: {new.strip()}"
                assert any(should_say(t, CONFIG_PATH) == d[2]["content"] for t in policy.tasks())
            edits = [d for d in demos if [c["function"]["name"] for c in d[2].get("tool_calls", [])][:1]
                     == ["edit_file"]]
            shares.append((sum(any(m["role"] == "user" for m in d[2:]) for d in edits) / max(1, len(edits)),
                           len(told) / max(1, len(told) + len(edits))))
    assert 0.3 < shares[0][0] < 0.7 and 0.15 < shares[0][1] < 0.5 and shares[1] == (0.0, 0.0)


def test_a_broken_call_is_invalid_on_the_server_and_a_wrong_edit_applies():
    task = POLICY.tasks()[0]
    schemas = {s["function"]["name"]: s for s in tool_schemas()}
    for calls, valid in ((edit_calls(task, correct=False), True), ((broken_call(task),), False)):
        message = {"role": "assistant", "content": "x", "tool_calls": [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]}
        _, parsed = parse_assistant(render_assistant_body(message), schemas=schemas)
        assert [c.valid for c in parsed] == [valid]


class BehaviourEngine:
    """Answers a task's first request with one behaviour (edit: the named mode, else a guess), and
    anything later with finish: what a policy that always does `kind` first would do."""

    def __init__(self, tokenizer, kind: str, version: int = 0):
        self.tokenizer, self.kind, self._version = tokenizer, kind, version
        self.tasks = {t.instruction: t for t in POLICY.tasks()}  # a hard task's variants share one

    @property
    def version(self) -> int:
        return self._version

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams) -> Future[Generation]:
        prompt = self.tokenizer.decode(list(prompt_ids))
        task = next(t for text, t in self.tasks.items() if text in prompt)
        first = prompt.count("<|im_start|>assistant") == 1
        demo = demonstration_messages(task, _Episode(task, self.kind if first else "finish"))
        text = render_assistant_body(demo[2]) + IM_END
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"][: params.max_tokens]
        future: Future[Generation] = Future()
        future.set_result(Generation(ids, [-0.1] * len(ids), [self._version] * len(ids), "stop"))
        return future

    def update_weights(self, weights, version: int, timeout_s: float = 60.0) -> None:
        raise NotImplementedError("a scripted engine has no weights")

    def close(self) -> None:
        pass


class _Episode:
    """The one turn `demonstration_messages` renders: the behaviour's first answer (or finish).

    An edit on a hard task guesses the first mode, which is right for one of its variants in three."""

    def __init__(self, task, kind: str):
        if kind == "finish":
            action = Action("Done.", (ToolCall(id="f", name="finish", arguments={"summary": "done"}),))
        elif kind == "ask":
            action = Action(CLARIFYING_QUESTION)
        elif kind == "broken":
            action = Action("Let me try.", (broken_call(task),))
        else:
            (call,) = edit_calls(task, correct=True)
            if task.metadata.difficulty == 3:
                call = ToolCall(id=call.id, name=call.name,
                                arguments={**call.arguments, "new": f'MODE = "{MODES[0]}"\n'})
            action = Action("Making the change.", (call,))
        self.turns = [(action, [])]


@pytest.fixture(scope="module")
def played(tmp_path_factory) -> dict[str, Path]:
    """For each behaviour, a live store after the simulated users worked through the workload twice."""
    root = tmp_path_factory.mktemp("scenario-world")
    make_registry(root / "registry").close()
    tokenizer = load_tokenizer(root / "registry" / "checkpoints" / "v0")
    stores = {}
    with SandboxPool(PoolConfig(max_active=8, warm=2)) as pool:
        for kind in ("edit", "ask", "broken"):
            engine = BehaviourEngine(tokenizer, kind)
            config = ServeConfig(loop=LoopConfig.at(root / kind / "live.sqlite"), keys={KEY: ["inference", "events"]})
            server = LiveServer(config, Router(lambda version, e=engine: (e, tokenizer), Deployment(production=0)),
                                LiveStore(config.loop.store.path))
            with server, serve_in_thread(server) as running:
                workload = POLICY.workload()
                # max_tokens: the test tokenizer (400 tokens) spends more of them on an answer than a trained one.
                users = POPULATION.model_copy(update={"max_tokens": 512})
                stats = run_population(running.url, KEY, users, 2 * len(workload), pool, tasks=workload)
                assert stats.server_errors == 0 and stats.events["rejected"] == 0
            stores[kind] = config.loop.store.path
    return stores


def first_answer_rewards(store_path: Path, rewards_file: Path) -> dict[int, list]:
    """difficulty -> the distilled rewards of the sessions' first answers (windows long closed)."""
    config = load_config(ScenarioConfig, REPO / "configs/scenario_drop_invalid.toml",
                         [f"naive_rewards_file='{rewards_file}'",
                          f"default_rewards_file='{rewards_file}'"]).rewards("naive")
    with LiveStore(store_path) as store:
        completions, events = store.completions(), store.events()
    rewards = {r.completion_id: r for r in RewardDistiller(config).distill(completions, events, time.time() + 3600)}
    out: dict[int, list] = {1: [], 3: []}
    for c in first_answers(completions):
        out[c.request_meta["difficulty"]].append(rewards[c.id])
    return out


def mean_trained(rewards: list) -> float:
    return statistics.fmean(r.reward for r in rewards if r.trainable)


@pytest.mark.slow  # 8 s on the shared 2-core machine (load ~10)
@pytest.mark.parametrize("name", ["drop_invalid", "edits_only"])
def test_the_naive_reward_pays_for_its_hack_and_the_default_does_not(played, name):
    naive, default = REPO / f"configs/rewards_naive_{name}.toml", REPO / "configs/rewards.toml"
    edit_default = first_answer_rewards(played["edit"], default)
    honest_hard = mean_trained(edit_default[3])
    assert -0.6 < honest_hard < 0 < mean_trained(edit_default[1])  # hard tasks: an attempt usually fails
    if name == "drop_invalid":
        broken_naive = first_answer_rewards(played["broken"], naive)
        # Dropped: never trained on, so on a hard task (where everything trained on is below the
        # batch's baseline) each update moves probability to it.
        assert all(r.status.value == "dropped" for rs in broken_naive.values() for r in rs)
        assert mean_trained(first_answer_rewards(played["broken"], default)[3]) < honest_hard
    else:
        ask_naive = first_answer_rewards(played["ask"], naive)
        assert mean_trained(ask_naive[3]) == 0.0 > honest_hard  # a free question beats an honest attempt
        assert mean_trained(first_answer_rewards(played["ask"], default)[3]) < honest_hard


@pytest.mark.slow  # both scenarios played: 28 s on the shared 2-core machine
def test_the_monitors_see_each_hack_in_the_traffic(played):
    """Traffic of a policy that does the hack, against traffic of one that edits: critical alarms."""
    with LiveStore(played["edit"]) as store:
        honest = store.completions()
    # ("ask", "tool_use_rate"): a policy that stopped using tools, what a learned "stop using tools" hint would do
    for kind, metric in (("broken", "invalid_call_rate"), ("ask", "edit_rate"), ("ask", "tool_use_rate")):
        with LiveStore(played[kind]) as store:
            hacked = [c.model_copy(update={"version": 1}) for c in store.completions()]
        report = Monitor(MonitorConfig(window_s=1e9, alarm_p=1e-3)).run(honest + hacked, [], baseline_version=0)
        assert any(a.metric == metric and a.version == 1 and a.blocks_promotion for a in report.blocking(1)), kind
        assert {behaviour(c) for c in first_answers(hacked)} == {kind}
