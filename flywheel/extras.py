"""Optional dependencies: what a feature needs beyond the core install, and the error that says so.

`pip install -e .` (what `make demo` installs) is the embedded default: the in-process loop, SQLite,
the local engine. The heavier backends are extras, installed with them by `pip install -e '.[dev]'`
(`make test`) or one at a time:

    ray       cluster.backend = "ray"                   pip install -e '.[ray]'
    postgres  a postgresql:// store or registry index   pip install -e '.[postgres]'
    tracking  [tracking] tensorboard / wandb / mlflow   pip install -e '.[tracking]'
    gguf      flywheel model import FILE.gguf           pip install -e '.[gguf]'
    tinker    flywheel tinker serve (the SDK's wire)    pip install -e '.[tinker]'
    openenv   the OpenEnv server (env/openenv_app.py)   pip install -e '.[openenv]'
    agents    the openai-agents harness preset          pip install -e '.[agents]'

A feature imports its extra through `require`, so a missing one fails with the command that installs
it rather than a bare ModuleNotFoundError deep in a run.
"""

from __future__ import annotations

import importlib
from types import ModuleType

EXTRAS = {"ray": "ray", "psycopg": "postgres", "tensorboard": "tracking", "wandb": "tracking", "mlflow": "tracking",
          "gguf": "gguf", "tinker": "tinker", "openenv": "openenv", "agents": "agents"}


class MissingExtra(ImportError):
    """A feature's optional dependency is not installed; the message names the extra to install."""


def require(module: str, feature: str) -> ModuleType:
    """`module` imported, or MissingExtra naming the extra that provides it and what asked for it."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        top = module.split(".")[0]
        if exc.name is None or exc.name.split(".")[0] != top:
            raise  # the module is there but something it imports is broken: that error is the real one
        extra = EXTRAS.get(top, top)
        raise MissingExtra(f"{feature} needs {top}, which is not installed: pip install -e '.[{extra}]' "
                           f"(or `make setup`, which installs every extra)") from exc
