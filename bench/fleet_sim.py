"""What 100,000 concurrent sandboxes take: a discrete-event simulation driven by figures measured here.

    python bench/fleet_sim.py                                   # measure, then simulate (~5 min on 2 shared cores)
    python bench/fleet_sim.py --concurrent 100000 --seconds 180 --node-cpus 64 --node-memory-gb 256

Prints one JSON object on stdout; progress goes to stderr.

Measured in the same run, on this machine (real bwrap sandboxes, a real Ray cluster of one node):
- memory per sandbox: MemAvailable before and after `--sample` sandboxes holding a task's workspace,
  idle and while each runs a Python process (what an episode's test runs do);
- creation rate of one node: a burst of `4 × --sample` acquires at a SandboxPool of `--sample`
  (the fleet's admission and creation path, without Ray), sandboxes created per second;
- the driver's cost per saved state: one EpisodeState of a real task (its workspace, `--tokens`
  tokens) received from an actor over a Ray streaming call and written to run/inflight/ by the
  RunFolder, as the Ray backend's driver does at every turn of every episode: driver CPU seconds
  per state (process time), and the same for the write alone.

Simulated (the model; every parameter is a flag):
- `--concurrent` episodes are wanted at all times: all asked for at t = 0 (the burst), and each one
  that ends is replaced at once by a new one (a closed loop at full demand).
- Nodes of `--node-cpus` and `--node-memory-gb`; each holds `node_capacity` sandboxes (the fleet's
  own policy: CPUs × sandboxes_per_cpu, memory × fraction / disk_mb) and so many nodes are used that
  the fleet holds `--concurrent`. The memory a full node's sandboxes really use is the measured
  figure times its capacity.
- A node makes sandboxes one after the other at its creation rate: this machine's measured rate
  scaled by `node-cpus / this machine's cores` (creation is CPU work: mount, write files); requests
  wait in the node's FIFO queue while it is full or busy creating. Requests go to the node with the
  fewest live-plus-queued (the least loaded, as the Ray runner picks workers).
- Episodes last `--episode-s` on average (exponential), with a turn every `--turn-s` (exponential);
  each turn's state costs a driver the measured CPU seconds; states go to `--drivers` drivers
  (episodes hashed to one), each a single FIFO server. A driver's load above 1 means its backlog
  grows without bound: the figure says how many drivers (Orchestrator shards) it takes.

Simulated twice: a node's creation rate as this machine's scaled by its cores with one driver,
then this machine's rate unscaled with the drivers it takes.

Outputs: nodes, memory per node, queue wait (burst and steady, p50/p99), creations per second,
states per second, each driver's utilization and its queue wait, and the drivers it takes to stay
under 70% busy.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

from flywheel.agent.episode import EpisodeState  # noqa: E402
from flywheel.env.families import task_set  # noqa: E402
from flywheel.env.fleet import node_capacity, percentile  # noqa: E402
from flywheel.env.pool import PoolConfig, SandboxPool  # noqa: E402
from flywheel.env.sandbox import SandboxConfig  # noqa: E402
from flywheel.rl.run_folder import RunFolder  # noqa: E402


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def measure_memory(files: dict, n: int) -> dict:
    """Host memory per sandbox: idle with a workspace, and running a Python process."""
    before = mem_available()
    with SandboxPool(PoolConfig(max_active=n, warm=0)) as pool:
        boxes = [pool.acquire(files) for _ in range(n)]
        time.sleep(0.5)
        idle = (before - mem_available()) / n
        samples: list[int] = []
        threads = [threading.Thread(target=b.run, args=("python3 -c 'import time; time.sleep(3)'",)) for b in boxes]
        for t in threads:
            t.start()
        for _ in range(4):
            time.sleep(0.5)
            samples.append(mem_available())
        for t in threads:
            t.join()
        running = (before - min(samples)) / n
        for b in boxes:
            pool.release(b)
    return {"idle_mb": max(idle, 0.0) / 2**20, "running_mb": max(running, 0.0) / 2**20, "sandboxes": n}


def measure_creation(files: dict, capacity: int) -> dict:
    """Sandboxes created per second by one pool under a burst of 4 × capacity acquires."""
    n = 4 * capacity
    with SandboxPool(PoolConfig(max_active=capacity, warm=0)) as pool:
        def one() -> None:
            pool.release(pool.acquire(files))

        threads = [threading.Thread(target=one) for _ in range(n)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        seconds = time.perf_counter() - t0
        stats = pool.stats()
    return {"sandboxes": n, "capacity": capacity, "seconds": seconds, "created_per_s": n / seconds,
            "queue_wait_ms_p99": stats["queue_wait_ms_p99"]}


def sample_state(task, tokens: int) -> EpisodeState:
    import base64  # noqa: PLC0415 - only here

    rng = random.Random(0)
    return EpisodeState(
        task_id=task.id, group_id="g", tokens=[rng.randrange(300) for _ in range(tokens)],
        loss_mask=[rng.randrange(2) for _ in range(tokens)], logprobs=[-rng.random() for _ in range(tokens)],
        versions=[0] * tokens, prompt_len=200, turns=5, tool_calls=5, invalid_tool_calls=0, invalid_streak=0,
        asked_question=False, workspace={p: base64.b64encode(d.encode() if isinstance(d, str) else d).decode()
                                         for p, d in task.files.items()})


def measure_driver(state: EpisodeState, n: int, with_ray: bool) -> dict:
    """Driver CPU seconds per state: written to run/inflight/ alone, and received over Ray then written."""
    out = {"state_kb": len(state.model_dump_json()) / 1024}
    with tempfile.TemporaryDirectory() as tmp:
        run = RunFolder(Path(tmp) / "run")
        cpu0, t0 = time.process_time(), time.perf_counter()
        for i in range(n):
            run.save_episode_state(f"g/{i % 64}", state)
        out["write_cpu_s"] = (time.process_time() - cpu0) / n
        out["write_wall_s"] = (time.perf_counter() - t0) / n
        if with_ray:
            import ray  # noqa: PLC0415 - Ray only when asked for

            ray.init(address="local", num_cpus=2, object_store_memory=100 * 2**20, include_dashboard=False,
                     _node_ip_address="127.0.0.1", log_to_driver=False)
            try:
                @ray.remote(num_cpus=0.1)
                class Player:
                    def play(self, s: EpisodeState, k: int):
                        for _ in range(k):
                            yield s

                player = Player.remote()
                list(player.play.remote(state, 8))  # warm-up: the actor's start, first transfer
                cpu0, t0 = time.process_time(), time.perf_counter()
                for i, ref in enumerate(player.play.remote(state, n)):
                    run.save_episode_state(f"g/{i % 64}", ray.get(ref))
                out["ray_and_write_cpu_s"] = (time.process_time() - cpu0) / n
                out["ray_and_write_wall_s"] = (time.perf_counter() - t0) / n
            finally:
                ray.shutdown()
    out["per_state_cpu_s"] = out.get("ray_and_write_cpu_s", out["write_cpu_s"])
    return out


def simulate(args, capacity: int, nodes: int, create_s: float, state_cpu_s: float, drivers: int) -> dict:
    """The fleet over `args.seconds` of simulated time; see the module docstring for the model."""
    rng = random.Random(args.seed)
    live = [0] * nodes  # sandboxes held (or being made) per node
    queues: list[list[tuple[float, int]]] = [[] for _ in range(nodes)]  # (asked at, episode) FIFO, as lists
    heads = [0] * nodes
    creating_until = [0.0] * nodes  # a node makes one sandbox at a time, at its creation rate
    driver_free = [0.0] * drivers
    events: list[tuple[float, int, int, int]] = []  # (time, kind, episode, node)
    ASK, MADE, TURN, END = 0, 1, 2, 3
    burst_waits, steady_waits, driver_waits = [], [], []
    made = states = ended = 0
    load = [(0, n) for n in range(nodes)]  # (live + queued, node): a heap, lazily corrected
    heapq.heapify(load)
    counts = [0] * nodes
    next_id = 0

    def ask(t: float) -> None:
        nonlocal next_id
        heapq.heappush(events, (t, ASK, next_id, -1))
        next_id += 1

    def start_creations(t: float, node: int) -> None:
        # Admit from the FIFO queue while the node has room; each creation starts when the last ends.
        while heads[node] < len(queues[node]) and live[node] < capacity:
            asked, episode = queues[node][heads[node]]
            heads[node] += 1
            live[node] += 1
            creating_until[node] = max(creating_until[node], t) + create_s
            heapq.heappush(events, (creating_until[node], MADE, episode, node))
            (burst_waits if asked == 0.0 else steady_waits).append(creating_until[node] - asked)

    for _ in range(args.concurrent):
        ask(0.0)
    ends: dict[int, float] = {}  # episode -> when it ends
    while events:
        t, kind, episode, node = heapq.heappop(events)
        if t > args.seconds:
            break
        if kind == ASK:
            while True:  # the least loaded node (heap entries may be stale)
                count, node = heapq.heappop(load)
                if count == counts[node]:
                    break
            counts[node] += 1
            heapq.heappush(load, (counts[node], node))
            queues[node].append((t, episode))
            start_creations(t, node)
        elif kind == MADE:
            made += 1
            ends[episode] = end = t + rng.expovariate(1 / args.episode_s)
            heapq.heappush(events, (end, END, episode, node))
            turn = t + rng.expovariate(1 / args.turn_s)
            if turn < end:
                heapq.heappush(events, (turn, TURN, episode, node))
        elif kind == TURN:
            states += 1
            d = episode % drivers
            begin = max(t, driver_free[d])
            driver_waits.append(begin - t)
            driver_free[d] = begin + state_cpu_s
            turn = t + rng.expovariate(1 / args.turn_s)
            if turn < ends[episode]:
                heapq.heappush(events, (turn, TURN, episode, node))
        else:
            ended += 1
            del ends[episode]
            live[node] -= 1
            counts[node] -= 1
            heapq.heappush(load, (counts[node], node))
            start_creations(t, node)
            ask(t)
    burst_waits.sort()
    steady_waits.sort()
    driver_waits.sort()
    horizon = args.seconds
    busy = states * state_cpu_s / (drivers * horizon)
    return {
        "simulated_s": horizon, "nodes": nodes, "capacity_per_node": capacity, "drivers": drivers,
        "burst_wait_s_p50": percentile(burst_waits, 0.5), "burst_wait_s_p99": percentile(burst_waits, 0.99),
        "steady_wait_s_p50": percentile(steady_waits, 0.5), "steady_wait_s_p99": percentile(steady_waits, 0.99),
        "time_to_fill_s": burst_waits[-1] if burst_waits else None,
        "created_per_s": made / horizon, "episodes_ended": ended, "states_per_s": states / horizon,
        "driver_utilization": busy, "driver_wait_s_p50": percentile(driver_waits, 0.5),
        "driver_wait_s_p99": percentile(driver_waits, 0.99),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrent", type=int, default=100_000)
    parser.add_argument("--seconds", type=float, default=180.0, help="simulated time")
    parser.add_argument("--episode-s", type=float, default=60.0, help="mean episode length")
    parser.add_argument("--turn-s", type=float, default=10.0, help="mean time between an episode's turns")
    parser.add_argument("--node-cpus", type=int, default=64)
    parser.add_argument("--node-memory-gb", type=float, default=256.0)
    parser.add_argument("--sandboxes-per-cpu", type=float, default=8.0)
    parser.add_argument("--memory-fraction", type=float, default=0.5)
    parser.add_argument("--sample", type=int, default=16, help="sandboxes measured at once")
    parser.add_argument("--tokens", type=int, default=4000, help="tokens of the measured EpisodeState")
    parser.add_argument("--states", type=int, default=300, help="states the driver measurement sends")
    parser.add_argument("--no-ray", action="store_true", help="measure the driver's write only")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    task = task_set(["bugfix"], "train", 1, seed=100, difficulty=1)[0]
    measured = {"machine_cpus": os.cpu_count(), "load_avg_1m": os.getloadavg()[0]}
    measured["memory"] = measure_memory(task.files, args.sample)
    log(f"memory: {measured['memory']}")
    measured["creation"] = measure_creation(task.files, args.sample)
    log(f"creation: {measured['creation']}")
    measured["driver"] = measure_driver(sample_state(task, args.tokens), args.states, not args.no_ray)
    log(f"driver: {measured['driver']}")

    disk_mb = SandboxConfig().disk_mb
    capacity, why = node_capacity(args.node_cpus, args.node_memory_gb * 2**30, args.sandboxes_per_cpu,
                                  args.memory_fraction, disk_mb, 10**9)
    nodes = math.ceil(args.concurrent / capacity)
    node_rate = measured["creation"]["created_per_s"] * args.node_cpus / measured["machine_cpus"]
    state_cpu_s = measured["driver"]["per_state_cpu_s"]
    states_per_s = args.concurrent / args.turn_s
    drivers = max(1, math.ceil(states_per_s * state_cpu_s / 0.7))
    plan = {"node": {"cpus": args.node_cpus, "memory_gb": args.node_memory_gb, "capacity": capacity,
                     "capacity_why": why, "created_per_s": node_rate,
                     "running_memory_gb_full": capacity * measured["memory"]["running_mb"] / 1024},
            "nodes": nodes, "drivers_for_70pct": drivers,
            "one_driver_utilization": states_per_s * state_cpu_s}
    log(f"plan: {plan}")
    # Two bounds on a node's creation rate: this machine's scaled by cores (creation is CPU work),
    # and this machine's as it is (as if a node's creation did not scale past 2 cores); one driver,
    # then as many as keep each under 70% busy.
    runs = []
    for rate, d, label in ((node_rate, 1, "creation scaled by cores, one driver"),
                           (measured["creation"]["created_per_s"], drivers, "creation as measured, sharded drivers")):
        t0 = time.perf_counter()
        runs.append({"case": label, "node_created_per_s": rate,
                     **simulate(args, capacity, nodes, 1 / rate, state_cpu_s, d)})
        log(f"simulated ({label}) in {time.perf_counter() - t0:.1f} s: {runs[-1]}")
    print(json.dumps({"args": vars(args), "measured": measured, "plan": plan, "simulated": runs}, indent=2))


if __name__ == "__main__":
    main()
