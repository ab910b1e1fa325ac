"""Gather what a report shows from run folders into one JSON-ready dict (the report and the dashboard share it).

    data = build_report_data(["runs/demo"])                      # simulated-RL runs and cycles found inside
    data = build_report_data(dirs, monitors=monitor_report, live={"production": "v3"})   # the server's view

A folder is searched up to `max_depth` levels down: every folder holding `metrics.jsonl` or
`eval.jsonl` is a simulated-RL run, every folder holding cycle records (`cycle-NNNN/` folders as
flywheel/live/cycle.py writes them) is a series of real-time RL cycles
(their cycle numbers must not repeat across folders; later folders win).
Monitor series come from `monitors` when given (the live server computes them from its store),
else from the cycles: the union of their series and alarms, a later cycle's point replacing an
earlier one for the same (metric, version, window).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from flywheel.report.records import (
    CycleRecord,
    MonitorSnapshot,
    ReportData,
    cycle_files,
    read_cycle_records,
    read_training_run,
)

_SKIP = {"inflight", "state", "checkpoints", "__pycache__"}  # big folders that never hold report inputs


def find_inputs(root: Path, max_depth: int = 3) -> tuple[list[Path], list[Path]]:
    """(simulated-RL run folders, cycle folders) under `root`, breadth first, `root` itself included."""
    runs, cycles = [], []
    level = [root]
    for _ in range(max_depth + 1):
        below = []
        for folder in level:
            try:
                names = {p.name: p for p in folder.iterdir()}
            except FileNotFoundError:  # a temporary folder of a run in progress, renamed since it was listed
                continue
            if "metrics.jsonl" in names or "eval.jsonl" in names:
                runs.append(folder)
            if cycle_files(folder):
                cycles.append(folder)
            below += sorted(p for n, p in names.items() if p.is_dir() and n not in _SKIP and not n.startswith("."))
        level = below
    return runs, cycles


def merged_monitors(cycles: Sequence[CycleRecord]) -> MonitorSnapshot | None:
    """The cycles' monitor series and alarms as one snapshot, or None when no cycle has any."""
    series: dict[tuple[str, int, float], Any] = {}
    alarms: dict[tuple[str, int, float], Any] = {}
    for c in cycles:
        series.update({(p.metric, p.version, p.window_start): p for p in c.series})
        alarms.update({(a.metric, a.version, a.window_start): a for a in c.alarms})
    if not series and not alarms:
        return None
    last = cycles[-1].cycle
    return MonitorSnapshot(source=f"cycles {cycles[0].cycle}–{last}" if len(cycles) > 1 else f"cycle {last}",
                           series=list(series.values()), alarms=list(alarms.values()))


def build_report_data(run_dirs: Sequence[str | Path] = (), *, monitors: Any = None,
                      live: dict[str, Any] | None = None, title: str = "flywheel",
                      max_depth: int = 3) -> dict[str, Any]:
    """The report's inputs as a JSON-ready dict (a `ReportData` dump; no NaN, no infinities).

    `monitors`: a `MonitorSnapshot`, a live `MonitorReport` or a dict of the same fields; None: from the cycles.
    A run dir that does not exist is named in `problems` (it may not have been created yet)."""
    problems: list[str] = []
    training, cycles_by_number = [], {}
    for run_dir in map(Path, run_dirs):
        if not run_dir.is_dir():
            problems.append(f"{run_dir}: no such folder yet")
            continue
        runs, cycle_dirs = find_inputs(run_dir, max_depth)
        for folder in runs:
            name = run_dir.name if folder == run_dir else str(folder.relative_to(run_dir))
            training.append(read_training_run(folder, name if len(run_dirs) == 1 else f"{run_dir.name}/{name}",
                                              problems))
        for folder in cycle_dirs:
            cycles_by_number.update({c.cycle: c for c in read_cycle_records(folder, problems)})
    cycles = [cycles_by_number[k] for k in sorted(cycles_by_number)]
    snapshot = MonitorSnapshot.model_validate(monitors) if monitors is not None else merged_monitors(cycles)
    data = ReportData(title=title, generated_at=time.time(), root=", ".join(str(d) for d in run_dirs),
                      live=live or {}, training=training, cycles=cycles, monitors=snapshot, problems=problems)
    return finite_json(data.model_dump(mode="json"))


def finite_json(value: Any) -> Any:
    """`value` with every NaN or infinity replaced by None (JSON has neither; browsers reject them)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite_json(v) for v in value]
    return value
