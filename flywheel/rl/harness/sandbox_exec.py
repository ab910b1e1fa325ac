"""A `bwrap`-shaped command that runs a harness's shell commands in its episode's flywheel sandbox.

    python -m flywheel.rl.harness.sandbox_exec --url URL --key KEY -- [bwrap options] bash -c COMMAND

An external agent harness that can wrap its commands in bubblewrap (mini-swe-agent's `bubblewrap`
environment: `executable` and `wrapper_args` in its config) is pointed at this module instead of
`bwrap`. It reads what the harness asked for from the bwrap-style argument list (the command after
`bash -c` or `sh -c`, each `--setenv NAME VALUE`; the mounts and `--chdir` it names are ignored:
the episode's workspace is the jail's `/workspace`), posts it to the episode's `exec` endpoint
(flywheel/rl/harness/server.py), prints the output and exits with the command's exit code, as bwrap
would. The command runs in flywheel's own jail (its limits, its workspace), never on this host.

Standard library only: the harness pays one interpreter start and one loopback request per command.
Exit codes of its own: 124 when the command timed out (as timeout(1)), 125 when the endpoint could
not be reached or refused the request (the reason on stderr).
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request

_SKIP = {"--bind": 2, "--ro-bind": 2, "--dev-bind": 2, "--bind-try": 2, "--ro-bind-try": 2, "--symlink": 2,
         "--chdir": 1, "--tmpfs": 1, "--proc": 1, "--dev": 1, "--size": 1, "--hostname": 1, "--unsetenv": 1}


def parse_bwrap_args(args: list[str]) -> tuple[str, str, dict[str, str]]:
    """(shell, command, env) from a bwrap argument list that ends in `SHELL -c COMMAND`."""
    env: dict[str, str] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--setenv" and i + 2 < len(args):
            env[args[i + 1]] = args[i + 2]
            i += 3
        elif arg in _SKIP:
            i += 1 + _SKIP[arg]
        elif arg.startswith("--"):
            i += 1  # a flag without a value (--unshare-all, --new-session, --die-with-parent, ...)
        else:
            break
    rest = args[i:]
    if len(rest) < 3 or rest[1] != "-c" or rest[0].rsplit("/", 1)[-1] not in ("bash", "sh"):
        raise ValueError(f"expected the bwrap options to end in `bash -c COMMAND` or `sh -c COMMAND`, got {rest[:3]}")
    return rest[0].rsplit("/", 1)[-1], rest[2], env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="the episode's base URL (ends in /episodes/ID)")
    parser.add_argument("--key", required=True, help="the episode's key")
    parser.add_argument("--timeout", type=float, default=None, help="seconds; default: the sandbox's")
    parser.add_argument("bwrap_args", nargs=argparse.REMAINDER)
    ns = parser.parse_args(argv)
    args = ns.bwrap_args[1:] if ns.bwrap_args[:1] == ["--"] else ns.bwrap_args
    try:
        shell, command, env = parse_bwrap_args(args)
    except ValueError as exc:
        print(f"flywheel sandbox_exec: {exc}", file=sys.stderr)
        return 125
    body = json.dumps({"command": command, "shell": shell, "env": env, "timeout_s": ns.timeout}).encode()
    request = urllib.request.Request(f"{ns.url.rstrip('/')}/exec", data=body, method="POST", headers={
        "content-type": "application/json", "authorization": f"Bearer {ns.key}"})
    try:
        with urllib.request.urlopen(request, timeout=(ns.timeout or 600) + 30) as response:
            result = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        print(f"flywheel sandbox_exec: the episode refused the command ({exc.code}): {exc.read()[:500]!r}",
              file=sys.stderr)
        return 125
    except (urllib.error.URLError, OSError) as exc:
        print(f"flywheel sandbox_exec: cannot reach {ns.url}: {exc}; is the harness endpoint running?",
              file=sys.stderr)
        return 125
    sys.stdout.write(result["output"])
    sys.stdout.flush()
    if result["timed_out"]:
        return 124
    return 128 if result["exit_code"] is None else int(result["exit_code"])


if __name__ == "__main__":
    sys.exit(main())
