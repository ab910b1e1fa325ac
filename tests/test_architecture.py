"""The architecture's rules, checked: the layering of the packages, one held-out task set, typed
configs that refuse unknown keys. Each test reads the real code (the imports by `ast`, the config
models by walking the package), so a change that breaks a rule fails here with its place named."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from collections.abc import Iterator
from pathlib import Path
from typing import get_args, get_origin

from pydantic import BaseModel

import flywheel
from flywheel.env.families import held_out_tasks, task_set
from flywheel.live.gate import EvalBattery
from flywheel.rl import bootstrap, train

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "flywheel"

# The stages, bottom up (docs/ARCHITECTURE.md, "dependencies point one way"): each may import
# itself, the stages below it and the libraries; `env` imports nothing of flywheel but `store`
# (its files: the one durable-write helper) and `extras` (which imports nothing).
STAGES = ("env", "model", "agent", "rl", "live", "tinker")
# Libraries that know no stage: they import only themselves, `extras` and `store` (the durable writes every
# writer shares), and every stage but env may use them. `api` is the OpenAI wire both servers and the SDK speak.
LIBRARIES = ("config", "stats", "store", "report", "extras", "api", "timing")


def allowed_imports(unit: str) -> set[str]:
    """The units (top-level packages or modules of flywheel) that `unit` may import."""
    if unit == "env":
        return {"env", "store", "extras"}
    if unit in STAGES:
        return set(STAGES[: STAGES.index(unit) + 1]) | set(LIBRARIES)
    if unit in LIBRARIES:
        return {unit, "store", "extras"}
    below = set(STAGES) | set(LIBRARIES)
    return {
        "client": {"api"},  # the SDK: sends the wire's events, and knows nothing of the server's stage
        "sim": below | {"client", "sim"},  # stands in for the world, drives everything but the commands
        "demo": below | {"client", "sim"},  # the CLI's demo
        "cli": below | {"client", "sim", "demo", "cli"},
        "__main__": {"cli"},  # `python -m flywheel`: the command, nothing else
    }.get(unit, set())


def unit_of(path: Path) -> str:
    """`flywheel/rl/train.py` -> rl, `flywheel/stats.py` -> stats."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return parts[0]


def flywheel_imports(path: Path) -> Iterator[tuple[int, str]]:
    """(line, unit) of every import of flywheel in a file, lazy ones inside functions included."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the file's own package
                base = list(path.relative_to(REPO).with_suffix("").parts[: -node.level])
                names = [".".join(base + ([node.module] if node.module else []))]
            else:
                names = [node.module or ""]
            if names == ["flywheel"]:  # from flywheel import stats
                names = [f"flywheel.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "flywheel" and len(parts) > 1:
                yield node.lineno, parts[1]


def test_no_import_runs_up_the_layers_and_only_the_commands_import_sim():
    files = sorted(PACKAGE.rglob("*.py"))
    units = {unit_of(f) for f in files if f.name != "__init__.py" or f.parent != PACKAGE}
    unplaced = sorted(u for u in units if not allowed_imports(u))
    assert not unplaced, f"place {unplaced} in tests/test_architecture.py's layering (STAGES, LIBRARIES or above)"
    wrong = []
    for path in files:
        if path.parent == PACKAGE and path.name == "__init__.py":
            continue
        unit = unit_of(path)
        for line, target in flywheel_imports(path):
            if target not in allowed_imports(unit):
                wrong.append(f"{path.relative_to(REPO)}:{line}: {unit} imports {target}")
    assert not wrong, "imports against the layering (docs/ARCHITECTURE.md):\n" + "\n".join(wrong)


def test_the_layering_check_sees_an_arrow_running_up(tmp_path):
    # The rule above must be able to fail: an import of agent from model, as chat.py once had.
    module = PACKAGE / "model" / "_probe_for_the_layering_test.py"
    assert not module.exists()
    module.write_text("def f():\n    from flywheel.agent.episode import run_episode  # noqa\n")
    try:
        found = [(line, target) for line, target in flywheel_imports(module)]
        assert found == [(2, "agent")] and "agent" not in allowed_imports(unit_of(module))
    finally:
        module.unlink()
    assert "sim" not in allowed_imports("live") and "sim" not in allowed_imports("rl")
    assert allowed_imports("env") == {"env", "store", "extras"} and "live" not in allowed_imports("report")
    assert allowed_imports("client") == {"api"} and not {"live", "model"} & allowed_imports("api")


# Module-level state that components share within a process, each standing for something the process
# has once (docs/ARCHITECTURE.md, "Package layout"): torch's thread count, the sandbox root's lease and
# watchdog, a loaded embedding model. Anything else a module fills at run time belongs to an object.
PROCESS_STATE = {"flywheel/model/engine.py:DECODE_THREADS", "flywheel/env/sandbox.py:_LEASES",
                 "flywheel/env/sandbox.py:_PREPARED", "flywheel/env/embedders.py:_EMBEDDERS"}


def module_state(path: Path) -> Iterator[str]:
    """`path:NAME` of each module-level name bound to an empty container (filled at run time) or to
    an instance of a class the module defines (an object holding state; a frozen dataclass's
    instance is a constant, as flywheel/model/chat.py's FLYWHEEL format)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    classes = {node.name for node in tree.body if isinstance(node, ast.ClassDef) and not frozen_dataclass(node)}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            target, value = node.target, node.value
        else:
            continue
        called = value.func.id if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) else None
        empty = (isinstance(value, ast.Dict) and not value.keys
                 or isinstance(value, ast.List | ast.Set) and not value.elts
                 or called in ("dict", "list", "set") and not value.args)
        instance = called in classes
        if isinstance(target, ast.Name) and (empty or instance):
            yield f"{path.relative_to(REPO)}:{target.id}"


