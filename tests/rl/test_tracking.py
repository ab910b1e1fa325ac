"""Experiment tracking: a run's metrics and eval table written to TensorBoard, W&B (offline, no
account) and MLflow's local store, then read back from what each wrote on disk; and what the
bootstrap and a live cycle log, read back from each tracker as they wrote it."""

from __future__ import annotations

import glob
import json
import struct
from pathlib import Path

import pytest

from flywheel.rl.tracking import Tracker, TrackingConfig, eval_table, flatten, mlflow_uri

STEPS = [{"loss": 0.5, "reward_mean": -0.25, "staleness": {"0": 10, "1": 2}, "note": "text", "nan": float("nan")},
         {"loss": 0.25, "reward_mean": 0.5, "staleness": {"0": 12, "1": 0}}]
REPORT = {"pass_rate": 0.5, "per_family": {"bugfix": {"pass_rate": 0.75, "n": 4}, "implement": {"pass_rate": 0.25,
                                                                                               "n": 4}}}


def test_flatten_keeps_finite_numbers_and_names_nested_ones():
    assert flatten(STEPS[0]) == {"loss": 0.5, "reward_mean": -0.25, "staleness/0": 10.0, "staleness/1": 2.0}


def test_nothing_selected_writes_nothing(tmp_path):
    with Tracker(TrackingConfig(), tmp_path) as tracker:
        tracker.log(STEPS[0], 1)
        tracker.table("eval", eval_table(REPORT), 1)
    assert list(tmp_path.iterdir()) == []


def _wandb_records(path: Path) -> list:
    """The protobuf records of a W&B run file: a LevelDB-style log (32 KiB blocks; each chunk a
    7-byte header of crc32, length, kind; FULL=1, FIRST=2, MIDDLE=3, LAST=4) after a 7-byte header."""
    from wandb.proto import wandb_internal_pb2  # noqa: PLC0415

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, raw, partial = 7, 32768, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # the block's tail is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 1:
            raw.append(chunk)
        elif kind in (2, 3):
            partial = (b"" if kind == 2 else partial) + chunk
        elif kind == 4:
            raw.append(partial + chunk)
    records = []
    for blob in raw:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(blob)
        records.append(record)
    return records


