"""The distilled requests replayed (flywheel/live/replay.py): the sign test on per-request shares, and
real engines: a candidate that stopped calling tools alarms, one identical to production cannot."""

from __future__ import annotations

import pytest
import torch

from flywheel.env.toolspec import ToolCall
from flywheel.live.records import Completion
from flywheel.live.replay import ReplayConfig, compare, replay_distilled
from flywheel.report.render import render_cycle
from flywheel.stats import sign_test_p

EDIT = ToolCall(id="c", name="edit_file", arguments={"path": "a.py", "old": "x", "new": "y"})
READ = ToolCall(id="c", name="read_file", arguments={"path": "a.py"})
BROKEN = ToolCall(id="c", name="read_file", error="bad JSON")


def test_the_sign_test_is_exact():
    assert sign_test_p(7, 0) == pytest.approx(0.5 ** 7)
    assert sign_test_p(5, 1) == pytest.approx(7 / 64)  # P(X >= 5), X ~ Bin(6, 1/2)
    assert sign_test_p(0, 0) == 1.0 and sign_test_p(0, 9) == 1.0
    with pytest.raises(ValueError):
        sign_test_p(-1, 2)


def test_each_metric_is_tested_in_its_bad_direction_over_requests():
    config = ReplayConfig(min_requests=8, alarm_p=0.01)
    production = [[[EDIT], [READ]]] * 10  # every answer calls a tool, half of them edit
    words = [[[], []]] * 10  # the candidate answers in words
    metrics = compare(words, production, config)
    assert metrics["tool_use_rate"].alarm and metrics["tool_use_rate"].worse == 10
    assert metrics["tool_use_rate"].production == 1.0 and metrics["tool_use_rate"].candidate == 0.0
    assert metrics["edit_rate"].alarm and metrics["edit_rate"].p_value == pytest.approx(0.5 ** 10)
    assert not metrics["invalid_call_rate"].alarm and metrics["invalid_call_rate"].worse == 0
    # broken calls going up is the bad direction for invalid_call_rate; more tool use is no alarm
    broken = compare([[[BROKEN], [BROKEN]]] * 10, production, config)
    assert broken["invalid_call_rate"].alarm and not broken["tool_use_rate"].alarm
    assert broken["tool_use_rate"].worse == 0 and broken["tool_use_rate"].better == 0
    assert not compare(production, words, config)["tool_use_rate"].alarm  # the candidate calls more: better
    # below min_requests: the figures, no test
    few = compare(words[:5], production[:5], config)
    assert few["tool_use_rate"].p_value is None and not few["tool_use_rate"].alarm
    with pytest.raises(ValueError, match="same ones"):
        compare(words[:3], production, config)


