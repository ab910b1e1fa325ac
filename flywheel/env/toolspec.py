"""The tool contract: what a tool call is and which calls are well-formed, apart from what runs them.

`TOOL_SCHEMAS` (OpenAI function-calling form), the `ToolCall` and `ToolResult` records,
`validate_arguments` (a call against its schema) and `unusable_text` (strings no path or command
line can hold) are shared by everything that speaks to the agent: the chat format and its parser,
the episode runner, the server, simulated users. `flywheel.env.tools.Toolbox` runs the calls in a
sandbox. This module imports nothing of the sandbox, so serving (which only parses and validates
calls) does not load the jail; tests/env/test_toolspec.py checks that.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


def _schema(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": properties,
                "required": required,
                "additionalProperties": False,
            },
        },
    }


_PATH = {"type": "string", "description": "Path relative to the workspace root."}
TOOL_SCHEMAS: dict[str, dict[str, Any]] = {
    s["function"]["name"]: s
    for s in [
        _schema(
            "read_file",
            "Read a text file, optionally only lines start_line..end_line (1-based, inclusive).",
            {"path": _PATH, "start_line": {"type": "integer"}, "end_line": {"type": "integer"}},
            ["path"],
        ),
        _schema(
            "list_dir",
            "List files and folders (two levels deep).",
            {
                "path": {
                    "type": "string",
                    "description": "Folder relative to the workspace root; default '.'.",
                }
            },
            [],
        ),
        _schema(
            "grep",
            "Search file contents with a regular expression (ripgrep syntax).",
            {
                "pattern": {"type": "string"},
                "path": {"type": "string", "description": "Folder or file to search; default '.'."},
                "glob": {"type": "string", "description": "Only files matching this glob, e.g. '*.py'."},
            },
            ["pattern"],
        ),
        _schema(
            "semantic_search",
            "Find the code most related in meaning to a natural-language query.",
            {"query": {"type": "string"}, "top_k": {"type": "integer"}},
            ["query"],
        ),
        _schema(
            "edit_file",
            "Replace one exact, unique snippet `old` of a file by `new`; with `old` empty, create the file.",
            {"path": _PATH, "old": {"type": "string"}, "new": {"type": "string"}},
            ["path", "old", "new"],
        ),
        _schema(
            "run_command",
            "Run a shell command in the workspace (no network) and return its output and exit code.",
            {"command": {"type": "string"}},
            ["command"],
        ),
        _schema(
            "finish",
            "End the task, with a short summary of what was done.",
            {"summary": {"type": "string"}},
            [],
        ),
    ]
}

_JSON_TYPES: dict[str, type | tuple[type, ...]] = {
    "string": str,
    "integer": int,
    "number": (int, float),
    "object": dict,
    "boolean": bool,
    "array": list,
    "null": type(None),
}


def validate_arguments(
    name: str, arguments: Any, schemas: Mapping[str, dict[str, Any]] | None = None
) -> str | None:
    """The reason a call's arguments do not fit its tool's schema, or None when they do.

    `schemas` (OpenAI function-calling form, by name) defaults to the agent's own tools; the server
    passes the tools a request declared. Checked: required arguments, the JSON type of each argument
    that declares one, and unknown arguments where `additionalProperties` is false (ours all are).
    """
    schemas = TOOL_SCHEMAS if schemas is None else schemas
    if name not in schemas:
        return f"unknown tool {name!r}; the tools are: {', '.join(schemas) or '(none declared)'}"
    if not isinstance(arguments, dict):
        return f"arguments of {name} must be a JSON object, got {type(arguments).__name__}"
    params = schemas[name]["function"].get("parameters") or {}
    properties = params.get("properties") or {}
    missing = [k for k in params.get("required", []) if k not in arguments]
    if missing:
        return f"{name} is missing required argument(s): {', '.join(missing)}"
    for key, value in arguments.items():
        spec = properties.get(key)
        if spec is None:
            if params.get("additionalProperties", True) is False:
                return f"{name} has no argument {key!r}; it takes: {', '.join(properties)}"
            continue
        expected = (
            _JSON_TYPES.get(spec.get("type"))
            if isinstance(spec, dict) and isinstance(spec.get("type"), str)
            else None
        )
        if expected is None:  # no type, a union of types, or a keyword we do not check
            continue
        if not isinstance(value, expected) or (expected in (int, (int, float)) and isinstance(value, bool)):
            return f"argument {key!r} of {name} must be a {spec['type']}, got {type(value).__name__}"
    return None


@dataclass(frozen=True)
class ToolCall:
    """One call as the model wrote it. `error` is set when the call was malformed (bad JSON,
    unknown tool, wrong arguments): it is still a call, answered with the error, never dropped."""

    id: str
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    @property
    def valid(self) -> bool:
        return self.error is None


@dataclass(frozen=True)
class ToolResult:
    call_id: str
    name: str
    content: str
    ok: bool
    duration_s: float


# Arguments that become a path, a regex or a command line for the kernel, where a string ends at
# its first NUL byte and one argument may hold at most MAX_ARG_STRLEN (128 kB) bytes.
_OS_STRINGS = frozenset({"path", "pattern", "glob", "command"})
_MAX_OS_STRING_BYTES = 100_000


def unusable_text(name: str, arguments: dict[str, object]) -> str | None:
    """Why a call's string arguments cannot be used as given, or None.

    Lone surrogates (JSON's "\\udc80" decodes to one) are not Unicode text: they cannot be encoded
    to a file, a command line or a tokenizer. NUL bytes and over-long strings cannot be a path,
    pattern or command; in edit text a NUL is fine and is written as it is.
    """
    for key, value in arguments.items():
        if not isinstance(value, str):
            continue
        try:
            size = len(value.encode("utf-8"))
        except UnicodeEncodeError as exc:
            return (
                f"argument {key!r} of {name} holds a lone surrogate (U+{ord(value[exc.start]):04X} at index "
                f"{exc.start}), which is not Unicode text; write the character itself"
            )
        if key in _OS_STRINGS and "\0" in value:
            at = value.index("\0")
            return f"argument {key!r} of {name} holds a NUL byte (at index {at}), which no {key} can hold"
        if key in _OS_STRINGS and size > _MAX_OS_STRING_BYTES:
            return (
                f"argument {key!r} of {name} is {size} bytes, over the {_MAX_OS_STRING_BYTES} a {key} may "
                "have; put long text in a file with edit_file and refer to it"
            )
    return None
