"""A training client outlives its server: `flywheel tinker serve` killed with SIGKILL at random moments
while the SDK trains, restarted on the same port and folder, and the SDK's same client object goes on.

Each life of the server is a forked child of this process (the imports and the tiny model are already
here, so a restart takes about a second instead of the CLI's start-up), serving the package's tiny
Registry from one folder. The client trains rounds of forward_backward + optim_step and scores the
data after each; a reference client on the first life, never interrupted, gives the loss after every
step. After each of two kills (one at a random moment, one after an acknowledged forward_backward
whose optim_step has not been sent) the server's record of the model (flywheel/tinker/records.py) says which
requests it applied; it must hold every acknowledged one and at most the one in flight, and the same
client's next forward must score exactly the reference's loss at that step: adapter, AdamW moments
and the pending gradient all came back (a lost moment or gradient changes the next step's loss)."""

from __future__ import annotations

import os
import random
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from conftest import KEYS
from installed import installed  # this folder's: skip with the install line, fail in CI

from flywheel.api.http import RunningServer
from flywheel.model.registry import Registry
from flywheel.tinker.records import model_folder
from flywheel.tinker.server import TinkerConfig, create_app
from flywheel.tinker.service import NotFound, TinkerService
from flywheel.tinker.wire import Datum, FwdBwdRequest

tinker = installed("tinker")
types = tinker.types
ROUNDS = 12


class ForkedServer:
    """One life at a time of the Tinker server on a fixed port, each a forked child; `kill` is SIGKILL."""

    def __init__(self, registry_root: Path, root: Path):
        self.registry_root, self.root = registry_root, root
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.pid = 0
        self.lives = 0

    def start(self) -> None:
        pid = os.fork()
        if pid == 0:  # the child: serve until killed
            try:
                config = TinkerConfig(registry=self.registry_root, root=self.root, keys=KEYS, port=self.port)
                RunningServer(create_app(TinkerService(Registry(self.registry_root), self.root), config),
                              port=self.port)
                while True:
                    time.sleep(3600)
            finally:
                os._exit(1)
        self.pid, self.lives = pid, self.lives + 1
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/api/v1/healthz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.05)
        raise RuntimeError("the forked tinker server did not answer within 60 s")

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)


def record(root: Path, model_id: str) -> tuple[int, bool]:
    """(optimizer steps, whether a gradient is pending) of the model as the server's record holds it."""
    saved = torch.load(model_folder(root, model_id) / "client.pt", weights_only=False)
    return saved["state"]["steps"], any(g is not None for g in saved["grads"])


@pytest.fixture
def life(server, tmp_path) -> Iterator[ForkedServer]:
    """The Tinker server's first life on the package's tiny Registry; the last one killed at the end."""
    _, registry = server
    life = ForkedServer(registry.root, tmp_path / "tinker")
    life.start()
    yield life
    life.kill()


def code_client(service) -> tuple:
    """A LoRA training client of the served model (seed 0), a short code sample's tokens and the
    cross-entropy datum on them."""
    client = service.create_lora_training_client(base_model="production", rank=4, seed=0).result()
    tokens = client.get_tokenizer().encode("def add(a, b):\n    return a + b\n")
    data = [types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})]
    return client, tokens, data


