"""The official tinker SDK (0.38), unmodified, against `flywheel tinker serve` on loopback: a real server,
real forward passes of the tiny model, real LoRA steps, the Registry it registers adapters in.

One server for the folder (conftest.py); each test drives it through `tinker.ServiceClient` the way a
Tinker script does, and checks numbers the server could not fake: the loss the SDK reports against
the per-token logprobs it returns, the sampler's logprobs against a forward pass of the same tokens,
the registered version's logits against the trained adapter's."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch
from installed import installed  # this folder's: skip with the install line, fail in CI

from flywheel.live.server import LiveServer, ServeConfig, serve_in_thread
from flywheel.live.settings import LoopConfig
from flywheel.model.registry import Registry

tinker = installed("tinker")
types = tinker.types

TEXT = "def add(a, b):\n    return a + b\n"


def datum(tokenizer, text: str = TEXT, weights: float = 1.0):
    ids = tokenizer.encode(text)
    return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                       loss_fn_inputs={"target_tokens": ids[1:], "weights": [weights] * (len(ids) - 1)})


def forward(client, data, loss="cross_entropy", inputs=None):
    result = client.forward(data, loss).result()
    return result.metrics["loss:sum"], [np.asarray(o["logprobs"].data) for o in result.loss_fn_outputs]


def test_sdk_trains_checkpoints_samples_and_registers_a_lora_adapter(server):
    url, registry = server
    service = tinker.ServiceClient(base_url=url, api_key="tml-alice")
    training = service.create_lora_training_client(base_model="production", rank=4, seed=0).result()
    assert training.get_info().lora_rank == 4
    tokenizer = training.get_tokenizer()  # from the tokenizer_id the server gives: the Registry version's folder
    data = [datum(tokenizer)]

    start, logprobs = forward(training, data)
    assert start == pytest.approx(-float(logprobs[0].sum()), rel=1e-5)  # cross_entropy = -sum(weights * logprobs)
    losses = []
    for _ in range(4):
        step = training.forward_backward(data, "cross_entropy")
        optim = training.optim_step(types.AdamParams(learning_rate=1e-2))
        losses.append(step.result().metrics["loss:sum"])
        assert optim.result().metrics["optim/skipped"] == 0.0
    assert losses[0] == pytest.approx(start, rel=1e-5) and losses == sorted(losses, reverse=True)

    # save_state, train on, then a client from the state scores the data as the saved weights did
    state_path = training.save_state("mid").result().path
    at_save, _ = forward(training, data)
    training.forward_backward(data, "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert forward(training, data)[0] < at_save
    resumed = service.create_training_client_from_state_with_optimizer(state_path).result()
    assert forward(resumed, data)[0] == pytest.approx(at_save, rel=1e-5)

    # a named sampler save is a Registry version: an adapter of v0 whose merged weights score as trained
    final, final_logprobs = forward(training, data)
    sampler_path = training.save_weights_for_sampler("final").result().path
    version = next(c for c in registry.list() if c.note == f"tinker {sampler_path}")
    assert version.base == 0 and version.org_id == ""
    merged, _ = Registry(registry.root).load(version.version)
    ids = torch.tensor([data[0].model_input.to_ints()])
    served = torch.log_softmax(merged(input_ids=ids).logits[0].float(), -1)
    targets = torch.tensor(data[0].loss_fn_inputs["target_tokens"].data)
    assert np.allclose(served.gather(-1, targets[:, None])[:, 0].detach().numpy(), final_logprobs[0], atol=1e-4)

    # sampling from it: per-token logprobs equal to a forward pass of the same tokens by the trainer
    sampler = service.create_sampling_client(model_path=sampler_path).result()
    prompt = tokenizer.encode(TEXT)[:4]
    response = sampler.sample(types.ModelInput.from_ints(prompt), 2, types.SamplingParams(max_tokens=6, seed=3),
                              include_prompt_logprobs=True).result()
    assert len(response.sequences) == 2 and response.prompt_logprobs[0] is None
    for sequence in response.sequences:
        assert 1 <= len(sequence.tokens) <= 6 and len(sequence.logprobs) == len(sequence.tokens)
        full = prompt + sequence.tokens
        scored = types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                             loss_fn_inputs={"target_tokens": full[1:], "weights": [0.0] * (len(full) - 1)})
        _, trainer_logprobs = forward(training, [scored])
        assert np.allclose(trainer_logprobs[0][len(prompt) - 1:], sequence.logprobs, atol=1e-3)
        assert np.allclose(trainer_logprobs[0][: len(prompt) - 1], response.prompt_logprobs[1:], atol=1e-3)


def test_rl_losses_and_a_custom_loss_follow_tinkers_definitions(server):
    url, _ = server
    training = tinker.ServiceClient(base_url=url, api_key="tml-alice").create_lora_training_client(
        base_model="production", rank=4, seed=1).result()
    tokenizer = training.get_tokenizer()
    base = datum(tokenizer)
    _, (logp,) = forward(training, [base])
    n = len(logp)
    advantages = np.where(np.arange(n) % 2 == 0, 1.0, -0.5).astype(np.float32)

    def rl_datum(sampler_logprobs):
        return types.Datum(model_input=base.model_input, loss_fn_inputs={
            "target_tokens": base.loss_fn_inputs["target_tokens"], "logprobs": sampler_logprobs.tolist(),
            "advantages": advantages.tolist()})

    # on-policy importance sampling: ratio 1, loss = -sum(advantages)
    on_policy = training.forward([rl_datum(logp)], "importance_sampling").result()
    assert on_policy.metrics["loss:sum"] == pytest.approx(-advantages.sum(), abs=1e-3)
    # PPO with the sampler one nat more likely: ratio e^-1 is under the 0.8 floor, which binds for A < 0
    stale = logp + 1.0
    ppo = training.forward([rl_datum(stale)], "ppo").result()
    ratio = np.exp(logp - stale)
    expected = -np.minimum(ratio * advantages, np.clip(ratio, 0.8, 1.2) * advantages).sum()
    assert ppo.metrics["loss:sum"] == pytest.approx(expected, rel=1e-4)
    wider = training.forward([rl_datum(stale)], "ppo", {"clip_low_threshold": 0.1}).result()
    assert wider.metrics["loss:sum"] == pytest.approx(-(ratio * advantages).sum(), rel=1e-4)

    # forward_backward_custom: the SDK computes the loss on the client and sends its gradient as weights
    def custom(data, logprobs_list):
        loss = -(logprobs_list[0] * torch.tensor(advantages)).sum()
        return loss, {"custom:sum": float(loss.detach())}

    result = training.forward_backward_custom([rl_datum(logp)], custom).result()
    assert result.metrics["loss:sum"] == pytest.approx(-(logp * advantages).sum(), rel=1e-4)
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    after = training.forward([rl_datum(logp)], "importance_sampling").result().metrics["loss:sum"]
    assert after < on_policy.metrics["loss:sum"]  # the step followed the custom loss's gradient downhill


def test_clients_are_isolated_by_adapter_and_key_and_unsupported_requests_are_refused(server):
    url, _ = server
    alice = tinker.ServiceClient(base_url=url, api_key="tml-alice")
    first = alice.create_lora_training_client(base_model="production", rank=4, seed=0).result()
    second = alice.create_lora_training_client(base_model="production", rank=4, seed=0).result()
    data = [datum(first.get_tokenizer())]
    before, _ = forward(second, data)
    for _ in range(2):
        first.forward_backward(data, "cross_entropy")
        first.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert forward(first, data)[0] < before and forward(second, data)[0] == pytest.approx(before, rel=1e-6)

    # both sampled at once, each from its own weights
    samplers = [c.save_weights_and_get_sampling_client().result() for c in (first, second)]
    prompt = types.ModelInput.from_ints(data[0].model_input.to_ints()[:4])
    pending = [s.sample(prompt, 1, types.SamplingParams(max_tokens=4, seed=5)) for s in samplers]
    outputs = [p.result().sequences[0] for p in pending]
    assert outputs[0].logprobs != outputs[1].logprobs

    # another key sees none of it; a sampling-only key cannot train; an unknown key gets nowhere
    raw = httpx.Client(base_url=url, timeout=30)
    for key, status in (("tml-bob", 404), ("tml-viewer", 403), ("tml-nobody", 401)):
        reply = raw.post("/api/v1/get_info", json={"model_id": first.model_id}, headers={"X-API-Key": key})
        assert reply.status_code == status, reply.text
    with pytest.raises(tinker.PermissionDeniedError):
        tinker.ServiceClient(base_url=url, api_key="tml-viewer").create_lora_training_client(
            base_model="production").result()

    # refused with the SDK's own errors, and the server keeps serving
    with pytest.raises(tinker.BadRequestError, match="not implemented by flywheel"):
        first.forward_backward(data, "cispo").result()
    with pytest.raises(tinker.BadRequestError, match="top_k is not supported"):
        samplers[0].sample(prompt, 1, types.SamplingParams(max_tokens=2, top_k=5)).result()
    with pytest.raises(tinker.BadRequestError, match="dimuon"):
        alice.create_lora_training_client(base_model="production", optimizer=types.DimuonOptimizerConfig()).result()
    headers = {"X-API-Key": "tml-alice"}
    session = raw.post("/api/v1/create_session", headers=headers,
                       json={"tags": [], "user_metadata": None, "sdk_version": "0.38.0"}).json()["session_id"]
    full = raw.post("/api/v1/create_model", headers=headers,
                    json={"session_id": session, "model_seq_id": 0, "base_model": "production"})
    assert full.status_code == 400 and "full fine-tuning is not supported" in full.json()["error"]
    garbage = raw.post("/api/v1/forward_backward", content=b"\xff\x00garbage",
                       headers=headers | {"Content-Type": "application/x-protobuf"})
    assert garbage.status_code == 400 and garbage.json()["category"] == "user"
    assert forward(first, data)[0] < before  # still serving the same client


def test_a_tinker_trained_adapter_is_served_by_the_live_server_as_its_registry_version(server, tmp_path):
    url, registry = server
    training = tinker.ServiceClient(base_url=url, api_key="tml-bob").create_lora_training_client(
        base_model="production", rank=4, seed=2).result()
    data = [datum(training.get_tokenizer())]
    training.forward_backward(data, "cross_entropy")
    training.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    sampler_path = training.save_weights_for_sampler("served").result().path
    version = next(c.version for c in registry.list() if c.note == f"tinker {sampler_path}")

    # deployed as the candidate of an A/B test, as a cycle deploys any version; `flywheel serve` serves it
    registry.set_alias("candidate", version)
    config = ServeConfig(loop=LoopConfig.at(tmp_path / "live.sqlite", registry.root), keys={"k": ["inference"]},
                         candidate_fraction=0.0, threads=1)
    live = LiveServer.from_config(config)
    with live, serve_in_thread(live) as running, httpx.Client(
            base_url=running.url, headers={"authorization": "Bearer k"}, timeout=120) as http:
        reply = http.post("/v1/chat/completions", json={
            "model": f"v{version}", "messages": [{"role": "user", "content": "Fix the failing test."}],
            "max_tokens": 8, "temperature": 1.0, "seed": 5}).json()
        assert "id" in reply, reply
        stored = live.store.completion(reply["id"])
    assert stored.version == version
    full = stored.prompt_ids + stored.completion_ids
    scored = types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                         loss_fn_inputs={"target_tokens": full[1:], "weights": [0.0] * (len(full) - 1)})
    _, (trained,) = forward(training, [scored])
    assert np.allclose(trained[len(stored.prompt_ids) - 1:], stored.logprobs, atol=1e-3)  # served = trained


ENDPOINTS = ["create_session", "session_heartbeat", "create_model", "get_info", "forward_backward", "optim_step",
             "save_weights", "load_weights", "save_weights_for_sampler", "create_sampling_session",
             "join_sampling_session", "asample", "retrieve_future", "no_such_endpoint"]
BODIES = [b"", b"not json", b"\xff\xfe", b"[]", b'{"model_id": 3}', b'{"session_id": {"a": 1}, "model_seq_id": -1}',
          b'{"request_id": "nope"}', b'{"sampling_session_id": "x:sample:0", "prompt": {"chunks": []}, '
          b'"sampling_params": {"max_tokens": 1e9}}', b'{"model_id": "../../etc", "path": "../x", "optimizer": true}']


def test_malformed_requests_cost_only_themselves(server):
    """Every endpoint, every kind of bad body: a 4xx in the Tinker error shape, never a 500."""
    url, _ = server
    with httpx.Client(base_url=url, timeout=30, headers={"X-API-Key": "tml-alice"}) as raw:
        for endpoint in ENDPOINTS:
            for body in BODIES:
                for content_type in ("application/json", "application/x-protobuf"):
                    reply = raw.post(f"/api/v1/{endpoint}", content=body, headers={"Content-Type": content_type})
                    assert 400 <= reply.status_code < 500, (endpoint, body, reply.status_code, reply.text)
                    assert reply.json()["category"] == "user"
        assert raw.get("/api/v1/healthz").json() == {"status": "ok"}