@pytest.mark.slow
def test_each_tracker_holds_the_logged_metrics_and_the_eval_table(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    config = TrackingConfig(tensorboard=True, wandb=True, mlflow=True, run_name="tracked")
    with Tracker(config, tmp_path, params={"lr": 1e-4, "run_dir": tmp_path}) as tracker:
        for step, metrics in enumerate(STEPS, start=1):
            tracker.log(metrics, step)
        tracker.table("eval", eval_table(REPORT), 2)
    root = tmp_path / "tracking"

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: PLC0415

    events = EventAccumulator(str(root / "tensorboard"), size_guidance={"tensors": 0, "scalars": 0}).Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 0.5), (2, 0.25)]
    assert [e.value for e in events.Scalars("staleness/0")] == [10, 12]
    assert "nan" not in events.Tags()["scalars"] and "note" not in events.Tags()["scalars"]
    text = events.Tensors("eval/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "| bugfix | 0.75 | 4 |" in text

    (run_file,) = glob.glob(str(root / "wandb" / "offline-run-*" / "run-*.wandb"))
    history = [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
               for r in _wandb_records(Path(run_file)) if r.WhichOneof("record_type") == "history"]
    assert [(h["_step"], h["loss"]) for h in history if "loss" in h] == [(1, 0.5), (2, 0.25)]
    assert [h["staleness/1"] for h in history if "staleness/1" in h] == [2, 0]
    (table,) = [h for h in history if "eval/path" in h]
    table_json = json.loads((Path(run_file).parent / "files" / table["eval/path"]).read_text())
    assert table_json["columns"] == ["family", "pass_rate", "n"] and table_json["data"][0] == ["bugfix", 0.75, 4]

    from mlflow.tracking import MlflowClient  # noqa: PLC0415

    client = MlflowClient(tracking_uri=mlflow_uri(root))
    (run,) = client.search_runs([client.get_experiment_by_name("flywheel").experiment_id])
    assert run.info.run_name == "tracked" and run.info.status == "FINISHED" and run.data.params["lr"] == "0.0001"
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss")] == [(1, 0.5), (2, 0.25)]
    assert [m.value for m in client.get_metric_history(run.info.run_id, "staleness/0")] == [10, 12]
    stored = json.loads(Path(client.download_artifacts(run.info.run_id, "tables/eval-step000002.json",
                                                       str(tmp_path))).read_text())
    assert stored["data"] == [["bugfix", 0.75, 4], ["implement", 0.25, 4]]


# ---- read back what each tracker wrote: (step, value) per metric


def tensorboard_scalars(root: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: PLC0415

    events = EventAccumulator(str(root / "tensorboard"), size_guidance={"scalars": 0}).Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


def wandb_scalars(root: Path, key: str) -> list[tuple[int, float]]:
    (run_file,) = glob.glob(str(root / "wandb" / "offline-run-*" / "run-*.wandb"))
    history = [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
               for r in _wandb_records(Path(run_file)) if r.WhichOneof("record_type") == "history"]
    return [(h["_step"], h[key]) for h in history if key in h]


def mlflow_scalars(root: Path, run_name: str, key: str) -> list[tuple[int, float]]:
    from mlflow.tracking import MlflowClient  # noqa: PLC0415

    client = MlflowClient(tracking_uri=mlflow_uri(root))
    (run,) = client.search_runs([client.get_experiment_by_name("flywheel").experiment_id],
                                filter_string=f"attributes.run_name = '{run_name}'")
    assert run.info.status == "FINISHED"
    return [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]


def assert_every_tracker_holds(root: Path, run_name: str, expected: dict[str, list[tuple[int, float]]]) -> None:
    for key, points in expected.items():
        for tracker, read in (("tensorboard", tensorboard_scalars(root, key)), ("wandb", wandb_scalars(root, key)),
                              ("mlflow", mlflow_scalars(root, run_name, key))):
            # TensorBoard keeps float32: equal to the logged value within its precision
            assert [s for s, _ in read] == [s for s, _ in points], (tracker, key, read)
            assert [v for _, v in read] == pytest.approx([v for _, v in points], rel=1e-6), (tracker, key, read)


ALL = {"tensorboard": True, "wandb": True, "mlflow": True}


@pytest.mark.slow
def test_the_bootstrap_logs_its_sft_and_eval_summary_to_each_tracker(tmp_path, monkeypatch):
    from flywheel.env.pool import SandboxPool  # noqa: PLC0415
    from flywheel.model.registry import Registry  # noqa: PLC0415
    from flywheel.rl.bootstrap import BootstrapConfig, bootstrap  # noqa: PLC0415
    from flywheel.sim.expert import bootstrap_demonstrations  # noqa: PLC0415

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    config = BootstrapConfig.model_validate({
        "families": ["bugfix"], "train_tasks_per_family": 2, "eval_tasks_per_family": 1, "vocab_size": 400,
        "threads": 1, "run_dir": tmp_path / "run", "registry_root": tmp_path / "registry",
        "model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1, "head_dim": 16,
                  "num_experts": 4, "experts_per_token": 2, "moe_intermediate_size": 32},
        "sft": {"steps": 3, "warmup_steps": 1}, "episode": {"temperature": 0.0, "max_turns": 1,
                                                            "max_tokens_per_turn": 8},
        "tracking": {**ALL, "run_name": "bootstrapped"}})
    with SandboxPool(config.pool) as pool:
        demonstrations = bootstrap_demonstrations(config, pool)
    bootstrap(config, demonstrations, log=lambda line: None)
    report = json.loads((config.run_dir / "eval.json").read_text())
    with Registry(config.registry_root) as registry:
        metrics = registry.get("production").metrics  # what the bootstrap recorded with its checkpoint
    assert_every_tracker_holds(config.run_dir / "tracking", "bootstrapped", {
        "sft_loss_final": [(0, metrics["sft_loss_final"])], "eval/pass_rate": [(0, report["pass_rate"])],
        "eval/valid_tool_call_rate": [(0, report["valid_tool_call_rate"])]})


@pytest.mark.slow
def test_a_live_cycle_logs_its_report_to_each_tracker_as_a_run_of_its_own(tmp_path, monkeypatch):
    from flywheel.live.cycle import CycleState, LiveConfig, LiveCycle  # noqa: PLC0415
    from flywheel.live.store import LiveStore  # noqa: PLC0415
    from flywheel.model.registry import Registry  # noqa: PLC0415
    from tests.report.run_folders import cycle  # noqa: PLC0415

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    LiveStore(tmp_path / "live.sqlite").close()
    Registry(tmp_path / "registry").close()
    config = LiveConfig.model_validate({"loop": {"store": {"path": tmp_path / "live.sqlite",
                                                           "registry_root": tmp_path / "registry"}},
                                        "run_dir": tmp_path / "cycles", "tracking": {**ALL, "run_name": "live"}})
    live = LiveCycle(config, control=None, log=lambda line: None)
    done = cycle(3).model_dump(exclude={"schema_", "finished_at"})  # a finished cycle's figures
    state = CycleState.model_validate({**done, "first_production": 0, "since": 0.0, "events_at_start": 0,
                                       "stage": "done"})
    (tmp_path / "cycles" / "cycle-0003").mkdir(parents=True)  # the cycle's folder, made by its first stage
    report = live._report(state)  # what the cycle does last: report.json, report.html, the trackers
    assert_every_tracker_holds(tmp_path / "cycles" / "tracking", "live-cycle-0003", {
        "timings/train_s": [(3, report.timings["train_s"])], "timings/total_s": [(3, report.timings["total_s"])],
        "gate/decision/checks/pass_rate/diff": [(3, 0.01)], "ab/metrics/persistence/diff": [(3, 0.08)],
        "production_after": [(3, 3.0)]})
