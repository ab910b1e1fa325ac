"""The report of a run folder: what it reads, what it draws, and how it copes with missing or broken inputs."""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser

import pytest
from run_folders import T0, cycle, write_cycle, write_training_run

from flywheel.report import (
    ABMetric,
    AlarmRecord,
    CycleRecord,
    GateCheck,
    SeriesPoint,
    build_report_data,
    read_cycle_records,
    render_cycle,
    render_report,
)
from flywheel.report.data import merged_monitors
from flywheel.report.records import ABRecord, GateDecisionRecord, GateRecord, MonitorRecord
from flywheel.report.render import ENGINE_STAGES, EPISODE_STAGES, LOOP_STAGES


class Elements(HTMLParser):
    """Every element with its attributes and the id of the <section> it is in."""

    def __init__(self, page: str):
        super().__init__()
        self.found: list[tuple[str, dict[str, str], str]] = []
        self.texts: dict[str, list[str]] = {}
        self._sections: list[str] = []
        self._depth: list[int] = []
        self.feed(page)

    def handle_starttag(self, tag, attrs):
        attributes = {k: v or "" for k, v in attrs}
        if tag == "section":
            self._sections.append(attributes.get("id", ""))
        self.found.append((tag, attributes, self._sections[-1] if self._sections else ""))

    def handle_endtag(self, tag):
        if tag == "section":
            self._sections.pop()

    def handle_data(self, data):
        self.texts.setdefault(self._sections[-1] if self._sections else "", []).append(data)

    def count(self, css_class: str, section: str) -> int:
        return sum(css_class in a.get("class", "").split() and s == section for _, a, s in self.found)

    def text(self, section: str) -> str:
        return " ".join(self.texts.get(section, []))


def test_report_draws_every_view_from_a_demo_folder(demo_folder):
    out = render_report(demo_folder)
    assert out == demo_folder / "report.html"
    page = out.read_text()
    assert "http://" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")  # nothing fetched from elsewhere
    assert "<script" not in page  # the static report needs none
    dom = Elements(page)
    # simulated RL: 6 steps of reward, 3 evals of 3 lines (all + 2 families), staleness max, throughput, the
    # draw's frontier share and its estimated and measured pass rates, the engine's decode and prefill tokens/s
    assert dom.count("point", "training") == 6 + 3 * 3 + 6 + 6 + 6 + 2 * 6 + 2 * 6
    assert dom.count("band", "training") == 1
    assert dom.count("bar", "training") == 2  # tokens 0 and 1 versions behind
    # cycles: each check across 2 cycles, the latest cycle's gate (2 checks) and A/B (2 metrics), then cycle 1's
    assert dom.count("estimate", "cycles") == 2 * 2 + 2 + 2 + (2 + 2)
    assert dom.count("interval", "cycles") == 2 * 2 + 2 + 2 + (2 + 2)
    # monitors: merged from both cycles, v0 v1 v2; the rolled-back cycle's alarm is marked
    assert dom.count("alarm", "monitors") == 1
    assert dom.count("point", "monitors") == 2 * 5 * 2 * 2  # 2 metrics, 5 windows, 2 versions, 2 cycles
    assert "no data yet" not in page
    assert "rollback" in dom.text("cycles") and "critical" in dom.text("monitors")


def test_an_empty_folder_says_no_data_yet_in_every_view(tmp_path):
    (tmp_path / "empty").mkdir()
    dom = Elements((render_report(tmp_path / "empty", tmp_path / "out" / "r.html")).read_text())
    for section in ("training", "cycles", "monitors"):
        assert "no data yet" in dom.text(section)
    data = build_report_data([tmp_path / "not-yet"])
    assert data["problems"] == [f"{tmp_path / 'not-yet'}: no such folder yet"]