def test_a_training_client_goes_on_after_kill_9_of_the_server_and_loses_nothing_acknowledged(life):
    service = tinker.ServiceClient(base_url=life.url, api_key="tml-alice")
    reference, _, data = code_client(service)
    adam = types.AdamParams(learning_rate=1e-2)

    def loss(client) -> float:
        return client.forward(data, "cross_entropy").result().metrics["loss:sum"]

    expected = [loss(reference)]  # the loss after each step of an uninterrupted client
    began = time.monotonic()
    for _ in range(ROUNDS):
        reference.forward_backward(data, "cross_entropy").result()
        reference.optim_step(adam).result()
        expected.append(loss(reference))
    round_s = (time.monotonic() - began) / ROUNDS

    training = service.create_lora_training_client(base_model="production", rank=4, seed=0).result()
    model_id = training.model_id
    rng = random.Random(os.environ.get("FLYWHEEL_FAULT_SEED"))
    kills: list[float] = []

    def kill_and_restart() -> None:
        kills.append(time.monotonic())
        life.kill()
        life.start()

    # One kill at a random moment of the loop below, from beside it (each kill costs the SDK's
    # backoff, about 4 s), and one at a chosen moment once it is done.
    killer = threading.Timer(rng.uniform(0, ROUNDS / 2) * round_s, kill_and_restart)
    steps, pending, failures, synced, chosen = 0, False, 0, True, False
    killer.start()
    while steps < ROUNDS:
        if steps == ROUNDS - 1 and killer.is_alive():  # the loop ran faster than the reference's rounds:
            killer.join()  # the random kill still lands inside it (CI saw the loop end before the timer)
        try:
            if not synced:  # after a kill: what the server holds, and the same client scores it
                held, held_pending = record(life.root, model_id)
                assert held in (steps, steps + 1), f"the server holds step {held}, {steps} were acknowledged"
                assert held > steps or held_pending or not pending, "an acknowledged forward_backward was lost"
                steps, pending, synced = held, held_pending and held == steps, True
                assert loss(training) == pytest.approx(expected[steps], rel=1e-5)
                continue
            if not pending:
                training.forward_backward(data, "cross_entropy").result()
                pending = True
            if not chosen and not killer.is_alive():
                chosen = True  # the third kill at a chosen moment: a gradient acknowledged, not yet applied
                kill_and_restart()
            training.optim_step(adam).result()
            steps, pending = steps + 1, False
            assert loss(training) == pytest.approx(expected[steps], rel=1e-5)
        except (ValueError, tinker.APIError):  # a request in flight at a kill
            failures, synced = failures + 1, False
            assert failures <= len(kills), f"{failures} failed requests for {len(kills)} kills"
    killer.join()
    assert chosen and len(kills) == 2 and life.lives == 3, "the loop ended before its kills"
    assert loss(training) == pytest.approx(expected[ROUNDS], rel=1e-5) and expected[ROUNDS] < expected[0]


def test_a_resent_training_request_is_not_applied_twice(server, tmp_path):
    """The SDK resends a request whose POST lost its connection: a forward_backward or optim_step whose
    seq_id the model has applied answers as before and changes nothing (records.py)."""
    _, registry = server
    service = TinkerService(registry, tmp_path)
    try:
        session = service.create_session("alice")
        model_id = service.create_model("alice", session, 0, "production", 4, 0, True, True)["model_id"]
        tokens = list(range(5, 25))
        datum = Datum(tokens[:-1], {"target_tokens": np.array(tokens[1:]), "weights": np.ones(len(tokens) - 1)})

        def forward_backward(seq: int) -> None:
            service.forward_backward("alice", FwdBwdRequest(model_id, seq, "cross_entropy", {}, False, [datum]))

        def gradient() -> list:
            return service.model(model_id, "alice").model.pending_gradients()

        adam = {"learning_rate": 1e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0,
                "grad_clip_norm": 0.0}
        forward_backward(1)
        once = gradient()
        forward_backward(1)  # the resend
        assert all(a is b is None or torch.equal(a, b) for a, b in zip(once, gradient(), strict=True))
        forward_backward(2)  # a new request adds its gradient
        assert any(a is not None and not torch.equal(a, b) for a, b in zip(once, gradient(), strict=True))
        first = service.optim_step("alice", model_id, 3, adam)
        weights = [p.detach().clone() for p in service.model(model_id, "alice").model.params]
        assert service.optim_step("alice", model_id, 3, adam) == first  # the resend: the same answer, no step
        entry = service.model(model_id, "alice")
        assert entry.model.steps == 1
        assert all(torch.equal(w, p) for w, p in zip(weights, entry.model.params, strict=True))
        service.optim_step("alice", model_id, 4, adam)
        assert entry.model.steps == 2
    finally:
        service.close()


