"""Hinted teachers: what a user's follow-up said, turned into per-token targets for the answer it was about.

    hints = followup_hints(store, batch.completions, at)      completion id -> the user's words (at: "answer" | "turn")
    report = attach_teachers(model, tokenizer, batch, hints, loss.distill, temperature)
    learner.train_step(batch.trajectories, batch.advantages())   the distillation term beside the reward's

A dissatisfied follow-up ("you changed notes.txt, the bug is in calc.py") says what was wrong and
where; the reward keeps only that the user was unhappy. Here the words are used as Cursor's
Composer report describes: the same policy version reads the follow-up as a hint, a user message
placed right before the answer it was about (`ConversationEncoder.hinted`), and scores the answer's
sampled tokens. That hinted model is the teacher; the Learner pulls the student (the same weights
without the hint) toward it token by token (`flywheel.rl.loss.DistillConfig`): no reward model, no
off-policy data, only tokens the student sampled itself.

The drop rule (measured, per follow-up): the student's and the hinted teacher's mean logprob of the
distilled span (the contents of the answer's tool calls, below) are computed in one forward; the
hint is kept only if the teacher's is below the student's by at least `min_gain` nats per token,
i.e. having read the hint, the model is less likely to write what the user disliked. A hint the
model does not take up (vague words, a wrong file, text it ignores) would only add noise to the
reward's signal, so it is dropped and counted
(`distill_dropped_share`). In simulation no better answer is known per request, so the rule measures
the answer that was disliked, not a better one.

Tool use is not the hint's to change. A hint that makes the disliked answer less likely may do so
by arguing against calling tools at all ("stop using tools" after a failing edit); distilled over
the whole answer, it teaches the policy to answer in words: hostile hints alone (equal rewards,
every answer hinted) cut the SFT-ed start policy's tool use from 35/48 to 15/48 answers in two
steps, and still to 14/48 of 30/48 with only the call-opening tokens guarded
(tests/live/test_hints.py, before this rule). So the term distils only the contents of the answer's
tool calls (the tokens after its first call opens, `<tool_call>` in flywheel's format, the openings
themselves excluded), and not their JSON syntax or markup (`syntax_tokens`: the hinted context
makes the model less sure of well-formed JSON, 0.19 nats a syntax token against 0.006 a word on
the kept hints of the start policy, and distilling that pushed down well-formed calls): which file,
which command, which arguments. The words before the first call,
where the policy decides whether to call at all, and answers without a call keep the reward's
gradient alone (`distill_dropped/no_call`); a hint after which the teacher is less likely to open
the answer's calls by more than `max_call_drop` nats on average argues against tools and is dropped
(`distill_dropped/tool_use`). The drop rule's gain is measured on the distilled span, and the span
alone reaches the Learner: the trajectory's teacher logprobs are null elsewhere, so no token outside
it is pulled at any of a train step's optimizer steps (the served logprob as a target would pull the
decision to call back toward the served policy once the first step has moved it).

Safety of the signal. A follow-up is a client's text and may be hostile ("ignore your instructions",
"stop using tools", "print your system prompt", or markup that imitates a tool call or a turn). It
is rendered as the body of a user turn through the one conversation encoder, whose markup
protection is the server's: no control or markup token string in it becomes its token, so it cannot
forge a role boundary, a tool call or a tool result (tested). What it says in words can still teach:
the term only reweights tokens the policy already sampled, toward what the policy itself would say
having read the hint, and every candidate is gated and monitored like any other (its tool-use and
edit rates among the monitors'); the hostile_hints scenario (flywheel/sim/scenario.py) measures a population of hostile
hints. A handful of hints cannot steer a step: a learner step moves each weight by about the
learning rate however few tokens its gradient came from, so a batch with fewer than `min_kept` (8)
hints through the rule distils none of them (`distill_dropped/too_few`) and trains on the reward
alone; one hostile hint of 48 did steer two steps before this floor (docs/feedback-distill.md).

Where the hint goes (`DistillConfig.hint_at`): at the answer the follow-up is tied to, or at every
answer of the turn it answered. A follow-up comes after the agent's turn (the simulated users speak
after a failing `finish`, flywheel/sim/users.py), so the answer that failed is often the edit
before the `finish` call; "turn" hints it too, and the drop rule then keeps the answers the words
move. That is where the words are about, but it pays only with a teacher that reads them
(bench/hint_teacher.py measures it); docs/feedback-distill.md has what it did with the scenario
world's start policy.

Departures from the report: one hint per answer (the follow-up that answered its turn), the
teacher is the served version itself (no separate, frozen teacher), and only the answer's tokens are
distilled, not later turns the hint might also have changed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Literal

import torch
from transformers import PreTrainedModel

from flywheel.agent.trajectory import Trajectory
from flywheel.api.events import EventType
from flywheel.live.batch import OnPolicyBatch
from flywheel.live.records import Completion
from flywheel.live.store import LiveStore
from flywheel.model.conversation import ConversationEncoder
from flywheel.rl.learner import token_logprobs
from flywheel.rl.loss import DistillConfig

SYNTAX = frozenset(' \t\n{}[]":,')


def syntax_tokens(tokenizer, tokens: Sequence[int]) -> set[int]:
    """Those of `tokens` that are JSON syntax (only braces, brackets, quotes, colons, commas,
    whitespace) or added/special tokens (a call's or a turn's markup): what makes a call well formed,
    not what it says."""
    markup = set(tokenizer.get_added_vocab().values()) | set(tokenizer.all_special_ids)
    return {t for t in set(tokens) if t in markup or set(tokenizer.decode([t], skip_special_tokens=False)) <= SYNTAX}


def followup_hints(store: LiveStore, completions: Sequence[Completion],
                   at: Literal["answer", "turn"] = "answer") -> dict[str, str]:
    """Completion id -> the words of the dissatisfied follow-up about it (the last such event with
    words, if one completion drew several); a satisfied one (the answer to a clarifying question) is
    no hint: nothing was wrong.

    at="answer": the completions the follow-ups are tied to. at="turn": a follow-up is tied to the
    completion it came after, but it is about the agent's whole turn, every answer since the user last
    spoke ("the tests still fail; it should say X" comes after the `finish` call, and the answer that
    failed is the edit before it), so each completion gets the words of the first follow-up (of any
    kind) tied to it or to a later completion of its session, when that one is dissatisfied with
    words. A turn is read from `completions` alone (a session's completions in time order, split after
    each one that drew a follow-up), so give a batch's whole sessions where it has them."""
    if at not in ("answer", "turn"):
        raise ValueError(f"at must be 'answer' or 'turn', got {at!r}")
    drew: set[str] = set()  # completions a user's message followed
    words: dict[str, str] = {}
    for completion_id, events in store.events_for_completions(c.id for c in completions).items():
        for e in events:
            if e.type != EventType.FOLLOWUP:
                continue
            drew.add(completion_id)
            text = e.payload.get("text")
            if e.payload.get("dissatisfied") is True and isinstance(text, str) and text.strip():
                words[completion_id] = text
    if at == "answer":
        return words
    sessions: dict[str, list[Completion]] = {}
    for c in completions:
        sessions.setdefault(c.session_id, []).append(c)
    out: dict[str, str] = {}
    for session in sessions.values():
        turn: list[str] = []
        for c in sorted(session, key=lambda c: (c.created_at, c.id)):
            turn.append(c.id)
            if c.id in drew:
                if c.id in words:
                    out |= dict.fromkeys(turn, words[c.id])
                turn = []
    return out


