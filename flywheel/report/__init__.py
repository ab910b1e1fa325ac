"""HTML report and plots: what a run did, readable offline; the same views back `flywheel serve`'s /dashboard.

    from flywheel.report import render_report, render_cycle, build_report_data, CycleSummary, write_cycle_summary
    render_report("runs/demo")                                   # -> runs/demo/report.html
    write_cycle_summary(CycleSummary(cycle=1, ...), run_dir / "cycles")   # what the real-time cycle writes

- `records`: the inputs (simulated-RL metrics.jsonl / eval.jsonl rows, `CycleSummary` per cycle)
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
    CycleSummary,
    GateCheck,
    MonitorSnapshot,
    ReportData,
    SeriesPoint,
    read_cycle_summaries,
    write_cycle_summary,
)
from flywheel.report.render import dashboard_page, render_body, render_cycle, render_page, render_report

__all__ = ["ABMetric", "AlarmRecord", "CycleSummary", "GateCheck", "MonitorSnapshot", "ReportData", "SeriesPoint",
           "build_report_data", "dashboard_page", "read_cycle_summaries", "render_body", "render_cycle",
           "render_page", "render_report", "write_cycle_summary"]
