"""A dependency-free test runner that every workspace ships as `run_tests.py`.

Why not pytest: sandboxes see only the system interpreter, and a grading run must start in
tens of milliseconds. Test files are `test_*.py` modules with `test_*` functions that assert.

    python3 run_tests.py tests                                    # the agent: a readable summary
    python3 -I run_tests.py --nonce-file .nonce tests_hidden      # the grader

When graded, the runner reads a one-time nonce from a file and deletes the file before any
workspace code is imported (an environment variable would stay readable in /proc/self/environ).
Everything the code under test writes to stdout and stderr, at the file-descriptor level, goes
to /dev/null; the runner then prints one line `<nonce> {json}` with the per-test results. So
output of the code under test can neither pose as the result nor push it out of the captured
output. The workspace directory is appended to the end of `sys.path`, so a workspace file named
like a standard module (`json.py`) cannot shadow the runner's own imports. Not covered: code
that deliberately inspects the runner's own memory (its frames) to find the nonce.
This file must keep to the standard library: it is copied into workspaces verbatim.
"""

import importlib.util
import json
import os
import sys
import traceback


def discover(targets):
    files = []
    for target in targets:
        if os.path.isfile(target):
            files.append(target)
            continue
        for dirpath, dirnames, filenames in os.walk(target):
            dirnames.sort()
            for name in sorted(filenames):
                if name.startswith("test_") and name.endswith(".py"):
                    files.append(os.path.join(dirpath, name))
    return files


def run_file(path):
    """Import one test file and run its test functions; yields (name, passed, message)."""
    module_name = "flywheel_test_" + os.path.splitext(os.path.basename(path))[0]
    try:
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except BaseException as exc:  # a broken import fails every test in the file, visibly
        yield path + "::<import>", False, "".join(traceback.format_exception_only(type(exc), exc)).strip()
        return
    for name in sorted(vars(module)):
        func = getattr(module, name)
        if not (name.startswith("test_") and callable(func)):
            continue
        try:
            func()
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt):
                raise
            tb = traceback.format_exception(type(exc), exc, exc.__traceback__)
            yield path + "::" + name, False, "".join(tb[-3:]).strip()
        else:
            yield path + "::" + name, True, ""


def read_nonce(argv):
    """Take `--nonce-file PATH` out of argv; return (nonce or None, remaining argv)."""
    if "--nonce-file" not in argv:
        return None, argv
    i = argv.index("--nonce-file")
    path = argv[i + 1]
    with open(path) as f:
        nonce = f.read().strip()
    os.unlink(path)
    return nonce, argv[:i] + argv[i + 2 :]


def silence_output():
    """Send fds 1 and 2 to /dev/null; return a private duplicate of the original stdout."""
    sys.stdout.flush()
    sys.stderr.flush()
    real_stdout = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    return real_stdout


def main(argv):
    nonce, argv = read_nonce(argv)
    real_stdout = silence_output() if nonce is not None else None
    targets = argv or ["tests"]
    workspace = os.getcwd()
    if workspace not in sys.path:
        sys.path.append(workspace)
    results = []
    for path in discover(targets):
        results.extend(run_file(path))
    passed = sum(1 for _, ok, _ in results if ok)
    failed = len(results) - passed
    if nonce is not None:
        record = {"passed": passed, "failed": failed, "tests": {name: ok for name, ok, _ in results}}
        os.write(real_stdout, ("\n" + nonce + " " + json.dumps(record) + "\n").encode())
        return 0
    for name, ok, message in results:
        if not ok:
            print("FAILED " + name)
            print("    " + message.replace("\n", "\n    "))
    if not results:
        print("no tests found in " + ", ".join(targets))
    print(f"{passed} passed, {failed} failed")
    return 0 if results and failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