def test_partial_inputs_render_what_there_is(tmp_path):
    """A cycle that has only gated (no A/B yet, no monitors) and a run without evals yet."""
    write_training_run(tmp_path / "run")
    (tmp_path / "run" / "eval.jsonl").unlink()
    gated = cycle(1).model_dump(by_alias=True)
    gated["gate"]["decision"] = {"passed": False, "checks": {"pass_rate": {
        "passed": False, "diff": None, "ci_low": None, "ci_high": None, "n": 4,
        "reason": "only 4 paired tasks, need 20: add eval tasks"}}}
    gated.update(ab=None, monitor=None, alarms=[], blocking_alarms=[], decision="rejected")
    write_cycle(type(cycle(1)).model_validate(gated), tmp_path / "cycles")
    dom = Elements(render_report(tmp_path).read_text())
    # no eval: reward, staleness, the throughputs, the draw's frontier share and pass rates
    assert dom.count("point", "training") == 6 + 6 + 6 + 2 * 6 + 6 + 2 * 6
    assert "no data yet" in " ".join(dom.texts.get("training", []))  # the held-out chart
    assert "not computed" in dom.text("cycles") and "no A/B test" in dom.text("cycles")
    assert "no data yet" in dom.text("monitors")


def test_a_run_in_progress_is_read_and_broken_lines_are_named(tmp_path):
    run = write_training_run(tmp_path / "run", torn_last_line=True)
    data = build_report_data([run])
    assert [s["step"] for s in data["training"][0]["steps"]] == [1, 2, 3, 4, 5, 6]
    assert data["problems"] == []  # the torn last line is being written: skipped without complaint
    with open(run / "metrics.jsonl", "a") as f:
        f.write('"}\n{"step": "seven"}\n{"step": 8, "reward_mean": 0.5}\n')
    data = build_report_data([run])
    assert [s["step"] for s in data["training"][0]["steps"]] == [1, 2, 3, 4, 5, 6, 8]
    assert len(data["problems"]) == 2 and all("metrics.jsonl:" in p for p in data["problems"])
    assert "Could not read everything" in render_report(run).read_text()


def test_data_is_plain_json_with_no_nan(tmp_path):
    run = write_training_run(tmp_path / "run")
    with open(run / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 7, "reward_mean": float("nan"), "staleness_mean": float("inf")}) + "\n")
    data = build_report_data([run])
    text = json.dumps(data, allow_nan=False)  # raises on NaN or infinities
    step = data["training"][0]["steps"][-1]
    assert step["reward_mean"] is None and step["staleness_mean"] is None
    assert data["training"][0]["steps"][0]["staleness"] == {"0": 300.0, "1": 100.0}  # the Learner's histogram
    assert json.loads(text) == data


def test_cycle_records_are_read_as_written_and_a_broken_one_is_named(tmp_path):
    folder = tmp_path / "cycles"
    for n in (2, 1, 10):
        write_cycle(cycle(n), folder)
    assert sorted(p.name for p in folder.iterdir()) == ["cycle-0001", "cycle-0002", "cycle-0010"]
    problems: list[str] = []
    assert [c.cycle for c in read_cycle_records(folder, problems)] == [1, 2, 10]
    assert read_cycle_records(folder, problems)[0] == CycleRecord.model_validate(cycle(1))
    (folder / "cycle-0003").mkdir()
    (folder / "cycle-0003" / "report.json").write_text('{"cycle": "three"}')
    assert [c.cycle for c in read_cycle_records(folder, problems)] == [1, 2, 10] and len(problems) == 1
    assert "cycle-0003/report.json" in problems[0]