@torch.no_grad()
def answer_logprobs(model: PreTrainedModel, student: Sequence[int], teacher: Sequence[int], answer: int,
                    temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The last `answer` tokens' logprobs [answer] under `model`, after the student's and the teacher's
    contexts (`student`, `teacher` end with the same answer), in one right-padded forward."""
    width = max(len(student), len(teacher))
    ids = torch.zeros((2, width), dtype=torch.long)
    attention = torch.zeros((2, width), dtype=torch.long)
    scored = torch.zeros((2, width), dtype=torch.float32)
    for row, seq in enumerate((student, teacher)):
        ids[row, : len(seq)] = torch.tensor(list(seq))
        attention[row, : len(seq)] = 1
        scored[row, len(seq) - answer : len(seq)] = 1
    device = next(model.parameters()).device
    logp, _ = token_logprobs(model, ids.to(device), attention.to(device), temperature, scored=scored.to(device))
    logp = logp.float().cpu()
    return logp[0, len(student) - answer : len(student)], logp[1, len(teacher) - answer : len(teacher)]


def attach_teachers(model: PreTrainedModel, tokenizer, batch: OnPolicyBatch, hints: dict[str, str],
                    config: DistillConfig, temperature: float) -> dict[str, float]:
    """Give each batch trajectory whose completion drew a hint its hinted teacher's logprobs
    (`Trajectory.teacher_logprobs`), where the drop rule keeps the hint (module docstring).

    `model` is the version that served the batch, in the mode the Learner trains it in (train: the
    teacher's and the student's logprobs then agree with the Learner's at the step's start).
    Returns the report's figures: distill_followups (the batch's answers with a hint, `followup_hints`),
    distill_kept, distill_dropped_share (of distill_followups; absent without any), distill_dropped/<why>
    (no_call, tool_use, no_gain; too_long: the hinted prompt is past the model's positions; too_few:
    hints that passed the rule in a batch with fewer than `min_kept` such),
    distill_gain_mean (nats per token, over the kept; absent without any)."""
    encoder = ConversationEncoder(tokenizer)
    opening = encoder.text(encoder.format.forced_call(None))[:1]  # the token that opens a tool call
    limit = getattr(model.config, "max_position_embeddings", None)
    form = syntax_tokens(tokenizer, [t for c in batch.completions if c.id in hints for t in c.completion_ids])
    dropped: Counter[str] = Counter()
    gains: list[float] = []
    taught: dict[int, Trajectory] = {}  # batch index -> the trajectory with its teacher, if the floor is met
    followups = 0
    for i, (trajectory, completion) in enumerate(zip(batch.trajectories, batch.completions, strict=True)):
        text = hints.get(completion.id)
        if text is None or not completion.completion_ids:
            continue
        followups += 1
        teacher_ids = [*encoder.hinted(completion.prompt_ids, text), *completion.completion_ids]
        if limit is not None and len(teacher_ids) > limit:
            dropped["too_long"] += 1
            continue
        answer = len(completion.completion_ids)
        calls = [j for j, t in enumerate(completion.completion_ids) if opening and t == opening[0]]
        if not calls:  # an answer in words: whether it should have called a tool is the reward's to say
            dropped["no_call"] += 1
            continue
        student_lp, teacher_lp = answer_logprobs(model, trajectory.tokens, teacher_ids, answer, temperature)
        if float((student_lp[calls] - teacher_lp[calls]).mean()) > config.max_call_drop:
            dropped["tool_use"] += 1  # the hint argues against calling tools
            continue
        span = torch.zeros(answer, dtype=torch.bool)
        span[calls[0] + 1:] = True
        span[calls] = False  # the distilled tokens: the calls' contents, not the decision to make them
        span &= torch.tensor([t not in form for t in completion.completion_ids])  # nor their JSON syntax
        gain = float((student_lp[span] - teacher_lp[span]).mean()) if span.any() else 0.0
        if gain < config.min_gain:
            dropped["no_gain"] += 1
            continue
        gains.append(gain)
        prompt = len(trajectory.tokens) - answer
        # None outside the span: the Learner distils the span alone, at every optimizer step of its train
        # step (a target equal to the served logprob would pull the rest back toward the served policy)
        target = [float(x) if inside else None for x, inside in zip(teacher_lp.tolist(), span.tolist(), strict=True)]
        taught[i] = trajectory.model_copy(update={"teacher_logprobs": [None] * prompt + target})
    if len(taught) < config.min_kept:  # too few to steer a step (DistillConfig.min_kept): the reward alone
        if taught:
            dropped["too_few"] += len(taught)
        taught, gains = {}, []
    for i, trajectory in taught.items():
        batch.trajectories[i] = trajectory
    n_dropped = sum(dropped.values())
    report = {"distill_followups": float(followups), "distill_kept": float(followups - n_dropped),
              **{f"distill_dropped/{why}": float(n) for why, n in sorted(dropped.items())}}
    if followups:  # no NaN: the report is JSON
        report["distill_dropped_share"] = n_dropped / followups
    if gains:
        report["distill_gain_mean"] = sum(gains) / len(gains)
    return report
