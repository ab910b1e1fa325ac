"""Typed configuration: pydantic models, read from TOML, with `--set key.sub=value` overrides.

Each component owns its small config next to its code (`SandboxConfig`, `ToolConfig`, ...);
a command's config composes them. The resolved config is written into each run's folder, so
a run can always be reproduced from what it wrote down.

This module is the only TOML reader: a config that includes another file (the live loop's
`loop_file` and `rewards_file`, a scenario's reward files) reads it with `read_toml` and layers
tables with `merge_tables` (`include_file`), so every file gets the same errors. A key that moved
elsewhere is refused with its new name (`refuse_moved`). Every config model forbids unknown keys
(`extra="forbid"`; tests/test_architecture.py checks each one), so a typo such as
`--set pool.max_actve=3` is an error naming the field, never a silently ignored setting.
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


def read_toml(path: str | Path) -> dict[str, Any]:
    """The tables of one TOML file; a missing or malformed file is a ConfigError naming it."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} not found; the repo's configs are in configs/ and paths are "
                          "relative to the working directory (run from the repo root)")
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from exc


def merge_tables(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """`base` with `top`'s keys on top, table by table (a key of `top` replaces a value, merges into a table)."""
    out = dict(base)
    for key, value in top.items():
        out[key] = (merge_tables(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict)
                    else value)
    return out


def include_file(data: Any, field: str, file_field: str) -> Any:
    """For a model's `mode="before"` validator: `data` with data[field] = the TOML file that
    data[file_field] names, data[field]'s own keys on top (a `[rewards]` table over `rewards_file`)."""
    if not isinstance(data, dict):
        return data
    path = data.get(file_field)
    if path is None or isinstance(data.get(field), BaseModel):
        return data  # no file, or a model given in Python: it stands as given
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{file_field} {path} not found; paths are relative to the working directory (run from the "
                         f"repo root), or set {file_field} to null and give a [{field}] table")
    return {**data, field: merge_tables(read_toml(path), data.get(field) or {})}


def refuse_moved(data: Any, moved: dict[str, str], why: str) -> None:
    """For a model's `mode="before"` validator: a key of `moved` that `data` still sets is an error
    naming where it went (`moved`: old key -> new key), not the bare "extra inputs are not permitted"."""
    if not isinstance(data, dict):
        return
    found = [key for key in moved if key in data]
    if found:
        raise ValueError("; ".join(f"{key} moved to {moved[key]}" for key in found) + f" ({why}): rename "
                         f"{'it' if len(found) == 1 else 'them'} in the config")


def merge_override(data: dict[str, Any], path: list[str], value: Any) -> None:
    node = data
    for part in path[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"cannot set {'.'.join(path)}: {part} is a value, not a table")
    node[path[-1]] = value


def load_config(model: type[M], path: str | Path | None = None, overrides: list[str] | None = None) -> M:
    data = read_toml(path) if path is not None else {}
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
