"""Real repositories as environments: a dependency environment bound into the jail, and a real
package's own pytest suite graded inside the sandbox exactly as pytest counts it outside.

The package is toolz 1.0.0 (its sdist from PyPI, 180 tests); the environment is pytest 9.2.0 built
once into the environment cache. Both are downloaded on first use (cached in the git-ignored
.cache/pypi and the environment cache); where the index cannot be reached the tests skip, and fail
under FLYWHEEL_CI=1.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from flywheel.agent.episode import EpisodeConfig, initial_prompt, run_episode
from flywheel.env.environments import EnvironmentMissing, EnvSpec, build, locate
from flywheel.env.families import mined
from flywheel.env.families.workspace import file_edits
from flywheel.env.grading import grade
from flywheel.env.harbor import export_task, import_task
from flywheel.env.mutations import KINDS, mutations
from flywheel.env.pool import PoolConfig, SandboxPool
from flywheel.env.repos import PYTEST_ENV, fetch_sdist, pytest_outside, sdist_files, write_tree
from flywheel.env.sandbox import Sandbox, SandboxConfig, Snapshot
from flywheel.env.semantic import EmbeddingCache, SemanticIndex
from flywheel.env.swebench import apply_patch, instance_task, read_instances, task_instance, write_instances
from flywheel.env.task import Task, TaskMetadata
from flywheel.model.engine import EngineConfig, LocalEngine
from flywheel.model.factory import ModelConfig, build_model
from flywheel.model.tokenizer import train_tokenizer
from flywheel.sim.expert import ScriptedExpert, run_policy
from tests.env.test_harbor import ECOSYSTEM_PYTHON, HARBOR_READS

ROOT = Path(__file__).parents[2]
BROKEN_FIRST = ("def first(seq):\n", "def first(seq):\n    return None\n")


def _needs_index(what: str, exc: Exception):
    if os.environ.get("FLYWHEEL_CI"):
        raise exc
    pytest.skip(f"{what} needs the package index: {exc}")


@pytest.fixture(scope="session")
def pytest_env():
    try:
        return build(PYTEST_ENV, progress=lambda _line: None)
    except RuntimeError as exc:
        _needs_index("building the pytest environment", exc)


@pytest.fixture(scope="session")
def toolz_files() -> dict[str, str]:
    try:
        return sdist_files(fetch_sdist("toolz", "1.0.0", ROOT / ".cache" / "pypi"))
    except RuntimeError as exc:
        _needs_index("the toolz sdist", exc)


@pytest.fixture(scope="session")
def toolz_outside(toolz_files, pytest_env) -> dict[str, str]:
    return pytest_outside(toolz_files, pytest_env, ["toolz/tests"])


def toolz_task(files: dict[str, str], ids) -> Task:
    return Task(id="repo/toolz", family="repo", split="train", instruction="keep toolz's tests passing",
                files=files, hidden_tests={}, test_command="python -m pytest -q toolz/tests",
                metadata=TaskMetadata(difficulty=2), environment=PYTEST_ENV.requirements, pass_to_pass=tuple(ids))


def broken(files: dict[str, str]) -> dict[str, str]:
    text = files["toolz/itertoolz.py"]
    assert text.count(BROKEN_FIRST[0]) == 1
    return {**files, "toolz/itertoolz.py": text.replace(*BROKEN_FIRST)}


def test_spec_key_ignores_order_and_names_the_build_command(tmp_path):
    a = EnvSpec(requirements=("pytest==9.2.0", "toolz==1.0.0"))
    assert a.key() == EnvSpec(requirements=("toolz==1.0.0", "pytest==9.2.0", "pytest==9.2.0", "# c")).key()
    assert a.key() != EnvSpec(requirements=("pytest==9.1.0", "toolz==1.0.0")).key()
    with pytest.raises(EnvironmentMissing, match="flywheel env build 'pytest==9.2.0' 'toolz==1.0.0'"):
        locate(a, tmp_path)
    with pytest.raises(ValueError, match="at least one requirement"):
        EnvSpec(requirements=())


@pytest.mark.slow  # 8 s on the shared 2-core machine (load ~10)
def test_environment_is_bound_read_only_with_precompiled_bytecode(pytest_env, toolz_files):
    config = SandboxConfig(wall_time_s=30, cpu_time_s=30)
    with Sandbox.create({"a.py": "x = 1\n"}, config, environment=pytest_env.path) as box:
        run = box.run("python -c 'import pytest; print(pytest.__version__, pytest.__file__)'")
        assert run.output.split() == ["9.2.0", "/env/site/pytest/__init__.py"], run.render()
        assert box.run("touch /env/site/planted").exit_code != 0
        assert box.run("ls -A /workspace").output.split() == ["a.py"]  # nothing of the env in the workspace
        # -v logs each module's source of code: pytest's own modules come from its .pyc files.
        verbose = box.run("python -v -c 'import _pytest.python' 2>&1").output
        assert "code object from '/env/site/_pytest/__pycache__/python.cpython" in verbose
    with Sandbox.create({"a.py": "x = 1\n"}, config) as bare:  # no environment: the standard library only
        assert "No module named pytest" in bare.run("python -m pytest").output


def test_toolz_suite_in_the_sandbox_equals_pytest_outside(pytest_env, toolz_files, toolz_outside):
    assert list(toolz_outside.values()).count("passed") == len(toolz_outside) == 180
    task = toolz_task(toolz_files, toolz_outside)
    clean = grade(task, Snapshot.of_files(toolz_files))
    assert (clean.passed, clean.failed, clean.all_passed) == (180, 0, True), clean.log
    assert clean.parts["pass_to_pass"] == pytest.approx(0.5) and clean.reward == pytest.approx(1.0)

    bad_files = broken(toolz_files)
    outside = pytest_outside(bad_files, pytest_env, ["toolz/tests"])
    failing_outside = sorted(t for t, o in outside.items() if o != "passed")
    inside = grade(task, Snapshot.of_files(bad_files))
    assert sorted(t for t, ok in inside.tests.items() if not ok) == failing_outside
    assert "toolz/tests/test_itertoolz.py::test_first" in failing_outside
    assert inside.failed == len(failing_outside) > 0 and not inside.all_passed


def test_a_conftest_rewriting_reports_cannot_forge_a_pass(toolz_files, toolz_outside):
    """A planted conftest.py turns every report into a pass (pytest itself then prints "180 passed"):
    the grader drops it, and its own call wrapper would not have believed it anyway."""
    forged = broken(toolz_files)
    forged["toolz/tests/conftest.py"] = (
        "import pytest\n\n@pytest.hookimpl(hookwrapper=True)\ndef pytest_runtest_makereport(item, call):\n"
        "    out = yield\n    out.get_result().outcome = 'passed'\n")
    forged["toolz/tests/test_itertoolz.py"] = forged["toolz/tests/test_itertoolz.py"] + "\nprint('180 passed')\n"
    result = grade(toolz_task(toolz_files, toolz_outside), Snapshot.of_files(forged))
    assert not result.tests["toolz/tests/test_itertoolz.py::test_first"]
    assert result.failed > 0 and not result.all_passed
    # The same conftest as part of the task itself (restored, not dropped): the call wrapper decides.
    own = grade(toolz_task(forged, toolz_outside), Snapshot.of_files(forged))
    assert sorted(t for t, ok in own.tests.items() if not ok) == sorted(t for t, ok in result.tests.items() if not ok)


# ---- the mined family: AST mutations of real packages, validated by their own tests ------------

def test_every_mutation_undoes_in_one_edit(toolz_files):
    source = toolz_files["toolz/itertoolz.py"]
    found = mutations(source, "toolz/itertoolz.py")
    assert len(found) > 200 and {m.kind for m in found} >= set(KINDS) - {"wrong_default"}
    assert found == mutations(source, "toolz/itertoolz.py")  # deterministic
    for m in found:
        broken = m.apply(source)
        compile(broken, m.path, "exec")  # every mutant still imports
        assert broken != source and m.undo(broken) == source
        edits = file_edits(m.path, broken, source)
        assert len(edits) == 1 and broken.replace(edits[0].old, edits[0].new) == source


@pytest.fixture(scope="module")
def mined_catalogue(tmp_path_factory, pytest_env, toolz_files):
    cache = tmp_path_factory.mktemp("mined")
    mined.build_catalogue(3, packages=["toolz"], cache=cache, progress=lambda _line: None, limit_tried=12)
    return cache


@pytest.mark.slow  # 14 s on the shared 2-core machine (load ~10)
def test_mined_tasks_fail_before_and_pass_after_their_fix_in_the_sandbox(mined_catalogue, toolz_files, tmp_path):
    bugs = mined.catalogue(mined_catalogue)
    assert 1 <= len(bugs) <= 3
    for bug in bugs:
        task = mined.to_task(bug, toolz_files)
        assert task.split == mined.split_of(f"toolz/{bug.module}", mined.EVAL_FRACTION)
        assert bug.fail_to_pass[0] in task.instruction and bug.mutation.new not in task.instruction
        before = grade(task, Snapshot.of_files(task.files))
        assert not any(before.tests[t] for t in task.fail_to_pass), bug.mutation.describe()
        assert all(before.tests[t] for t in task.pass_to_pass)
        assert before.parts["fail_to_pass"] == 0 and before.parts["pass_to_pass"] > 0
        fixed = apply_edits(task.files, task.reference_edits)
        assert fixed[bug.module] == toolz_files[bug.module]
        after = grade(task, Snapshot.of_files(fixed))
        assert after.all_passed and after.reward == pytest.approx(1.0), after.log
    assert_graded_alike_through_harbor(task, fixed, tmp_path / "harbor")  # the last one, exported
    # The same catalogue draws the same tasks for a seed, and ids regenerate them.
    split = bugs[0].split()
    drawn = mined.generate(split, 1, seed=4, cache=mined_catalogue)
    assert drawn == mined.generate(split, 1, seed=4, cache=mined_catalogue)
    assert mined.get(drawn[0].id, cache=mined_catalogue) == drawn[0]


@pytest.mark.slow  # its module's mined catalogue: 22 s on the shared 2-core machine
def test_scripted_expert_solves_a_mined_task_end_to_end(mined_catalogue, toolz_files):
    task = mined.to_task(mined.catalogue(mined_catalogue)[0], toolz_files)
    episode = run_policy(task, ScriptedExpert(seed=0).play(task))
    assert episode.finished and episode.final is not None
    test_runs = [r.content for _, obs in episode.turns if isinstance(obs, list) for r in obs
                 if "passed" in r.content]
    assert test_runs and "failed" not in test_runs[-1], test_runs
    assert grade(task, episode.final).all_passed


@pytest.mark.slow  # the mined catalogue, and 10 s of its own
def test_the_policy_plays_a_mined_task_and_its_records_are_right(mined_catalogue, toolz_files):
    """A real (tiny, untrained) model drives an episode on a mined toolz task through the engine, the
    tools and the pytest grader: whatever it writes, the trajectory holds every token with its
    logprob and version, and the reward parts are the SWE-bench ones of the untouched bug."""
    task = mined.to_task(mined.catalogue(mined_catalogue)[0], toolz_files)
    tokenizer = train_tokenizer([initial_prompt(task), task.instruction] * 5, vocab_size=600)
    model = build_model(ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                                    num_experts=4, experts_per_token=2, moe_intermediate_size=64), tokenizer)
    with SandboxPool(PoolConfig(max_active=2, warm=0)) as pool, LocalEngine(model, EngineConfig(max_batch=2)) as engine:
        traj = run_episode(task, engine, tokenizer, pool, EpisodeConfig(max_turns=2, max_tokens_per_turn=24))
    assert traj.task_id == task.id and traj.family == task.family and traj.turns >= 1
    assert len(traj.tokens) == len(traj.loss_mask) == len(traj.logprobs) == len(traj.versions)
    assert traj.generated_tokens == sum(traj.loss_mask) > 0
    assert {v for v, m in zip(traj.versions, traj.loss_mask, strict=True) if m} == {engine.version}
    # Graded by the repository's own suite: the bug is still there, the other named tests still pass.
    assert traj.outcome is not None and not traj.outcome.all_passed and not traj.outcome.timed_out
    assert traj.reward_parts["fail_to_pass"] == 0 and traj.reward_parts["pass_to_pass"] > 0
    assert traj.reward == pytest.approx(sum(traj.reward_parts.values()))


def apply_edits(files: dict[str, str], edits) -> dict[str, str]:
    out = dict(files)
    for e in edits:
        assert out[e.path].count(e.old) == 1
        out[e.path] = out[e.path].replace(e.old, e.new)
    return out


# ---- SWE-bench instances in and out ------------------------------------------------------------

def _git(repo: Path, *args: str) -> str:
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t",
           "PATH": os.environ["PATH"], "HOME": str(repo)}
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True, env=env).stdout


def test_swebench_instance_from_a_git_repository_hides_the_future(tmp_path, pytest_env):
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    test_zero = "from calc import add\n\n\ndef test_zero():\n    assert add(0, 0) == 0\n"
    write_tree(repo, {"calc/__init__.py": "def add(a, b):\n    return a - b\n", "calc/tests/test_calc.py": test_zero})
    _git(repo, "add", ".")
    _git(repo, "commit", "-qm", "base")
    base = _git(repo, "rev-parse", "HEAD").strip()
    (repo / "calc/__init__.py").write_text("def add(a, b):\n    return a + b  # FIXED-IN-THE-FUTURE\n")
    test_patch_text = "\n\ndef test_two():\n    assert add(1, 1) == 2\n"
    (repo / "calc/tests/test_calc.py").write_text((repo / "calc/tests/test_calc.py").read_text() + test_patch_text)
    patch = _git(repo, "diff", "--", "calc/__init__.py")
    test_patch = _git(repo, "diff", "--", "calc/tests")
    _git(repo, "commit", "-qam", "fix add")
    line = json.dumps({"instance_id": "calc-1", "repo": "local/calc", "base_commit": base, "problem_statement":
                       "add(1, 1) is not 2", "patch": patch, "test_patch": test_patch,
                       "FAIL_TO_PASS": json.dumps(["calc/tests/test_calc.py::test_two"]),
                       "PASS_TO_PASS": ["calc/tests/test_calc.py::test_zero"], "version": "0.1"})
    (tmp_path / "in.jsonl").write_text(line + "\n")
    [instance] = read_instances(tmp_path / "in.jsonl")
    task = instance_task(instance, repo)
    assert not any(".git" in p.split("/") for p in task.files)
    assert "FIXED-IN-THE-FUTURE" not in json.dumps(task.files) and "test_two" not in json.dumps(task.files)
    with Sandbox.create(task.files, environment=pytest_env.path) as box:
        assert box.run("git log").exit_code != 0  # no history in the workspace at all
    before = grade(task, Snapshot.of_files(task.files))
    assert before.tests == {"calc/tests/test_calc.py::test_two": False, "calc/tests/test_calc.py::test_zero": True}
    assert before.parts["fail_to_pass"] == 0 and before.parts["pass_to_pass"] == pytest.approx(0.25)
    fixed = apply_edits(task.files, task.reference_edits)
    assert grade(task, Snapshot.of_files(fixed)).all_passed
    # Out again: the instance's patch and test patch reproduce the fix and the tests.
    out = task_instance(task)
    assert write_instances(tmp_path / "out.jsonl", [out]) == 1
    [back] = read_instances(tmp_path / "out.jsonl")
    assert apply_patch(task.files, back.patch) == fixed
    test_file = "calc/tests/test_calc.py"
    assert apply_patch(task.files, back.test_patch)[test_file] == task.hidden_tests[test_file]
    assert (back.FAIL_TO_PASS, back.PASS_TO_PASS) == (list(task.fail_to_pass), list(task.pass_to_pass))
    # And as a Harbor task folder: imported back, its own tests/test.sh grades it as flywheel does.
    assert_graded_alike_through_harbor(task, fixed, tmp_path / "harbor")


def assert_graded_alike_through_harbor(task: Task, fixed: dict[str, str], out: Path) -> None:
    """`task` exported as a Harbor folder and imported back: its test.sh, run in the jail, gives the
    untouched and the fixed workspace the rewards flywheel's own grading gives them."""
    folder = export_task(task, out)
    if ECOSYSTEM_PYTHON.exists() or os.environ.get("FLYWHEEL_CI") == "1":  # Harbor's own package loads it
        read = json.loads(subprocess.run([str(ECOSYSTEM_PYTHON), "-c", HARBOR_READS, str(folder)], check=True,
                                         capture_output=True, text=True, timeout=120).stdout)
        assert read[folder.name]["valid"] and read[folder.name]["metadata"]["flywheel_id"] == task.id
    imported = import_task(folder)
    assert imported.grader == "harbor" and imported.files == task.files
    for files in (task.files, fixed):
        ours, theirs = grade(task, Snapshot.of_files(files)), grade(imported, Snapshot.of_files(files))
        assert theirs.reward == pytest.approx(ours.reward), (ours.parts, theirs.parts, theirs.log)
        assert theirs.all_passed == ours.all_passed


