"""LocalEngine against full forward passes of a real tiny Qwen3-MoE (no mocks, CPU, float32).

Every check compares the engine with the plain model: logprobs with a full forward over the same
tokens, greedy tokens with one-at-a-time decoding without a cache. No timing assertions; waits
have timeouts so a broken engine fails instead of hanging.
"""

from __future__ import annotations

import copy
import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from flywheel.model.chat import IM_END, SYSTEM_PROMPT, render_messages, tool_schemas
from flywheel.model.engine import (
    EngineConfig,
    EngineError,
    Generation,
    LocalEngine,
    SamplingParams,
    _BatchCache,
    _DecodeThreads,
    sample_tokens,
    wait_all,
)
from flywheel.model.factory import ModelConfig, build_model
from flywheel.model.process_engine import ProcessEngine
from flywheel.model.tokenizer import train_tokenizer
from tests.rl.fault_injection import engine_processes, fault_seed

TIMEOUT_S = 120.0
TINY = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, num_experts=8,
            experts_per_token=2, moe_intermediate_size=64)
CODE = [
    "def add(a, b):\n    return a + b\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n        "
    "self.items.append(x)\n",
    "import os\nfor name in sorted(os.listdir('.')):\n    print(name)\n",
    "def test_add():\n    assert add(2, 3) == 5\n",
]


def conversation(instruction: str, reply: str) -> str:
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": instruction},
                {"role": "assistant", "content": reply,
                 "tool_calls": [{"id": "c1", "type": "function",
                                 "function": {"name": "read_file", "arguments": {"path": "main.py"}}}]},
                {"role": "tool", "tool_call_id": "c1", "content": CODE[0]}]
    return render_messages(messages, tool_schemas())


@pytest.fixture(scope="module")
def tokenizer():
    corpus = [conversation(f"Fix the bug in function {i}.", f"Looking at file {i} first.") for i in range(6)] + CODE * 4
    return train_tokenizer(corpus, vocab_size=600)


def tiny_model(tokenizer, seed: int):
    model = build_model(ModelConfig(**TINY, seed=seed), tokenizer)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0)  # spread the logits so greedy argmax is never a near-tie between batched and single runs
    return model


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny_model(tokenizer, seed=0)


@pytest.fixture(scope="module")
def other_weights(tokenizer):
    return {k: v.clone() for k, v in tiny_model(tokenizer, seed=1).state_dict().items()}


@pytest.fixture(scope="module")
def prompts(tokenizer):
    texts = [conversation("Fix the failing test.", "Reading."), "def add(a, b):", CODE[1], "import os\n",
             conversation("Rename the helper.", "Searching for it."), "x", CODE[3] + CODE[2]]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def engine_for(model, **config) -> LocalEngine:
    return LocalEngine(copy.deepcopy(model), EngineConfig(**config))  # update_weights loads into the engine's model


def full_logprobs(model, prompt: list[int], generated: list[int], temperature: float = 1.0) -> torch.Tensor:
    """log p(generated[i] | prompt + generated[:i]) from one forward pass without a cache."""
    ids = torch.tensor([prompt + generated])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()  # [generated, vocab]
    logp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
    return logp.gather(1, torch.tensor(generated).unsqueeze(1)).squeeze(1)


# A cached, padded, batched decode and one full forward add up in different orders: in float32 the
# logprobs agree to about 1e-4, and up to 2e-4 at temperature 0.7 (the logits are divided) on
# some CPUs; a child process with its own thread count sums in its own order too. A wrong
# position, mask or cache is off by 0.1 or more.
LOGPROB_ATOL = 5e-4

def greedy_reference(model, prompt: list[int], max_tokens: int, stop: tuple[int, ...] = ()) -> Generation:
    """One sequence at a time, no cache, no padding: the plainest possible greedy decoder."""
    tokens: list[int] = []
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0, -1]
            tokens.append(int(logits.argmax()))
            if tokens[-1] in stop:
                return Generation(tokens, [], [], "stop")
    return Generation(tokens, [], [], "length")


