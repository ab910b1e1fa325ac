"""The run folder: what a resume reads back after a crash, on a real filesystem."""

from __future__ import annotations

import json
import os
import threading

import pytest
import torch

from flywheel.agent.episode import EpisodeState
from flywheel.rl.run_folder import RunFolder


def test_a_line_cut_by_a_crash_is_skipped_and_the_rest_read(tmp_path):
    run = RunFolder(tmp_path)
    run.append("trajectories.jsonl", {"episode": "g0/0"})
    with open(tmp_path / "trajectories.jsonl", "a") as f:
        f.write('{"episode": "g0/')  # what a kill mid-write leaves
    assert run.read("trajectories.jsonl") == [{"episode": "g0/0"}]
    assert run.read("missing.jsonl") == []


def test_state_saves_learner_and_progress_together_and_survives_a_crash_between_renames(tmp_path):
    run = RunFolder(tmp_path)
    assert run.load_state() is None
    run.save_state({"weights": torch.ones(3)}, {"step": 1, "consumed": {"g0": 1}})
    run.save_state({"weights": torch.full((3,), 2.0)}, {"step": 2, "consumed": {"g0": 1, "g1": 2}})
    learner, progress = run.load_state()
    assert torch.equal(learner["weights"], torch.full((3,), 2.0)) and progress["step"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["inflight", "state"]  # no temp or displaced folder left
    os.replace(tmp_path / "state", tmp_path / "state.old")  # a crash after the first of replace_folder's renames
    learner, progress = run.load_state()
    assert progress["step"] == 2
    run.save_state({"weights": torch.zeros(3)}, {"step": 3, "consumed": {}})  # the next save puts it right
    assert run.load_state()[1]["step"] == 3 and not (tmp_path / "state.old").exists()


def test_a_later_save_lands_off_the_callers_path_and_its_record_only_after_it(tmp_path):
    run, release = RunFolder(tmp_path), threading.Event()

    def slow_snapshot():
        release.wait(timeout=30)
        return {"weights": torch.ones(2)}

    progress, metrics = {"step": 1}, {"step": 1, "reward": 0.5}
    run.save_state_later(slow_snapshot, progress, then=("metrics.jsonl", metrics))
    progress["step"], metrics["step"] = 99, 99  # the caller goes on: what was queued is what it was
    assert run.load_state() is None and run.read("metrics.jsonl") == []  # nothing before the state lands
    release.set()
    run.wait_for_state()
    learner, saved = run.load_state()
    assert saved == {"step": 1} and torch.equal(learner["weights"], torch.ones(2))
    assert run.read("metrics.jsonl") == [{"step": 1, "reward": 0.5}]


def test_a_crash_between_a_save_and_its_record_is_completed_by_the_resume_once(tmp_path):
    """The kill lands after the checkpoint is swapped in, before its metrics line is appended: the
    step is checkpointed (a resume goes on after it), so the resume appends the line it kept."""
    run = RunFolder(tmp_path)
    run.append("metrics.jsonl", {"step": 1})
    line = json.dumps({"step": 2, "reward": 0.25}, separators=(",", ":"))
    run.save_state({"weights": torch.ones(1)}, {"step": 2}, record=("metrics.jsonl", line))  # ... killed here
    resumed = RunFolder(tmp_path)
    assert resumed.complete_record() is True
    assert resumed.complete_record() is False  # a second resume does not append it again
    assert resumed.read("metrics.jsonl") == [{"step": 1}, {"step": 2, "reward": 0.25}]
    # the usual path: the record was appended after its save, and nothing is added
    run.save_state_later(lambda: {"weights": torch.ones(1)}, {"step": 3}, then=("metrics.jsonl", {"step": 3}))
    run.wait_for_state()
    assert RunFolder(tmp_path).complete_record() is False and len(run.read("metrics.jsonl")) == 3


def test_a_failed_later_save_drops_its_record_and_is_raised_not_swallowed(tmp_path):
    run = RunFolder(tmp_path)
    run.save_state({"weights": torch.zeros(1)}, {"step": 1})

    def lost():
        raise RuntimeError("the learner actor died")

    run.save_state_later(lost, {"step": 2}, then=("metrics.jsonl", {"step": 2}))
    with pytest.raises(RuntimeError, match="actor died"):
        run.wait_for_state()
    assert run.load_state()[1] == {"step": 1} and run.read("metrics.jsonl") == []  # the resume redoes step 2
    run.wait_for_state()  # raised once
    run.save_state_later(lost, {"step": 2})
    with pytest.raises(RuntimeError):  # the next save raises the previous one's failure before queueing
        run.save_state_later(lambda: {"weights": torch.ones(1)}, {"step": 3})


def test_episode_states_round_trip_by_episode_id(tmp_path):
    run = RunFolder(tmp_path)
    state = EpisodeState(task_id="bugfix/1", group_id="g3", tokens=[1, 2, 3], loss_mask=[0, 1, 1],
                         logprobs=[0.0, -0.5, -0.25], versions=[-1, 0, 0], prompt_len=1, turns=1, tool_calls=1,
                         invalid_tool_calls=0, invalid_streak=0, asked_question=False, workspace={"a.py": "eA=="})
    run.save_episode_state("g3/1", state)
    assert run.episode_states() == {"g3/1": state}
    run.drop_episode_state("g3/1")
    assert run.episode_states() == {}