def test_the_cycle_writer_can_pass_the_live_records_as_they_are():
    # the live stage loads torch and transformers: only these tests import it, here
    from flywheel.live.abtest import compare  # noqa: PLC0415
    from flywheel.live.gate import GateDecision, non_inferiority  # noqa: PLC0415
    from flywheel.live.monitors import Alarm, MetricPoint  # noqa: PLC0415

    gate = GateDecision(passed=True, checks={"pass_rate": non_inferiority([1.0] * 60, [1.0] * 59 + [0.0], 0.05)})
    ab = {"reward": compare("reward", [0.1, 0.2, 0.3, 0.2], [0.5, 0.6, 0.7, 0.6], 0.95)}
    alarm = Alarm(metric="edit_rate", version=3, window_start=T0, window_end=T0 + 60, baseline="version 2",
                  baseline_value=0.6, value=0.2, n=40, baseline_n=400, score=-5.0, p_value=1e-7, severity="critical",
                  blocks_promotion=True)
    point = MetricPoint(metric="edit_rate", version=3, window_start=T0, window_end=T0 + 60, n=40, value=0.2)
    summary = CycleRecord(cycle=4, production=2, candidate=3, gate={"decision": gate}, ab={"metrics": ab},
                          alarms=[alarm], monitor={"series": [point]})
    check, metric = summary.gate_checks[0], summary.ab_metrics[0]
    assert (check.name, check.passed, check.method) == ("pass_rate", True, "tango") and check.margin is None
    assert metric.name == "reward" and metric.verdict == "better" and metric.significant
    assert summary.alarms[0].blocks_promotion and summary.series[0].value == 0.2
    assert CycleRecord.model_validate_json(summary.model_dump_json()) == summary


def test_render_cycle_is_a_standalone_page_and_escapes_what_it_is_given():
    c = cycle(2, promote=False).model_copy(update={"reason": "<script>alert(1)</script> & rolled back"})
    page = render_cycle(c.model_dump())
    dom = Elements(page)
    assert page.startswith("<!DOCTYPE html>") and "<script>" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt; &amp; rolled back" in page
    assert sum("estimate" in a.get("class", "") for _, a, _ in dom.found) == 2 + 2  # gate checks, A/B metrics
    assert sum("alarm" in a.get("class", "").split() for _, a, _ in dom.found) == 1
    assert len(re.findall(r'class="point"', page)) == 2 * 5 * 2  # its monitor series


def test_later_cycles_replace_earlier_monitor_points():
    first = CycleRecord.model_validate(cycle(1))
    second = CycleRecord.model_validate(cycle(2))
    second.monitor.series = [p.model_copy(update={"value": 0.1}) for p in first.series[:1]]
    merged = merged_monitors([first, second])
    assert merged is not None and len(merged.series) == len(first.series)
    assert merged.series[0].value == 0.1 and merged.source == "cycles 1–2"
    assert merged_monitors([CycleRecord(cycle=1)]) is None


