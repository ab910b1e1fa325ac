"""Kills at random moments of a local `flywheel train` run: the version invariants hold through each.

The driver (on the local backend: the Orchestrator, the engine, the Learner and the sandbox pool in
one process) is SIGKILLed at moments drawn at random, and once at the moment the reported bug needed:
the engines already sample with a policy whose checkpoint is not on disk yet (checkpoint_every = 2
makes that a whole step). Each time it restarts and resumes; then every invariant of
flywheel/rl/audit.py must hold on the records. The Ray backend's processes (learner, workers,
engines, pools, nodes) are killed the same way in tests/rl/test_ray.py; bench/faults.py runs many
more trials of both. Real CLI, engine, sandboxes, grading and Learner: no mocks.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from flywheel.rl.audit import trained_steps
from flywheel.rl.run_folder import RunFolder
from flywheel.rl.train import TrainConfig
from tests.rl.fault_injection import EngineKilledRun, KilledRun, fault_seed
from tests.rl.question_policy import register_question_policy

pytestmark = pytest.mark.slow  # one run killed twice: ~40 s on 2 shared cores


@pytest.fixture(scope="module")
def registry_root(tmp_path_factory) -> Path:
    return register_question_policy(tmp_path_factory.mktemp("faults") / "registry")


def local_config(registry_root: Path, run_dir: Path, steps: int = 5, checkpoint_every: int = 2,
                 **update) -> TrainConfig:
    return TrainConfig.model_validate({
        "registry_root": str(registry_root), "run_dir": str(run_dir), "families": ["bugfix"],
        "train_tasks_per_family": 2, "eval_tasks_per_family": 1, "eval_at_start": False, "threads": 1,
        "register_checkpoint": False,
        "orchestrator": {"group_size": 4, "groups_per_step": 2, "max_staleness": 1, "concurrency": 16,
                         "max_steps": steps, "filter_zero_signal": False, "checkpoint_every": checkpoint_every,
                         "episode": {"max_turns": 4, "max_tokens_per_turn": 24, "temperature": 0.5}},
        "learner": {"lr": 1e-4, "temperature": 0.5},
        "engine": {"threads": 1},
        "pool": {"warm": 0}} | update)


@pytest.mark.parametrize("update", [{}, {"lora": {"rank": 4}}], ids=["full", "lora"])
def test_a_driver_killed_at_random_moments_trains_only_on_what_its_own_weights_sampled(registry_root, tmp_path, update):
    """lora: the run trains an adapter on the policy (flywheel/rl/lora.py); its checkpoint holds the
    adapter and its optimizer, the engines sample with the merged weights."""
    seed = fault_seed()
    config = local_config(registry_root, tmp_path / "run", **update)
    trial = KilledRun(config, random.Random(seed)).run(kills=2, targeted=1)
    said = f"seed {seed}, kills {trial.kills}; logs in {tmp_path}"
    assert len(trial.kills) == 2, said
    assert trial.kills[0].kind == "lost policy" and trial.lost[0].records > 0, said  # the bug's moment was reached
    assert trial.violations == [], said
    steps = trained_steps(RunFolder(trial.run_dir))
    assert sorted(steps) == [1, 2, 3, 4, 5] and [steps[k]["policy_version"] for k in sorted(steps)] == [1, 2, 3, 4, 5]
    # The resume played again what the lost policy sampled: the count of rewound episodes, or on disk a
    # struck-out trajectory or a restarted group. A count lives from checkpoint to checkpoint, and an
    # in-flight state rewound leaves nothing on disk: a second kill before the resumed run's next
    # checkpoint (it resumes from the same one) can leave no trace of the first resume's rewind.
    records = [json.loads(line) for line in (trial.run_dir / "trajectories.jsonl").read_text().splitlines()]
    groups = [json.loads(line) for line in (trial.run_dir / "groups.jsonl").read_text().splitlines()]
    rewound = (steps[5]["rewound_episodes"] >= 1 or any("discarded" in r for r in records)
               or any("restarted_from" in g for g in groups))
    assert rewound or trial.kills[1].resumes_at == trial.kills[0].resumes_at, said


def test_an_engine_process_killed_at_random_moments_is_started_again_and_the_run_goes_on(registry_root, tmp_path):
    """~40 s. The demo's engine runs in a process of its own (`engine.separate_process`). Killed three times
    at random moments of a run (rollouts, the learner step, a weight update alike), it is started
    again with the latest weights each time and its requests go on there: the driver never stops, every
    step is trained once at its version, and the run's records keep every invariant of the audit."""
    seed = fault_seed()
    config = local_config(registry_root, tmp_path / "run", steps=14, checkpoint_every=2,
                          engine={"threads": 1, "separate_process": True})
    trial = EngineKilledRun(config, random.Random(seed)).run(kills=3)
    said = f"seed {seed}, kills {trial.kills}; logs in {tmp_path}"
    assert len({k.pid for k in trial.kills}) == 3, said
    assert trial.violations == [], said
    steps = trained_steps(RunFolder(trial.config.run_dir))
    assert [steps[k]["policy_version"] for k in sorted(steps)] == list(range(1, 15)), said
    assert steps[14]["engine_restarts"] == 3, said
    log = (tmp_path / "run-driver-0.log").read_text()
    # each kill is named: a running process's death, or (a kill that hit a replacement while it started)
    # "its replacement failed: engine process died before it was ready (code -9)"
    deaths = [line for line in log.splitlines() if line.startswith("engine: ") and "(code -9)" in line]
    assert len(deaths) == 3, said
