"""The run folder: what a resume reads back after a crash, on a real filesystem."""

from __future__ import annotations

import os

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


def test_episode_states_round_trip_by_episode_id(tmp_path):
    run = RunFolder(tmp_path)
    state = EpisodeState(task_id="bugfix/1", group_id="g3", tokens=[1, 2, 3], loss_mask=[0, 1, 1],
                         logprobs=[0.0, -0.5, -0.25], versions=[-1, 0, 0], prompt_len=1, turns=1, tool_calls=1,
                         invalid_tool_calls=0, invalid_streak=0, asked_question=False, workspace={"a.py": "eA=="})
    run.save_episode_state("g3/1", state)
    assert run.episode_states() == {"g3/1": state}
    run.drop_episode_state("g3/1")
    assert run.episode_states() == {}