# ---- semantic search at repository scale: embeddings cached by content ------------------------

def test_a_bad_instances_file_is_refused_naming_the_file_the_line_and_the_field(tmp_path):
    path = tmp_path / "instances.jsonl"
    good = json.dumps({"instance_id": "calc-1", "repo": "local/calc", "base_commit": "abc", "problem_statement": "p",
                       "patch": "", "test_patch": "", "FAIL_TO_PASS": ["t.py::a"], "PASS_TO_PASS": "[]"})
    for text, error in [
        (None, f"no instances file at {path}; write one with `flywheel tasks export --format swebench --out {path}`"),
        (good + "\n" + '{"instance_id": "x"}\n', f"{path}:2 is not a SWE-bench instance record (repo: Field required)"),
        (good + "\n\n" + good[:40] + "\n", f"{path}:3 is not a SWE-bench instance record"),
        ("\n", f"{path} holds no instances"),
    ]:
        if text is not None:
            path.write_text(text)
        with pytest.raises(ValueError) as refused:
            read_instances(path)
        assert error in str(refused.value), str(refused.value)
    path.write_text(good + "\n\n")
    [instance] = read_instances(path)
    assert instance.instance_id == "calc-1"


def test_semantic_index_embeds_an_identical_file_once_across_sandboxes(tmp_path, toolz_files):
    cache = EmbeddingCache(tmp_path / "embeddings")
    modules = ("toolz/itertoolz.py", "toolz/recipes.py", "toolz/dicttoolz.py", "toolz/utils.py")
    files = {p: toolz_files[p] for p in modules}
    with Sandbox.create(files) as first, Sandbox.create(files) as second:
        cold = SemanticIndex(first.workspace, cache)
        hits = cold.search("split a sequence into groups of n items", top_k=3)
        assert any("partition" in h.text for h in hits) and cache.hits == 0 and cache.misses > 0
        misses = cache.misses
        warm = SemanticIndex(second.workspace, cache)  # another sandbox, the same files: no embedding
        assert [(h.path, h.start_line) for h in warm.search("split a sequence into groups of n items", top_k=3)] \
            == [(h.path, h.start_line) for h in hits]
        assert cache.misses == misses and cache.hits == cold.chunk_count() and warm.embedded_files == 4
        second.write_text("toolz/recipes.py", second.read_text("toolz/recipes.py") + "\n# edited\n")
        warm.search("anything")
        assert cache.misses == misses + 1 and warm.embedded_chunks == 1  # the edit re-embeds its one chunk
