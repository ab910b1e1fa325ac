"""A run joins a cluster that `ray start --head` started (cluster.address), as a team with a cluster
runs it: a real head node on loopback, a real driver process, Ray's token authentication as the
head turns it on."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("ray")

RAY = str(Path(sys.executable).parent / "ray")
DRIVER = """
import sys
from flywheel.rl.cluster import ClusterConfig, start_cluster
with start_cluster(ClusterConfig(backend="ray", address=sys.argv[1]), log=print) as cluster:
    import ray

    @ray.remote(num_cpus=0.1)
    def square(x):
        return x * x

    @ray.remote(num_cpus=0.1)
    class Square:  # an actor: the cluster calls back its owner, this driver, which a wrong auth mode refuses
        def of(self, x):
            return x * x

    print("ran", ray.get(square.remote(7)), ray.get(Square.remote().of.remote(8)))
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
# ray start's default (the driver asks for token mode itself), a head started without it (the
# user's RAY_AUTH_MODE=disabled, for the head and the run alike), and a head without it while a
# stale token file from an earlier `ray start` lies in ~/.ray (the run must not ask for token mode)
@pytest.mark.parametrize("auth", ["token", "disabled", "stale"])
def test_a_run_joins_a_cluster_started_by_ray_start(tmp_path, auth):
    port = free_port()
    # HOME of their own: `ray start` writes its token to ~/.ray/auth_token, which must not outlive the test
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0",
           "HOME": str(tmp_path)}
    env.pop("RAY_AUTH_MODE", None)
    if auth != "token":
        env["RAY_AUTH_MODE"] = "disabled"
    if auth == "stale":
        (tmp_path / ".ray").mkdir()
        (tmp_path / ".ray" / "auth_token").write_text("a-token-this-cluster-never-had")
    log = open(tmp_path / "head.log", "w")  # noqa: SIM115 - closed with the head, below
    head = subprocess.Popen([RAY, "start", "--head", "--block", f"--port={port}", "--node-ip-address=127.0.0.1",
                             "--num-cpus=1", f"--object-store-memory={80 << 20}", "--include-dashboard=false",
                             "--disable-usage-stats"],
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline, out = time.monotonic() + 120, None
        while time.monotonic() < deadline:  # the head takes a few seconds to listen
            driver_env = {k: v for k, v in env.items() if not (auth == "stale" and k == "RAY_AUTH_MODE")}
            out = subprocess.run([sys.executable, "-c", DRIVER, f"127.0.0.1:{port}"], capture_output=True, text=True,
                                 env=driver_env, timeout=120)
            if out.returncode == 0 or head.poll() is not None:
                break
            time.sleep(2)
        assert out is not None and out.returncode == 0, out.stderr[-3000:] if out else "no driver ran"
        assert f"(joined 127.0.0.1:{port})" in out.stdout and "ran 49 64" in out.stdout, out.stdout
    finally:
        head.terminate()
        head.wait(timeout=120)
        log.close()
