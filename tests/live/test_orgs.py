"""Per-organization adapters: a real peft LoRA adapter on the real tiny base, trained by the Learner on
one organization's on-policy completions, registered as a Registry version with its base and
organization, loaded back exactly, and gated on two batteries."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
import torch
from tiny_serving import KEYS, make_registry

from flywheel.live.batch import on_policy_batch
from flywheel.live.cycle import HttpControl
from flywheel.live.deploy import Deployment
from flywheel.live.gate import GateDecision, GateResult, GateRun
from flywheel.live.orgs import (
    OrgAdapterConfig,
    gate_decision,
    org_alias,
    orgs_with_traffic,
    register_adapter,
    train_org_adapter,
)
from flywheel.live.records import Completion
from flywheel.live.rewards import RewardDistiller
from flywheel.live.server import LiveServer, ServeConfig, serve_in_thread
from flywheel.live.settings import LoopConfig, StoreConfig
from flywheel.model.adapters import adapter_view, load_adapted, lora_model, merged
from flywheel.model.chat import SYSTEM_PROMPT
from flywheel.model.engine import EngineConfig, LocalEngine, SamplingParams
from flywheel.model.registry import PRODUCTION, CheckpointNotFound
from flywheel.rl.learner import LearnerConfig


def sampled(model, tokenizer, org: str, n: int, seed: int) -> list[Completion]:
    """n completions of one prompt sampled from `model` itself, 6 tokens each, with their exact
    behaviour logprobs (on-policy); one batched forward pass per token."""
    gen = torch.Generator().manual_seed(seed)
    prompt = tokenizer("Fix the failing test.", add_special_tokens=False)["input_ids"]
    ids = torch.tensor([prompt] * n)  # [n, seq]
    logprobs = []
    with torch.no_grad():
        for _ in range(6):
            logp = torch.log_softmax(model(ids).logits[:, -1].float(), dim=-1)  # [n, vocab]
            token = torch.multinomial(logp.exp(), 1, generator=gen)  # [n, 1]
            logprobs.append(logp.gather(1, token))
            ids = torch.cat([ids, token], dim=1)
    lp = torch.cat(logprobs, dim=1)  # [n, 6]
    return [Completion(id=f"{org}-{k}", session_id=f"{org}-s{k}", user_id="u", version=0, prompt_ids=prompt,
                       completion_ids=ids[k, len(prompt):].tolist(), logprobs=lp[k].tolist(), latency_ms=5.0,
                       created_at=1000.0 + k, org_id=org, request_meta={"family": "f"}) for k in range(n)]


def seq_logprob(model, c: Completion) -> float:
    ids = c.prompt_ids + c.completion_ids
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    p = len(c.prompt_ids)
    return float(sum(logp[p - 1 + i, t] for i, t in enumerate(c.completion_ids)))


def test_an_org_adapter_trains_on_its_traffic_registers_with_base_and_org_and_loads_back(tmp_path):
    torch.manual_seed(0)
    torch.set_num_threads(1)
    registry = make_registry(tmp_path / "registry")
    base, tokenizer = registry.load(0)
    acme = sampled(base, tokenizer, "acme", 24, seed=1)
    few = sampled(base, tokenizer, "tiny-co", 3, seed=2)
    rewards = {r.completion_id: r for r in RewardDistiller().distill(acme + few, [], now=10**10)}  # all defaulted
    assert set(orgs_with_traffic(acme + few, rewards, version=0, min_completions=8)) == {"acme"}

    # The organization's convention: completions that use token `house` are kept, the rest reverted.
    house = acme[0].completion_ids[0]
    for c in acme:
        r = rewards[c.id]
        reward = 1.0 if house in c.completion_ids else -1.0
        rewards[c.id] = r.model_copy(update={"reward": reward, "parts": {"no_feedback": reward}})
    batch = on_policy_batch(acme, [rewards[c.id] for c in acme], version=0)
    before = {c.id: seq_logprob(base, c) for c in acme}
    base_weights = {k: v.clone() for k, v in base.state_dict().items()}
    config = OrgAdapterConfig(rank=4, alpha=8.0)
    adapter, metrics = train_org_adapter(base, batch, LearnerConfig(lr=5e-3, minibatches=2, ppo_epochs=2), config)
    assert metrics["optimizer_steps"] == 4 and 0 < metrics["trainable_params"] < 0.2 * sum(
        p.numel() for p in base.parameters())
    # The shared base is untouched; the adapter moved the organization's rewarded answers up.
    assert all(torch.equal(v, base_weights[k]) for k, v in base.state_dict().items())
    gain = {c.id: seq_logprob(adapter, c) - before[c.id] for c in acme}
    good = [gain[c.id] for c in acme if house in c.completion_ids]
    bad = [gain[c.id] for c in acme if house not in c.completion_ids]
    assert good and bad and sum(good) / len(good) > sum(bad) / len(bad)

    checkpoint = register_adapter(registry, adapter, tokenizer, base=0, org_id="acme",
                                  metrics={"batch_completions": 24.0}, aliases=[org_alias(PRODUCTION, "acme")])
    assert (checkpoint.base, checkpoint.org_id, checkpoint.parent) == (0, "acme", 0)
    assert registry.get("production-acme").version == checkpoint.version and registry.get(PRODUCTION).version == 0
    files = {p.name for p in checkpoint.path.iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json", "flywheel.json"} <= files
    assert "model.safetensors" not in files  # the base is not copied
    with pytest.raises(ValueError, match="is a LoRA adapter of v0 for 'acme'"):
        registry.load(checkpoint.version)
    loaded, _ = load_adapted(registry, checkpoint.version)
    ids = torch.tensor([acme[0].prompt_ids + acme[0].completion_ids])
    with torch.no_grad():
        trained_logits = adapter(ids).logits
        assert torch.allclose(loaded(ids).logits, trained_logits, atol=1e-5)
        assert torch.allclose(merged(adapter)(ids).logits, trained_logits, atol=1e-4)
    # Served without reloading the base: the view shares every tensor the adapter does not touch.
    view = adapter_view(base, loaded)
    second = adapter_view(base, train_org_adapter(base, batch, LearnerConfig(lr=1e-2), config)[0])
    with torch.no_grad():
        assert torch.allclose(view(ids).logits, trained_logits, atol=1e-4)
        assert not torch.allclose(second(ids).logits, trained_logits, atol=1e-4)
    base_params = dict(base.named_parameters())
    for model in (view, second):
        shared = {n for n, p in model.named_parameters() if p.data_ptr() == base_params[n].data_ptr()}
        adapted = set(base_params) - shared
        assert adapted and all(n.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"))
                               for n in adapted)
        assert "model.embed_tokens.weight" in shared
    assert all(torch.equal(v, base_weights[k]) for k, v in base.state_dict().items())
    with LocalEngine(view, EngineConfig(max_batch=2)) as engine:
        generation = engine.generate([acme[0].prompt_ids], SamplingParams(temperature=0.0, max_tokens=3))[0]
    with torch.no_grad():
        expect = adapter(torch.tensor([acme[0].prompt_ids])).logits[0, -1].argmax().item()
    assert generation.token_ids[0] == expect
    with pytest.raises(ValueError, match="adapters apply on a full checkpoint"):
        register_adapter(registry, adapter, tokenizer, base=checkpoint.version, org_id="acme")
    with pytest.raises(ValueError, match="organization id"):
        register_adapter(registry, adapter, tokenizer, base=0, org_id="Acme Corp")
    registry.close()


def _run(**checks: bool) -> GateRun:
    results = {name: GateResult(passed=ok, diff=0.0 if ok else -0.3, ci_low=-0.05 if ok else -0.4, ci_high=0.1, n=32,
                                method="paired", reason="within the margin" if ok else "below the margin")
               for name, ok in checks.items()}
    return GateRun(decision=GateDecision(passed=all(checks.values()), checks=results), candidate_version=3,
                   production_version=0, tasks=32, candidate={}, production={}, seconds=1.0)


def test_an_adapter_must_pass_both_its_organizations_battery_and_the_general_one():
    assert gate_decision(_run(pass_rate=True), _run(pass_rate=True)).passed
    forgot = gate_decision(_run(pass_rate=True), _run(pass_rate=False, valid_tool_call_rate=True))
    assert not forgot.passed and forgot.reason.startswith("general battery: pass_rate")
    assert not gate_decision(_run(pass_rate=False), _run(pass_rate=True)).passed


def random_adapters(registry, org: str, seeds) -> list[int]:
    """Distinct adapters of `org` on v0, one per seed (LoRA B starts at zero, so it gets random weights)."""
    base, tokenizer = registry.load(0)
    versions = []
    for seed in seeds:
        adapter = lora_model(base, OrgAdapterConfig(rank=4))
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in adapter.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
        versions.append(register_adapter(registry, adapter, tokenizer, base=0, org_id=org).version)
    return versions


def test_the_server_routes_each_org_to_its_adapters_ab_tests_within_it_and_rolls_it_back_alone(tmp_path):
    torch.manual_seed(0)
    torch.set_num_threads(1)
    registry = make_registry(tmp_path / "registry")
    a1, a2 = random_adapters(registry, "acme", (1, 2))
    registry.close()
    keys = {**KEYS, "acme-key": ["inference", "events"]}
    serve = ServeConfig(loop=LoopConfig.at(tmp_path / "live" / "live.sqlite", tmp_path / "registry"), keys=keys,
                        orgs={"acme-key": "acme"}, threads=1, candidate_fraction=0.0)
    server = LiveServer.from_config(serve)
    server.set_deployment(Deployment(production=0))
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "Fix the failing test."}]
    with serve_in_thread(server) as running:
        acme = openai.OpenAI(base_url=f"{running.url}/v1", api_key="acme-key", max_retries=0, timeout=60)
        other = openai.OpenAI(base_url=f"{running.url}/v1", api_key="inference-key", max_retries=0, timeout=60)

        def served(api: openai.OpenAI, session: str) -> tuple[int, str]:
            r = api.chat.completions.create(model="flywheel", messages=messages, max_tokens=2,
                                            extra_body={"session_id": session})
            c = server.store.completion(r.id)
            return c.version, c.arm

        server.set_org_deployment("acme", Deployment(production=a1))
        assert served(acme, "a-0") == (a1, "production") and served(other, "o-0") == (0, "production")
        # One engine per adapter on the base's own tensors: nothing of the base was loaded again.
        view = server._org_routers["acme"].engine(a1).model
        shared = server.router.engine(0).model
        assert view.get_input_embeddings().weight.data_ptr() == shared.get_input_embeddings().weight.data_ptr()

        server.set_org_deployment("acme", Deployment(production=a1, candidate=a2, candidate_fraction=0.5))
        seen = {served(acme, f"ab-{i}") for i in range(16)}
        assert seen == {(a1, "production"), (a2, "candidate")}
        assert {served(other, f"o-{i}")[0] for i in range(4)} == {0}
        assert server.org_deployment("acme").candidate == a2

        server.set_org_deployment("acme", None)  # rolled back alone
        assert served(acme, "a-1") == (0, "production") and server.org_deployment("acme") is None
        with pytest.raises(ValueError, match="full checkpoint"):
            server.set_org_deployment("acme", Deployment(production=a1, candidate=1, candidate_fraction=0.5))
        # The base against its first adapter, within the organization:
        server.set_org_deployment("acme", Deployment(production=0, candidate=a1, candidate_fraction=0.5))
        assert {served(acme, f"first-{i}") for i in range(12)} == {(0, "production"), (a1, "candidate")}
    server.close()


def test_admin_endpoints_set_org_deployments_that_every_replica_follows(tmp_path, store_url):
    """Two servers on one real store (SQLite file, then PostgreSQL), as replicas: an organization's
    deployment set through one's admin endpoint is validated, moves that organization's Registry
    aliases, and is served by the other, which also restores it when it starts after the change."""
    torch.set_num_threads(1)
    registry = make_registry(tmp_path / "registry")
    a1, a2 = random_adapters(registry, "acme", (1, 2))
    (g1,) = random_adapters(registry, "globex", (3,))
    keys = {**KEYS, "acme-key": ["inference"]}

    def replica(name: str) -> LiveServer:
        store = StoreConfig(registry_root=tmp_path / "registry", path=tmp_path / name / "live.sqlite", url=store_url)
        return LiveServer.from_config(ServeConfig(loop=LoopConfig(store=store), keys=keys, orgs={"acme-key": "acme"},
                                                  threads=1, candidate_fraction=0.0, deployment_poll_s=0.1))

    admin = {"authorization": "Bearer admin-key"}
    url = "/v1/admin/orgs/acme/deployment"
    ab = {"production": a1, "candidate": a2, "candidate_fraction": 0.5}
    with replica("a") as a, serve_in_thread(a) as running_a, httpx.Client(base_url=running_a.url, timeout=60) as http:
        assert http.get("/v1/admin/orgs").status_code == 401
        assert http.get("/v1/admin/orgs", headers={"authorization": "Bearer inference-key"}).status_code == 403
        assert http.put(url, json={"deployment": None}, headers={"authorization": "Bearer acme-key"}).status_code == 403
        listed = http.get("/v1/admin/orgs", headers=admin).json()
        assert listed["shared"]["production"] == 0
        assert [(o["org_id"], o["deployment"], o["adapters"]) for o in listed["orgs"]] == [
            ("acme", None, [a1, a2]), ("globex", None, [g1])]

        for body, status, says in [
            ({"deployment": {"production": g1}}, 400, "an adapter of 'globex'"),
            ({"deployment": {"production": a1, "candidate": 1, "candidate_fraction": 0.5}}, 400, "a full checkpoint"),
            ({"deployment": {"production": 999}}, 404, "999"),
            ({"deployment": {"production": a1, "candidate": a1}}, 400, "both production and candidate"),
            ({"deployment": {"production": a1}, "extra": 1}, 400, "extra"),
            ({}, 400, "deployment"),
        ]:
            r = http.put(url, json=body, headers=admin)
            assert r.status_code == status and says in r.json()["error"]["message"], (body, r.text)
        r = http.put("/v1/admin/orgs/Acme Corp/deployment", json={"deployment": None}, headers=admin)
        assert r.status_code == 400 and "organization id" in r.json()["error"]["message"]
        assert a.org_deployment("acme") is None  # nothing refused changed anything

        r = http.put(url, json={"deployment": ab}, headers=admin)
        assert r.status_code == 200, r.text
        assert r.json()["deployment"] == ab and r.json()["previous"] is None and r.json()["served_versions"] == [a1, a2]
        assert http.get(url, headers=admin).json()["deployment"] == ab
        assert (registry.get("production-acme").version, registry.get("candidate-acme").version) == (a1, a2)

        # A replica started after the change serves it from the store; later changes it follows.
        with replica("b") as b, serve_in_thread(b) as running_b:
            def b_serves(wanted) -> None:
                deadline = time.monotonic() + 30
                while httpx.get(f"{running_b.url}{url}", headers=admin).json()["deployment"] != wanted:
                    assert time.monotonic() < deadline, f"replica b did not follow to {wanted}"
                    time.sleep(0.05)

            b_serves(ab)
            acme = openai.OpenAI(base_url=f"{running_b.url}/v1", api_key="acme-key", max_retries=0, timeout=60)
            versions = set()
            for i in range(12):
                reply = acme.chat.completions.create(model="flywheel", max_tokens=1, extra_body={"session_id": f"s{i}"},
                                                     messages=[{"role": "user", "content": "Fix the failing test."}])
                versions.add(b.store.completion(reply.id).version)
            assert versions == {a1, a2}  # the A/B split within acme's traffic, on replica b

            # What `flywheel live` uses next to a server: the same endpoints.
            control = HttpControl(running_a.url, "admin-key")
            assert control.org_current("acme") == Deployment(**ab) and control.org_current("globex") is None
            control.apply_org("acme", Deployment(production=a2), "cycle")
            control.close()
            b_serves({"production": a2, "candidate": None, "candidate_fraction": 0.0})
            r = http.put(url, json={"deployment": None}, headers=admin)
            assert r.status_code == 200 and r.json()["previous"]["production"] == a2
            b_serves(None)
            assert b.org_deployment("acme") is None
        with pytest.raises(CheckpointNotFound):
            registry.get("production-acme")
        rows = a.store.latest_org_deployments()
        assert rows["acme"]["production"] is None and rows["acme"]["note"] == "admin endpoint"
    registry.close()
