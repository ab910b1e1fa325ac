"""The architecture's rules, checked: the layering of the packages, one held-out task set, typed
configs that refuse unknown keys. Each test reads the real code (the imports by `ast`, the config
models by walking the package), so a change that breaks a rule fails here with its place named."""

from __future__ import annotations

from pathlib import Path

from flywheel.env.families import held_out_tasks, task_set
from flywheel.live.gate import EvalBattery
from flywheel.rl import bootstrap, train

REPO = Path(__file__).resolve().parents[1]


def test_every_evaluator_plays_the_one_held_out_set_whatever_its_seed():
    expected = [t.id for t in held_out_tasks(["bugfix", "implement"], 3, difficulty=1)]
    # Run seeds move the training draws, never the held-out set.
    boot = bootstrap.eval_tasks(bootstrap.BootstrapConfig(families=["bugfix", "implement"], eval_tasks_per_family=3,
                                                          eval_difficulty=1, seed=5))
    rl = train.eval_tasks(train.TrainConfig(families=["bugfix", "implement"], eval_tasks_per_family=3,
                                            eval_difficulty=1, seed=3))
    gate = EvalBattery(families=["bugfix", "implement"], tasks_per_family=3, difficulty=1).tasks()
    assert [t.id for t in boot] == [t.id for t in rl] == [t.id for t in gate] == expected
    assert all(t.split == "eval" for t in boot)
    # Disjoint from what the runs train on.
    trained = {t.content_key() for t in task_set(["bugfix", "implement"], "train", 20, seed=100, difficulty=1)}
    assert trained.isdisjoint(t.content_key() for t in boot)
    # A smaller set is a prefix of a larger one, family by family.
    larger = [t.id for t in held_out_tasks(["bugfix"], 5, difficulty=1)]
    assert larger[:3] == expected[:3]