def test_the_live_cycles_own_records_are_read_finished_or_running(tmp_path):
    """flywheel/live/cycle.py writes cycle-NNNN/report.json when a cycle is done and state.json while it runs."""
    # the live stage loads torch and transformers: only these tests import it, here
    from flywheel.live.abtest import ABReport, compare  # noqa: PLC0415
    from flywheel.live.cycle import CycleReport, CycleState, MonitorSummary  # noqa: PLC0415
    from flywheel.live.gate import GateDecision, GateRun, non_inferiority  # noqa: PLC0415
    from flywheel.live.monitors import MetricPoint  # noqa: PLC0415

    gate = GateRun(decision=GateDecision(passed=True,
                                         checks={"pass_rate": non_inferiority([1.0] * 60, [1.0] * 60, 0.05)}),
                   candidate_version=1, production_version=0, tasks=60, candidate={}, production={}, seconds=3.0)
    ab = ABReport(decision="promote", reason="persistence better", confidence=0.95, closed={}, versions={}, outside={},
                  metrics={"reward": compare("reward", [0.1, 0.2, 0.3, 0.2], [0.5, 0.6, 0.7, 0.6], 0.95)})
    series = [MetricPoint(metric="edit_rate", version=v, window_start=T0 + 60 * w, window_end=T0 + 60 * w + 60,
                          n=30, value=0.5) for v in (0, 1) for w in range(3)]
    done = CycleReport(cycle=1, trigger="events", started_at=T0, finished_at=T0 + 99, production=0, candidate=1,
                       production_after=1, decision="promote", reason="the A/B test says so", batch=None, served={},
                       train=None, gate=gate, ab=ab, alarms=[], blocking_alarms=[],
                       monitor=MonitorSummary(baseline_version=0, tests=6, series=series),
                       timings={"train_s": 40.0, "gate_s": 9.0, "total_s": 99.0})
    running = CycleState(cycle=2, trigger="clock", started_at=T0 + 200, production=1, first_production=0,
                         since=T0 + 99, events_at_start=10, stage="gated", candidate=2, gate=gate)
    for state in (done, running):
        (tmp_path / "live" / f"cycle-{state.cycle:04d}").mkdir(parents=True)
    (tmp_path / "live" / "cycle-0001" / "report.json").write_text(done.model_dump_json(by_alias=True))
    (tmp_path / "live" / "cycle-0001" / "state.json").write_text("{}")  # report.json is read when there is one
    (tmp_path / "live" / "cycle-0002" / "state.json").write_text(running.model_dump_json())
    data = build_report_data([tmp_path])
    assert data["problems"] == []
    first, second = (CycleRecord.model_validate(c) for c in data["cycles"])
    assert (first.production, first.candidate, first.decision, first.running) == (0, 1, "promote", None)
    assert first.gate_checks[0].name == "pass_rate" and first.gate_passed
    assert first.ab_metrics[0].verdict == "better"
    assert first.ab_decision == "promote" and len(first.series) == 6 and first.seconds == 99.0
    assert (second.running, second.candidate, second.decision, second.ab_metrics) == ("gated", 2, None, [])
    dom = Elements(render_report(tmp_path).read_text())
    assert "running: gated" in dom.text("cycles") and dom.count("point", "monitors") == 6


def test_the_reports_cycle_record_names_only_fields_the_cycle_writes():
    """CycleRecord is the part of the live cycle's record the report draws: no field of its own."""
    # the live stage loads torch and transformers: only these tests import it, here
    from flywheel.live.abtest import ABReport, MetricComparison  # noqa: PLC0415
    from flywheel.live.cycle import CycleReport, CycleState, MonitorSummary  # noqa: PLC0415
    from flywheel.live.gate import GateDecision, GateResult, GateRun  # noqa: PLC0415
    from flywheel.live.monitors import Alarm, MetricPoint  # noqa: PLC0415

    pairs = [(CycleRecord, {*CycleReport.model_fields, *CycleState.model_fields}),
             (GateRecord, GateRun.model_fields), (GateDecisionRecord, GateDecision.model_fields),
             (ABRecord, ABReport.model_fields), (MonitorRecord, MonitorSummary.model_fields),
             (AlarmRecord, Alarm.model_fields),
             (SeriesPoint, MetricPoint.model_fields),
             (GateCheck, {*GateResult.model_fields, "name"}),  # name: the key of GateDecision.checks
             (ABMetric, {*MetricComparison.model_fields, "significant"})]  # significant: from the verdict
    for record, written in pairs:
        own = set(record.model_fields) - set(written)
        assert not own, f"{record.__name__} has fields the cycle never writes: {own}"


def chart_points(page: str, title: str) -> dict[str, list[float]]:
    """The data-x of every point of the chart titled `title` (its aria-label), by series."""
    chart = next(svg for svg in page.split("<svg")[1:] if f'aria-label="{title}' in svg)
    dom = Elements("<svg" + chart.split("</svg>")[0])
    points: dict[str, list[float]] = {}
    for tag, attributes, _ in dom.found:
        if tag == "circle" and "point" in attributes.get("class", ""):
            points.setdefault(attributes["data-series"], []).append(float(attributes["data-x"]))
    return points


