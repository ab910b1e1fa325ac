"""Experiment tracking: a run's metrics and eval tables to the trackers its users already run.

    [tracking]                      in train.toml, bootstrap.toml or live.toml (each optional, off by default)
    tensorboard = true              event files under DIR/tensorboard   (`tensorboard --logdir DIR/tensorboard`)
    wandb = true                    Weights & Biases; offline unless WANDB_MODE says otherwise: DIR/wandb holds
                                    the run (`wandb sync DIR/wandb/offline-run-*` uploads it later; no account
                                    is needed to write it)
    mlflow = true                   MLflow's local store: DIR/mlflow.db (SQLite; MLflow 3 keeps its file store in
                                    maintenance) and DIR/mlartifacts
                                    (`mlflow ui --backend-store-uri sqlite:///DIR/mlflow.db`)

`metrics.jsonl`, `eval.jsonl` and the cycle reports stay the records; a tracker gets a copy of the
same rows: `Tracker.log(metrics, step)` takes the numbers of a row (nested dicts flattened with
"/", non-finite values and non-numbers left out, as the trackers would refuse them) and
`Tracker.table(name, rows, step)` an eval table (one dict per row). DIR is the config's `dir`, by
default `<run folder>/tracking`. Each backend is imported only when selected, so a run that tracks
nothing pays nothing. W&B keeps one active run per process (its library's global state): a process
opens one tracked run at a time.

Who logs what: `flywheel.rl.train` each learner step's metrics and each held-out eval (numbers and
the per-family table), `flywheel.rl.bootstrap` the SFT and eval summary, `flywheel.live.cycle` each
cycle's gate, A/B and training figures.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from flywheel.extras import require


class TrackingConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tensorboard: bool = False
    wandb: bool = False
    mlflow: bool = False
    dir: Path | None = None  # default: <run folder>/tracking
    project: str = "flywheel"  # the W&B project and the MLflow experiment
    run_name: str | None = None  # default: the run folder's name

    @property
    def enabled(self) -> bool:
        return self.tensorboard or self.wandb or self.mlflow


def flatten(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """The finite numbers of `metrics`, nested dicts as "outer/inner" (bools as 0/1)."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, f"{name}/"))
        elif isinstance(value, bool | int | float) and math.isfinite(float(value)):
            out[name] = float(value)
    return out


class Tracker:
    """The selected trackers of one run; `log`, `table`, then `close` (or use it as a context manager)."""

    def __init__(self, config: TrackingConfig, run_dir: Path, params: Mapping[str, Any] | None = None):
        self.config = config
        self.dir = config.dir or run_dir / "tracking"
        name = config.run_name or Path(run_dir).resolve().name
        params = json.loads(json.dumps(params or {}, default=str))  # plain JSON: paths and enums as text
        self._tb = self._wandb = self._mlflow = None
        self._mlflow_run = ""
        if not config.enabled:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        if config.tensorboard:
            require("tensorboard", "[tracking] tensorboard = true")
            from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415  (only when selected: ~2 s)

            self._tb = SummaryWriter(log_dir=str(self.dir / "tensorboard"))
            self._tb.add_text("config", f"```\n{json.dumps(params, indent=2)}\n```", 0)
        if config.wandb:
            wandb = require("wandb", "[tracking] wandb = true")

            # Offline unless the user chose otherwise: writing a run needs no account or network.
            mode = os.environ.get("WANDB_MODE", "offline")
            self._wandb = wandb.init(project=config.project, name=name, dir=str(self.dir), config=params,
                                     mode=mode, reinit="finish_previous")
        if config.mlflow:
            require("mlflow", "[tracking] mlflow = true")
            from mlflow.tracking import MlflowClient  # noqa: PLC0415  (only when selected: ~10 s to import)

            self._mlflow = MlflowClient(tracking_uri=mlflow_uri(self.dir))
            experiment = self._mlflow.get_experiment_by_name(config.project)
            experiment_id = (experiment.experiment_id if experiment is not None else self._mlflow.create_experiment(
                config.project, artifact_location=(self.dir / "mlartifacts").resolve().as_uri()))
            self._mlflow_run = self._mlflow.create_run(experiment_id, run_name=name).info.run_id
            for key, value in flatten(params).items():
                self._mlflow.log_param(self._mlflow_run, key[:250], value)

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        values = flatten(metrics)
        if not values or not self.config.enabled:
            return
        if self._tb is not None:
            for key, value in values.items():
                self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(values, step=step)
        if self._mlflow is not None:
            from mlflow.entities import Metric  # noqa: PLC0415

            now = int(time.time() * 1000)
            metrics_batch = [Metric(_mlflow_key(k), v, now, step) for k, v in values.items()]
            for i in range(0, len(metrics_batch), 1000):  # MLflow takes at most 1000 metrics per batch
                self._mlflow.log_batch(self._mlflow_run, metrics=metrics_batch[i:i + 1000])

    def table(self, name: str, rows: Sequence[Mapping[str, Any]], step: int) -> None:
        """An eval table: TensorBoard as a markdown table, W&B as a wandb.Table, MLflow as a JSON table."""
        if not rows or not self.config.enabled:
            return
        columns = list(dict.fromkeys(k for row in rows for k in row))
        data = [[_cell(row.get(c)) for c in columns] for row in rows]
        if self._tb is not None:
            lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
            lines += ["| " + " | ".join(str(v) for v in row) + " |" for row in data]
            self._tb.add_text(name, "\n".join(lines), step)
            self._tb.flush()
        if self._wandb is not None:
            wandb = require("wandb", "[tracking] wandb = true")

            self._wandb.log({name: wandb.Table(columns=columns, data=data)}, step=step)
        if self._mlflow is not None:
            self._mlflow.log_dict(self._mlflow_run, {"columns": columns, "data": data},
                                  f"tables/{name}-step{step:06d}.json")

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        if self._mlflow is not None:
            self._mlflow.set_terminated(self._mlflow_run)
            self._mlflow = None

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def mlflow_uri(tracking_dir: Path) -> str:
    """The MLflow tracking URI of a run's tracking folder (its SQLite store)."""
    return f"sqlite:///{(tracking_dir / 'mlflow.db').resolve()}"


def eval_table(report: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The per-family rows of an eval report (`flywheel.agent.evaluate`), family first."""
    return [{"family": family, **{k: v for k, v in row.items() if not isinstance(v, Mapping | list)}}
            for family, row in report.get("per_family", {}).items()]


def _cell(value: Any) -> Any:
    return value if isinstance(value, str | int | float | bool) or value is None else json.dumps(value, default=str)


def _mlflow_key(key: str) -> str:
    # MLflow keys allow letters, digits, _ - . space / only
    return "".join(c if c.isalnum() or c in "_-. /" else "_" for c in key)[:250]
