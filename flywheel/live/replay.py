"""The distilled requests, replayed: did the hints move the candidate's behaviour where they were applied?

    report = replay_distilled(candidate_engine, production_engine, tokenizer, completions, ReplayConfig(), 1.0)
    report.blocking      # the metrics whose change on these requests blocks the promotion

Hinted self-distillation (hints.py) trains on the requests whose users' follow-ups it kept. A hint
population that argues against tools ("stop using tools"), or for broken calls, shows first on
exactly those requests: in the monitors' traffic the effect is diluted by every other request, and
it waits on the A/B test. So after the gate, when the cycle distilled any hint, both versions answer
each distilled request again (its prompt as it was served, without the hint), `samples` times at
the temperature users sample at, and the monitors' behaviour rates are compared request by request:

| metric            | per answer                                              | bad  |
|-------------------|---------------------------------------------------------|------|
| tool_use_rate     | made >= 1 tool call (valid or not)                      | down |
| invalid_call_rate | made >= 1 invalid tool call (the agent's tool schemas)  | up   |
| edit_rate         | made a valid edit call                                  | down |

A request gives each version the share of its samples that did it. The test is the exact sign test
(`flywheel.stats.sign_test_p`) over the requests on which the two shares differ, one-sided in the
metric's bad direction: requests are independent draws of the users' traffic, a request's samples
are not, so the request is the unit. Both versions sample sample j of request i from the same seed
(common random numbers): a candidate identical to production differs on no request, and a real
change is not drowned by sampling noise. A p-value below `alarm_p` is an alarm, and with the
cycle's `alarms_block_promotion` it rejects the candidate. Below `min_requests` distilled requests
the figures are reported and nothing is tested (7 requests all one way are p = 0.0078).

Nothing here reads the hints: the probe measures the candidate, whatever taught it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from pydantic import BaseModel, ConfigDict, Field
from transformers import PreTrainedTokenizerBase

from flywheel.env.toolspec import ToolCall
from flywheel.live.records import Completion
from flywheel.live.rewards import EDIT_TOOLS
from flywheel.model.conversation import ConversationEncoder
from flywheel.model.engine import Engine, SamplingParams
from flywheel.stats import sign_test_p


class ReplayConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    enabled: bool = True  # runs only in cycles that distilled a hint (learner.loss.distill.weight > 0)
    samples: int = Field(4, ge=1)  # answers per request and version
    max_tokens: int = Field(256, ge=1)  # per answer; a request's served answer was at most this long in the world
    max_requests: int = Field(64, ge=1)  # the first ones by time, when more were distilled
    min_requests: int = Field(8, ge=1)  # fewer: reported, not tested
    alarm_p: float = Field(0.01, gt=0, lt=0.5)
    seed: int = 0


# metric -> (what one answer did, the bad direction)
METRICS: dict[str, tuple[Callable[[list[ToolCall]], bool], str]] = {
    "tool_use_rate": (lambda calls: bool(calls), "down"),
    "invalid_call_rate": (lambda calls: any(not c.valid for c in calls), "up"),
    "edit_rate": (lambda calls: any(c.valid and c.name in EDIT_TOOLS for c in calls), "down"),
}


class ReplayMetric(BaseModel):
    candidate: float  # mean over requests of the share of samples that did it
    production: float
    worse: int  # requests on which the candidate's share moved in the bad direction
    better: int
    p_value: float | None  # None: too few requests to test
    alarm: bool


class ReplayReport(BaseModel):
    requests: int
    samples: int
    metrics: dict[str, ReplayMetric]
    seconds: float

    @property
    def blocking(self) -> list[str]:
        return [name for name, m in self.metrics.items() if m.alarm]

    def describe(self, names: Sequence[str] | None = None) -> str:
        """The metrics (`names`, default all) in words, e.g. "tool_use_rate 0.81 -> 0.22 (worse on 9, ...)"."""
        chosen = {n: self.metrics[n] for n in (names if names is not None else self.metrics)}
        return ", ".join(f"{name} {m.production:.2f} -> {m.candidate:.2f} (worse on {m.worse}, better on {m.better}"
                         + (f", p={m.p_value:.1e})" if m.p_value is not None else ")")
                         for name, m in chosen.items())


def answer_calls(engine: Engine, tokenizer: PreTrainedTokenizerBase, prompts: Sequence[Sequence[int]],
                 config: ReplayConfig, temperature: float) -> list[list[list[ToolCall]]]:
    """[request][sample] -> the tool calls of that answer, parsed as the server parses them."""
    encoder = ConversationEncoder(tokenizer)
    futures = [[engine.submit(prompt, SamplingParams(
                    temperature=temperature, max_tokens=config.max_tokens, stop_token_ids=tuple(encoder.stop_ids),
                    seed=config.seed * 1_000_003 + i * 1_009 + j))
                for j in range(config.samples)] for i, prompt in enumerate(prompts)]
    return [[encoder.format.parse(tokenizer.decode(f.result().token_ids, skip_special_tokens=False))[1]
             for f in row] for row in futures]


def compare(candidate: Sequence[Sequence[list[ToolCall]]], production: Sequence[Sequence[list[ToolCall]]],
            config: ReplayConfig) -> dict[str, ReplayMetric]:
    """Each metric's per-request shares of both versions, and its sign test (module docstring)."""
    if len(candidate) != len(production):
        raise ValueError(f"{len(candidate)} candidate and {len(production)} production requests: replay the same ones")
    out = {}
    for name, (did, bad) in METRICS.items():
        cand = [sum(map(did, answers)) / len(answers) for answers in candidate]
        prod = [sum(map(did, answers)) / len(answers) for answers in production]
        down = sum(c < p for c, p in zip(cand, prod, strict=True))
        up = sum(c > p for c, p in zip(cand, prod, strict=True))
        worse, better = (down, up) if bad == "down" else (up, down)
        p = sign_test_p(worse, better) if len(cand) >= config.min_requests else None
        out[name] = ReplayMetric(candidate=sum(cand) / len(cand) if cand else 0.0,
                                 production=sum(prod) / len(prod) if prod else 0.0, worse=worse, better=better,
                                 p_value=p, alarm=p is not None and p < config.alarm_p)
    return out


def replay_distilled(candidate: Engine, production: Engine, tokenizer: PreTrainedTokenizerBase,
                     completions: Sequence[Completion], config: ReplayConfig, temperature: float) -> ReplayReport:
    """Both versions answer the distilled requests (`completions`, as served) again; the comparison."""
    start = time.perf_counter()
    prompts = [c.prompt_ids for c in sorted(completions, key=lambda c: (c.created_at, c.id))[: config.max_requests]]
    with ThreadPoolExecutor(2, thread_name_prefix="replay") as workers:  # two engines, both cores
        cand, prod = workers.map(lambda engine: answer_calls(engine, tokenizer, prompts, config, temperature),
                                 (candidate, production))
    return ReplayReport(requests=len(prompts), samples=config.samples, metrics=compare(cand, prod, config),
                        seconds=time.perf_counter() - start)
