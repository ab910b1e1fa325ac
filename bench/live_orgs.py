"""Longer loops and organizations: outcomes that arrive hours later, and per-organization adapters.

    python bench/live_orgs.py                     # both parts (8-15 min on 2 shared, heavily loaded cores)
    python bench/live_orgs.py --cycles 4 --org-samples 96

Prints one JSON object on stdout; progress goes to stderr.

Part 1, background sessions (`background`): several cycles, 6 simulated hours apart, over a real
LiveStore. Each cycle's window holds background sessions of the production version whose outcome
comes a delay after the session ends, drawn from the simulated users' background profile
(`UserProfile.outcome_delay_s`, here 1 to 10 hours: some come after the next cycle started). Each
cycle gathers with `gather_background` (the real rule) at its cutoff + the late-arrival window, for
windows of 0 (the baseline: no wait), 1 and 3 hours: the share of the window's sessions whose
outcome arrived in time, and what was left out by reason. Time is the records' timestamps; nothing
sleeps. The session-level outcome rate here does not improve over cycles: the scripted policy does
not learn (part 2 is where weights change).

Part 2, organizations (`orgs`): the tiny Qwen3-MoE base and two organizations, each with its own
convention: an answer is kept (edit persisted) when it uses the organization's house vocabulary, and
reverted with a dissatisfied follow-up otherwise. General traffic has no convention. Each cycle
samples `--org-samples` answers per organization from what serves it (the base, then its adapter:
on-policy), trains its LoRA adapter with the real Learner on them (`train_org_adapter`), and
measures on fresh samples: persistence and dissatisfied-follow-up rate, adapter against base, with
Wilson intervals; and the general battery: the per-token logprob of fixed general answers under
adapter and base (Welch interval of the difference), which should stay within the margin
(`--general-margin` nats per token). This is a token-level world, not the coding-task world: the
tiny model solves no procedural task, so a pass rate there would be 0 for every version.

Measured (2 cores shared with other jobs, load average 20-46): background outcomes in time over
3 cycles x 40 sessions: 34/120 (28%) with no wait, 74/120 (62%) waiting 1 h, 83/120 (69%) waiting
3 h (the rest: open, left out, or past the 8 h horizon, scored as the worst outcome). Organizations,
house vocabulary, lr 1e-2: acme persistence 0.18 / 0.17 / 0.15 against the base's 0.14 over three
cycles (n = 200 each: within the Wilson intervals, so no significant gain), general logprob
difference -0.002, -0.014, -0.020 nats per token (inside the 0.1 margin); that run was stopped by
its 900 s timeout before globex. An earlier run with one house token per org and lr 5e-3: globex
0.04 / 0.03 / 0.07 against 0.01, acme 0.03 / 0.04 / 0.04 against 0.03. The adapter's effect in
this world is small: a LoRA on the attention projections of a random-init model moves its output
distribution little in 12 optimizer steps; the world needs a stronger learnable convention (or an
SFT-ed base) before its figures say much.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

from flywheel.api.events import Event, EventType
from flywheel.live.batch import on_policy_batch
from flywheel.live.orgs import OrgAdapterConfig, adapter_view, train_org_adapter
from flywheel.live.records import BACKGROUND, Completion, CompletionToolCall
from flywheel.live.rewards import Reward, RewardConfig, RewardDistiller, RewardStatus
from flywheel.live.sessions import gather_background
from flywheel.live.store import LiveStore
from flywheel.model.chat import SYSTEM_PROMPT, render_messages, tool_schemas
from flywheel.model.factory import ModelConfig, build_model
from flywheel.model.tokenizer import train_tokenizer
from flywheel.rl.learner import LearnerConfig
from flywheel.stats import welch_interval, wilson_interval

H = 3600.0


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---- part 1: background sessions


def background(cycles: int, sessions_per_cycle: int, seed: int) -> dict:
    rng = random.Random(seed)
    waits = {"0h": 0.0, "1h": H, "3h": 3 * H}
    period, t0 = 6 * H, 1_000_000.0
    out: dict = {"cycles": cycles, "sessions_per_cycle": sessions_per_cycle, "outcome_delay_h": [1, 10],
                 "by_wait": {}}
    with tempfile.TemporaryDirectory() as tmp:
        store = LiveStore(Path(tmp) / "live.sqlite", synchronous="NORMAL")
        pending: list[Event] = []
        for c in range(cycles):
            start = t0 + c * period
            for k in range(sessions_per_cycle):
                name, begin = f"c{c}-s{k}", start + rng.uniform(0, period - H)
                turns = rng.randint(4, 12)
                for i in range(turns):
                    calls = [CompletionToolCall(name="edit_file" if i == turns // 2 else "read_file",
                                                arguments={"path": "a.py"})] if i < turns - 1 else []
                    store.add_completion(Completion(
                        id=f"{name}-{i}", session_id=name, user_id="u", version=0, prompt_ids=[1], completion_ids=[2],
                        logprobs=[-0.1], latency_ms=10.0, tool_calls=calls, created_at=begin + 120.0 * i,
                        session_kind=BACKGROUND))
                end = begin + 120.0 * (turns - 1)
                what = "merged" if rng.random() < 0.6 else "reverted"
                pending.append(Event(id=f"out-{name}", type=EventType.OUTCOME, session_id=name,
                                     time=end + rng.uniform(1, 10) * H, payload={"outcome": what}))
        distiller = RewardDistiller(RewardConfig())
        for label, wait in waits.items():
            rows = []
            for c in range(cycles):
                since, cutoff = t0 + c * period, t0 + (c + 1) * period
                now = cutoff + wait
                arrived = [e for e in pending if e.time <= now]
                store.add_events(arrived)  # idempotent: earlier waits' events are duplicates
                got = gather_background(store, distiller, 0, since, cutoff, now)
                total = got.sessions + sum(got.left_out.values())
                # In time: an outcome arrived; "unresolved" sessions (horizon passed) are in the batch
                # scored as the worst outcome, "open" ones are left out.
                in_time = got.sessions - got.outcomes.get("unresolved", 0)
                rows.append({"cycle": c + 1, "sessions": total, "in_time": in_time,
                             "share_in_time": in_time / total if total else None, "left_out": got.left_out,
                             "outcomes": got.outcomes})
            n = sum(r["sessions"] for r in rows)
            k = sum(r["in_time"] for r in rows)
            low, high = wilson_interval(k, n)
            out["by_wait"][label] = {"share_in_time": k / n, "ci": [low, high], "by_cycle": rows}
            log(f"background: wait {label}: {k}/{n} sessions' outcomes in time ({k / n:.0%})")
        store.close()
    return out


# ---- part 2: organizations


def _tiny_base(seed: int):
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "Fix the failing test."},
                {"role": "assistant", "content": "Reading.", "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "read_file", "arguments": {"path": "a.py"}}}]}]
    corpus = [render_messages(messages, tool_schemas())] * 4 + ["def add(a, b):\n    return a + b\n"] * 4
    tokenizer = train_tokenizer(corpus, vocab_size=400)
    model = build_model(ModelConfig(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=32,
                                    num_experts=4, experts_per_token=2, moe_intermediate_size=64, seed=seed),
                        tokenizer)
    return model.eval(), tokenizer


def _sample(model, prompt: list[int], n: int, tokens: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, tokens] sampled ids and their logprobs, one batched forward per token (exact behaviour logprobs)."""
    ids = torch.tensor([prompt] * n)
    lps = []
    with torch.no_grad():
        for _ in range(tokens):
            logp = torch.log_softmax(model(ids).logits[:, -1].float(), dim=-1)  # [n, vocab]
            tok = torch.multinomial(logp.exp(), 1, generator=gen)
            lps.append(logp.gather(1, tok))
            ids = torch.cat([ids, tok], 1)
    return ids[:, len(prompt):], torch.cat(lps, 1)


