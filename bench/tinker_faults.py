"""Kill -9 of `flywheel tinker serve` at random moments while a Tinker client trains and checkpoints:
what a death costs, and that nothing acknowledged is lost.

    python bench/tinker_faults.py                  # 3 kills, the tiny model
    python bench/tinker_faults.py --kills 5 --seed 1

One Registry and checkpoint folder for the whole run. Each life of the server: a client (the tinker
SDK) creates a LoRA model, and loops forward_backward + optim_step, save_state, and every third
round save_weights_for_sampler (a Registry version), recording each path the server acknowledged
with the loss the model scored right before the save. At a random moment the server is killed
(SIGKILL) and started again. After every restart, every acknowledged checkpoint of every earlier
life must load (`create_training_client_from_state`) and score the recorded loss, and every
acknowledged sampler save must be a Registry version that loads merged. Printed: kills,
checkpoints acknowledged and lost (must be 0), versions acknowledged and lost (0), leftovers of
unfinished writes, and the restart's seconds (process start to the first answered request).
What a death costs by design: the requests in flight. (The training client itself goes on after a
restart, flywheel/tinker/records.py, tests/tinker/test_restart.py; here each life's client stops at
its kill, and the checks are of the checkpoints and versions it left.)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

KEY = "tml-faults"


def start(config: Path, log) -> tuple[subprocess.Popen, float]:
    began = time.monotonic()
    process = subprocess.Popen([sys.executable, "-m", "flywheel", "tinker", "serve", "--config", str(config)],
                               stdout=log, stderr=log, start_new_session=True)
    url = json.loads(config.with_suffix(".json").read_text())["url"]
    while True:
        try:
            if httpx.get(f"{url}/api/v1/healthz", timeout=1).status_code == 200:
                return process, time.monotonic() - began
        except httpx.HTTPError:
            pass
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}; see its log")
        time.sleep(0.1)


def train_until_killed(url: str, tokens: list[int], acked: list[dict], stop: threading.Event) -> None:
    import tinker  # noqa: PLC0415
    from tinker import types  # noqa: PLC0415

    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})
    try:
        client = tinker.ServiceClient(base_url=url, api_key=KEY)
        training = client.create_lora_training_client(base_model="production", rank=4, seed=0).result()
        for step in range(10_000):
            if stop.is_set():
                return
            training.forward_backward([datum], "cross_entropy")
            training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
            loss = training.forward([datum], "cross_entropy").result().metrics["loss:sum"]
            path = training.save_state(f"step-{step}").result().path
            acked.append({"kind": "state", "path": path, "loss": loss})
            if step % 3 == 2:
                sampler = training.save_weights_for_sampler(f"sampler-{step}").result().path
                acked.append({"kind": "sampler", "path": sampler})
    except Exception:  # noqa: BLE001 -- the kill: the requests in flight fail, which is the cost being measured
        return


def check(url: str, registry_root: Path, tokens: list[int], acked: list[dict]) -> dict[str, int]:
    import tinker  # noqa: PLC0415
    from tinker import types  # noqa: PLC0415

    from flywheel.model.registry import Registry  # noqa: PLC0415

    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})
    client = tinker.ServiceClient(base_url=url, api_key=KEY)
    lost_states = lost_versions = 0
    states = [a for a in acked if a["kind"] == "state"]
    for entry in random.sample(states, min(4, len(states))) + states[-1:]:  # a sample, and the newest
        try:
            resumed = client.create_training_client_from_state(entry["path"]).result()
            loss = resumed.forward([datum], "cross_entropy").result().metrics["loss:sum"]
            lost_states += abs(loss - entry["loss"]) > 1e-3 * abs(entry["loss"])
        except Exception:  # noqa: BLE001 -- an acknowledged checkpoint that does not load is a loss, counted
            lost_states += 1
    notes = {c.note for c in Registry(registry_root).list()}
    for entry in (a for a in acked if a["kind"] == "sampler"):
        lost_versions += f"tinker {entry['path']}" not in notes
    return {"states_checked": min(5, len(states)), "states_lost": lost_states, "versions_lost": lost_versions}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-s", type=float, default=2.0, help="earliest kill, seconds after training starts")
    parser.add_argument("--max-s", type=float, default=8.0, help="latest kill")
    parser.add_argument("--port", type=int, default=8191)
    args = parser.parse_args()
    random.seed(args.seed)
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "live"))
    from tiny_serving import make_registry  # noqa: PLC0415  (the tests' tiny Registry)

    work = Path(tempfile.mkdtemp(prefix="tinker-faults-"))
    registry = make_registry(work / "registry")
    tokenizer_path = registry.get("production").path
    registry.close()
    from flywheel.model.tokenizer import load_tokenizer  # noqa: PLC0415

    tokens = load_tokenizer(tokenizer_path).encode("def add(a, b):\n    return a + b\n")
    url = f"http://127.0.0.1:{args.port}"
    config = work / "tinker.toml"
    config.write_text(f'port = {args.port}\nregistry = "{work / "registry"}"\nroot = "{work / "tinker"}"\n'
                      f'threads = 1\n[keys]\n"{KEY}" = ["training", "sampling"]\n')
    config.with_suffix(".json").write_text(json.dumps({"url": url}))
    acked: list[dict] = []
    restarts, rounds = [], []
    with open(work / "server.log", "ab") as log:
        process, _ = start(config, log)
        for _ in range(args.kills):
            stop = threading.Event()
            before = len(acked)
            trainer = threading.Thread(target=train_until_killed, args=(url, tokens, acked, stop), daemon=True)
            trainer.start()
            time.sleep(random.uniform(args.min_s, args.max_s))
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            stop.set()
            process, seconds = start(config, log)
            restarts.append(round(seconds, 2))
            trainer.join(120)  # its retries reach the new server, which knows no such model: it stops
            rounds.append(len(acked) - before)
        result = check(url, work / "registry", tokens, acked)
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    leftovers = [str(p.relative_to(work)) for p in work.rglob("*") if ".tmp" in p.name]
    print(json.dumps({
        "kills": args.kills, "acknowledged_per_life": rounds,
        "states_acknowledged": sum(a["kind"] == "state" for a in acked),
        "versions_acknowledged": sum(a["kind"] == "sampler" for a in acked), **result,
        "unfinished_write_leftovers": leftovers, "restart_s": restarts,
    }, indent=1))
    print(f"work folder: {work}", file=sys.stderr)


if __name__ == "__main__":
    main()
