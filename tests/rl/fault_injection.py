"""Kills at random moments of a real `flywheel train` run, for tests/rl/test_faults.py, tests/rl/test_ray.py
and bench/faults.py.

    trial = KilledRun(config, rng).run(kills=3)     the driver (`python -m flywheel train`, a process of
                                                    its own) SIGKILLed at random moments, restarted each time,
                                                    then run to its end
    trial.violations                                flywheel/rl/audit.py's verdict on the records
    faults = ActorFaults(run_dir, cluster, rng)     on a Ray run in this process: a thread that kills the
    faults.start(["learner", "pool", "node"])       learner actor, a rollout worker, an engine, a node's sandbox
    train(config, log=faults.log)                   pool or a whole node, each at a random moment; `log` takes
                                                    the lost samples when the learner's death restarts the run

A kill moment is drawn as a step and a fraction of a step: the kill lands that far into the step
after the drawn one has finished (steps are timed as the run goes), so kills fall across rollouts,
the learner step, the weight update and the checkpoint's write alike. Before each restart the run
folder's lost samples are taken (`lost_samples`): what the policies newer than the checkpoint
sampled, which the resumed run must not train on. Nothing is mocked: the real CLI, engine,
sandboxes, grading and Learner.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from flywheel.rl.audit import LostSamples, audit, lost_samples, trained_steps
from flywheel.rl.run_folder import RunFolder
from flywheel.rl.train import TrainConfig

REPO = Path(__file__).resolve().parents[2]


def fault_seed() -> int:
    """The seed of a test's random kill moments: FLYWHEEL_FAULT_SEED when set (to replay a failure),
    else a new one. Printed, so that pytest shows it with any failure."""
    seed = int(os.environ.get("FLYWHEEL_FAULT_SEED") or random.randrange(2**32))
    print(f"FLYWHEEL_FAULT_SEED={seed}")
    return seed


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
        with open(self._log(), "w") as log:  # the child holds its own copy of the descriptor (its output: `_log()`)
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


def _stat(pid: int | str) -> list[str]:
    """/proc/PID/stat's fields after the command name: [state, ppid, pgrp, ...]."""
    return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()


def _children(parent: int, marker: bytes) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if int(_stat(entry.name)[1]) == parent and marker in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except (OSError, IndexError, ValueError):  # it exited meanwhile
            continue
    return found


def engine_processes(parent: int) -> list[int]:
    """The pids of `parent`'s ProcessEngine children (spawned: `multiprocessing.spawn` in their command)."""
    return _children(parent, b"multiprocessing.spawn")


def vllm_servers(parent: int) -> list[int]:
    """The pids of the vLLM API servers `parent` started, each the leader of its process group
    (flywheel/model/vllm_server.py)."""
    return _children(parent, b"vllm.entrypoints.openai.api_server")


