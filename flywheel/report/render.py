"""HTML pages from report data: the static report of a run folder, one cycle's page, the live dashboard.

    render_report(Path("runs/demo"))                      # -> runs/demo/report.html
    html = render_cycle(cycle_report)                     # one real-time RL cycle (its CycleReport), a page
    body = render_body(build_report_data(dirs))           # the sections, as the dashboard polls them

Views: simulated RL (reward, held-out pass rate with its Wilson band, staleness, tokens by
staleness, throughput), real-time RL (a table of cycles, each gate check across cycles as an
interval against its margin, per cycle the gate, the A/B differences with their intervals and the
alarms) and monitors (each metric per version over time, alarms marked). A view without data says
"no data yet". The pages are self-contained: inline CSS and SVG, and on the dashboard a few lines
of inline script that poll; nothing is fetched from elsewhere, so they open offline.
"""

from __future__ import annotations

import datetime as dt
import json
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from flywheel.report.data import build_report_data
from flywheel.report.records import CycleRecord, MonitorSnapshot, ReportData, TrainingRun
from flywheel.report.svg import (
    BAD,
    GOOD,
    MUTED,
    PALETTE,
    WARN,
    Bar,
    IntervalRow,
    Layer,
    Mark,
    Series,
    bar_chart,
    escape,
    format_value,
    interval_chart,
    line_chart,
    stacked_chart,
)
from flywheel.store.files import write_atomic

# The monitors' metrics in the order flywheel/live/monitors.py lists them; others follow by name.
MONITOR_ORDER = ("edit_rate", "tool_use_rate", "clarify_rate_clear", "clarify_rate_ambiguous", "invalid_call_rate",
                 "tests_passed_rate", "response_length", "reward_outcome_corr", "reward_mean")
_SMALL = 380  # width of the charts shown several to a row
# Versions are Registry versions (vN) everywhere in the report; inside a simulated-RL run, progress
# is counted in learner steps, step 0 being the start checkpoint (the Learner's `policy_version`).
_STEP_AXIS = "learner step (0: the start checkpoint)"
# A step's anatomy as metrics.jsonl holds it (`time/<stage>`, flywheel/rl/train.py `LOOP_STAGES` and
# `ROLLOUT_STAGES`, same names in the same order), with what the report calls each stage.
LOOP_STAGES = {"wait_rollouts": "waiting for complete groups", "wait_staleness": "waiting on the staleness bound",
               "learner_forward_backward": "Learner forward + backward", "learner_optimizer": "Learner optimizer",
               "learner_other": "Learner, other", "weight_push": "weight push", "checkpoint": "checkpoint",
               "loop_other": "loop, other"}
ENGINE_STAGES = {"engine_prefill": "prefill", "engine_decode": "decode", "engine_swap": "weight swap",
                 "engine_idle": "idle"}
EPISODE_STAGES = {"episode_generate": "waiting for the engine", "episode_tools": "tool calls",
                  "episode_grade": "grading", "episode_sandbox": "sandbox creation"}

CSS = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 0; color: #222;
       background: #f6f7f9; }
header { background: #1f2a37; color: #fff; padding: 12px 24px; display: flex; gap: 24px; align-items: baseline;
         flex-wrap: wrap; }
