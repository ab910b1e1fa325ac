"""Typed configuration: pydantic models, read from TOML, with `--set key.sub=value` overrides.

Each component owns its small config next to its code (`SandboxConfig`, `ToolConfig`, ...);
a command's config composes them. The resolved config is written into each run's folder, so
a run can always be reproduced from what it wrote down.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)


class ConfigError(ValueError):
    pass


def parse_override(item: str) -> tuple[list[str], Any]:
    """`a.b=3` -> (["a", "b"], 3). Values are TOML literals; anything else is a plain string."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {item!r} must look like key.sub=value, e.g. pool.max_active=8")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key.strip().split("."), value


def merge_override(data: dict[str, Any], path: list[str], value: Any) -> None:
    node = data
    for part in path[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"cannot set {'.'.join(path)}: {part} is a value, not a table")
    node[path[-1]] = value


def load_config(model: type[M], path: str | Path | None = None, overrides: list[str] | None = None) -> M:
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} not found; the repo's configs are in configs/")
        data = tomllib.loads(path.read_text())
    for item in overrides or []:
        merge_override(data, *parse_override(item))
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"invalid config{f' in {path}' if path else ''}:\n{exc}") from exc


def write_resolved(config: BaseModel, run_dir: Path) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    out = run_dir / "config.json"
    out.write_text(json.dumps(config.model_dump(mode="json"), indent=2))
    return out