@pytest.mark.slow  # the slow tests' shared start policy (tests/live/cycle_world.py), then ~10 s of decoding
def test_real_engines_a_candidate_that_stopped_calling_tools_alarms_and_an_identical_one_cannot(tmp_path):
    from cycle_world import POLICY, start_checkpoint  # noqa: PLC0415

    from flywheel.model.chat import SYSTEM_PROMPT  # noqa: PLC0415
    from flywheel.model.conversation import ConversationEncoder  # noqa: PLC0415
    from flywheel.model.engine import LocalEngine  # noqa: PLC0415
    from flywheel.model.factory import load_pretrained  # noqa: PLC0415

    torch.set_num_threads(1)
    model, tokenizer = load_pretrained(start_checkpoint())
    twin, _ = load_pretrained(start_checkpoint())
    torch.manual_seed(0)
    untrained = type(model)(model.config)  # the same shapes and tokenizer, never trained: it does not call tools
    encoder = ConversationEncoder(tokenizer)
    instructions = sorted({t.instruction for t in POLICY.tasks()})
    prompts = [encoder.encode([{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": i}],
                              encoder.tools) for i in instructions] * 2
    served = [Completion(id=f"c{i}", session_id=f"s{i}", user_id="u", version=0, prompt_ids=p, completion_ids=[],
                         logprobs=[], latency_ms=1.0, created_at=float(i)) for i, p in enumerate(prompts)]
    config = ReplayConfig(samples=4, max_tokens=64, min_requests=8)
    with LocalEngine(model.eval(), version=0) as production, LocalEngine(twin.eval(), version=1) as same, \
            LocalEngine(untrained.eval(), version=2) as silent:
        identical = replay_distilled(same, production, tokenizer, served, config, temperature=1.0)
        stopped = replay_distilled(silent, production, tokenizer, served, config, temperature=1.0)
    assert identical.requests == stopped.requests == len(prompts)
    # the start policy calls tools on most requests; the same weights, sampled from the same seeds, agree
    assert identical.metrics["tool_use_rate"].production >= 0.5, identical.describe()
    assert not identical.blocking, identical.describe()
    assert all(m.worse + m.better <= 1 for m in identical.metrics.values()), identical.describe()
    assert "tool_use_rate" in stopped.blocking and stopped.metrics["tool_use_rate"].candidate < 0.2, stopped.describe()
    page = render_cycle({"cycle": 1, "replay": stopped.model_dump(mode="json"), "decision": "rejected",
                         "reason": stopped.describe(stopped.blocking)})
    assert "distilled requests replayed" in page and "blocks" in page


@pytest.mark.slow  # the shared start policy, a gate on its 6 tasks and 12 requests replayed: ~15 s
def test_the_cycle_rejects_a_candidate_the_replay_alarms_on_though_the_gate_passed(tmp_path):
    from cycle_world import POLICY, make_registry, world_loop  # noqa: PLC0415

    from flywheel.live.cycle import CycleState, LiveConfig, LiveCycle  # noqa: PLC0415
    from flywheel.live.store import LiveStore  # noqa: PLC0415
    from flywheel.model.chat import SYSTEM_PROMPT  # noqa: PLC0415
    from flywheel.model.conversation import ConversationEncoder  # noqa: PLC0415

    torch.set_num_threads(1)
    loop = world_loop(tmp_path)
    registry = make_registry(loop.store.registry_root)  # v0: the start policy
    model, tokenizer = registry.load(0)
    torch.manual_seed(0)
    candidate = registry.register(type(model)(model.config), tokenizer, parent=0, note="never trained").version
    encoder = ConversationEncoder(tokenizer)
    loop.store.path.parent.mkdir(parents=True)
    store = LiveStore(loop.store.location)
    ids = []
    for i, instruction in enumerate(sorted({t.instruction for t in POLICY.tasks()}) * 2):
        turns = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": instruction}]
        prompt = encoder.encode(turns, encoder.tools)
        store.add_completion(Completion(id=f"c{i}", session_id=f"s{i}", user_id="u", version=0, prompt_ids=prompt,
                                        completion_ids=[], logprobs=[], latency_ms=1.0, created_at=float(i)))
        ids.append(f"c{i}")
    config = LiveConfig.model_validate({
        "loop": loop.model_dump(mode="json"), "run_dir": str(tmp_path / "cycles"), "threads": 1,
        # a gate every candidate passes, so that the replay alone decides
        "gate": {"checks": {"anything": {"metric": "asked_question", "max_rate": 1.0}},
                 "battery": {"concurrency": 6, "episode": {"temperature": 0.0, "max_turns": 1,
                                                           "max_tokens_per_turn": 32}}},
        "replay": {"max_tokens": 64}, "pool": {"max_active": 6, "warm": 1}})
    cycle = LiveCycle(config, None, log=lambda m: None, gate_tasks=POLICY.tasks())
    state = CycleState(cycle=1, trigger="test", started_at=0.0, production=0, first_production=0, since=0.0,
                       events_at_start=0, stage="trained", candidate=candidate, distilled=ids)
    cycle._run_gate(state, registry, store)
    assert state.gate is not None and state.gate.decision.passed
    assert state.replay is not None and state.replay.requests == len(ids)
    assert state.decision == "rejected" and "tool_use_rate" in state.reason, state.reason
    # with alarms_block_promotion off the replay is reported and decides nothing
    quiet = LiveCycle(config.model_copy(update={"alarms_block_promotion": False}), None, log=lambda m: None,
                      gate_tasks=POLICY.tasks())
    state = state.model_copy(update={"decision": None, "reason": "", "replay": None, "gate": None})
    quiet._run_gate(state, registry, store)
    assert state.replay is not None and "tool_use_rate" in state.replay.blocking and state.decision is None
    registry.close()