def test_the_start_checkpoint_is_the_first_point_of_the_training_plots(tmp_path):
    """Step s trains on what the policy before it sampled, so the reward of the start's own samples is
    drawn at step 0, where the start's held-out eval is: both charts describe the same policy at each x."""
    page = render_report(write_training_run(tmp_path / "run", steps=6)).read_text()
    reward = chart_points(page, "Training reward")
    assert reward == {"run": [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]}
    held_out = chart_points(page, "Held-out pass rate")
    assert all(xs[0] == 0.0 for xs in held_out.values()) and set(held_out) == {"all families", "bugfix", "implement"}


def chart_values(page: str, title: str) -> dict[str, list[tuple[float, float]]]:
    """The (data-x, data-y) of every point of the chart titled `title`, by series."""
    chart = next(svg for svg in page.split("<svg")[1:] if f'aria-label="{title}' in svg)
    dom = Elements("<svg" + chart.split("</svg>")[0])
    points: dict[str, list[tuple[float, float]]] = {}
    for tag, attributes, _ in dom.found:
        if tag == "circle" and "point" in attributes.get("class", ""):
            points.setdefault(attributes["data-series"], []).append((float(attributes["data-x"]),
                                                                     float(attributes["data-y"])))
    return points


def test_the_draw_is_drawn_by_the_policy_that_sampled_it_and_older_runs_have_no_draw_charts(tmp_path):
    """The frontier share over steps, and the draw's estimated pass rate beside the measured one, each
    point at the policy that sampled the groups (step - 1), as the training reward is."""
    page = render_report(write_training_run(tmp_path / "run", steps=4)).read_text()
    frontier = chart_values(page, "Groups on the frontier")
    assert frontier == {"on the frontier (some passed, some failed)": [(0.0, 0.1), (1.0, 0.2), (2.0, 0.3),
                                                                         (3.0, 0.4)]}
    draw = chart_values(page, "The draw&#x27;s pass rate") or chart_values(page, "The draw's pass rate")
    assert draw["estimated when drawn"] == [(x, 0.5) for x in (0.0, 1.0, 2.0, 3.0)]
    assert draw["measured"] == [(0.0, 0.45), (1.0, 0.4), (2.0, 0.35), (3.0, 0.3)]
    older = render_report(write_training_run(tmp_path / "older", steps=4, draw=False)).read_text()
    assert "Groups on the frontier" not in older and "Training reward" in older


def training_row(page: str) -> list[str]:
    """The cells of the simulated-RL table's first row, as text."""
    row = page.split('<section id="training">')[1].split("<tbody><tr>")[1].split("</tr>")[0]
    return [re.sub(r"<[^>]+>", "", cell) for cell in re.findall(r"<td[^>]*>(.*?)</td>", row)]


def test_at_the_start_is_the_step_0_eval_or_says_there_was_none(tmp_path):
    run = write_training_run(tmp_path / "run", steps=6)
    assert training_row(render_report(run).read_text()) == ["run", "6", "0.2 [0.1, 0.3]", "0.5 [0.4, 0.6] (step 6)",
                                                           "—"]
    # a run whose first eval came after some training: that eval is not the start's pass rate
    rows = (run / "eval.jsonl").read_text().splitlines()
    (run / "eval.jsonl").write_text("\n".join(rows[1:]) + "\n")
    assert training_row(render_report(run).read_text())[2:4] == ["not evaluated at step 0", "0.5 [0.4, 0.6] (step 6)"]


def test_the_paired_change_of_a_finished_run_is_in_its_row(tmp_path):
    run = write_training_run(tmp_path / "run", steps=6)
    lift = {"before": 0.469, "after": 0.531, "diff": 0.0625, "ci": [0.01, 0.12], "tasks": 96, "gained": 9,
            "lost": 3, "significant": True}
    (run / "summary.json").write_text(json.dumps({"steps": 6, "lift": lift}))
    assert training_row(render_report(run).read_text())[4] == "+0.062 [+0.010, +0.120], 9 gained / 3 lost of 96: " \
                                                              "significant"
    (run / "summary.json").write_text(json.dumps({"steps": 6, "lift": None}))  # no start eval: no change
    data = build_report_data([run])
    assert data["training"][0]["lift"] is None and data["problems"] == []
    (run / "summary.json").write_text("[1, 2]")
    assert "no readable lift" in build_report_data([run])["problems"][0]


