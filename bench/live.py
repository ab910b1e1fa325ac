"""Live-server benchmark: event ingestion through the SDK per store backend and replica count, against
the raw database; completions committed per second per backend; the server's overhead per completion.

    python bench/live.py                        # full run (~2-3 min on 2 idle cores, plus the servers' starts)
    python bench/live.py --events 50000         # quicker
    python bench/live.py --only events --backends postgresql --replicas 2
    python bench/live.py --only harness         # one part: events, completions, overhead, streaming or harness

Prints one JSON object on stdout; progress goes to stderr.

Events: `flywheel serve` runs as its own process (as deployed) on a registry holding one
default-size model; the benchmark pre-stores completions, then emits `--events` feedback events
naming them through `EventClient` (batches of `--batch`) and times from the first emit until
`flush` returns, i.e. until the server has acknowledged every event after its durable commit
(synchronous FULL, as configured). The baseline inserts the same events straight into a fresh
SQLite file with the same schema, the same batch size and the same synchronous setting:
`events_vs_raw_sqlite` is the share of raw SQLite's rate the whole path (SDK, HTTP, JSON,
validation, completion lookup, commit) keeps. Target: events_per_s >= 20,000 on a 2-core VM.

Backends and replicas: the same run for each `--backends` (sqlite: run_dir/live.sqlite; postgresql:
FLYWHEEL_PG_URL, else a throwaway cluster with fsync on, a fresh schema per run) and `--replicas`
(1 or 2 `flywheel serve` processes on one store, the events split between them, each with its own
SDK client, timed until both have flushed). The PostgreSQL baseline inserts the same events straight
through psycopg with the store's statement (one unnest INSERT per batch, synchronous_commit on).
Completions (`--only completions`): completions/s that 1 and 16 request threads commit through one
store, now (`grouped`: LiveStore.add_completion as served, group commit, synchronous per backend:
FULL on PostgreSQL, NORMAL on SQLite; `grouped_full`: SQLite at FULL, which also survives power
loss) against before (`one_each`: one transaction per completion at synchronous NORMAL, PostgreSQL's
synchronous_commit off, the same checks per completion), alternated A/B `--rounds` times, medians;
then `--kills` kill -9s at random moments under 8 committing threads, per mode: of PostgreSQL (all
its processes, a throwaway cluster of the bench's own; then restarted, crash recovery included) and
of the SQLite store's host process, with the acknowledged completions missing afterwards (`acknowledged_lost`) and, for
PostgreSQL, the time from its restart to the first commit (the store reconnects by itself).

Streaming: the same request answered whole and streamed, alternating (a LiveServer in this process,
the default-size model, `--stream-tokens` tokens at T=1 with a seed): `ttft_ms` is the client's
time to the first content chunk, `inter_token_ms` the gaps between content chunks, against the
whole answer's time (the baseline: without streaming the first byte arrives with the last token).
`engine_process`: the same with the model in its own process (`engine.separate_process`), each
sampled token relayed to the server over the ProcessEngine's pipe.

Harness: one bugfix task played by the built-in runner and by mini-swe-agent through the harness
endpoint (flywheel/live/harness.py), both with the same scripted answers (`--harness-turns` test
runs, then the end), so the engine costs nothing and the figures are the loops' own:
`harness_overhead_per_turn_ms` is the harness's request-to-request time per turn (the command
through sandbox_exec, HTTP, litellm, the agent) less the built-in runner's time per turn;
`harness_startup_s` the harness process's start until its first request.

Overhead: a LiveServer in this process; each sample is one completion through HTTP (keep-alive,
the body the openai client sends) and one straight `submit` to the very engine the server uses,
same prompt, greedy, same length, alternating. `server_overhead_ms` is the difference of each pair;
`server_overhead_same_request_ms` subtracts the engine time the server measured for that very
request, which is immune to the engine's own variance. Target: p50 <= 5 ms. The figures include
the load of whatever else runs on the machine (`load_average` is reported).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import openai
import torch

from flywheel.client import EventClient
from flywheel.env.families import generate
from flywheel.live.records import Completion
from flywheel.live.server import LiveServer, ServeConfig, serve_in_thread
from flywheel.live.settings import LoopConfig
from flywheel.live.store import EVENT_COLUMNS, INSERT_COMPLETION, SCHEMA, LiveStore
from flywheel.model.chat import IM_END, SYSTEM_PROMPT, render_messages, tool_schemas
from flywheel.model.conversation import ConversationEncoder
from flywheel.model.engine import EngineConfig, SamplingParams
from flywheel.model.factory import ModelConfig, build_model
from flywheel.model.registry import PRODUCTION, Registry
from flywheel.model.tokenizer import train_tokenizer
from flywheel.store.database import StoreUnavailable, connect_url
from flywheel.store.pg_cluster import ThrowawayCluster, new_schema_url

REPO = Path(__file__).resolve().parents[1]
KEYS = {"bench-key": ["inference", "events", "admin"]}
FAMILIES = ("bugfix", "implement", "crossfile", "ambiguous")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def percentiles(ms: list[float]) -> tuple[float, float]:
    s = sorted(ms)
    return round(s[len(s) // 2], 3), round(s[min(len(s) - 1, int(0.99 * len(s)))], 3)


def conversations(n: int) -> list[list[dict]]:
    """First turns of real tasks: system prompt and the task's instruction."""
    tasks = [t for family in FAMILIES for t in generate(family, "train", n, seed=0)]
    return [[{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": t.instruction}] for t in tasks]


def build_registry(root: Path, chats: list[list[dict]]) -> None:
    tokenizer = train_tokenizer([render_messages(c, tool_schemas()) for c in chats], vocab_size=2048)
    Registry(root).register(build_model(ModelConfig(), tokenizer), tokenizer, aliases=[PRODUCTION])


def make_events(n: int, completions: list[Completion], seed: int) -> list[dict]:
    rng = random.Random(seed)
    kinds = [("edit_applied", {}), ("edit_persisted", {}), ("followup", {"dissatisfied": True}),
             ("followup", {"dissatisfied": False}), ("thumbs", {"up": True})]
    out = []
    for i in range(n):
        c = completions[rng.randrange(len(completions))]
        kind, payload = kinds[i % len(kinds)]
        out.append({"id": f"ev-{seed}-{i}", "type": kind, "session_id": c.session_id, "completion_id": c.id,
                    "time": 1e9 + i, "payload": payload})
    return out


def bench_raw_sqlite(path: Path, events: list[dict], batch: int) -> float:
    """Events/s inserting straight into SQLite: same schema, batch size and synchronous setting."""
    db = sqlite3.connect(str(path), isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=FULL")
    for statement in SCHEMA:
        db.execute(statement)
    t0 = time.perf_counter()
    for start in range(0, len(events), batch):
        db.execute("BEGIN IMMEDIATE")
        db.executemany(
            "INSERT OR IGNORE INTO events (id, type, session_id, completion_id, time, received_at, payload) VALUES (?, "
            "?, ?, ?, ?, ?, ?)",
            [(e["id"], e["type"], e["session_id"], e["completion_id"], e["time"], time.time(), json.dumps(e["payload"]))
             for e in events[start : start + batch]])
        db.execute("COMMIT")
    elapsed = time.perf_counter() - t0
    db.close()
    return len(events) / elapsed


def bench_raw_postgres(url: str, events: list[dict], batch: int) -> float:
    """Events/s inserting straight into PostgreSQL with the store's own batch statement, durable commits."""
    with LiveStore(url):  # the schema
        pass
    db = connect_url(url, "FULL")
    t0 = time.perf_counter()
    for start in range(0, len(events), batch):
        with db.transaction():
            db.insert_new("events", EVENT_COLUMNS, "id", [
                (e["id"], e["type"], e["session_id"], e["completion_id"], e["time"], time.time(),
                 json.dumps(e["payload"]), e.get("org_id") or "") for e in events[start : start + batch]])
    elapsed = time.perf_counter() - t0
    db.close()
    return len(events) / elapsed


def completion_record(cid: str) -> Completion:
    return Completion(id=cid, session_id=f"s{hash(cid) % 50}", user_id="u", version=0, prompt_ids=list(range(64)),
                      completion_ids=list(range(16)), logprobs=[-0.1] * 16, latency_ms=1.0, created_at=time.time())


class CompletionWriter:
    """How a server commits completions, from many request threads on one store:
    "grouped": LiveStore.add_completion as served now (synchronous FULL, group commit);
    "one_each": one transaction per completion at synchronous NORMAL on the store's one connection
    under its lock, as completions were committed before (PostgreSQL: synchronous_commit off).
    Both on the same (reconnecting) backend, so the kill runs compare durability alone."""

    def __init__(self, location: str | Path, mode: str):
        self.mode = mode
        # the schema; "grouped" commits through it, "grouped_full" with an fsync per commit on SQLite too
        self.store = LiveStore(location, completions_synchronous="FULL" if mode == "grouped_full" else None)
        self._db = connect_url(location, "NORMAL") if mode == "one_each" else None
        self._lock = threading.Lock()

    def commit(self, c: Completion) -> None:
        if self._db is None:
            self.store.add_completion(c)
            return
        row = self.store.completion_row(c)  # the same checks as add_completion
        with self._lock, self._db.transaction("NORMAL"):
            self._db.execute(INSERT_COMPLETION, row)

    def close(self) -> None:
        self.store.close()
        if self._db is not None:
            self._db.close()


def bench_completions(location: str | Path, n: int, concurrency: int, mode: str) -> float:
    """Completions/s that `concurrency` request threads commit through one store, `mode` as CompletionWriter."""
    writer = CompletionWriter(location, mode)
    shares = [[completion_record(f"{mode}-{t}-{i}") for i in range(n // concurrency)] for t in range(concurrency)]
    threads = [threading.Thread(target=lambda share=share: [writer.commit(c) for c in share]) for share in shares]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    writer.close()
    return sum(len(share) for share in shares) / elapsed


def bench_completion_throughput(backend: str, fresh: Any, run_dir: Path, n: int, rounds: int) -> dict:
    """Before (one_each) and now (grouped), alternated A/B `rounds` times, at 1 and 16 request threads."""
    out: dict = {}
    for concurrency in (1, 16):
        modes = ("one_each", "grouped", "grouped_full") if backend == "sqlite" else ("one_each", "grouped")
        runs: dict[str, list[float]] = {mode: [] for mode in modes}
        for r in range(rounds):
            for mode in modes:
                location = fresh() or run_dir / f"completions-{mode}-{concurrency}-{r}.sqlite"
                runs[mode].append(bench_completions(location, n, concurrency, mode))
        out[str(concurrency)] = {mode: round(sorted(v)[len(v) // 2]) for mode, v in runs.items()}
        out[str(concurrency)]["runs"] = {mode: [round(x) for x in v] for mode, v in runs.items()}
        log(f"completions on {backend}, {concurrency} thread(s): {out[str(concurrency)]}")
    return out


def bench_postgres_kills(cluster: ThrowawayCluster, kills: int, mode: str, seed: int) -> dict:
    """kill -9 of every PostgreSQL process at random moments while 8 threads commit completions:
    the acknowledged completions missing afterwards, and the recovery after each restart."""
    rng = random.Random(seed)
    url = cluster.new_schema_url()
    writer = CompletionWriter(url, mode)
    acked: list[tuple[str, float]] = []
    refused, stop, lock = [0], threading.Event(), threading.Lock()

    def write() -> None:
        while not stop.is_set():
            c = completion_record(uuid.uuid4().hex)
            try:
                writer.commit(c)
            except StoreUnavailable:
                refused[0] += 1
                time.sleep(0.01)
                continue
            with lock:
                acked.append((c.id, time.monotonic()))

    threads = [threading.Thread(target=write, daemon=True) for _ in range(8)]
    for t in threads:
        t.start()
    restart_s, recovery_s = [], []
    for _ in range(kills):
        time.sleep(rng.uniform(0.1, 0.8))
        cluster.kill()
        killed = time.monotonic()
        time.sleep(rng.uniform(0.05, 0.3))
        cluster.restart()  # crash recovery, then accepting connections (pg_ctl -w)
        back = time.monotonic()
        restart_s.append(back - killed)
        while time.monotonic() - back < 30:
            with lock:
                later = [at for _, at in acked if at > back]
            if later:
                recovery_s.append(min(later) - back)
                break
            time.sleep(0.005)
    stop.set()
    for t in threads:
        t.join(30)
    writer.close()
    with LiveStore(url) as store:
        stored = {c.id for c in store.completions()}
    lost = sum(cid not in stored for cid, _ in acked)
    return {"kills": kills, "acknowledged": len(acked), "acknowledged_lost": lost, "refused_503": refused[0],
            "down_s_max": round(max(restart_s), 2), "first_commit_after_restart_s_max": round(max(recovery_s), 3),
            "first_commit_after_restart_s": [round(x, 3) for x in recovery_s]}


# The host process of a SQLite store, as small as it can be (no torch): CompletionWriter's two modes.
_SQLITE_WRITER = """
import sys, threading, time, uuid
from flywheel.live.records import Completion
from flywheel.live.store import LiveStore
from flywheel.store.database import connect_url
path, mode, insert = sys.argv[1], sys.argv[2], sys.argv[3]
store, db, lock, out = LiveStore(path), connect_url(path, "NORMAL"), threading.Lock(), threading.Lock()
def write():
    while True:
        c = Completion(id=uuid.uuid4().hex, session_id="s", user_id="u", version=0, prompt_ids=list(range(64)),
                       completion_ids=list(range(16)), logprobs=[-0.1] * 16, latency_ms=1.0, created_at=time.time())
        if mode == "grouped":
            store.add_completion(c)
        else:
            row = store.completion_row(c)
            with lock, db.transaction("NORMAL"):
                db.execute(insert, row)
        with out:
            print(c.id, flush=True)
for _ in range(8):
    threading.Thread(target=write, daemon=True).start()
threading.Event().wait()
"""


def bench_sqlite_kills(run_dir: Path, kills: int, mode: str, seed: int) -> dict:
    """kill -9 of the store's host process (8 threads committing) at random moments: acknowledged lost."""
    rng = random.Random(seed)
    path = run_dir / f"kills-{mode}.sqlite"
    LiveStore(path).close()
    acked: list[str] = []
    for _ in range(kills):
        proc = subprocess.Popen([sys.executable, "-c", _SQLITE_WRITER, str(path), mode, INSERT_COMPLETION],
                                cwd=REPO, stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        acked.append(proc.stdout.readline().strip())
        time.sleep(rng.uniform(0.1, 0.8))
        proc.kill()
        acked += [line.strip() for line in proc.stdout if line.strip()]
        proc.wait()
    with LiveStore(path) as store:
        stored = {c.id for c in store.completions()}
    return {"kills": kills, "acknowledged": len(acked), "acknowledged_lost": sum(cid not in stored for cid in acked)}


def bench_completions_part(run_dir: Path, args: argparse.Namespace) -> dict:
    """Completions: throughput before and now per backend, and acknowledged completions lost under kill -9."""
    run_dir.mkdir(parents=True, exist_ok=True)
    out: dict = {}
    with ThrowawayCluster() as cluster:  # its own: the kill runs kill it
        for backend in args.backends:
            fresh = (lambda: new_schema_url(cluster.url)) if backend == "postgresql" else (lambda: None)
            out[backend] = {"per_s": bench_completion_throughput(backend, fresh, run_dir, args.completions,
                                                                 args.rounds)}
        if "postgresql" in args.backends:
            for mode in ("one_each", "grouped"):
                log(f"completions: PostgreSQL killed {args.kills} times under {mode} commits ...")
                out["postgresql"][f"kills_{mode}"] = bench_postgres_kills(cluster, args.kills, mode, seed=46)
    if "sqlite" in args.backends:
        for mode in ("one_each", "grouped"):
            log(f"completions: the SQLite store's host process killed {args.kills} times under {mode} commits ...")
            out["sqlite"][f"kills_{mode}"] = bench_sqlite_kills(run_dir, args.kills, mode, seed=46)
    return out


def bench_events(registry_root: Path, run_dir: Path, n: int, batch: int, threads: int, store_url: str | None,
                 replicas: int) -> dict:
    location = store_url or run_dir / "live.sqlite"
    completions = [Completion(id=f"c{i}", session_id=f"s{i % 200}", user_id="u", version=0, prompt_ids=[1],
                              completion_ids=[2], logprobs=[-0.1], latency_ms=1.0, created_at=1e9) for i in range(1000)]
    with LiveStore(location) as store:
        for c in completions:
            store.add_completion(c)
    servers, urls = [], []
    for r in range(replicas):
        port = free_port()
        # SQLite replicas share run_dir/live.sqlite; PostgreSQL ones each keep their config.json apart.
        replica_dir = run_dir if store_url is None else run_dir / f"replica-{r}"
        cmd = [sys.executable, "-m", "flywheel.cli", "serve", "--config", str(REPO / "configs" / "serve.toml"),
               "--set", f"loop.store.registry_root={json.dumps(str(registry_root))}",
               "--set", f"loop.store.path={json.dumps(str(replica_dir / 'live.sqlite'))}", "--set", f"port={port}",
               "--set", f"threads={threads}", "--set", f"max_events_per_batch={max(batch, 5000)}"]
        if store_url is not None:
            cmd += ["--set", f"loop.store.url={json.dumps(store_url)}"]
        servers.append(subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
        urls.append(f"http://127.0.0.1:{port}")
    log(f"events: starting {replicas} `flywheel serve` ...")
    try:
        for url, server in zip(urls, servers, strict=True):
            wait_healthy(url, server)
        events = make_events(n, completions, seed=1)
        log(f"events: {n} through the SDK in batches of {batch}, {replicas} replica(s) ...")
        clients = [EventClient(url, "dev-events-key", batch_size=batch, flush_interval_s=0.02, max_queue=n + 1)
                   for url in urls]
        t0 = time.perf_counter()
        for i, e in enumerate(events):
            clients[i % replicas].emit(e["type"], e["session_id"], e["completion_id"], e["payload"], event_id=e["id"],
                                       at=e["time"])
        emit_s = time.perf_counter() - t0
        for client in clients:
            if not client.flush(timeout_s=600):
                raise RuntimeError(f"events not acknowledged within 600 s: {client.stats}")
        elapsed = time.perf_counter() - t0
        stats = [client.stats for client in clients]
        for client in clients:
            client.close()
    finally:
        for server in servers:
            server.terminate()
            server.wait(30)
    accepted = sum(st.accepted for st in stats)
    if accepted != n:
        raise RuntimeError(f"only {accepted} of {n} events accepted: {stats}")
    with LiveStore(location) as store:
        stored = store.count_events()
    sdk = n / elapsed
    return {"events_per_s": round(sdk), "emit_us_per_event": round(emit_s / n * 1e6, 2), "events": n, "batch": batch,
            "replicas": replicas, "stored": stored, "retries": sum(st.retries for st in stats),
            "dropped": sum(st.dropped for st in stats)}


def bench_backend(backend: str, registry_root: Path, run_dir: Path, args: argparse.Namespace,
                  pg_url: str | None) -> dict:
    """Events through 1 and/or 2 replicas and the raw baseline, on one backend."""
    fresh = (lambda: new_schema_url(pg_url)) if backend == "postgresql" else (lambda: None)
    out: dict = {"replicas": {}}
    for replicas in args.replicas:
        out["replicas"][str(replicas)] = bench_events(registry_root, run_dir / f"{backend}-{replicas}", args.events,
                                                      args.batch, args.threads, fresh(), replicas)
    completions = [Completion(id=f"c{i}", session_id=f"s{i % 200}", user_id="u", version=0, prompt_ids=[1],
                              completion_ids=[2], logprobs=[-0.1], latency_ms=1.0, created_at=1e9) for i in range(1000)]
    log(f"events: the same events straight into {backend} ...")
    if backend == "postgresql":
        raw = bench_raw_postgres(fresh(), make_events(args.events, completions, seed=2), args.batch)
    else:
        raw = bench_raw_sqlite(run_dir / "raw.sqlite", make_events(args.events, completions, seed=2), args.batch)
    out["raw_events_per_s"] = round(raw)
    out["events_vs_raw"] = round(out["replicas"][str(args.replicas[0])]["events_per_s"] / raw, 3)
    return out


def bench_overhead(registry_root: Path, run_dir: Path, requests: int, max_tokens: int, threads: int) -> dict:
    torch.set_num_threads(threads)
    config = ServeConfig(loop=LoopConfig.at(run_dir / "live.sqlite", registry_root), keys=KEYS, candidate_fraction=0.0,
                         threads=threads)
    server = LiveServer.from_config(config)
    chats = conversations(2)
    engine = server.router.engine(server.deployment.production)
    tokenizer = server.router.tokenizer(server.deployment.production)
    encoder = ConversationEncoder(tokenizer)
    stop = (tokenizer.convert_tokens_to_ids(IM_END),)
    pairs, same_request, engine_ms, server_ms, openai_ms = [], [], [], [], []
    with serve_in_thread(server) as running, httpx.Client(base_url=running.url, timeout=60,
                                                           headers={"authorization": "Bearer bench-key"}) as http:
        api = openai.OpenAI(base_url=f"{running.url}/v1", api_key="bench-key", max_retries=0)
        log(f"overhead: {requests} completions through the server and straight to the engine ...")
        for i in range(requests + 5):  # the first 5 warm up
            chat = chats[i % len(chats)]
            body = json.dumps({"model": "flywheel", "messages": chat, "tools": tool_schemas(), "max_tokens": max_tokens,
                               "temperature": 0})
            prompt = encoder.encode(chat, tool_schemas())
            t0 = time.perf_counter()
            alone = engine.submit(prompt, SamplingParams(0.0, 1.0, max_tokens, stop)).result()
            e = (time.perf_counter() - t0) * 1000
            t0 = time.perf_counter()
            response = http.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
            s = (time.perf_counter() - t0) * 1000
            t0 = time.perf_counter()
            api.chat.completions.create(model="flywheel", messages=chat, tools=tool_schemas(), max_tokens=max_tokens,
                                        temperature=0)
            o = (time.perf_counter() - t0) * 1000
            result = response.json()
            if result["usage"]["completion_tokens"] != len(alone.token_ids):
                raise RuntimeError("the server and the engine alone generated different lengths; the comparison is "
                                   "void")
            if i >= 5:
                engine_ms.append(e)
                server_ms.append(s)
                openai_ms.append(o)
                pairs.append(s - e)
                same_request.append(s - result["flywheel"]["engine_ms"])
    server.close()
    (p50, p99), (sp50, sp99) = percentiles(pairs), percentiles(same_request)
    return {"server_overhead_ms_p50": p50, "server_overhead_ms_p99": p99, "target_server_overhead_ms_p50": 5.0,
            "server_overhead_same_request_ms_p50": sp50, "server_overhead_same_request_ms_p99": sp99,
            "engine_alone_ms_p50": percentiles(engine_ms)[0], "through_server_ms_p50": percentiles(server_ms)[0],
            "through_openai_client_ms_p50": percentiles(openai_ms)[0], "requests": requests, "max_tokens": max_tokens,
            "prompt_tokens_mean": round(sum(len(encoder.encode(c, tool_schemas())) for c in chats) / len(chats))}


def bench_streaming(registry_root: Path, run_dir: Path, requests: int, max_tokens: int, threads: int,
                    separate_process: bool = False) -> dict:
    """Time to first token and inter-token latency of streamed answers, against the same request
    answered whole (the baseline: without streaming the first byte comes with the last token).
    separate_process: the model decodes in a ProcessEngine, each token relayed over its pipe."""
    torch.set_num_threads(threads)
    config = ServeConfig(loop=LoopConfig.at(run_dir / "live.sqlite", registry_root), keys=KEYS, candidate_fraction=0.0,
                         threads=threads, default_max_tokens=max_tokens,
                         engine=EngineConfig(separate_process=separate_process, threads=threads))
    server = LiveServer.from_config(config)
    chats = conversations(2)
    ttft, server_ttft, gaps, whole = [], [], [], []
    with serve_in_thread(server) as running, httpx.Client(base_url=running.url, timeout=120,
                                                           headers={"authorization": "Bearer bench-key"}) as http:
        log(f"streaming: {requests} streamed and {requests} whole answers of {max_tokens} tokens ...")
        for i in range(requests + 2):  # the first 2 warm up
            body = {"model": "flywheel", "messages": chats[i % len(chats)], "max_tokens": max_tokens,
                    "temperature": 1.0, "seed": i}
            t0 = time.perf_counter()
            http.post("/v1/chat/completions", json=body).raise_for_status()
            w = (time.perf_counter() - t0) * 1000
            arrivals, last = [], None
            t0 = time.perf_counter()
            with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
                for line in response.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                        arrivals.append((time.perf_counter() - t0) * 1000)
                    last = chunk
            if i >= 2 and arrivals:
                whole.append(w)
                ttft.append(arrivals[0])
                server_ttft.append(last["flywheel"]["ttft_ms"])
                gaps += [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    server.close()
    return {"ttft_ms_p50": percentiles(ttft)[0], "ttft_ms_p99": percentiles(ttft)[1],
            "server_ttft_ms_p50": percentiles(server_ttft)[0],
            "inter_token_ms_p50": percentiles(gaps)[0] if gaps else None,
            "inter_token_ms_p99": percentiles(gaps)[1] if gaps else None,
            "baseline_whole_answer_ms_p50": percentiles(whole)[0],
            "ttft_share_of_whole_answer": round(percentiles(ttft)[0] / percentiles(whole)[0], 3),
            "requests": requests, "max_tokens": max_tokens}


class _Scripted:
    """An Engine answering each turn with the next scripted text: both runners get the same tokens at
    no model cost, so the difference is the loop's own (HTTP, the harness, its command wrapper)."""

    def __init__(self, tokenizer, turns: list[str]):
        self.tokenizer, self.turns, self.version = tokenizer, list(turns), 0

    def submit(self, prompt_ids, params):
        from concurrent.futures import Future  # noqa: PLC0415

        from flywheel.model.engine import Generation  # noqa: PLC0415

        ids = self.tokenizer(self.turns.pop(0), add_special_tokens=False)["input_ids"]
        future = Future()
        future.set_result(Generation(ids, [-0.5] * len(ids), [0] * len(ids), "stop"))
        return future


def bench_harness(turns: int) -> dict:
    """A harness episode (mini-swe-agent through the per-episode endpoint) against the built-in
    runner on the same task with the same scripted answers: `turns` commands, then the end."""
    from flywheel.agent.episode import EpisodeConfig, initial_prompt, run_episode  # noqa: PLC0415
    from flywheel.env.pool import PoolConfig, SandboxPool  # noqa: PLC0415
    from flywheel.live.harness import HarnessConfig, HarnessServer, run_harness_episode  # noqa: PLC0415

    task = generate("bugfix", "train", 1, seed=5, difficulty=1)[0]

    def call(name: str, **arguments) -> str:
        return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>{IM_END}'

    command = call("run_command", command=task.test_command)
    tokenizer = train_tokenizer([initial_prompt(task, with_tools=False), command] * 8, vocab_size=800,
                                tools_in_prompt=False)
    with SandboxPool(PoolConfig(max_active=2, warm=1)) as pool:
        log(f"harness: the built-in runner, {turns} commands then finish ...")
        t0 = time.perf_counter()
        builtin = run_episode(task, _Scripted(tokenizer, [command] * turns + [call("finish", summary="done")]),
                              tokenizer, pool, EpisodeConfig(max_turns=turns + 1, max_tokens=16384))
        builtin_s = time.perf_counter() - t0
        log(f"harness: mini-swe-agent through the harness endpoint, {turns} commands then submit ...")
        engine = _Scripted(tokenizer, [command] * turns + [call("run_command",
                                                                command="echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT")])
        server = HarnessServer(engine, tokenizer, pool, HarnessConfig(max_tokens=16384, max_turns=turns + 2))
        with server.serve(), tempfile.TemporaryDirectory(prefix="flywheel-bench-harness-") as work:
            started = time.perf_counter()
            result = run_harness_episode(server, task, Path(work), step_limit=turns + 2)
            harness_s = time.perf_counter() - started
    if result.harness_exit_code != 0 or result.breaks or result.commands != turns + 1:
        raise RuntimeError(f"the harness episode did not run as scripted: {result.harness_output[-1500:]}")
    arrivals = [c["received_s"] for c in result.completions]
    per_turn = (arrivals[-1] - arrivals[0]) / (len(arrivals) - 1)  # request to request: command, HTTP, agent
    builtin_per_turn = (builtin.timings["total_s"] - builtin.timings["grade_s"]) / builtin.turns
    return {"harness_per_turn_ms": round(per_turn * 1000, 1), "builtin_per_turn_ms": round(builtin_per_turn * 1000, 1),
            "harness_overhead_per_turn_ms": round((per_turn - builtin_per_turn) * 1000, 1),
            # the harness process's start (interpreter, litellm) until its first request
            "harness_startup_s": round(arrivals[0] - started, 2),
            "harness_episode_s": round(harness_s, 2), "builtin_episode_s": round(builtin_s, 2),
            "harness_exec_s": round(result.timings["exec_s"], 3),
            "builtin_tools_s": round(builtin.timings["tools_s"], 3), "turns": turns}


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"`flywheel serve` exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"`flywheel serve` not healthy within {timeout_s} s")


def free_port() -> int:
    import socket  # noqa: PLC0415

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--batch", type=int, default=1000, help="events per SDK batch (and per raw SQLite transaction)")
    parser.add_argument("--requests", type=int, default=200, help="completion pairs for the overhead")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (the server's event loop needs the other core)")
    parser.add_argument("--only", choices=["events", "completions", "overhead", "streaming", "harness"],
                        help="run one part")
    parser.add_argument("--backends", default="sqlite,postgresql", help="comma-separated: sqlite, postgresql")
    parser.add_argument("--replicas", default="1,2", help="comma-separated replica counts to measure ingestion with")
    parser.add_argument("--completions", type=int, default=2000, help="completions per throughput run")
    parser.add_argument("--rounds", type=int, default=2, help="A/B rounds of the completions throughput")
    parser.add_argument("--kills", type=int, default=5, help="kill -9s per backend and mode (completions part)")
    parser.add_argument("--stream-requests", type=int, default=20, help="streamed answers for TTFT / inter-token")
    parser.add_argument("--stream-tokens", type=int, default=32)
    parser.add_argument("--harness-turns", type=int, default=6, help="commands of the harness-vs-built-in episode")
    args = parser.parse_args()
    args.replicas = [int(r) for r in args.replicas.split(",")]
    backends = args.backends = args.backends.split(",")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="flywheel-bench-live-") as tmp:
        root = Path(tmp)
        if args.only != "completions":  # the one part that serves no model
            log("building a registry with one default-size model ...")
            build_registry(root / "registry", conversations(6))
        events: dict = {}
        completions: dict = {}
        overhead: dict = {}
        streaming: dict = {}
        harness: dict = {}
        if args.only in (None, "events"):
            cluster = None
            pg_url = os.environ.get("FLYWHEEL_PG_URL")
            if "postgresql" in backends and not pg_url:
                log("postgresql: starting a throwaway cluster (fsync on) ...")
                cluster = ThrowawayCluster().start()
                pg_url = cluster.url
            try:
                for backend in backends:
                    events[backend] = bench_backend(backend, root / "registry", root / "events", args, pg_url)
            finally:
                if cluster is not None:
                    cluster.stop()
        if args.only in (None, "completions"):
            completions = bench_completions_part(root / "completions", args)
        if args.only in (None, "overhead"):
            overhead = bench_overhead(root / "registry", root / "overhead", args.requests, args.max_tokens,
                                      args.threads)
        if args.only in (None, "streaming"):
            streaming = bench_streaming(root / "registry", root / "streaming", args.stream_requests,
                                        args.stream_tokens, args.threads)
            log("streaming: the same through a model in its own process (ProcessEngine) ...")
            streaming["engine_process"] = bench_streaming(root / "registry", root / "streaming-process",
                                                          args.stream_requests, args.stream_tokens, args.threads,
                                                          separate_process=True)
        if args.only in (None, "harness"):
            harness = bench_harness(args.harness_turns)
    headline = {f"{backend}_events_per_s_{r}_replica{'s' if r > 1 else ''}": result["replicas"][str(r)]["events_per_s"]
                for backend, result in events.items() for r in args.replicas}
    report = {**headline,
              **{f"{b}_completions_per_s_16_threads": r["per_s"]["16"] for b, r in completions.items()},
              **{f"{b}_acknowledged_lost_under_kills": {m: r[f"kills_{m}"]["acknowledged_lost"]
                                                        for m in ("one_each", "grouped")}
                 for b, r in completions.items() if "kills_grouped" in r},
              "target_events_per_s": 20000,
              **{k: overhead[k] for k in ("server_overhead_ms_p50", "server_overhead_ms_p99") if k in overhead},
              "events": events, "completions": completions, "overhead": overhead, "streaming": streaming,
              "harness": harness,
              "settings": {"synchronous": "FULL", "threads": args.threads, "cpus": os.cpu_count(),
                           "load_average": [round(x, 2) for x in os.getloadavg()], "torch": torch.__version__},
              "total_s": round(time.perf_counter() - t0, 1)}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
