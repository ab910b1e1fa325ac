"""flywheel/rl/audit.py: each invariant, broken on purpose in a run folder written by hand, is found
and named (the fault tests rely on it finding what they look for); a folder that keeps them all passes."""

from __future__ import annotations

import json
from pathlib import Path

from flywheel.rl.audit import audit, lost_samples
from flywheel.rl.run_folder import RunFolder


def trajectory(versions: list[int], logprob: float = -0.5, tokens: list[int] | None = None) -> dict:
    """Two prompt tokens, then one generated token per version."""
    n = len(versions)
    return {"tokens": tokens or [1, 2, *range(10, 10 + n)], "loss_mask": [0, 0] + [1] * n,
            "logprobs": [0.0, 0.0] + [logprob] * n, "versions": [-1, -1, *versions]}


def write(root: Path, groups: dict[str, int], steps: list[tuple[list[str], int]],
          episodes: dict[str, dict], extra: list[dict] = ()) -> Path:
    """groups: id -> start version; steps: (groups trained, policy version after); episodes: id -> trajectory."""
    run = RunFolder(root)
    for g, v in groups.items():
        run.append("groups.jsonl", {"group": g, "task": "t", "version": v})
    for e, t in episodes.items():
        run.append("trajectories.jsonl", {"episode": e, "trajectory": t})
    for record in extra:
        run.append("trajectories.jsonl", record)
    for k, (trained, version) in enumerate(steps, 1):
        run.append("metrics.jsonl", {"step": k, "policy_version": version, "groups": trained})
    return root


def two_groups(v0: list[int], v1: list[int]) -> dict[str, dict]:
    return {**{f"g0/{i}": trajectory(v0) for i in range(2)}, **{f"g1/{i}": trajectory(v1) for i in range(2)}}


def test_a_run_that_keeps_every_invariant_passes(tmp_path):
    root = write(tmp_path, {"g0": 0, "g1": 1}, [(["g0"], 1), (["g1"], 2)], two_groups([0, 0], [1, 1]))
    assert audit(root, [], max_staleness=1, group_size=2) == []


def test_each_broken_invariant_is_named(tmp_path):
    cases = {  # what the violation says: (group starts, steps (groups trained, policy after), trajectories)
        "staleness 2 > 1": ({"g0": 0, "g1": 0}, [(["g0"], 1), ([], 2), (["g1"], 3)], two_groups([0], [0])),
        "newer than the weights trained": ({"g0": 0, "g1": 0}, [(["g0", "g1"], 1)], two_groups([0], [1])),
        "which the run did not have then": ({"g0": 0, "g1": 2}, [(["g0"], 1), (["g1"], 2)], two_groups([0], [1])),
        "older than its group's start": ({"g0": 0, "g1": 1}, [(["g0"], 1), (["g1"], 2)], two_groups([0], [0, 1])),
        "older than an earlier token's": ({"g0": 0, "g1": 0}, [(["g0", "g1"], 1)], two_groups([0], [1, 0])),
        "was trained at step 1 too": ({"g0": 0, "g1": 0}, [(["g0", "g1"], 1), (["g1"], 2)], two_groups([0], [0])),
    }
    for i, (said, (groups, steps, episodes)) in enumerate(cases.items()):
        violations = audit(write(tmp_path / str(i), groups, steps, episodes), [], max_staleness=1, group_size=2)
        assert any(said in v for v in violations), (said, violations)
    incomplete = two_groups([0], [0])
    del incomplete["g1/1"]
    violations = audit(write(tmp_path / "x", {"g0": 0, "g1": 0}, [(["g0", "g1"], 1)], incomplete), [], 1, 2)
    assert any("incomplete: 1 of 2" in v for v in violations), violations
    twice = write(tmp_path / "y", {"g0": 0}, [(["g0"], 1)], {"g0/0": trajectory([0]), "g0/1": trajectory([0])},
                  extra=[{"episode": "g0/1", "trajectory": trajectory([0])}])
    assert any("two trajectories with no strike" in v for v in audit(twice, [], 1, 2))


def test_tokens_of_a_lost_policy_are_found_whatever_version_the_run_reached_since(tmp_path):
    """Killed at policy 1 with its checkpoint lost: the saved state of g1/0 holds a token policy 1
    sampled. A resume that kept it trains on it later, when the run's own policy 1 exists: the
    version looks right, the fingerprint (tokens up to it, its logprob) says it is the lost one's.
    Struck out and played again, with other weights (another logprob), it passes."""
    root = tmp_path / "run"
    run = RunFolder(root)
    kept = trajectory([0, 1], logprob=-0.25)
    run.save_state({"version": 0}, {"step": 0, "policy_version": 0, "consumed": {}, "counts": {}})
    (root / "inflight" / "g1_0.json").write_text(json.dumps(kept))
    lost = lost_samples(root)
    assert lost.resumes_at == 0 and lost.records == 1
    episodes = {"g0/0": trajectory([0]), "g0/1": trajectory([0]), "g1/0": kept, "g1/1": trajectory([0, 1])}
    write(root, {"g0": 0, "g1": 0}, [(["g0"], 1), (["g1"], 2)], episodes)
    assert any("sampled by weights the run lost" in v and "g1/0" in v for v in audit(root, [lost], 1, 2))
    replayed = RunFolder(tmp_path / "replayed")
    replayed.append("trajectories.jsonl", {"episode": "g1/0", "trajectory": kept})
    write(tmp_path / "replayed", {"g0": 0, "g1": 0}, [(["g0"], 1), (["g1"], 2)],
          {e: t for e, t in episodes.items() if e != "g1/0"},
          extra=[{"episode": "g1/0", "discarded": 0}, {"episode": "g1/0", "trajectory": trajectory([0, 1], -0.3)}])
    assert audit(tmp_path / "replayed", [lost], 1, 2) == []


def test_a_lost_policy_made_again_with_the_same_weights_rightly_names_its_tokens(tmp_path):
    """Policy 1 was pushed, sampled and lost before its checkpoint; the resumed run makes version 1
    again. With the same weights (a retrain on the same batch: equal digests in policies.jsonl) an
    episode played again samples the very same tokens and logprobs, and they are policy 1's: no
    violation. With other weights (another digest), or with the lost policy's digest unknown, the
    same trajectory is one that carried the lost token into training."""
    kept = trajectory([0, 1], logprob=-0.25)
    episodes = {"g0/0": trajectory([0]), "g0/1": trajectory([0]), "g1/0": kept, "g1/1": trajectory([0, 1])}
    for remade, written, found in ((7, True, False), (8, True, True), (7, False, True)):
        root = tmp_path / f"{remade}-{written}"
        run = RunFolder(root)
        run.save_state({"version": 0}, {"step": 0, "policy_version": 0, "consumed": {}, "counts": {}})
        if written:
            run.append("policies.jsonl", {"version": 1, "digest": 7})
        (root / "inflight" / "g1_0.json").write_text(json.dumps(kept))
        lost = lost_samples(root)
        assert lost.records == 1 and lost.digests == ({1: 7} if written else {})
        (root / "inflight" / "g1_0.json").unlink()  # the resume drops it; the episode plays again
        run.append("policies.jsonl", {"version": 1, "digest": remade})
        run.append("policies.jsonl", {"version": 2, "digest": 9})
        write(root, {"g0": 0, "g1": 0}, [(["g0"], 1), (["g1"], 2)], episodes)
        violations = audit(root, [lost], 1, 2)
        assert any("sampled by weights the run lost" in v and "g1/0" in v for v in violations) == found, violations
        assert found or violations == []
