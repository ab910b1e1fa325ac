"""HTML report and plots: what a run did, readable offline; the same views back `flywheel serve`'s /dashboard.

    from flywheel.report import render_report, render_cycle, build_report_data
    render_report("runs/demo")                                   # -> runs/demo/report.html
    render_cycle(cycle_report.model_dump(mode="json", by_alias=True))   # one cycle's page (live/cycle.py)

- `records`: the inputs, read as their writers write them (simulated-RL metrics.jsonl / eval.jsonl
             rows; the real-time cycle's own report.json / state.json per cycle, as a `CycleRecord`)
- `data`:    finds them in run folders and gathers one JSON-ready dict (`build_report_data`)
- `render`:  pages and sections from that dict (`render_report`, `render_cycle`, `render_body`)
- `svg`:     the charts, inline SVG built in Python (no plotting library, no CDN)

Nothing here imports the rest of flywheel: the inputs are plain records, so the live server can
import this package and a report can be rendered without torch.
"""

from flywheel.report.data import build_report_data
from flywheel.report.records import (
    ABMetric,
    AlarmRecord,
    CycleRecord,
    GateCheck,
    MonitorSnapshot,
    ReportData,
    SeriesPoint,
    read_cycle_records,
)
from flywheel.report.render import dashboard_page, render_body, render_cycle, render_page, render_report

__all__ = ["ABMetric", "AlarmRecord", "CycleRecord", "GateCheck", "MonitorSnapshot", "ReportData",
           "SeriesPoint", "build_report_data", "dashboard_page", "read_cycle_records", "render_body",
           "render_cycle", "render_page", "render_report"]