def _token_logprobs(model, prompt: list[int], answers: torch.Tensor) -> list[float]:
    """Mean per-token logprob of each answer [n, tokens] after `prompt`."""
    ids = torch.cat([torch.tensor([prompt] * len(answers)), answers], 1)
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[:, len(prompt) - 1 : -1].float(), dim=-1)
    return logp.gather(2, answers.unsqueeze(-1)).squeeze(-1).mean(1).tolist()


def orgs(cycles: int, samples: int, measure: int, general_margin: float, seed: int) -> dict:
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    base, tokenizer = _tiny_base(seed)
    tokens = 8
    prompts = {org: tokenizer(f"[{org}] Fix the failing test.", add_special_tokens=False)["input_ids"]
               for org in ("acme", "globex")}
    general_prompt = tokenizer("Fix the failing test.", add_special_tokens=False)["input_ids"]
    general_answers, _ = _sample(base, general_prompt, measure, tokens, gen)
    general_base = _token_logprobs(base, general_prompt, general_answers)
    # Each org's house vocabulary: 8 tokens the base uses, disjoint between the orgs (the base, near
    # uniform over its 400 tokens, uses one of them in ~10-20% of its answers).
    probe, _ = _sample(base, prompts["acme"], 256, tokens, gen)
    counts = {t: int((probe == t).any(1).sum()) for t in probe.unique().tolist()}
    usable = sorted(counts, key=lambda t: -counts[t])
    house = {"acme": torch.tensor(usable[0:16:2]), "globex": torch.tensor(usable[1:16:2])}
    config, learner = OrgAdapterConfig(rank=8, alpha=16.0), LearnerConfig(lr=1e-2, minibatches=2, ppo_epochs=2)
    result: dict = {"house_tokens": {org: t.tolist() for org, t in house.items()}, "general_margin": general_margin,
                    "by_org": {}}
    for org, prompt in prompts.items():
        adapter, served, rows = None, base, []
        base_answers, _ = _sample(base, prompt, measure, tokens, gen)
        base_kept = int(torch.isin(base_answers, house[org]).any(1).sum())
        for c in range(cycles):
            started = time.perf_counter()
            answers, logprobs = _sample(served, prompt, samples, tokens, gen)  # on-policy: what serves the org
            completions, rewards = [], []
            for k in range(samples):
                kept = bool(torch.isin(answers[k], house[org]).any())
                cid = f"{org}-{c}-{k}"
                completions.append(Completion(id=cid, session_id=cid, user_id="u", version=0, prompt_ids=prompt,
                                              completion_ids=answers[k].tolist(), logprobs=logprobs[k].tolist(),
                                              latency_ms=5.0, org_id=org, request_meta={"family": org}))
                parts = {"edit_persisted": 1.0} if kept else {"edit_reverted": -1.0, "followup_dissatisfied": -0.5}
                rewards.append(Reward(completion_id=cid, session_id=cid, version=0, arm="production",
                                      reward=sum(parts.values()), parts=parts, status=RewardStatus.FINAL))
            batch = on_policy_batch(completions, rewards, version=0)
            adapter, metrics = train_org_adapter(base, batch, learner, config, adapter)
            served = adapter_view(base, adapter)
            fresh, _ = _sample(served, prompt, measure, tokens, gen)
            kept = int(torch.isin(fresh, house[org]).any(1).sum())
            general = welch_interval(_token_logprobs(served, general_prompt, general_answers), general_base)
            row = {"cycle": c + 1,
                   "persistence": {"adapter": kept / measure, "adapter_ci": wilson_interval(kept, measure),
                                   "base": base_kept / measure, "base_ci": wilson_interval(base_kept, measure)},
                   "dissatisfied": {"adapter": 1 - kept / measure, "base": 1 - base_kept / measure},
                   "general_logprob_diff": {"estimate": general.estimate, "ci": [general.low, general.high],
                                            "within_margin": general.low > -general_margin},
                   "train_loss": metrics["loss"], "seconds": time.perf_counter() - started}
            rows.append(row)
            log(f"{org} cycle {c + 1}: persistence adapter {kept / measure:.2f} vs base {base_kept / measure:.2f}; "
                f"general logprob diff {general.estimate:+.3f} [{general.low:+.3f}, {general.high:+.3f}]")
        result["by_org"][org] = rows
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cycles", type=int, default=3)
    parser.add_argument("--sessions", type=int, default=40, help="background sessions per cycle")
    parser.add_argument("--org-samples", type=int, default=128, help="answers per organization per cycle")
    parser.add_argument("--measure", type=int, default=200, help="fresh answers per measurement")
    parser.add_argument("--general-margin", type=float, default=0.1, help="nats per token")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(2)
    started = time.perf_counter()
    out = {"background": background(args.cycles, args.sessions, args.seed),
           "orgs": orgs(args.cycles, args.org_samples, args.measure, args.general_margin, args.seed)}
    out["seconds"] = time.perf_counter() - started
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