def frozen_dataclass(node: ast.ClassDef) -> bool:
    return any(isinstance(d, ast.Call) and getattr(d.func, "id", None) == "dataclass"
               and any(k.arg == "frozen" and getattr(k.value, "value", None) is True for k in d.keywords)
               for d in node.decorator_list)


def test_module_level_state_is_only_what_the_architecture_names():
    found = {name for path in sorted(PACKAGE.rglob("*.py")) for name in module_state(path)}
    assert found == PROCESS_STATE, (f"module-level state not named in docs/ARCHITECTURE.md: "
                                    f"{sorted(found - PROCESS_STATE)}; named but gone: {sorted(PROCESS_STATE - found)}")


def test_the_module_state_check_sees_a_module_level_registry():
    module = PACKAGE / "model" / "_probe_for_the_state_test.py"
    assert not module.exists()
    module.write_text("class Pool:\n    pass\n\nPOOL = Pool()\n_SEEN: dict[str, int] = {}\nLIMITS = {'a': 1}\n")
    try:
        assert set(module_state(module)) == {"flywheel/model/_probe_for_the_state_test.py:POOL",
                                             "flywheel/model/_probe_for_the_state_test.py:_SEEN"}
    finally:
        module.unlink()


def _flywheel_models() -> list[type[BaseModel]]:
    models = []
    for info in pkgutil.walk_packages(flywheel.__path__, "flywheel."):
        module = importlib.import_module(info.name)
        models += [obj for obj in vars(module).values() if inspect.isclass(obj) and issubclass(obj, BaseModel)
                   and obj.__module__ == module.__name__]
    return models


def _nested_models(annotation: object) -> Iterator[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation
    if get_origin(annotation) is not None:  # X | None, list[X], dict[str, X | Y], Literal[...]
        for arg in get_args(annotation):
            yield from _nested_models(arg)


def config_models() -> set[type[BaseModel]]:
    """Every model named *Config in flywheel, and every model a field of one holds, however deep."""
    todo = [m for m in _flywheel_models() if m.__name__.endswith("Config")]
    seen: set[type[BaseModel]] = set()
    while todo:
        model = todo.pop()
        if model in seen:
            continue
        seen.add(model)
        for field in model.model_fields.values():
            todo += list(_nested_models(field.annotation))
    return seen


def test_every_config_model_forbids_unknown_keys():
    models = config_models()
    names = {m.__name__ for m in models}
    # The walk reaches the nested ones (a broken walk would pass vacuously).
    assert {"PoolConfig", "SandboxConfig", "GradeConfig", "ToolConfig", "UserProfile", "NonInferiorityCheck"} <= names
    lax = sorted(f"{m.__module__}.{m.__name__}" for m in models if m.model_config.get("extra") != "forbid")
    assert not lax, f"set model_config = ConfigDict(extra='forbid') on {lax}: a typo must be an error, not ignored"


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
