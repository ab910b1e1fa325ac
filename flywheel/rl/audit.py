"""The version invariants of a simulated-RL run, checked on its run folder: what the fault tests
(tests/rl/test_faults.py) and `bench/faults.py` assert after killing a run's processes at random
moments.

    lost = lost_samples(run_dir)       after a kill, before the run resumes: the policy it will
                                       resume at, and every record a newer policy sampled (those
                                       weights die with the process)
    audit(run_dir, [lost, ...], max_staleness, group_size) -> violations ([] when all hold)

What was trained is read from the records as the run wrote them: the steps of metrics.jsonl (the
last line of each step: a step whose checkpoint was lost is trained again), each naming its groups;
a group's episodes are their trajectories in trajectories.jsonl (the last record of each, unless a
resume struck it out), its start version the last record of groups.jsonl. The invariants:

- lineage: every trained token's version names the weights that sampled it. A token a lost policy
  sampled is recognised by its fingerprint, taken before the resume: the tokens up to it, its
  logprob and its version (weights that differ give it another logprob), so a trajectory that
  carries it into training is caught whatever version the resumed run has reached by then. Unless
  the resumed run made that version again with the very same weights (policies.jsonl: each
  version's digest, written before the engines got it): a retrain on the same batch does, and its
  samples are then the same tokens with the same logprobs, rightly called by that version.
- start: a trained group's start version exists: 0 ≤ start ≤ the version it was trained from,
  and no token of the group is older than its start.
- staleness: the version a group is trained from is at most its start + max_staleness, and at
  most max_staleness past its oldest token; no token is newer than the weights trained, nor older
  than a token before it (an episode never continues under older weights).
- once: each group is trained in one step at most, and each episode has one record between strikes.
- complete: every trained group has its group_size trajectories.

Reading the records costs no more than the run wrote; nothing here runs on a training path.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flywheel.rl.run_folder import RunFolder

Fingerprint = tuple[str, float, int]  # (sha1 of the token ids up to it, its logprob, its version)


@dataclass(frozen=True)
class LostSamples:
    """What a kill took with it: the policy its resume goes back to, the first token of every
    record sampled by a newer policy, by prefix length (tokens up to and including it), and the
    digests of those newer policies' weights (policies.jsonl; a version missing had none written)."""
    resumes_at: int
    first_lost: Mapping[int, frozenset[Fingerprint]]
    digests: Mapping[int, int] = field(default_factory=dict)

    @property
    def records(self) -> int:
        return sum(len(f) for f in self.first_lost.values())


def _prefix(tokens: Sequence[int], length: int) -> str:
    return hashlib.sha1(json.dumps(list(tokens[:length])).encode()).hexdigest()


def resume_version(run_dir: str | Path) -> int:
    """The policy version a run in `run_dir` resumes at: its checkpoint's (0 before the first)."""
    progress = RunFolder(run_dir).load_progress()
    if progress is None:
        return 0
    return int(progress.get("policy_version", progress["step"]))


def lost_samples(run_dir: str | Path) -> LostSamples:
    """Call after a kill and before the run resumes (or on a live run, to see whether it holds any).
    Every trajectory and saved in-flight state in
    the folder that holds a token of a policy newer than the checkpoint, fingerprinted at its
    first such token."""
    run = RunFolder(run_dir)
    version = resume_version(run_dir)
    records: list[Mapping[str, Any]] = [r["trajectory"] for r in run.read("trajectories.jsonl") if "trajectory" in r]
    for path in run.inflight.glob("*.json"):
        try:
            records.append(json.loads(path.read_text()))
        except FileNotFoundError:  # read while the run lives: the episode finished meanwhile
            continue
    lost: dict[int, set[Fingerprint]] = {}
    for r in records:
        p = next((i for i, (v, m) in enumerate(zip(r["versions"], r["loss_mask"], strict=True)) if m and v > version),
                 None)
        if p is not None:
            lost.setdefault(p + 1, set()).add((_prefix(r["tokens"], p + 1), r["logprobs"][p], r["versions"][p]))
    digests = {v: d for v, d in policy_digests(run).items() if v > version}
    return LostSamples(version, {n: frozenset(f) for n, f in lost.items()}, digests)


def policy_digests(run: RunFolder) -> dict[int, int]:
    """Each policy version's weights digest (`flywheel.rl.learner.weights_digest`): its last record in
    policies.jsonl, the weights the run holds under that version now."""
    return {int(r["version"]): int(r["digest"]) for r in run.read("policies.jsonl")}