def process_group(pgid: int) -> list[int]:
    """The live processes of process group `pgid` (a vLLM server: its API server, engine core, ...)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int(_stat(entry.name)[2]) == pgid and _stat(entry.name)[0] != "Z":
                found.append(int(entry.name))
        except (OSError, IndexError, ValueError):
            continue
    return found


@dataclass
class EngineKill:
    after_step: int  # steps the run had finished when the kill's step began
    fraction: float  # how far into the next step it landed, in steps
    pid: int  # the engine process killed (vLLM: the server's API server, the leader of its group)
    recovery_s: float | None = None  # from the kill to the next finished step
    process: str = ""  # the process killed, by its name (vLLM: one of the server's, drawn)


@dataclass
class EngineKilledRun:
    """One run of `config` (a `separate_process` engine, or `engine.backend = "vllm"` with servers of
    its own) whose engine process, not the driver, is SIGKILLed at random moments drawn from `rng`:
    the driver starts another in its place and goes on. With vLLM a server is drawn, and one of its
    processes (the API server, the engine core, ...): a crash of any of them takes the server down."""
    config: TrainConfig
    rng: random.Random
    timeout_s: float = 300.0
    kills: list[EngineKill] = field(default_factory=list)

    def run(self, kills: int) -> EngineKilledRun:
        killed = KilledRun(self.config, self.rng, self.timeout_s)
        self.config.run_dir.mkdir(parents=True, exist_ok=True)
        run = RunFolder(self.config.run_dir)
        proc = killed.start()
        until = functools.partial(self._until, proc, time.monotonic() + self.timeout_s)
        vllm = self.config.engine.backend == "vllm"
        find, count = (vllm_servers, self.config.engine.vllm.servers) if vllm else (engine_processes, 1)
        try:
            while len(self.kills) < kills and proc.poll() is None:
                after = min(len(trained_steps(run)) + self.rng.randrange(2), self.config.orchestrator.max_steps - 2)
                fraction = self.rng.random()
                until(lambda after=after: killed._training(proc) and len(trained_steps(run)) >= after)
                time.sleep(fraction * step_seconds(run))
                until(lambda: len(find(proc.pid)) == count)  # none dead and not yet replaced
                pid = self.rng.choice(find(proc.pid))
                # vLLM: any of the server's processes whose death takes it down (its resource tracker's does not)
                victim = self.rng.choice([p for p in process_group(pid) if _name(p) != "resource tracker"]
                                         or [pid]) if vllm else pid
                name = _name(victim)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(victim, signal.SIGKILL)
                at, lines = time.monotonic(), len(run.read("metrics.jsonl"))
                self.kills.append(EngineKill(after, fraction, pid, process=name))
                # replaced, and the next step done; a kill in the run's last step may see it end first
                until(lambda pid=pid: proc.poll() is not None or (pid not in (alive := find(proc.pid))
                                                                  and len(alive) == count))
                until(lambda lines=lines: proc.poll() is not None or len(run.read("metrics.jsonl")) > lines)
                if len(run.read("metrics.jsonl")) > lines:
                    self.kills[-1].recovery_s = time.monotonic() - at
                if vllm and self.rng.random() < 0.5:  # else the next kill may find a replacement still starting
                    until(lambda: proc.poll() is not None or all(_serving(p) for p in find(proc.pid)))
            until(lambda: proc.poll() is not None)
        except RunEnded:  # done before the moment waited for: fewer kills (the caller counts them)
            pass
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if proc.returncode != 0:
            raise RuntimeError(f"the run exited {proc.returncode}; see {killed._log()}")
        return self

    def _until(self, proc: subprocess.Popen, deadline: float, ready: Any) -> None:
        while not ready():
            if proc.poll() is not None and not ready():
                cls = RunEnded if proc.returncode == 0 else RuntimeError
                raise cls(f"the run exited {proc.returncode} after {len(self.kills)} engine kills, before "
                          "the moment it was waited for")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the run did not finish within {self.timeout_s:.0f} s")
            time.sleep(0.02)

    @property
    def violations(self) -> list[str]:
        o = self.config.orchestrator
        return audit(self.config.run_dir, [], o.staleness_bound, o.group_size)


class RunEnded(RuntimeError):
    """The run finished (exit 0) before the moment a kill waited for."""


def _serving(pid: int) -> bool:
    """Whether the vLLM API server `pid` answers its /health (its port read from its command line)."""
    try:
        argv = (Path("/proc") / str(pid) / "cmdline").read_bytes().split(b"\0")
        port = int(argv[argv.index(b"--port") + 1])
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2.0).status_code == 200
    except (OSError, ValueError, IndexError, httpx.HTTPError):
        return False


def _name(pid: int) -> str:
    """A process's name (vLLM names its engine core and workers); for a plain interpreter, what it runs."""
    try:
        name = (Path("/proc") / str(pid) / "comm").read_text().strip()
        if name.startswith("python"):
            argv = (Path("/proc") / str(pid) / "cmdline").read_bytes().split(b"\0")
            runs = next((a.decode() for a in argv[1:] if a and not a.startswith(b"-")), "")
            known = {"vllm.entrypoints": "api server", "resource_tracker": "resource tracker",
                     "multiprocessing": "spawned child"}
            name = next((label for key, label in known.items() if key in runs), runs[:40] or name)
        return name
    except OSError:
        return ""


