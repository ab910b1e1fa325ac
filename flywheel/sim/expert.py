"""A scripted agent that solves every task family through the tools only.

It knows the task's reference edits (a stand-in for competence) but touches the workspace only
with tool calls, the way a model must: explore (list + grep for the function the instruction
names, in one parallel turn), read the files it will change, edit them, run the visible tests,
finish. Every argument it passes can be read off what it has seen (the instruction, earlier tool
results), so a model trained on its episodes can learn to do the same; when the instruction
names the one file to change, it reads that file straight away. On an ambiguous task its first
move is one clarifying question. With `mistake_rate > 0` some episodes go wrong the way real
agents do (a fix left out, a guess instead of a question), so demonstrations built from it leave
room for RL. It lives in `sim/` because it stands in for a competent policy; no core code imports it.
"""

from __future__ import annotations

import random
import re
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any

from flywheel.env.environments import task_environment
from flywheel.env.families.functions import PACKAGES
from flywheel.env.pool import SandboxPool
from flywheel.env.sandbox import Sandbox, Snapshot
from flywheel.env.task import Task
from flywheel.env.tools import Toolbox
from flywheel.env.toolspec import ToolCall, ToolResult
from flywheel.model.chat import SYSTEM_PROMPT, openai_tool_call
from flywheel.rl.bootstrap import BootstrapConfig, train_tasks

CLARIFYING_QUESTION = "Before I change anything: could you tell me exactly which behaviour you want here?"


@dataclass(frozen=True)
class Action:
    """One assistant turn: some text, and tool calls (none means the text is said to the user)."""

    text: str
    calls: tuple[ToolCall, ...] = ()


Observation = list[ToolResult] | str  # tool results, or the user's reply to a question
Policy = Generator[Action, Observation | None, None]


def _named_path(instruction: str) -> str | None:
    """The source file an instruction names, if any (test files are where failures show, not where
    fixes go)."""
    paths = [p for p in re.findall(r"[\w/]+\.py", instruction) if not p.startswith("tests/")]
    return paths[0] if paths else None


class ScriptedExpert:
    def __init__(self, seed: int = 0, mistake_rate: float = 0.0, wrong_path_rate: float = 0.0,
                 repair_rate: float = 0.0):
        self.rng = random.Random(seed)
        self.mistake_rate = mistake_rate
        # How often an episode that left part of its fix out, once its test run fails, reads the
        # files again, makes the rest of the fix and runs the tests again instead of finishing
        # anyway: the other way to meet a red test run, so the start policy holds both and RL can
        # choose between them.
        self.repair_rate = repair_rate
        # How often a file the instruction names is first read under a wrong package (the slip a
        # small model makes most), then from the path the tool's error suggests: a demonstration
        # of recovering from a failed call, which agents otherwise never see.
        self.wrong_path_rate = wrong_path_rate

    def _explore(self, task: Task, call) -> list[ToolCall]:
        """The first look, built only from what the agent can see: the function the instruction
        speaks of is found by its definition, or by every use when it is to be renamed."""
        explore = [call("list_dir", path=".")]
        name = task.metadata.extra.get("template")
        if isinstance(name, str) and name in task.instruction:
            rename = task.metadata.extra.get("mode") == "rename"
            explore.append(call("grep", pattern=rf"\b{name}\b" if rename else rf"def {name}\b", glob="*.py"))
        if self.rng.random() < 0.1:
            explore.append(call("semantic_search", query=task.instruction[:200]))
        return explore

    def play(self, task: Task) -> Policy:
        n = 0

        def call(name: str, **arguments: object) -> ToolCall:
            nonlocal n
            n += 1
            return ToolCall(id=f"call_{n}", name=name, arguments=dict(arguments))

        def edit(text: str, some: list) -> Action:
            return Action(text, tuple(call("edit_file", path=e.path, old=e.old, new=e.new) for e in some))

        def run_tests() -> Action:
            return Action("Running the tests.", (call("run_command", command=task.test_command),))

        slip = self.rng.random() < self.mistake_rate
        if task.metadata.ambiguous and not (slip and self.rng.random() < 0.5):
            yield Action(CLARIFYING_QUESTION)
        edits = list(task.reference_edits)
        to_read = sorted({e.path for e in edits if e.old})
        named = _named_path(task.instruction)
        if not (to_read and named in to_read and len(to_read) == 1):
            yield Action("Let me look at the project first.", tuple(self._explore(task, call)))
        elif self.wrong_path_rate and self.rng.random() < self.wrong_path_rate and "/" in to_read[0]:
            folder, rest = to_read[0].split("/", 1)
            wrong = f"{self.rng.choice([p for p in PACKAGES if p != folder])}/{rest}"
            yield Action("Reading the code I need to change.", (call("read_file", path=wrong),))
        if to_read:
            yield Action("Reading the code I need to change.", tuple(call("read_file", path=p) for p in to_read))
        left: list = []
        if slip and edits:
            cut = self.rng.randrange(len(edits))
            edits, left = edits[:cut], edits[cut:]  # leaves part of the fix out
        if edits:
            yield edit("Making the change.", edits)
        results = yield run_tests()
        if left and _tests_failed(results) and self.rng.random() < self.repair_rate:
            rereads = sorted({e.path for e in left if e.old})
            if rereads:
                yield Action("The tests still fail. Reading the code again.",
                             tuple(call("read_file", path=p) for p in rereads))
            yield edit("Fixing the rest.", left)
            yield run_tests()
        yield Action("Done.", (call("finish", summary="Made the change and ran the tests."),))


