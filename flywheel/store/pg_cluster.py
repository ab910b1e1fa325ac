"""A throwaway PostgreSQL cluster in a temporary folder, for tests and benchmarks (never for data you keep).

    with ThrowawayCluster() as cluster:          # initdb + pg_ctl start, as an unprivileged user
        url = cluster.new_schema_url()           # postgresql://flywheel@127.0.0.1:PORT/postgres?options=...

It uses the distribution's server binaries (Debian: `apt-get install postgresql` puts them in
/usr/lib/postgresql/VERSION/bin). initdb refuses to run as root, so as root the cluster runs as the
`postgres` system user (the package creates it) through `runuser`. It listens on 127.0.0.1 only,
trusts local connections (a throwaway), and keeps `fsync=on`, so a durability test measures real
durable commits. `new_schema_url` gives each test its own schema in the one database: a fresh,
empty store in ~1 ms, where CREATE DATABASE costs a checkpoint.
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

SUPERUSER = "flywheel"


def server_binaries() -> Path | None:
    """The newest /usr/lib/postgresql/*/bin holding initdb, or the folder of an `initdb` on PATH."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[-3]))
    if found:
        return Path(found[-1]).parent
    on_path = shutil.which("initdb")
    return Path(on_path).parent if on_path else None


class ThrowawayCluster:
    def __init__(self, bin_dir: Path | None = None, port: int | None = None):
        bin_dir = bin_dir or server_binaries()
        if bin_dir is None:
            raise FileNotFoundError("no PostgreSQL server binaries (initdb); install them with "
                                    "`apt-get install -y postgresql`, or set FLYWHEEL_PG_URL to a server you run")
        self.bin_dir, self.port = bin_dir, port or _free_port()
        self.folder = Path(tempfile.mkdtemp(prefix="flywheel-pg-"))
        self.data = self.folder / "data"
        self._as_user: list[str] = []
        if os.geteuid() == 0:
            shutil.chown(self.folder, "postgres", "postgres")
            self._as_user = ["runuser", "-u", "postgres", "--"]
        self.url = f"postgresql://{SUPERUSER}@127.0.0.1:{self.port}/postgres"
        self._postmaster: subprocess.Popen[bytes] | None = None

    def start(self) -> ThrowawayCluster:
        self._run("initdb", "-D", str(self.data), "-U", SUPERUSER, "-A", "trust", "-E", "UTF8", "--no-locale")
        self.restart()
        return self

    def restart(self, timeout_s: float = 60.0) -> None:
        """Start the server on the cluster's data (after `kill`: crash recovery replays the WAL first)
        and return once it accepts connections. The postmaster is this process's child (not pg_ctl's
        orphan), so that `kill` reaps it at once: a new postmaster refuses to start while the old
        one's pid still answers, and an orphan waits for whoever adopts it."""
        options = ["-c", "listen_addresses=127.0.0.1", "-c", f"port={self.port}", "-c",
                   f"unix_socket_directories={self.folder}", "-c", "fsync=on", "-c", "synchronous_commit=on",
                   "-c", "max_connections=200"]
        with open(self.folder / "server.log", "ab") as log:
            self._postmaster = subprocess.Popen([*self._as_user, str(self.bin_dir / "postgres"), "-D", str(self.data),
                                                 *options], stdout=log, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL, start_new_session=True)
        ready = [*self._as_user, str(self.bin_dir / "pg_isready"), "-q", "-h", "127.0.0.1", "-p", str(self.port)]
        deadline = time.monotonic() + timeout_s
        while subprocess.run(ready, check=False).returncode != 0:
            if self._postmaster.poll() is not None or time.monotonic() > deadline:
                tail = (self.folder / "server.log").read_text()[-2000:]
                raise RuntimeError(f"PostgreSQL did not start (exit {self._postmaster.poll()}):\n{tail}")
            time.sleep(0.02)

    def kill(self, timeout_s: float = 10.0) -> None:
        """SIGKILL the postmaster and every process it started, as a crash of the database host's
        PostgreSQL would (what was in its WAL buffers and not yet flushed is lost), and wait until
        none is left, so that `restart` can start it again."""
        postmaster = int((self.data / "postmaster.pid").read_text().split()[0])
        pids = [postmaster, *_children(postmaster)]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        assert self._postmaster is not None, "kill() a cluster this object started"
        self._postmaster.wait(timeout_s)  # reaped here (as root: `runuser` reaps it, and exits)
        deadline = time.monotonic() + timeout_s
        while any(_alive(pid) for pid in pids):  # a zombie backend holds no port or shared memory
            if time.monotonic() > deadline:
                raise RuntimeError(f"PostgreSQL's processes {pids} outlived SIGKILL for {timeout_s} s")
            time.sleep(0.005)

    def stop(self) -> None:
        if (self.data / "postmaster.pid").exists():
            self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")
        if self._postmaster is not None:
            self._postmaster.wait(30)
        shutil.rmtree(self.folder, ignore_errors=True)

    def new_schema_url(self, base_url: str | None = None) -> str:
        return new_schema_url(base_url or self.url)

    def __enter__(self) -> ThrowawayCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self, program: str, *args: str) -> None:
        result = subprocess.run([*self._as_user, str(self.bin_dir / program), *args], capture_output=True, text=True,
                                check=False)
        if result.returncode != 0:
            log = self.folder / "server.log"
            tail = log.read_text()[-2000:] if log.exists() else ""
            raise RuntimeError(f"{program} failed ({result.returncode}): {result.stderr.strip()}\n{tail}")


def new_schema_url(base_url: str) -> str:
    """A fresh schema in the database at `base_url`, and a URL whose connections use it (search_path)."""
    import psycopg  # noqa: PLC0415  (only callers with a PostgreSQL need the driver)

    name = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(base_url, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {name}")
    separator = "&" if "?" in base_url else "?"
    return f"{base_url}{separator}options=-csearch_path%3D{name}"


def _alive(pid: int) -> bool:
    """Running: a zombie (dead, not yet reaped by whoever adopted it) holds no port or shared memory."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (the postmaster's backends, its WAL writer, ...)."""
    found = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            fields = Path(stat).read_text().rsplit(")", 1)[1].split()
        except OSError:  # it exited meanwhile
            continue
        if int(fields[1]) == pid:
            found.append(int(Path(stat).parent.name))
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