def trained_steps(run: RunFolder) -> dict[int, dict[str, Any]]:
    """metrics.jsonl by step, the last line of each (a step retrained after its checkpoint was lost)."""
    return {row["step"]: row for row in run.read("metrics.jsonl")}


def audit(run_dir: str | Path, lost: Iterable[LostSamples], max_staleness: int, group_size: int,
          start_version: int = 0) -> list[str]:
    """The run's violations of the invariants (module docstring), each a sentence naming its
    group or episode; [] when every one holds. `lost`: `lost_samples` of every kill the run
    resumed from."""
    run = RunFolder(run_dir)
    violations: list[str] = []
    steps = trained_steps(run)
    if sorted(steps) != list(range(1, len(steps) + 1)):
        violations.append(f"metrics.jsonl has steps {sorted(steps)}, not 1..{len(steps)}")
    starts = {r["group"]: r["version"] for r in run.read("groups.jsonl")}
    finished: dict[str, Mapping[str, Any]] = {}
    for r in run.read("trajectories.jsonl"):
        if "discarded" in r:
            finished.pop(r["episode"], None)
            continue
        if r["episode"] in finished:
            violations.append(f"episode {r['episode']} has two trajectories with no strike between")
        finished[r["episode"]] = r["trajectory"]
    fingerprints: dict[int, set[Fingerprint]] = {}
    made = policy_digests(run)
    for samples in lost:
        remade = {v for v, d in samples.digests.items() if made.get(v) == d}  # the same weights again
        for n, f in samples.first_lost.items():
            fingerprints.setdefault(n, set()).update(p for p in f if p[2] not in remade)
    consumed = (run.load_progress() or {}).get("consumed", {})

    trained_in: dict[str, int] = {}
    version = start_version  # the weights each step trained: the previous step's result
    for k in sorted(steps):
        row, trained_from, version = steps[k], version, int(steps[k]["policy_version"])
        if "groups" not in row:
            violations.append(f"step {k}'s metrics line names no groups")
            continue
        for g in row["groups"]:
            where = f"group {g} (step {k}, trained from policy {trained_from})"
            if g in trained_in:
                violations.append(f"{where} was trained at step {trained_in[g]} too")
            trained_in[g] = k
            if g in consumed and consumed[g] != version:
                violations.append(f"{where}: the checkpoint has it consumed at policy {consumed[g]}, not {version}")
            start = starts.get(g)
            if start is None or not 0 <= start <= trained_from:
                violations.append(f"{where} started at policy {start}, which the run did not have then")
            elif trained_from > start + max_staleness:
                violations.append(f"{where} started at policy {start}: trained more than {max_staleness} later")
            members = [finished.get(f"{g}/{i}") for i in range(group_size)]
            if any(t is None for t in members):
                violations.append(f"{where} is incomplete: {sum(t is not None for t in members)} of {group_size}")
            for i, t in enumerate(members):
                if t is not None:
                    violations += _token_violations(f"episode {g}/{i} of {where}", t, start, trained_from,
                                                    max_staleness, fingerprints)
    return violations


def _token_violations(where: str, t: Mapping[str, Any], start: int | None, trained_from: int, max_staleness: int,
                      fingerprints: Mapping[int, set[Fingerprint]]) -> list[str]:
    found = []
    generated = [v for v, m in zip(t["versions"], t["loss_mask"], strict=True) if m]
    if generated:
        if max(generated) > trained_from:
            found.append(f"{where} holds a token of policy {max(generated)}, newer than the weights trained")
        if trained_from - min(generated) > max_staleness:
            found.append(f"{where} holds a token of policy {min(generated)}: staleness "
                         f"{trained_from - min(generated)} > {max_staleness}")
        if generated != sorted(generated):
            found.append(f"{where} holds a token whose version is older than an earlier token's")
        if start is not None and min(generated) < start:
            found.append(f"{where} holds a token of policy {min(generated)}, older than its group's start {start}")
    tokens = t["tokens"]
    for n, prints in fingerprints.items():
        if n <= len(tokens) and (_prefix(tokens, n), t["logprobs"][n - 1], t["versions"][n - 1]) in prints:
            found.append(f"{where} holds token {n - 1} of policy {t['versions'][n - 1]} sampled by weights the "
                         "run lost at a kill")
            break
    return found