def wait_until(condition, timeout_s: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        time.sleep(0.001)


@pytest.mark.parametrize("lean_decode", [True, False])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_equal_a_full_forward_pass(model, prompts, temperature, lean_decode):
    with engine_for(model, max_batch=4, max_prefill_per_step=2, lean_decode=lean_decode) as engine:
        assert (engine._lean is not None) == lean_decode
        futures = [engine.submit(p, SamplingParams(temperature=temperature, max_tokens=12 + i))
                   for i, p in enumerate(prompts)]
        gens = wait_all(futures, TIMEOUT_S)
    for prompt, gen in zip(prompts, gens, strict=True):
        assert gen.finish_reason == "length" and gen.versions == [0] * len(gen.token_ids)
        expected = full_logprobs(model, prompt, gen.token_ids, temperature)
        torch.testing.assert_close(torch.tensor(gen.logprobs), expected, atol=LOGPROB_ATOL, rtol=0)


def test_greedy_logprobs_are_of_temperature_one(model, prompts):
    with engine_for(model) as engine:
        gen = engine.submit(prompts[0], SamplingParams(temperature=0, max_tokens=6)).result(TIMEOUT_S)
    torch.testing.assert_close(torch.tensor(gen.logprobs), full_logprobs(model, prompts[0], gen.token_ids),
                               atol=LOGPROB_ATOL, rtol=0)


def test_weight_swap_mid_generation_rebuilds_the_cache(model, other_weights, prompts):
    new_model = copy.deepcopy(model)
    new_model.load_state_dict(other_weights)
    with engine_for(model, max_batch=8) as engine:
        futures = [engine.submit(p, SamplingParams(temperature=1.0, max_tokens=400)) for p in prompts[:4]]
        wait_until(lambda: engine.steps > 3)
        swapper = threading.Thread(target=engine.update_weights, args=(other_weights, 1))
        swapper.start()
        swapper.join(TIMEOUT_S)
        assert not swapper.is_alive() and engine.version == 1 and engine.swaps == 1
        gens = wait_all(futures, TIMEOUT_S)
    for prompt, gen in zip(prompts[:4], gens, strict=True):
        before = gen.versions.count(0)
        assert 0 < before < len(gen.versions), "the swap should land mid-generation"
        assert gen.versions == [0] * before + [1] * (len(gen.versions) - before)
        old = full_logprobs(model, prompt, gen.token_ids[:before])
        new = full_logprobs(new_model, prompt, gen.token_ids)[before:]
        torch.testing.assert_close(torch.tensor(gen.logprobs[:before]), old, atol=LOGPROB_ATOL, rtol=0)
        torch.testing.assert_close(torch.tensor(gen.logprobs[before:]), new, atol=LOGPROB_ATOL, rtol=0)


def test_a_swap_that_keeps_the_cache_records_the_logprobs_it_sampled_with(model, other_weights, prompts):
    """kv_on_update="keep": tokens after the swap come from the new weights reading the old weights'
    keys and values; their logprobs must be exactly those (what the decoupled loss divides by)."""
    new_model = copy.deepcopy(model)
    new_model.load_state_dict(other_weights)
    with engine_for(model, max_batch=8, kv_on_update="keep") as engine:
        turn = engine.submit(prompts[4], SamplingParams(max_tokens=3, session="kept")).result(TIMEOUT_S)
        futures = [engine.submit(p, SamplingParams(temperature=1.0, max_tokens=400)) for p in prompts[:3]]
        wait_until(lambda: engine.steps > 3)
        engine.update_weights(other_weights, 1, timeout_s=TIMEOUT_S)
        gens = wait_all(futures, TIMEOUT_S)
        engine.submit(prompts[4] + turn.token_ids + [5], SamplingParams(max_tokens=2, session="kept")).result(TIMEOUT_S)
        assert engine.reused_tokens == len(prompts[4]) + len(turn.token_ids) - 1  # kept sessions survive the swap too
    for prompt, gen in zip(prompts[:3], gens, strict=True):
        before = gen.versions.count(0)
        assert 0 < before < len(gen.versions), "the swap should land mid-generation"
        assert gen.versions == [0] * before + [1] * (len(gen.versions) - before)
        torch.testing.assert_close(torch.tensor(gen.logprobs[:before]),
                                   full_logprobs(model, prompt, gen.token_ids[:before]),
                                   atol=LOGPROB_ATOL, rtol=0)
        # The reference: the old model's cache over everything fed before the swap (the newest
        # sampled token was not yet fed), then the new model over the rest on top of it.
        tokens = prompt + gen.token_ids
        fed = len(prompt) + before - 1
        cache = DynamicCache()
        with torch.no_grad():
            model(input_ids=torch.tensor([tokens[:fed]]), cache=cache, use_cache=True)
            logits = new_model(input_ids=torch.tensor([tokens[fed:-1]]), cache=cache, use_cache=True).logits[0].float()
        mixed = torch.log_softmax(logits, -1).gather(1, torch.tensor(gen.token_ids[before:]).unsqueeze(1)).squeeze(1)
        torch.testing.assert_close(torch.tensor(gen.logprobs[before:]), mixed, atol=LOGPROB_ATOL, rtol=0)
        recomputed = full_logprobs(new_model, prompt, gen.token_ids)[before:]
        assert (torch.tensor(gen.logprobs[before:]) - recomputed).abs().max() > 1e-3, "the old KV should matter"


def test_waiting_requests_are_admitted_lowest_priority_first(model, prompts):
    finished: list[str] = []
    with engine_for(model, max_batch=1) as engine:
        first = engine.submit(prompts[0], SamplingParams(temperature=0, max_tokens=60))
        wait_until(lambda: engine.steps > 0)  # it holds the only row; the rest wait
        waiting = {name: engine.submit(prompts[1], SamplingParams(temperature=0, max_tokens=3, priority=priority))
                   for name, priority in [("late", 5), ("old", 1), ("old-second", 1), ("default", 0)]}
        for name, future in waiting.items():
            future.add_done_callback(lambda _, name=name: finished.append(name))
        wait_all([first, *waiting.values()], TIMEOUT_S)
    assert finished == ["default", "old", "old-second", "late"]


def test_a_session_turn_prefills_only_its_new_tokens_and_equals_a_full_forward(model, other_weights, prompts):
    """Multi-turn: each next prompt extends the last prompt and answer; the kept KV must give exactly
    the logprobs of the whole context, in batches that mix kept and fresh rows."""
    tool_result = prompts[3][:4]
    with engine_for(model, max_batch=4, max_prefill_per_step=3) as engine:
        first = wait_all([engine.submit(p, SamplingParams(max_tokens=6 + i, session=f"s{i}"))
                          for i, p in enumerate(prompts[:3])], TIMEOUT_S)
        seconds = [p + g.token_ids + tool_result for p, g in zip(prompts[:3], first, strict=True)]
        futures = [engine.submit(c, SamplingParams(max_tokens=8, session=f"s{i}")) for i, c in enumerate(seconds)]
        futures.append(engine.submit(prompts[4], SamplingParams(max_tokens=8, session="new")))  # a fresh row alongside
        replies = wait_all(futures, TIMEOUT_S)
        assert engine.reused_tokens == sum(len(c) - len(tool_result) - 1 for c in seconds)
        for context, reply in zip(seconds + [prompts[4]], replies, strict=True):
            expected = full_logprobs(model, context, reply.token_ids)
            torch.testing.assert_close(torch.tensor(reply.logprobs), expected, atol=LOGPROB_ATOL, rtol=0)

        # A prompt that does not extend the kept tokens is prefilled whole (and still right).
        third = prompts[5] + seconds[0]
        reused = engine.reused_tokens
        wrong = engine.submit(third, SamplingParams(max_tokens=5, session="s0")).result(TIMEOUT_S)
        assert engine.reused_tokens == reused
        torch.testing.assert_close(torch.tensor(wrong.logprobs), full_logprobs(model, third, wrong.token_ids),
                                   atol=LOGPROB_ATOL, rtol=0)

        # New weights: kept KV is stale, so nothing is reused.
        engine.update_weights(other_weights, 1, timeout_s=TIMEOUT_S)
        fourth = seconds[1] + replies[1].token_ids + tool_result
        after = engine.submit(fourth, SamplingParams(max_tokens=5, session="s1")).result(TIMEOUT_S)
        assert engine.reused_tokens == reused
    new_model = copy.deepcopy(model)
    new_model.load_state_dict(other_weights)
    torch.testing.assert_close(torch.tensor(after.logprobs), full_logprobs(new_model, fourth, after.token_ids),
                               atol=LOGPROB_ATOL, rtol=0)


def test_a_groups_shared_prompt_is_prefilled_once_and_equals_a_full_forward(model, other_weights, prompts):
    """G episodes of a GRPO group send one prompt: the first is prefilled, the others copy its KV,
    whether they arrive in the same admission or later, and sample exactly as from a full forward."""
    group = 5
    with engine_for(model, max_batch=8, max_prefill_per_step=3) as engine:
        futures = [engine.submit(prompts[0], SamplingParams(max_tokens=6 + i)) for i in range(group)]
        futures.append(engine.submit(prompts[2], SamplingParams(max_tokens=6)))  # another task's prompt alongside
        gens = wait_all(futures, TIMEOUT_S)
        assert engine.reused_tokens == (group - 1) * (len(prompts[0]) - 1)
        for prompt, gen in zip([prompts[0]] * group + [prompts[2]], gens, strict=True):
            torch.testing.assert_close(torch.tensor(gen.logprobs), full_logprobs(model, prompt, gen.token_ids),
                                       atol=LOGPROB_ATOL, rtol=0)

        # New weights: the kept prompt KV is of the old ones, so the prompt is prefilled anew.
        engine.update_weights(other_weights, 1, timeout_s=TIMEOUT_S)
        reused = engine.reused_tokens
        after = engine.submit(prompts[0], SamplingParams(max_tokens=5)).result(TIMEOUT_S)
        assert engine.reused_tokens == reused
    new_model = copy.deepcopy(model)
    new_model.load_state_dict(other_weights)
    torch.testing.assert_close(torch.tensor(after.logprobs), full_logprobs(new_model, prompts[0], after.token_ids),
                               atol=LOGPROB_ATOL, rtol=0)
    with engine_for(model, prompt_cache=0) as engine:
        wait_all([engine.submit(prompts[0], SamplingParams(max_tokens=3)) for _ in range(3)], TIMEOUT_S)
        assert engine.reused_tokens == 0


def test_the_engine_counts_the_tokens_it_prefills_and_decodes(model, other_weights, prompts):
    """`counters()`: prefill tokens are those fed (a group's twin prompts count their last token
    only), decode tokens one per row per step (a request's first token comes from its prefill), and
    the seconds of each are counted; a ProcessEngine answers with its child's."""
    lengths = [4, 7, 1, 5]
    with engine_for(model, max_batch=8, prompt_cache=0) as engine:
        wait_all([engine.submit(p, SamplingParams(max_tokens=n)) for p, n in zip(prompts, lengths, strict=False)],
                 TIMEOUT_S)
        c = engine.counters()
        assert c["prefill_tokens"] == sum(len(p) for p in prompts[: len(lengths)])
        assert c["decode_tokens"] == sum(n - 1 for n in lengths) and c["decode_steps"] >= max(lengths) - 1
        assert c["prefill_s"] > 0 and c["decode_s"] > 0 and c["swap_s"] == 0
        engine.update_weights(other_weights, 1, timeout_s=TIMEOUT_S)
        assert engine.counters()["swap_s"] > 0
    with engine_for(model, max_batch=8) as engine:  # the prompt cache: the twins feed their last token
        wait_all([engine.submit(prompts[0], SamplingParams(max_tokens=2)) for _ in range(3)], TIMEOUT_S)
        assert engine.counters()["prefill_tokens"] == len(prompts[0]) + 2
    with ProcessEngine(model, EngineConfig(max_batch=4, prompt_cache=0)) as remote:
        remote.generate(prompts[:2], SamplingParams(max_tokens=3))
        c = remote.counters()
        assert c["prefill_tokens"] == len(prompts[0]) + len(prompts[1]) and c["decode_tokens"] == 4


def test_the_session_cache_keeps_only_the_most_recent(model, prompts):
    with engine_for(model, session_cache=2) as engine:
        gens = [engine.submit(p, SamplingParams(max_tokens=3, session=f"s{i}")).result(TIMEOUT_S)
                for i, p in enumerate(prompts[:3])]
        for i in (0, 2):  # s0 was dropped when s2 finished; s2 is kept
            engine.submit(prompts[i] + gens[i].token_ids + [5],
                          SamplingParams(max_tokens=2, session=f"s{i}")).result(TIMEOUT_S)
        assert engine.reused_tokens == len(prompts[2]) + len(gens[2].token_ids) - 1


@pytest.mark.parametrize(("lean_decode", "rows_in_place"), [(True, True), (False, True), (True, False)])
def test_continuous_batching_matches_one_at_a_time_greedy(model, prompts, lean_decode, rows_in_place):
    lengths = [5, 30, 9, 17, 3, 24, 12]
    # A stop token that greedy decoding reaches mid-way in some sequences but not all.
    free = [greedy_reference(model, p, n).token_ids for p, n in zip(prompts, lengths, strict=True)]
    stop = free[1][len(free[1]) // 2]
    expected = [greedy_reference(model, p, n, (stop,)) for p, n in zip(prompts, lengths, strict=True)]
    assert {"stop", "length"} == {g.finish_reason for g in expected}

    # 7 requests: most wait
    with engine_for(model, max_batch=3, max_prefill_per_step=2, lean_decode=lean_decode,
                    rows_in_place=rows_in_place) as engine:
        futures = [engine.submit(p, SamplingParams(temperature=0, max_tokens=n, stop_token_ids=(stop,)))
                   for p, n in zip(prompts, lengths, strict=True)]
        gens = wait_all(futures, TIMEOUT_S)
    for want, got, n in zip(expected, gens, lengths, strict=True):
        assert got.token_ids == want.token_ids
        assert got.finish_reason == want.finish_reason
        if got.finish_reason == "stop":
            assert got.token_ids[-1] == stop and stop not in got.token_ids[:-1]
        else:
            assert len(got.token_ids) == n


def test_rows_leave_and_join_the_batch_in_place_with_each_rows_own_cache():
    """`drop` moves the last rows into the places of those that leave, and `append` writes newcomers
    into the room that leaves: every row keeps exactly its keys, values, mask and position, as the
    copying `select` and `from_parts` give them."""
    g = torch.Generator().manual_seed(0)

    def cache(rows: int, width: int, lengths: list[int]) -> _BatchCache:
        layers, mask = _BatchCache.allocate([(torch.empty(0, 2, 0, 4), torch.empty(0, 2, 0, 4))] * 2, rows, 64)
        for k, v in layers:
            k.copy_(torch.randn(k.shape, generator=g))
            v.copy_(torch.randn(v.shape, generator=g))
        for r, n in enumerate(lengths):
            mask[r, width - n : width] = 1
        return _BatchCache(layers, mask, width)

    def rows_of(c: _BatchCache) -> list[tuple]:  # each row's real tokens, right-aligned
        out = []
        for r in range(c.mask.shape[0]):
            real = c.mask[r, : c.width] > 0
            out.append((int(c.positions[r]), [(k[r, :, : c.width][:, real], v[r, :, : c.width][:, real])
                                              for k, v in c.layers]))
        return out

    def same(a: list[tuple], b: list[tuple]) -> None:
        assert [p for p, _ in a] == [p for p, _ in b]
        for (_, la), (_, lb) in zip(a, b, strict=True):
            for (ka, va), (kb, vb) in zip(la, lb, strict=True):
                assert torch.equal(ka, kb) and torch.equal(va, vb)

    batch = cache(6, 20, [20, 5, 12, 17, 9, 14])
    before = rows_of(batch)
    order = batch.drop([1, 4])
    assert sorted(order) == [0, 2, 3, 5] and batch.mask.shape[0] == 4
    same(rows_of(batch), [before[i] for i in order])
    newcomer = cache(2, 11, [11, 6])
    assert batch.append(newcomer) and batch.mask.shape[0] == 6
    same(rows_of(batch), [before[i] for i in order] + rows_of(newcomer))
    assert not batch.append(cache(1, 30, [30]))  # wider than the batch: the caller copies (from_parts)
    assert not batch.append(newcomer)  # no room left
    copied = _BatchCache.from_parts([batch.select(list(range(6))), cache(1, 30, [30])])
    assert copied.mask.shape[0] == 7 and copied.width == 30


def test_mixed_greedy_and_sampled_rows_share_a_batch(model, prompts):
    with engine_for(model, max_batch=8) as engine:
        futures = [engine.submit(p, SamplingParams(temperature=0 if i % 2 else 1.0, max_tokens=8))
                   for i, p in enumerate(prompts)]
        gens = wait_all(futures, TIMEOUT_S)
    for i, (p, g) in enumerate(zip(prompts, gens, strict=True)):
        if i % 2:
            assert g.token_ids == greedy_reference(model, p, 8).token_ids


def test_tiny_top_p_is_greedy(model, prompts):
    with engine_for(model, max_batch=8) as engine:
        gens = wait_all([engine.submit(p, SamplingParams(temperature=1.0, top_p=1e-6, max_tokens=10)) for p in prompts],
                        TIMEOUT_S)
    for p, g in zip(prompts, gens, strict=True):
        assert g.token_ids == greedy_reference(model, p, 10).token_ids


def test_top_p_samples_only_inside_the_nucleus(model, prompts):
    top_p = 0.6
    with engine_for(model, max_batch=8) as engine:
        gens = wait_all([engine.submit(p, SamplingParams(temperature=1.5, top_p=top_p, max_tokens=25))
                         for p in prompts], TIMEOUT_S)
    for prompt, gen in zip(prompts, gens, strict=True):
        ids = torch.tensor([prompt + gen.token_ids])
        with torch.no_grad():
            probs = torch.softmax(model(input_ids=ids).logits[0, len(prompt) - 1 : -1] / 1.5, dim=-1)
        for row, token in zip(probs, gen.token_ids, strict=True):
            more_likely = row[row > row[token]].sum()
            assert more_likely < top_p + 1e-5, "sampled a token outside the nucleus"


def test_stop_token_is_included_and_max_tokens_gives_length(model, prompts, tokenizer):
    first = greedy_reference(model, prompts[2], 1).token_ids[0]
    with engine_for(model) as engine:
        stopped = engine.submit(prompts[2], SamplingParams(temperature=0, max_tokens=50,
                                                           stop_token_ids=(first,))).result(TIMEOUT_S)
        capped = engine.submit(prompts[2], SamplingParams(temperature=1.0, max_tokens=7,
                                                          stop_token_ids=())).result(TIMEOUT_S)
        one = engine.submit([tokenizer.convert_tokens_to_ids(IM_END)], SamplingParams(max_tokens=1)).result(TIMEOUT_S)
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop"
    assert len(capped.token_ids) == 7 and capped.finish_reason == "length"
    assert len(one.token_ids) == 1 and one.finish_reason == "length"


def test_bad_requests_raise_value_error(model):
    with engine_for(model) as engine:
        with pytest.raises(ValueError, match="empty prompt"):
            engine.submit([], SamplingParams())
        with pytest.raises(ValueError, match="max_tokens"):
            engine.submit([1, 2], SamplingParams(max_tokens=0))
        with pytest.raises(ValueError, match="top_p"):
            engine.submit([1, 2], SamplingParams(top_p=0))
        vocab = model.get_input_embeddings().num_embeddings
        for bad in (vocab, -1):
            with pytest.raises(ValueError, match=f"token id {bad} is outside"):
                engine.submit([1, bad, 2], SamplingParams())
        assert len(engine.generate([[1, 2]], SamplingParams(max_tokens=2))[0].token_ids) >= 1  # still serving


def test_a_dead_loop_fails_loudly(model, prompts):
    bad = {k: torch.zeros(3, 3) for k in model.state_dict()}
    with engine_for(model, max_batch=2) as engine:
        futures = [engine.submit(p, SamplingParams(max_tokens=100_000)) for p in prompts[:4]]  # two running, two queued
        wait_until(lambda: engine.steps > 1)
        with pytest.raises(EngineError, match="died"):
            engine.update_weights(bad, version=1, timeout_s=TIMEOUT_S)
        for f in futures:
            with pytest.raises(EngineError, match="died"):
                f.result(TIMEOUT_S)
        with pytest.raises(EngineError, match="died"):
            engine.submit(prompts[0], SamplingParams())
        with pytest.raises(EngineError, match="died"):
            engine.update_weights(bad, version=2, timeout_s=TIMEOUT_S)


def test_close_aborts_in_flight_and_queued_requests(model, prompts):
    engine = engine_for(model, max_batch=2)
    futures = [engine.submit(p, SamplingParams(max_tokens=100_000)) for p in prompts[:3]]
    wait_until(lambda: engine.steps > 2)
    engine.close()
    gens = wait_all(futures, TIMEOUT_S)
    assert [g.finish_reason for g in gens] == ["aborted"] * 3
    assert all(len(g.token_ids) > 0 for g in gens[:2]) and gens[2].token_ids == []
    assert all(len(g.token_ids) == len(g.logprobs) == len(g.versions) for g in gens)
    with pytest.raises(EngineError, match="closed"):
        engine.submit(prompts[0], SamplingParams())


def test_sampling_draws_each_token_with_its_probability():
    """The sampler's frequencies match softmax(logits / T), with and without top_p (chi-square)."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -30.0]] * 2)
    generator = torch.Generator().manual_seed(0)
    n = 20_000
    for temperature, top_p in ((1.0, 1.0), (1.5, 1.0), (1.0, 0.9)):
        counts = torch.zeros(2, 5)
        for _ in range(n // 500):
            batch = logits.repeat(250, 1)  # 500 rows per call
            choice, logp = sample_tokens(batch, [temperature] * 500, [top_p] * 500, generator)
            counts.index_put_((torch.arange(500) % 2, choice), torch.ones(500), accumulate=True)
            assert torch.allclose(logp, torch.log_softmax(batch / temperature,
                                                          -1).gather(1, choice[:, None]).squeeze(1))
        probs = torch.softmax(logits[0] / temperature, -1)
        if top_p < 1:  # the nucleus: tokens until the mass reaches top_p, renormalized
            keep = (probs.cumsum(0) - probs) <= top_p
            probs = torch.where(keep, probs, 0.0)
            probs = probs / probs.sum()
        expected = probs * counts.sum(1, keepdim=True)
        seen = expected > 0
        assert (counts[~seen] == 0).all(), "sampled a token of zero probability"
        chi2 = ((counts[seen] - expected[seen]) ** 2 / expected[seen]).sum().item()
        assert chi2 < 30, f"T={temperature}, top_p={top_p}: chi-square {chi2:.1f} over {int(seen.sum())} cells"


def test_an_engine_decodes_on_its_thread_count_and_gives_the_cores_back(model, prompts):
    """A busy engine decodes with `threads` intra-op threads; once idle, the count it changed is
    restored (PyTorch's count is shared: threads started later would inherit it)."""
    def new_thread_count() -> int:
        counts: list[int] = []
        thread = threading.Thread(target=lambda: counts.append(torch.get_num_threads()))
        thread.start()
        thread.join()
        return counts[0]

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    during: list[int] = []
    hook = model.register_forward_pre_hook(lambda *_: during.append(torch.get_num_threads()))
    try:
        with LocalEngine(model, EngineConfig(threads=1)) as engine:
            engine.generate([prompts[0]], SamplingParams(max_tokens=20))
            assert during and set(during) == {1}
            deadline = time.monotonic() + 5
            while new_thread_count() != 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert new_thread_count() == 2 and torch.get_num_threads() == 2  # idle: every core is back
    finally:
        hook.remove()
        torch.set_num_threads(before)


def test_decode_threads_are_restored_only_when_every_engine_is_idle():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        threads, a, b = _DecodeThreads(), object(), object()
        threads.busy(a, 1)
        threads.busy(b, 1)
        threads.idle(a)
        assert torch.get_num_threads() == 1  # b still decodes
        threads.idle(b)
        assert torch.get_num_threads() == 2
        threads.busy(a, None)  # an engine configured to leave threads alone
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.slow  # 15 s on the shared 2-core machine (load ~10)
def test_process_engine_answers_as_the_local_engine_does(model, other_weights, prompts):
    """The same model in a child process: same greedy tokens and logprobs, before and after a swap."""
    params = SamplingParams(temperature=0, max_tokens=10)
    with engine_for(model) as local:
        before = local.generate(prompts, params)
        local.update_weights(other_weights, 1)
        after = local.generate(prompts, params)
    with ProcessEngine(model, EngineConfig(max_batch=4)) as remote:
        first = remote.generate(prompts, params)
        remote.update_weights(other_weights, 1)
        assert remote.version == 1
        swapped = remote.generate(prompts, params)
    assert [g.token_ids for g in first] == [g.token_ids for g in before]
    torch.testing.assert_close(torch.tensor(first[0].logprobs), torch.tensor(before[0].logprobs), atol=LOGPROB_ATOL,
                               rtol=0)
    assert [g.token_ids for g in swapped] == [g.token_ids for g in after] != [g.token_ids for g in before]
    assert all(g.versions == [1] * len(g.token_ids) for g in swapped)
    torch.testing.assert_close(torch.tensor(swapped[0].logprobs), torch.tensor(after[0].logprobs), atol=LOGPROB_ATOL,
                               rtol=0)


@pytest.mark.slow  # 7 s on the shared 2-core machine (load ~10)
def test_process_engine_checks_requests_and_fails_loudly_when_its_process_dies(model, prompts):
    """With no restarts allowed (`process_restarts = 0`) a death fails every request and later call."""
    with ProcessEngine(model, EngineConfig(max_batch=2, process_restarts=0)) as engine:
        with pytest.raises(ValueError, match="outside the model's vocabulary"):
            engine.submit([10**6], SamplingParams())
        with pytest.raises(ValueError, match="empty prompt"):
            engine.submit([], SamplingParams())
        waiting = [engine.submit(p, SamplingParams(temperature=1.0, max_tokens=10_000)) for p in prompts[:3]]
        engine._process.kill()
        for future in waiting:
            with pytest.raises(EngineError, match="engine process exited"):
                future.result(TIMEOUT_S)
        with pytest.raises(EngineError, match="engine process exited"):
            engine.submit(prompts[0], SamplingParams())
        with pytest.raises(EngineError, match="engine process exited"):
            engine.update_weights({}, 1)


@pytest.mark.slow  # 4 trials of a child killed and started again: ~30 s on the shared 2-core machine
def test_process_engine_starts_a_dead_process_again_and_its_requests_go_on(model, other_weights, prompts):
    """The child SIGKILLed at random moments (after a drawn number of streamed tokens, while its
    replacement starts, or while a weight update is on its way): every request still completes
    once, a streamed one with exactly the tokens its caller was streamed, each token with the
    version that sampled it; the new child
    holds the latest weights (its greedy tokens are those weights', not the start's), and its
    counters answer. A weight update the dead child never acknowledged is done."""
    seed = fault_seed()
    rng = random.Random(seed)
    params = SamplingParams(temperature=0, max_tokens=48)
    with engine_for(model) as local:
        local.update_weights(other_weights, 1)
        expected = [g.token_ids for g in local.generate(prompts, params)]
    with ProcessEngine(model, EngineConfig(max_batch=4, process_restarts=5)) as engine:
        engine.update_weights(other_weights, 1)
        for trial in range(4):
            said = f"seed {seed}, trial {trial}"
            if trial == 3:  # an update in flight: the dead child never answers it, the new one starts with it
                updating = threading.Thread(target=engine.update_weights, args=(other_weights, 2))
                updating.start()
                time.sleep(rng.random() * 0.05)
                engine._process.kill()
                updating.join(TIMEOUT_S)
                assert not updating.is_alive() and engine.version == 2, said
                done = engine.generate(prompts, params)
                assert [g.token_ids for g in done] == expected and all(set(g.versions) == {2} for g in done), said
                break
            streamed: list[list[int]] = [[] for _ in prompts]
            futures = [engine.submit(p, replace(params, on_token=lambda t, lp, got=streamed[i]: got.append(t)) if i % 2
                                     else params) for i, p in enumerate(prompts)]
            kill_after = rng.randrange(1, 30)  # streamed tokens of the first streamed request
            deadline = time.monotonic() + TIMEOUT_S
            while len(streamed[1]) < kill_after and not futures[1].done() and time.monotonic() < deadline:
                time.sleep(0.001)
            first = engine.pid
            engine._process.kill()
            if trial == 1:  # its replacement killed too, while it starts (importing torch): a third one serves
                while not (starting := [p for p in engine_processes(os.getpid()) if p != first]):
                    assert time.monotonic() < deadline, said
                    time.sleep(0.001)
                time.sleep(rng.random() * 0.5)
                os.kill(starting[0], signal.SIGKILL)
            results = wait_all(futures, TIMEOUT_S)
            assert engine.restarts == trial + 1 + (trial >= 1), said
            assert [g.token_ids for g in results] == expected, said
            for i, gen in enumerate(results):
                assert gen.versions == [1] * len(gen.token_ids) and len(gen.logprobs) == len(gen.token_ids), said
                if i % 2:
                    assert streamed[i] == gen.token_ids, said  # none twice, none missing
            after = engine.generate(prompts[:2], params)  # the new child's own: version 1's weights
            assert [g.token_ids for g in after] == expected[:2], said
            assert engine.counters()["decode_steps"] >= 0, said


@pytest.mark.slow  # ~8 s
def test_a_process_engine_closed_while_it_restarts_leaves_no_process_behind(model, prompts):
    engine = ProcessEngine(model, EngineConfig(max_batch=2))
    waiting = engine.submit(prompts[0], SamplingParams(temperature=1.0, max_tokens=10_000))
    first = engine.pid
    engine._process.kill()
    deadline = time.monotonic() + TIMEOUT_S
    while not [p for p in engine_processes(os.getpid()) if p != first]:  # the replacement is starting
        assert time.monotonic() < deadline
        time.sleep(0.001)
    started = time.monotonic()
    engine.close()
    assert time.monotonic() - started < 20.0
    with pytest.raises(EngineError):
        waiting.result(TIMEOUT_S)
    while engine_processes(os.getpid()):  # the replacement is stopped once it is ready, not left running
        assert time.monotonic() < deadline, engine_processes(os.getpid())
        time.sleep(0.1)


@pytest.mark.slow  # ~8 s
def test_process_engine_fails_every_request_once_its_restarts_are_spent(model, prompts):
    with ProcessEngine(model, EngineConfig(max_batch=2, process_restarts=1)) as engine:
        engine._process.kill()
        assert len(engine.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4))[0].token_ids) == 4
        waiting = engine.submit(prompts[0], SamplingParams(temperature=1.0, max_tokens=10_000))
        engine._process.kill()
        with pytest.raises(EngineError, match=r"exited .*1 restarts spent"):
            waiting.result(TIMEOUT_S)
        with pytest.raises(EngineError, match="restarts spent"):
            engine.submit(prompts[0], SamplingParams())


# A program that starts a ProcessEngine, forks a child that keeps the engine's pipe open (as a
# sandbox supervisor forked from a trainer does), prints the engine's pid and waits to be killed.
_ENGINE_OWNER = """
import os, sys, time
from flywheel.model.engine import EngineConfig
from flywheel.model.factory import ModelConfig, build_model
from flywheel.model.process_engine import ProcessEngine
from flywheel.model.tokenizer import train_tokenizer

if __name__ == "__main__":
    tokenizer = train_tokenizer(["def add(a, b):\\n    return a + b\\n"] * 8, vocab_size=300)
    model = build_model(ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                                    num_experts=4, experts_per_token=2, moe_intermediate_size=32), tokenizer)
    engine = ProcessEngine(model, EngineConfig(max_batch=2))
    if os.fork() == 0:
        time.sleep(60)
        os._exit(0)
    print(engine._process.pid, flush=True)
    time.sleep(60)
"""


@pytest.mark.slow  # about 10 s on the shared 2-core machine
def test_the_engine_process_exits_when_its_owner_is_terminated(tmp_path):
    """SIGTERM skips the owner's `close`, and a forked child of the owner keeps the pipe open: the
    engine's process still exits, adopted by another parent, instead of running on as an orphan."""
    script = tmp_path / "owner.py"
    script.write_text(_ENGINE_OWNER)
    owner = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        child = int(owner.stdout.readline())
        owner.send_signal(signal.SIGTERM)
        owner.wait(TIMEOUT_S)
        deadline = time.monotonic() + 10
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(child), "the engine's process outlived its owner"
    finally:
        try:
            os.killpg(owner.pid, signal.SIGKILL)  # the forked child, and anything left
        except ProcessLookupError:
            pass


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie has exited; its new parent reaps it


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_an_engine_on_a_gpu_answers_as_the_cpu_model_does(model, other_weights, prompts):
    """The engine runs where its model is: logprobs of sampled tokens, greedy tokens, a session's
    second turn and a weight swap (CPU weights into the GPU model) all agree with the CPU model."""
    new_model = copy.deepcopy(model)
    new_model.load_state_dict(other_weights)
    with LocalEngine(copy.deepcopy(model).to("cuda"), EngineConfig(max_batch=4, max_prefill_per_step=2)) as engine:
        sampled = wait_all([engine.submit(p, SamplingParams(temperature=1.0, max_tokens=10, session=f"s{i}"))
                            for i, p in enumerate(prompts)], TIMEOUT_S)
        second = [p + g.token_ids + prompts[1] for p, g in zip(prompts, sampled, strict=True)]
        turn2 = wait_all([engine.submit(p, SamplingParams(temperature=0, max_tokens=8, session=f"s{i}"))
                          for i, p in enumerate(second)], TIMEOUT_S)
        assert engine.reused_tokens > 0
        engine.update_weights(other_weights, version=1)
        swapped = wait_all([engine.submit(p, SamplingParams(temperature=0, max_tokens=8)) for p in prompts], TIMEOUT_S)
    for prompt, gen in zip(prompts, sampled, strict=True):
        torch.testing.assert_close(torch.tensor(gen.logprobs), full_logprobs(model, prompt, gen.token_ids),
                                   atol=1e-3, rtol=0)
    for prompt, gen in zip(second, turn2, strict=True):
        assert gen.token_ids == greedy_reference(model, prompt, 8).token_ids
    for prompt, gen in zip(prompts, swapped, strict=True):
        assert gen.token_ids == greedy_reference(new_model, prompt, 8).token_ids and set(gen.versions) == {1}