def test_versions_are_registry_versions_everywhere(demo_folder):
    """"vN" is a Registry version; a simulated-RL run counts learner steps, never "policy versions"."""
    page = render_report(demo_folder).read_text()
    assert "policy version" not in page.lower()
    assert re.findall(r"v\d+ → v\d+", page)  # the cycles' versions, as the Registry numbers them
    assert "learner step (0: the start checkpoint)" in page


def test_a_ray_runs_fleet_is_drawn_per_node_and_a_local_run_has_no_fleet_charts(tmp_path):
    run = write_training_run(tmp_path / "run", steps=4)
    assert "(Ray)" not in render_report(run).read_text()  # a local run writes no fleet.jsonl
    with open(run / "fleet.jsonl", "w") as f:  # train.py's lines: {"step", **RayRollouts.stats()}
        for step in range(1, 5):
            nodes = {node: {"worker": f"rollout-{i}", "live_sandboxes": step + i, "peak": 6, "queued": 0,
                            "queue_wait_ms_p99": 2.5 * step, "created_per_s": 1.0, "capacity": 6, "warm": 1,
                            "queue_wait_ms_p50": 1.0, "created_per_s_recent": 0.5 * i, "resumed_episodes": 0}
                     for i, node in enumerate(["7bddd57a", "0c1e2f3a"]) if step < 4 or i == 0}  # a node lost
            f.write(json.dumps({"step": step, "live_workers": len(nodes), "nodes": nodes,
                                "engines": {"engine-0": {"node": "7bddd57a", "version": step}}}) + "\n")
    page = render_report(run).read_text()
    live = chart_points(page, "Live sandboxes per node")
    assert live == {"node 7bddd57a": [1.0, 2.0, 3.0, 4.0], "node 0c1e2f3a": [1.0, 2.0, 3.0]}  # its gap is a gap
    assert set(chart_points(page, "Sandbox admission queue wait")) == {"node 7bddd57a", "node 0c1e2f3a"}
    assert chart_points(page, "Sandboxes created per second per node")
    assert build_report_data([run])["training"][0]["fleet"][0]["nodes"]["7bddd57a"]["live_sandboxes"] == 1


def test_each_steps_anatomy_is_drawn_stacked_with_the_stage_names_the_loop_writes(tmp_path):
    page = render_report(write_training_run(tmp_path / "run", steps=4)).read_text()
    loop = next(svg for svg in page.split("<svg")[1:] if 'aria-label="Where the wall time' in svg)
    dom = Elements("<svg" + loop.split("</svg>")[0])
    parts: dict[float, float] = {}
    for tag, attributes, _ in dom.found:
        if tag == "rect" and "stacked" in attributes.get("class", ""):
            step = float(attributes["data-x"])
            parts[step] = parts.get(step, 0.0) + float(attributes["data-value"])
    assert parts == pytest.approx({1: 0.66, 2: 0.64, 3: 0.66, 4: 0.64})  # the parts add up to time/step
    for title in ("Engine wall time behind each step", "Engine throughput", "Episode-seconds behind each step"):
        assert f'aria-label="{title}' in page
    assert chart_points(page, "Engine throughput")["decode"] == [1.0, 2.0, 3.0, 4.0]
    # the report's stage names are the loop's (report/ may not import rl/, so they are written twice)
    from flywheel.rl import train  # noqa: PLC0415  (torch: only this test imports it, here)

    assert tuple(LOOP_STAGES) == train.LOOP_STAGES
    assert set(ENGINE_STAGES) | set(EPISODE_STAGES) == set(train.ROLLOUT_STAGES)
