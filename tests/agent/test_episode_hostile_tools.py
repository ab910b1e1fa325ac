"""An episode whose agent turns its workspace hostile still ends normally, each bad call counted as failed.

Before the tools were hardened, editing the FIFO below blocked the episode's thread forever, and the
lone surrogate and the tree deeper than PATH_MAX raised out of `run_episode` (and so out of the
Orchestrator). Real sandbox, real tools, real grading; the engine replays scripted turns.
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import Future

import pytest

from flywheel.agent.episode import initial_prompt, run_episode
from flywheel.agent.trajectory import Status
from flywheel.env.families import generate
from flywheel.env.pool import PoolConfig, SandboxPool
from flywheel.model.chat import IM_END, render_messages
from flywheel.model.engine import Generation, SamplingParams
from flywheel.model.tokenizer import train_tokenizer


class _ReplayEngine:
    """Answers each turn with the next scripted text."""

    def __init__(self, tokenizer, turns: list[str]):
        self.tokenizer, self.turns, self.prompts = tokenizer, list(turns), []

    @property
    def version(self) -> int:
        return 0

    def submit(self, prompt_ids, params: SamplingParams) -> Future:
        self.prompts.append(list(prompt_ids))
        ids = self.tokenizer(self.turns.pop(0), add_special_tokens=False)["input_ids"][: params.max_tokens]
        future: Future = Future()
        future.set_result(Generation(ids, [-0.5] * len(ids), [0] * len(ids), "stop"))
        return future

    def close(self) -> None:
        pass


def _call(name: str, **arguments) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'


DEEP_TREE = "python3 -c \"import os\nfor _ in range(2100): os.mkdir('d'); os.chdir('d')\""


def test_a_hostile_workspace_costs_failed_calls_not_the_episode():
    task = generate("bugfix", "train", 1, seed=5, difficulty=1)[0]
    (edit,) = task.reference_edits
    corpus = [initial_prompt(task), _call("read_file", path="a.py") + IM_END] * 10
    corpus += [render_messages([{"role": "user", "content": t.instruction}]) for t in generate("bugfix", "train", 20)]
    tokenizer = train_tokenizer(corpus, vocab_size=800)
    turns = [
        _call("run_command", command="mkfifo pipe.txt && " + DEEP_TREE) + IM_END,
        _call("edit_file", path="pipe.txt", old="", new="x") + _call("read_file", path="pipe.txt") + IM_END,
        _call("edit_file", path=edit.path, old=edit.old, new="\udc80") + IM_END,  # a lone surrogate
        _call("edit_file", path=edit.path, old=edit.old, new=edit.new) + IM_END,
        _call("finish", summary="fixed") + IM_END,
    ]
    out: dict[str, object] = {}
    with SandboxPool(PoolConfig(max_active=2, warm=1)) as pool:
        engine = _ReplayEngine(tokenizer, turns)
        worker = threading.Thread(target=lambda: out.update(traj=run_episode(task, engine, tokenizer, pool)),
                                  daemon=True)
        worker.start()
        worker.join(120)
        assert not worker.is_alive(), "the episode hung"
        assert "traj" in out, "run_episode raised"
    traj = out["traj"]
    assert traj.status == Status.FINISHED, (traj.status, traj.error)
    assert [n for _, _, n in traj.failed_turns] == [2, 1] and traj.failed_tool_calls == 3
    assert traj.all_passed and traj.reward == pytest.approx(1.0)
    told = tokenizer.decode(engine.prompts[2])
    assert "pipe.txt is not a regular file but a FIFO" in told