header h1 { font-size: 18px; margin: 0; }
header .meta { color: #c8d0da; font-size: 12px; }
main { padding: 8px 24px 32px; }
section { background: #fff; border: 1px solid #e2e5ea; border-radius: 6px; margin: 16px 0; padding: 8px 16px 16px; }
section h2 { font-size: 16px; margin: 8px 0 12px; }
section h3 { font-size: 14px; margin: 16px 0 8px; }
.charts { display: flex; flex-wrap: wrap; gap: 12px; align-items: flex-start; }
.charts svg { background: #fff; border: 1px solid #eef0f3; border-radius: 4px; max-width: 100%; height: auto; }
table { border-collapse: collapse; font-size: 13px; margin: 4px 0 8px; }
th, td { border-bottom: 1px solid #e8eaee; padding: 4px 10px; text-align: left; white-space: nowrap; }
th { color: #555; font-weight: 600; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
.good { color: #2e7d32; font-weight: 600; } .bad { color: #c62828; font-weight: 600; } .muted { color: #888; }
.facts { display: flex; gap: 20px; flex-wrap: wrap; margin: 4px 0; }
.facts div span { color: #666; margin-right: 4px; }
.problems { background: #fff4e5; border-color: #f0c36d; }
.empty-note { color: #888; font-style: italic; }
details > summary { cursor: pointer; font-weight: 600; margin: 8px 0; }
"""

# Polls the data endpoint and swaps in the server-rendered sections. The key (if the page was opened
# with ?key=...) is passed on; body[data-polls] counts successful refreshes (the browser test reads it).
_POLL_SCRIPT = """
(function () {
  var refreshMs = %(refresh_ms)d, dataUrl = %(data_url)s;
  var key = new URLSearchParams(window.location.search).get("key");
  var url = dataUrl + (dataUrl.indexOf("?") < 0 ? "?" : "&") + "html_only=1" +
            (key ? "&key=" + encodeURIComponent(key) : "");
  var polls = 0, content = document.getElementById("content"), status = document.getElementById("status");
  function poll() {
    fetch(url, {cache: "no-store"}).then(function (r) {
      if (!r.ok) { return r.text().then(function (t) { throw new Error(r.status + " " + t); }); }
      return r.json();
    }).then(function (d) {
      content.innerHTML = d.html;
      polls += 1;
      document.body.setAttribute("data-polls", String(polls));
      document.body.removeAttribute("data-error");
      status.textContent = "updated " + new Date().toLocaleTimeString() + " · every " + refreshMs / 1000 + " s";
    }).catch(function (e) {
      document.body.setAttribute("data-error", String(e.message || e));
      status.textContent = "update failed: " + (e.message || e) + " (retrying)";
    }).then(function () { window.setTimeout(poll, refreshMs); });
  }
  poll();
})();
"""


def _as_data(data: ReportData | dict[str, Any]) -> ReportData:
    return data if isinstance(data, ReportData) else ReportData.model_validate(data)


def _clock(t: float | None) -> str:
    if t is None:
        return "—"
    return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _section(title: str, body: str, css_id: str = "", css_class: str = "") -> str:
    ids = f' id="{css_id}"' if css_id else ""
    classes = f' class="{css_class}"' if css_class else ""
    return f"<section{ids}{classes}><h2>{escape(title)}</h2>{body}</section>"


def _charts(svgs: Iterable[str]) -> str:
    return '<div class="charts">' + "".join(svgs) + "</div>"


def _table(header: Sequence[str], rows: Iterable[Sequence[str]], numeric: Sequence[int] = ()) -> str:
    """A table; cells are HTML already (escape text before passing it)."""
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f'<td class="num">{c}</td>' if i in numeric else f"<td>{c}</td>"
                                    for i, c in enumerate(row)) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _decision(cycle: CycleRecord) -> str:
    if cycle.running is not None:
        return f'<span class="muted">running: {escape(cycle.running)}</span>'
    return f"<b>{escape(cycle.decision or '—')}</b>"


def _verdict(ok: bool | None, yes: str = "passed", no: str = "failed") -> str:
    if ok is None:
        return '<span class="muted">—</span>'
    return f'<span class="good">{escape(yes)}</span>' if ok else f'<span class="bad">{escape(no)}</span>'


def _interval(value: float | None, low: float | None, high: float | None) -> str:
    if low is None or high is None:
        return escape(format_value(value))
    return escape(f"{format_value(value)} [{format_value(low)}, {format_value(high)}]")


# ---- simulated RL


def _training_section(runs: Sequence[TrainingRun]) -> str:
    if not any(r.steps or r.evals for r in runs):
        return _section("Simulated RL", '<p class="empty-note">no data yet: no metrics.jsonl or eval.jsonl found</p>',
                        "training")
    colors = {r.name: PALETTE[i % len(PALETTE)] for i, r in enumerate(runs)}
    # Step s trains on episodes that policies before s sampled: drawn at s - 1, the reward lines up
    # with the held-out eval of the same policy, and the start checkpoint's samples are the first point.
    reward = [Series(r.name, [(s.step - 1, s.reward_mean) for s in r.steps], color=colors[r.name]) for r in runs]
    held_out = [Series(r.name if len(runs) > 1 else "all families", [(e.step, e.pass_rate) for e in r.evals],
                       band=[(e.step, *(e.pass_rate_ci or (None, None))) for e in r.evals], color=colors[r.name])
                for r in runs]
    if len(runs) == 1:  # one run: its families too, dashed, without bands (they would hide each other)
        families = list(dict.fromkeys(f for e in runs[0].evals for f in e.per_family))
        held_out += [Series(f, [(e.step, e.per_family[f].pass_rate if f in e.per_family else None)
                                for e in runs[0].evals], color=PALETTE[(i + 1) % len(PALETTE)], dashed=True)
                     for i, f in enumerate(families)]
    staleness = [Series(f"{r.name} max" if len(runs) > 1 else "max", [(s.step, s.staleness_max) for s in r.steps],
                        color=colors[r.name]) for r in runs]
    staleness += [Series(f"{r.name} mean" if len(runs) > 1 else "mean", [(s.step, s.staleness_mean) for s in r.steps],
                         color=colors[r.name], dashed=True, markers=False) for r in runs]
    histogram: dict[int, float] = defaultdict(float)
    for r in runs:
        for s in r.steps:
            for k, tokens in s.staleness.items():
                histogram[k] += tokens
    throughput = [Series(r.name, [(s.step, s.tokens_per_s) for s in r.steps], color=colors[r.name]) for r in runs]
    charts = [
        line_chart("Training reward (mean of the episodes each policy sampled)", reward,
                   x_label=f"the policy that sampled them, by {_STEP_AXIS}", y_label="reward"),
        line_chart("Held-out pass rate (95% Wilson band)", held_out, x_label=_STEP_AXIS, y_label="pass rate",
                   y_range=(0, 1)),
        line_chart("Staleness of trained tokens", staleness, x_label="learner step",
                   y_label="learner steps behind"),
        bar_chart("Trained tokens by staleness", [Bar(str(k), histogram[k], tooltip=f"{histogram[k]:,.0f} tokens "
                                                  f"{k} learner steps old") for k in sorted(histogram)],
                  x_label="steps behind the learner", y_label="tokens"),
        line_chart("Learner throughput", throughput, x_label="learner step", y_label="tokens / s"),
    ]
    charts += _draw_charts(runs, colors)
    charts += _fleet_charts(runs)
    charts += _anatomy_charts(runs)
    table = _table(["run", "learner steps", "held-out pass rate at the start (step 0)", "at the end",
                    "change (paired, 95% CI)"], [_training_row(r) for r in runs], numeric=(1,))
    return _section("Simulated RL", table + _charts(charts), "training")


def _draw_charts(runs: Sequence[TrainingRun], colors: dict[str, str]) -> list[str]:
    """What the groups completed before each step drew (metrics.jsonl's draw, flywheel/rl/train.py
    `draw_metrics`): the share on the frontier, and the pass rate estimated for their tasks when they
    were drawn beside the one they had. Lined up as the training reward is, by the policy that sampled
    them. Runs written before the draw was recorded have none: no chart."""
    drawn = [r for r in runs if any(s.frontier_share is not None for s in r.steps)]
    if not drawn:
        return []
    x_label = f"the policy that sampled them, by {_STEP_AXIS}"
    one = len(drawn) == 1
    share = [Series("on the frontier (some passed, some failed)" if one else f"{r.name} frontier",
                    [(s.step - 1, s.frontier_share) for s in r.steps], color=colors[r.name]) for r in drawn]
    share += [Series("with any signal (rewards differ)" if one else f"{r.name} signal",
                     [(s.step - 1, s.signal_share) for s in r.steps], color=colors[r.name], dashed=True, markers=False)
              for r in drawn]
    run = drawn[-1]
    name = "" if one else f" ({run.name})"
    draw = [Series("estimated when drawn", [(s.step - 1, s.draw_estimate) for s in run.steps], color=MUTED,
                   dashed=True),
            Series("measured", [(s.step - 1, s.rollout_pass_rate) for s in run.steps], color=colors[run.name])]
    return [line_chart("Groups on the frontier (share of those completed before each step)", share, x_label=x_label,
                       y_label="share of groups", y_range=(0, 1)),
            line_chart(f"The draw's pass rate: estimated from earlier episodes, and measured{name}", draw,
                       x_label=x_label, y_label="pass rate", y_range=(0, 1))]


def _anatomy_charts(runs: Sequence[TrainingRun]) -> list[str]:
    """Each step's anatomy (the last run's that has one): the loop's wall time by stage, the engine's
    wall time behind it, the episodes' seconds summed, and the engine's tokens per second."""
    run = next((r for r in reversed(runs) if any(s.stage_seconds for s in r.steps)), None)
    if run is None:
        return []
    steps = [s for s in run.steps if s.stage_seconds]
    xs = [s.step for s in steps]

    def layers(stages: dict[str, str]) -> list[Layer]:
        return [Layer(label, [s.stage_seconds.get(stage) for s in steps], color=PALETTE[i % len(PALETTE)])
                for i, (stage, label) in enumerate(stages.items())]

    def rate(kind: str) -> list[tuple[float, float | None]]:
        seconds = [(s.step, s.stage_tokens.get(f"engine_{kind}"), s.stage_seconds.get(f"engine_{kind}")) for s in steps]
        return [(x, tokens / t if tokens is not None and t else None) for x, tokens, t in seconds]

    name = f" ({run.name})" if len(runs) > 1 else ""
    charts = [stacked_chart(f"Where the wall time of each step went{name}", xs, layers(LOOP_STAGES),
                            x_label="learner step", y_label="seconds", unit=" s")]
    if any("engine_decode" in s.stage_seconds for s in steps):
        charts += [stacked_chart(f"Engine wall time behind each step{name}", xs, layers(ENGINE_STAGES),
                                 x_label="learner step", y_label="seconds", unit=" s"),
                   line_chart(f"Engine throughput{name}", [Series("decode", rate("decode")),
                                                           Series("prefill", rate("prefill"))],
                              x_label="learner step", y_label="tokens / s")]
    charts.append(stacked_chart(f"Episode-seconds behind each step, summed over its episodes{name}", xs,
                                layers(EPISODE_STAGES), x_label="learner step", y_label="seconds", unit=" s"))
    return charts


FLEET_CHARTS = (("live_sandboxes", "Live sandboxes per node (Ray)", "sandboxes"),
                ("queue_wait_ms_p99", "Sandbox admission queue wait per node, p99 (Ray)", "ms"),
                ("created_per_s_recent", "Sandboxes created per second per node (Ray)", "sandboxes / s"))


def _fleet_charts(runs: Sequence[TrainingRun]) -> list[str]:
    """A Ray run's fleet.jsonl: one line per node (per run and node when several runs have one)."""
    with_fleet = [r for r in runs if r.fleet]
    charts = []
    for field, title, unit in FLEET_CHARTS:
        series = []
        for r in with_fleet:
            nodes = list(dict.fromkeys(node for point in r.fleet for node in point.nodes))
            for node in nodes:
                name = f"{r.name} {node}" if len(with_fleet) > 1 else f"node {node}"
                series.append(Series(name, [(p.step, getattr(p.nodes[node], field) if node in p.nodes else None)
                                            for p in r.fleet], color=PALETTE[len(series) % len(PALETTE)]))
        if series:
            charts.append(line_chart(title, series, x_label="learner step", y_label=unit))
    return charts


def _training_row(run: TrainingRun) -> list[str]:
    """A run's start (its step-0 eval only: a later first eval is not the start's figure), its end and
    the paired change between them."""
    start, end = run.start_eval, (run.evals[-1] if run.evals else None)
    lift = run.lift
    change = "—"
    if lift is not None and lift.diff is not None and lift.ci is not None:
        change = escape(f"{lift.diff:+.3f} [{lift.ci[0]:+.3f}, {lift.ci[1]:+.3f}], {lift.gained} gained / "
                        f"{lift.lost} lost of {lift.tasks}: "
                        f"{'significant' if lift.significant else 'not significant'}")
    return [escape(run.name), str(len(run.steps)),
            _interval(start.pass_rate, *(start.pass_rate_ci or (None, None))) if start else
            '<span class="muted">not evaluated at step 0</span>',
            _interval(end.pass_rate, *(end.pass_rate_ci or (None, None))) + escape(f" (step {end.step})") if end
            else "—",
            change]


# ---- real-time RL


def _gate_rows(checks: Iterable[tuple[str, Any]]) -> list[IntervalRow]:
    return [IntervalRow(label, g.diff, g.ci_low, g.ci_high, color=GOOD if g.passed else BAD,
                        tooltip=f"{label}: {'passed' if g.passed else 'failed'}. {g.reason}".strip(),
                        tick=-g.margin if g.margin is not None else None,
                        tick_label="−margin" if g.margin is not None else "")
            for label, g in checks]


def _ab_color(m: Any) -> str:
    if m.verdict == "better":
        return GOOD
    if m.verdict == "worse":
        return BAD
    return WARN if m.significant else MUTED


def cycle_section(cycle: CycleRecord, monitors: bool = False) -> str:
    """One cycle: gate checks against their margins, A/B differences, alarms, timings (and its monitors)."""
    versions = f"v{cycle.production if cycle.production is not None else '?'} → " \
               f"v{cycle.candidate if cycle.candidate is not None else '?'}"
    parts = [f'<p><b>{escape(versions)}</b> · started {escape(_clock(cycle.started_at))} · gate '
             f'{_verdict(cycle.gate_passed)} · A/B {escape(cycle.ab_decision or "—")} · decision '
             f'{_decision(cycle)}</p>']
    if cycle.reason:
        parts.append(f"<p>{escape(cycle.reason)}</p>")
    gate = interval_chart(f"Cycle {cycle.cycle}: gate (candidate − production)",
                          _gate_rows((g.name, g) for g in cycle.gate_checks),
                          x_label="difference; tick: −margin",
                          empty_message="no data yet: the gate has not run")
    ab_charts = [interval_chart(f"A/B {m.name}", [IntervalRow("cand − prod", m.diff, m.ci_low, m.ci_high,
                                                               color=_ab_color(m))],
                                x_label=m.name + (" (higher is better)" if m.higher_is_better else
                                                  " (lower is better)" if m.higher_is_better is False else ""),
                                width=_SMALL, empty_message="not enough answers yet")
                 for m in cycle.ab_metrics]
    if not cycle.ab_metrics:
        ab_charts = [interval_chart("A/B test", [], empty_message="no data yet: no A/B test", width=_SMALL)]
    parts.append(_charts([gate, *ab_charts]))
    if cycle.gate_checks:
        parts.append(_table(["gate check", "result", "difference [interval]", "margin", "reason"],
                            ([escape(g.name), _verdict(g.passed), _interval(g.diff, g.ci_low, g.ci_high),
                              escape(format_value(g.margin)), escape(g.reason)] for g in cycle.gate_checks),
                            numeric=(3,)))
    if cycle.ab_metrics:
        parts.append(_table(
            ["A/B metric", "production", "candidate", "difference [interval]", "n (prod / cand)", "verdict"],
            ([escape(m.name), escape(format_value(m.production)), escape(format_value(m.candidate)),
              _interval(m.diff, m.ci_low, m.ci_high),
              escape(f"{m.n_production if m.n_production is not None else '—'} / "
                     f"{m.n_candidate if m.n_candidate is not None else '—'}"),
              f'<span style="color:{_ab_color(m)}">{escape(m.verdict or ("significant" if m.significant else "—"))}'
              f"</span>"] for m in cycle.ab_metrics), numeric=(1, 2)))
    if cycle.replay is not None:
        r = cycle.replay
        parts.append(_table(
            [f"distilled requests replayed ({r.requests} x {r.samples})", "production", "candidate",
             "requests worse / better", "p (sign test)", "alarm"],
            ([escape(name), escape(format_value(m.production)), escape(format_value(m.candidate)),
              escape(f"{m.worse} / {m.better}"), escape(format_value(m.p_value) if m.p_value is not None else "—"),
              _verdict(not m.alarm, "none", "blocks")] for name, m in r.metrics.items()), numeric=(1, 2)))
    if cycle.alarms:
        parts.append(_alarms_table(cycle.alarms))
    if cycle.timings:
        parts.append("<p>" + " · ".join(escape(f"{k} {v:,.1f} s") for k, v in cycle.timings.items()) + "</p>")
    if monitors and cycle.series:
        parts.append(_monitor_charts(MonitorSnapshot(series=cycle.series, alarms=cycle.alarms)))
    return f'<div class="cycle" id="cycle-{cycle.cycle}"><h3>Cycle {cycle.cycle}</h3>{"".join(parts)}</div>'


def _cycles_section(cycles: Sequence[CycleRecord]) -> str:
    if not cycles:
        return _section("Real-time RL cycles",
                        '<p class="empty-note">no data yet: no cycle-NNNN/report.json found</p>', "cycles")
    rows = [[str(c.cycle), escape(_clock(c.started_at)),
             escape(f"v{c.production} → v{c.candidate}" if c.candidate is not None else "—"),
             _verdict(c.gate_passed), escape(c.ab_decision or "—"), _decision(c),
             str(sum(a.blocks_promotion for a in c.alarms)),
             escape(f"{c.seconds:,.0f} s" if c.seconds is not None else "—")] for c in cycles]
    table = _table(["cycle", "started", "versions", "gate", "A/B", "decision", "blocking alarms", "time"], rows,
                   numeric=(0, 6, 7))
    names = list(dict.fromkeys(g.name for c in cycles for g in c.gate_checks))
    across = [interval_chart(f"Gate {name} by cycle", _gate_rows((f"cycle {c.cycle}", g) for c in cycles
                                                                   for g in c.gate_checks if g.name == name),
                             x_label="candidate − production; tick: −margin", width=_SMALL) for name in names]
    latest, older = cycles[-1], cycles[-2::-1]
    details = "".join(f"<details><summary>Cycle {c.cycle}: {escape(c.decision or '—')}</summary>"
                      f"{cycle_section(c)}</details>" for c in older)
    body = table + (_charts(across) if across else "") + cycle_section(latest) + details
    return _section("Real-time RL cycles", body, "cycles")


# ---- monitors


def _alarms_table(alarms: Sequence[Any], limit: int = 50) -> str:
    latest = sorted(alarms, key=lambda a: a.window_start, reverse=True)[:limit]
    rows = [[escape(a.metric), escape(f"v{a.version}"), escape(_clock(a.window_start)), escape(format_value(a.value)),
             escape(format_value(a.baseline_value)),
             f'<span style="color:{BAD if a.severity == "critical" else WARN}">{escape(a.severity)}</span>',
             "yes" if a.blocks_promotion else "no"] for a in latest]
    more = f"<p class='muted'>and {len(alarms) - limit} older alarms</p>" if len(alarms) > limit else ""
    return _table(["alarm", "version", "window", "value", "baseline", "severity", "blocks promotion"], rows,
                  numeric=(3, 4)) + more


def _monitor_charts(snapshot: MonitorSnapshot) -> str:
    points = [p.window_start for p in snapshot.series] + [a.window_start for a in snapshot.alarms]
    t0 = min(points)
    metrics = sorted({p.metric for p in snapshot.series} | {a.metric for a in snapshot.alarms},
                     key=lambda m: (MONITOR_ORDER.index(m) if m in MONITOR_ORDER else len(MONITOR_ORDER), m))
    charts = []
    for metric in metrics:
        by_version: dict[int, list[tuple[float, float | None]]] = defaultdict(list)
        for p in sorted(snapshot.series, key=lambda p: p.window_start):
            if p.metric == metric:
                by_version[p.version].append(((p.window_start - t0) / 60, p.value))
        series = [Series(f"v{v}", pts, color=PALETTE[v % len(PALETTE)]) for v, pts in sorted(by_version.items())]
        marks = [Mark((a.window_start - t0) / 60, a.value, f"{a.severity} alarm: {metric} of v{a.version} "
                      f"{format_value(a.value)} vs baseline {format_value(a.baseline_value)}"
                      + (" (blocks promotion)" if a.blocks_promotion else ""),
                      color=BAD if a.severity == "critical" else WARN, kind=f"{a.severity} alarm")
                 for a in snapshot.alarms if a.metric == metric and a.value is not None]
        charts.append(line_chart(metric, series, marks=marks, x_label=f"minutes since {_clock(t0)}",
                                 y_range=(0, 1) if "_rate" in metric else None, width=_SMALL, height=230))
    return _charts(charts)


def _monitors_section(snapshot: MonitorSnapshot | None) -> str:
    if snapshot is None or not (snapshot.series or snapshot.alarms):
        return _section("Monitors", '<p class="empty-note">no data yet: no monitor series</p>', "monitors")
    critical = sum(a.severity == "critical" for a in snapshot.alarms)
    head = (f"<p>From {escape(snapshot.source or 'the monitors')}: {len(snapshot.series)} windows, "
            f"{len(snapshot.alarms)} alarms ({critical} critical). Triangles mark alarms.</p>")
    alarms = _alarms_table(snapshot.alarms) if snapshot.alarms else ""
    return _section("Monitors", head + _monitor_charts(snapshot) + alarms, "monitors")


# ---- pages


def render_body(data: ReportData | dict[str, Any]) -> str:
    """The report's sections (the part of the page the dashboard replaces on each poll)."""
    d = _as_data(data)
    parts = []
    if d.problems:
        items = "".join(f"<li>{escape(p)}</li>" for p in d.problems)
        parts.append(_section("Could not read everything", f"<ul>{items}</ul>", "problems", "problems"))
    if d.live:
        facts = "".join(f"<div><span>{escape(k)}</span><b>{escape(format_value(v) if isinstance(v, float) else v)}"
                        f"</b></div>" for k, v in d.live.items())
        parts.append(_section("Live", f'<div class="facts">{facts}</div>', "live"))
    parts += [_training_section(d.training), _cycles_section(d.cycles), _monitors_section(d.monitors)]
    return "".join(parts)


def render_page(data: ReportData | dict[str, Any], script: str = "") -> str:
    """A whole self-contained HTML page of `data`; `script` (JavaScript) runs at the end of the body."""
    d = _as_data(data)
    source = f" · {escape(d.root)}" if d.root else ""
    script_tag = f"<script>{script}</script>" if script else ""
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{escape(d.title)}</title>'
            f'<meta name="viewport" content="width=device-width, initial-scale=1"><style>{CSS}</style></head>'
            f'<body><header><h1>{escape(d.title)}</h1><span class="meta">generated {escape(_clock(d.generated_at))}'
            f'{source}</span><span class="meta" id="status"></span></header>'
            f'<main id="content">{render_body(d)}</main>{script_tag}</body></html>')


def dashboard_page(data: ReportData | dict[str, Any], data_url: str, refresh_s: float) -> str:
    """`render_page` plus the script that re-renders from `data_url` every `refresh_s` seconds."""
    script = _POLL_SCRIPT % {"refresh_ms": max(int(refresh_s * 1000), 250), "data_url": json.dumps(data_url)}
    return render_page(data, script=script.replace("</", "<\\/"))


def render_cycle(cycle: CycleRecord | dict[str, Any], title: str | None = None) -> str:
    """One cycle as a standalone HTML page (its gate, A/B test, alarms and monitor series); `cycle` is
    a `CycleRecord`, or flywheel/live/cycle.py's `CycleReport` or its dump."""
    c = cycle if isinstance(cycle, CycleRecord) else CycleRecord.model_validate(cycle)
    title = title or f"flywheel cycle {c.cycle}"
    body = f"<section>{cycle_section(c, monitors=True)}</section>"
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>'
            f'<style>{CSS}</style></head><body><header><h1>{escape(title)}</h1></header>'
            f'<main id="content">{body}</main></body></html>')


def render_report(run_dir: str | Path, out_path: str | Path | None = None, title: str | None = None) -> Path:
    """Write the HTML report of everything under `run_dir` to `out_path` (default run_dir/report.html)."""
    run_dir = Path(run_dir)
    out = Path(out_path) if out_path is not None else run_dir / "report.html"
    data = build_report_data([run_dir], title=title or f"flywheel report: {run_dir.name}")
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, render_page(data))
    return out
