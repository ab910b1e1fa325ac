"""Kills at random moments of a real `flywheel train` run, for tests/rl/test_faults.py and bench/faults.py.

    trial = KilledRun(config, rng).run(kills=3)     the driver (`python -m flywheel train`, a process of
                                                    its own) SIGKILLed at random moments, restarted each time,
                                                    then run to its end
    trial.violations                                flywheel/rl/audit.py's verdict on the records

A kill moment is drawn as a step and a fraction of a step: the kill lands that far into the step
after the drawn one has finished (steps are timed as the run goes), so kills fall across rollouts,
the learner step, the weight update and the checkpoint's write alike. Before each restart the run
folder's lost samples are taken (`lost_samples`): what the policies newer than the checkpoint
sampled, which the resumed run must not train on. Nothing is mocked: the real CLI, engine,
sandboxes, grading and Learner.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flywheel.rl.audit import LostSamples, audit, lost_samples, trained_steps
from flywheel.rl.run_folder import RunFolder
from flywheel.rl.train import TrainConfig

REPO = Path(__file__).resolve().parents[2]


def overrides(data: Mapping[str, Any], prefix: str = "") -> Iterator[str]:
    """A config's values as `flywheel train --set` items (TOML literals), tables flattened to dotted keys."""
    for key, value in data.items():
        if isinstance(value, Mapping):
            yield from overrides(value, f"{prefix}{key}.")
        elif value is not None:
            yield f"{prefix}{key}={json.dumps(value)}"


@dataclass
class Kill:
    kind: str  # "drawn": at a drawn moment; "lost policy": once a record holds a token newer than the checkpoint
    after_step: int  # steps the run had finished when the kill's step began (the run's own count)
    fraction: float  # how far into the next step it landed, in steps
    at_s: float  # seconds since the driver started
    resumes_at: int  # the policy version of the checkpoint the next start resumes at
    lost_records: int  # records holding tokens of policies newer than that
    recovery_s: float | None = None  # from the kill to the resumed run's next finished step


@dataclass
class KilledRun:
    """One run of `config` whose driver is killed at random moments drawn from `rng`."""
    config: TrainConfig
    rng: random.Random
    timeout_s: float = 300.0
    kills: list[Kill] = field(default_factory=list)
    lost: list[LostSamples] = field(default_factory=list)
    logs: list[str] = field(default_factory=list)

    @property
    def run_dir(self) -> Path:
        return self.config.run_dir

    def command(self) -> list[str]:
        data = self.config.model_dump(mode="json", exclude_defaults=True)
        return [sys.executable, "-m", "flywheel", "train", *(f"--set={item}" for item in overrides(data))]

    def start(self) -> subprocess.Popen:
        env = {**os.environ, "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        with open(self._log(), "w") as log:  # the child holds its own copy of the descriptor
            return subprocess.Popen(self.command(), cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)

    def run(self, kills: int, targeted: int = 0) -> KilledRun:
        """Kill the driver `kills` times, then let it finish; raises if the last start fails or the run
        hangs. The first `targeted` kills wait for the moment of a lost policy instead of a drawn one:
        a record on disk holds a token newer than the checkpoint (the engines sample with a policy
        whose checkpoint is not written yet)."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + self.timeout_s
        run, killed_at = RunFolder(self.run_dir), None
        while True:
            proc, started = self.start(), time.monotonic()
            lines = len(run.read("metrics.jsonl"))
            done = len(trained_steps(run))
            # the kill's step: one that leaves at least one to train after it, `fraction` of a step into it
            after = self.rng.randrange(done, max(done + 1, self.config.orchestrator.max_steps - 1))
            fraction, kill_at = self.rng.random(), None
            last, aimed = len(self.kills) == kills, len(self.kills) < targeted
            while proc.poll() is None:
                now = time.monotonic()
                if now > deadline:
                    proc.kill()
                    raise TimeoutError(f"the run did not finish within {self.timeout_s:.0f} s; see its logs")
                if killed_at is not None and len(run.read("metrics.jsonl")) > lines:
                    self.kills[-1].recovery_s = now - killed_at  # the resumed run's first step is done
                    killed_at = None
                if not last and kill_at is None and (lost_samples(self.run_dir).records if aimed else
                                                     self._training(proc) and len(trained_steps(run)) >= after):
                    kill_at = now + (0.0 if aimed else fraction * step_seconds(run))
                if kill_at is not None and now >= kill_at:
                    proc.send_signal(signal.SIGKILL)
                    proc.wait()
                    killed_at = time.monotonic()
                    samples = lost_samples(self.run_dir)  # before the restart reads the folder
                    self.lost.append(samples)
                    self.kills.append(Kill("lost policy" if aimed else "drawn", after, fraction, killed_at - started,
                                           samples.resumes_at, samples.records))
                    break
                time.sleep(0.02)
            else:
                if proc.returncode != 0:
                    raise RuntimeError(f"the run exited {proc.returncode}; see {self.run_dir.parent}/*.log")
                return self

    def _training(self, proc: subprocess.Popen) -> bool:
        """Whether this start of the driver has set up and resumed (its "training v..." line)."""
        return "\ntraining v" in "\n" + self._log().read_text()

    def _log(self) -> Path:
        return self.run_dir.parent / f"{self.run_dir.name}-driver-{len(self.kills)}.log"

    @property
    def violations(self) -> list[str]:
        o = self.config.orchestrator
        return audit(self.run_dir, self.lost, o.staleness_bound, o.group_size)


def step_seconds(run: RunFolder, default: float = 1.0) -> float:
    """The run's median step so far (wall time between metrics lines), `default` before two lines."""
    times = sorted(row["time"] for row in trained_steps(run).values() if "time" in row)
    gaps = sorted(b - a for a, b in zip(times, times[1:], strict=False) if b > a)
    return gaps[len(gaps) // 2] if gaps else default