def _tests_failed(results: Observation | None) -> bool:
    """Whether a test run's result shows a failure (its status line is not exit code 0)."""
    return isinstance(results, list) and bool(results) and not results[-1].content.endswith("[exit code 0]")


@dataclass
class ExpertEpisode:
    task: Task
    turns: list[tuple[Action, Observation]] = field(default_factory=list)
    final: Snapshot | None = None
    finished: bool = False


def run_policy(task: Task, policy: Policy, pool: SandboxPool | None = None, max_turns: int = 12) -> ExpertEpisode:
    """Drive a scripted policy against a real sandbox until it calls `finish` or runs out of turns."""
    episode = ExpertEpisode(task)
    environment = task_environment(task)
    box = (pool.acquire(task.files, environment=environment) if pool
           else Sandbox.create(task.files, environment=environment))
    try:
        with Toolbox(box) as tools:
            observation: Observation | None = None
            for _ in range(max_turns):
                try:
                    action = policy.send(observation) if observation is not None else next(policy)
                except StopIteration:
                    break
                if action.calls:
                    observation = tools.execute(action.calls)
                else:
                    observation = task.answer_question(action.text)
                episode.turns.append((action, observation))
                if any(c.name == "finish" for c in action.calls):
                    episode.finished = True
                    break
        episode.final = box.snapshot()
    finally:
        if pool:
            pool.release(box)
        else:
            box.close()
    return episode


def demonstration_messages(task: Task, episode: ExpertEpisode) -> list[dict[str, Any]]:
    """A scripted episode as OpenAI-style chat messages, for supervised fine-tuning."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM_PROMPT},
                                      {"role": "user", "content": task.instruction}]
    for action, observation in episode.turns:
        messages.append({"role": "assistant", "content": action.text,
                         "tool_calls": [openai_tool_call(c) for c in action.calls]})
        if any(c.name == "finish" for c in action.calls):
            break
        if isinstance(observation, str):
            messages.append({"role": "user", "content": observation})
        else:
            messages += [{"role": "tool", "tool_call_id": r.call_id, "content": r.content} for r in observation]
    return messages


def demonstrations(tasks: list[Task], pool: SandboxPool, mistake_rate: float = 0.0, seed: int = 0,
                   workers: int = 8, wrong_path_rate: float = 0.0,
                   repair_rate: float = 0.0) -> list[list[dict[str, Any]]]:
    """Expert episodes on `tasks` as chat messages, run concurrently (commands are subprocesses)."""
    from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415

    def one(i: int) -> list[dict[str, Any]]:
        expert = ScriptedExpert(seed=seed * 100_003 + i, mistake_rate=mistake_rate, wrong_path_rate=wrong_path_rate,
                                repair_rate=repair_rate)
        return demonstration_messages(tasks[i], run_policy(tasks[i], expert.play(tasks[i]), pool))

    with ThreadPoolExecutor(workers) as executor:
        return list(executor.map(one, range(len(tasks))))


def bootstrap_demonstrations(config: BootstrapConfig, pool: SandboxPool) -> list[list[dict[str, Any]]]:
    """What `flywheel bootstrap` and the demo train version 0 on: the expert on the config's
    training tasks, as imperfect as its `demo_*` rates say."""
    return demonstrations(train_tasks(config), pool, mistake_rate=config.demo_mistake_rate, seed=config.seed,
                          wrong_path_rate=config.demo_wrong_path_rate, repair_rate=config.demo_repair_rate)
