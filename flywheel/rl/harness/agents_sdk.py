"""The OpenAI Agents SDK as a harness program: the "openai-agents" preset of `[rollout.harness]`.

    python -m flywheel.rl.harness.agents_sdk --base-url URL --api-key KEY --exec-url URL \
        --instruction-file FILE [--max-turns 8] [--model flywheel] [--status-file FILE]

What a user of the SDK writes, and nothing of flywheel's inside the loop: an `Agent` whose model is
the SDK's chat-completions model over an `AsyncOpenAI` client at the episode's base URL, one
`bash` function tool that posts its command to the episode's `exec` endpoint (so it runs in the
jail), and `Runner.run` to `--max-turns`. Tracing is off (nothing leaves the machine). The
status file says why it stopped: `{"exit_status": "Finished" | "MaxTurnsExceeded"}`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from flywheel.extras import require


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--api-key", required=True)
    parser.add_argument("--exec-url", required=True)
    parser.add_argument("--instruction-file", required=True, type=Path)
    parser.add_argument("--max-turns", type=int, default=8)
    parser.add_argument("--model", default="flywheel")
    parser.add_argument("--status-file", type=Path, default=None)
    ns = parser.parse_args(argv)

    import httpx  # noqa: PLC0415
    # the SDK: imported when the program runs, not with flywheel
    agents = require("agents", "the openai-agents harness preset")
    from openai import AsyncOpenAI  # noqa: PLC0415

    exec_client = httpx.AsyncClient(headers={"authorization": f"Bearer {ns.api_key}"}, timeout=None)

    @agents.function_tool
    async def bash(command: str) -> str:
        """Run a shell command in the task's workspace and return its output and exit code."""
        result = (await exec_client.post(ns.exec_url, json={"command": command, "shell": "bash"})).json()
        note = " (timed out)" if result["timed_out"] else ""
        return f"{result['output']}\n[exit code {result['exit_code']}{note}]"

    agents.set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=ns.base_url, api_key=ns.api_key, max_retries=0)
    agent = agents.Agent(name="flywheel", instructions="Solve the task in the workspace with the bash tool.",
                         tools=[bash], model=agents.OpenAIChatCompletionsModel(model=ns.model, openai_client=client))
    status = "Finished"
    try:
        asyncio.run(agents.Runner.run(agent, ns.instruction_file.read_text(), max_turns=ns.max_turns))
    except agents.MaxTurnsExceeded:
        status = "MaxTurnsExceeded"
    if ns.status_file is not None:
        ns.status_file.write_text(json.dumps({"exit_status": status}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