def test_samplers_sample_the_same_weights_after_kill_9_of_the_server(life):
    """Every sampler the server answered for (a base, a named save, an unnamed RL-step snapshot)
    comes back from its record (records.py): after kills at a random moment of a snapshot-per-step
    loop and after it, the SDK's same SamplingClient objects draw the same tokens with the same
    logprobs as before."""
    service = tinker.ServiceClient(base_url=life.url, api_key="tml-alice")
    training, tokens, data = code_client(service)
    prompt = types.ModelInput.from_ints(tokens[:5])
    params = types.SamplingParams(max_tokens=8, seed=11, temperature=1.0)

    def draw(sampler) -> tuple[list[int], list[float]]:
        sequence = sampler.sample(prompt, 1, params).result().sequences[0]
        return list(sequence.tokens), list(sequence.logprobs)

    samplers = {"base": service.create_sampling_client(base_model="production").result()}
    drawn: dict[str, tuple[list[int], list[float]]] = {}
    rng = random.Random(os.environ.get("FLYWHEEL_FAULT_SEED"))
    kills = []

    def kill_and_restart() -> None:
        kills.append(time.monotonic())
        life.kill()
        life.start()

    killer = threading.Timer(rng.uniform(0.5, 4.0), kill_and_restart)
    killer.start()
    step, failures = 0, 0
    # Snapshots until the kill has come and gone, at most 40: the server keeps the newest 64
    # (`max_snapshots`), and an evicted one rightly answers 404.
    while (step < 6 or killer.is_alive()) and step < 40:
        try:
            training.forward_backward(data, "cross_entropy").result()
            training.optim_step(types.AdamParams(learning_rate=5e-2)).result()
            sampler = training.save_weights_and_get_sampling_client().result()
            drawn[f"step {step}"] = draw(sampler)
            samplers[f"step {step}"] = sampler
            step += 1
        except (ValueError, tinker.APIError):  # a request in flight at the kill
            failures += 1
            assert failures <= len(kills), f"{failures} failed requests for {len(kills)} kills"
    killer.join()
    path = training.save_weights_for_sampler("named").result().path
    samplers["named"] = service.create_sampling_client(model_path=path).result()
    for name in ("base", "named"):
        drawn[name] = draw(samplers[name])
    assert len({tuple(t) for t, _ in drawn.values()}) > 2, "the samplers' weights should differ"

    kill_and_restart()  # a chosen moment: every sampler acknowledged, none in use
    assert life.lives == 3 and len(kills) == 2
    for name, sampler in samplers.items():
        again_tokens, again_logprobs = draw(sampler)
        assert again_tokens == drawn[name][0], name
        assert again_logprobs == pytest.approx(drawn[name][1], abs=1e-5), name


def test_only_the_newest_snapshots_keep_a_record(server, tmp_path):
    _, registry = server
    service = TinkerService(registry, tmp_path, max_snapshots=2)
    try:
        session = service.create_session("alice")
        model_id = service.create_model("alice", session, 0, "production", 4, 0, True, True)["model_id"]
        ids = [service.save_for_sampler("alice", model_id, None, session, seq)["sampling_session_id"]
               for seq in (1, 2, 3)]
        on_disk = sorted(p.name for p in (tmp_path / "samplers").iterdir())
        assert on_disk == sorted(f"{i.replace(':', '_')}.pt" for i in ids[1:])
        with pytest.raises(NotFound):
            service.sampler(ids[0], "alice")
        restarted = TinkerService(registry, tmp_path)
        try:
            assert restarted.sampler(ids[2], "alice").deltas is not None
            with pytest.raises(NotFound):
                restarted.sampler(ids[2], "bob")  # the owner comes back with it
        finally:
            restarted.close()
    finally:
        service.close()
