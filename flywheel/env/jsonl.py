"""Reading a JSON-lines file of records (tasks, SWE-bench instances) so that a bad file is refused
before anything runs on it, with the file, the line and the field named."""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ValidationError

Record = TypeVar("Record", bound=BaseModel)


def read_records(path: Path, model: type[Record], *, what: str, plural: str, command: str) -> list[Record]:
    """The `model` records of `path`, one per line (blank lines skipped). A missing file, a line that
    is no `what`, or a file with none raises ValueError naming the file (and line), and `command`,
    the flywheel command that writes such a file."""
    if not path.is_file():
        raise ValueError(f"no {plural} file at {path}; write one with `{command} --out {path}`")
    records = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                records.append(model.model_validate_json(line))
            except ValidationError as exc:
                reason = exc.errors()[0]
                where = ".".join(str(part) for part in reason["loc"])
                raise ValueError(f"{path}:{n} is not a {what} record ({where + ': ' if where else ''}{reason['msg']}); "
                                 f"each line must be one {what.lower()} as `{command}` writes it") from None
    if not records:
        raise ValueError(f"{path} holds no {plural}; write some with `{command} --out {path}`")
    return records