def step_seconds(run: RunFolder, default: float = 1.0) -> float:
    """The run's median step so far (wall time between metrics lines), `default` before two lines."""
    times = sorted(row["time"] for row in trained_steps(run).values() if "time" in row)
    gaps = sorted(b - a for a, b in zip(times, times[1:], strict=False) if b > a)
    return gaps[len(gaps) // 2] if gaps else default


# The named actors of a Ray run, by the prefix of their names (flywheel/rl/ray_backend.py, ray_fleet.py).
ACTOR_PREFIX = {"learner": "learner-", "worker": "rollout-", "engine": "engine-", "pool": "sandbox-fleet-"}


def named_actors(prefix: str) -> list:
    """The live actors whose name starts with `prefix` ("rollout-", "learner-"), by name."""
    import ray  # noqa: PLC0415 - only the Ray faults need it

    found = ray.util.list_named_actors(all_namespaces=True)
    return [ray.get_actor(a["name"], namespace=a["namespace"]) for a in sorted(found, key=lambda a: a["name"])
            if a["name"].startswith(prefix)]


@dataclass
class ActorFault:
    kind: str  # learner, worker, engine, pool (a node's sandbox pool actor) or node (its raylet and all on it)
    after_step: int  # steps the run had finished when it was dealt
    at: float  # time.monotonic() when dealt
    target: str  # the actor's name, or the node's id
    recovery_s: float | None = None  # from the fault to the next finished step


@dataclass
class ActorFaults:
    """Kills parts of a Ray run that `train` drives in this process, at random moments drawn from
    `rng` (a step, then a fraction of a step into it; the learner once a record holds a token newer
    than the checkpoint, the moment a lost policy costs the most). `removed` counts the nodes
    removed, for the caller to add back. Pass `log` to `train`: when the learner's death restarts
    the run, it takes the lost samples before the resume reads the folder."""
    run_dir: Path
    cluster: Any  # ray.cluster_utils.Cluster, for node faults
    rng: random.Random
    faults: list[ActorFault] = field(default_factory=list)
    lost: list[LostSamples] = field(default_factory=list)
    logs: list[str] = field(default_factory=list)
    errors: list[BaseException] = field(default_factory=list)
    removed: int = 0  # nodes removed and not added back
    stopped: threading.Event = field(default_factory=threading.Event)  # `stop`: the run is over, deal no more

    def log(self, line: str) -> None:
        self.logs.append(line)
        if "restarting from" in line:  # the learner died: the run closed, and resumes after this returns
            self.lost.append(lost_samples(self.run_dir))

    def start(self, kinds: Sequence[str]) -> threading.Thread:
        thread = threading.Thread(target=self._deal, args=(list(kinds),), name="faults", daemon=True)
        thread.start()
        return thread

    def _deal(self, kinds: list[str]) -> None:
        run = RunFolder(self.run_dir)
        try:
            for kind in kinds:
                if kind == "learner":
                    self._until(lambda: lost_samples(self.run_dir).records > 0)
                else:
                    after = len(trained_steps(run)) + self.rng.randrange(2)
                    self._until(lambda after=after: len(trained_steps(run)) >= after and _playing(self.run_dir))
                    time.sleep(self.rng.random() * step_seconds(run))
                self.faults.append(ActorFault(kind, len(trained_steps(run)), time.monotonic(), self._kill(kind)))
                lines = len(run.read("metrics.jsonl"))
                self._until(lambda lines=lines: len(run.read("metrics.jsonl")) > lines)
                self.faults[-1].recovery_s = time.monotonic() - self.faults[-1].at
        except BaseException as exc:  # noqa: BLE001 - the test asserts on it
            self.errors.append(exc)

    def stop(self, dealer: threading.Thread) -> None:
        """The run is over: a fault not dealt yet is not dealt later (in whatever runs next)."""
        self.stopped.set()
        dealer.join(timeout=60)

    def _until(self, ready: Any, timeout_s: float = 180.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            if self.stopped.is_set():
                raise RuntimeError(f"the run ended before the moment of fault {len(self.faults) + 1}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the run did not reach the moment of fault {len(self.faults) + 1} in time")
            time.sleep(0.02)

    def _kill(self, kind: str) -> str:
        """Kill one live actor of `kind` (or the node of a live rollout worker); returns its name (node id)."""
        import ray  # noqa: PLC0415

        deadline = time.monotonic() + 60.0
        while time.monotonic() < deadline:  # an actor that died a moment ago is still listed: try the next
            found = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                           if a["name"].startswith(ACTOR_PREFIX["worker" if kind == "node" else kind]))
            for name in self.rng.sample(found, len(found)):
                try:
                    actor = named_actors(name)[0]
                    if kind == "node":
                        # a replacement still starting (importing torch) answers only once started
                        node_id = ray.get(actor.where.remote(), timeout=2)["node_id"]
                        node = next(n for n in self.cluster.list_all_nodes() if n.node_id == node_id)
                        self.cluster.remove_node(node)
                        self.removed += 1  # the caller adds it back on its main thread (Ray nodes set signal handlers)
                        return node_id
                    ray.kill(actor, no_restart=True)
                    return name
                except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError, ValueError, IndexError):
                    continue  # the next one
            time.sleep(0.2)
        raise RuntimeError(f"no live {kind} to kill in 60 s")


def _playing(run_dir: Path) -> bool:
    """Whether episodes are in flight (a saved state exists): a fault then lands mid-episode."""
    inflight = run_dir / "inflight"
    return inflight.exists() and any(inflight.glob("*.json"))
