"""Harness rollouts: a third-party agent program plays flywheel episodes, token-exact.

server.py        the per-episode OpenAI and exec endpoints, the token ledger, grading (HarnessServer)
program.py       which program plays and how it starts: `[rollout.harness]`, its presets, the runner
sandbox_exec.py  a `bwrap`-shaped command that runs a harness's shell commands in the episode's jail
agents_sdk.py    the OpenAI Agents SDK as a harness program (the "openai-agents" preset)
"""
