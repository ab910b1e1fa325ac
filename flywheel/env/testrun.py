"""A dependency-free test runner that every workspace ships as `run_tests.py`.

Why not pytest: sandboxes see only the system interpreter, and a grading run must start in
tens of milliseconds. Test files are `test_*.py` modules with `test_*` functions that assert.

    python3 run_tests.py tests                                          # the agent: a readable summary
    exec python3 -I -S run_tests.py --report-fd 3 tests_hidden/test_x.py # the grader (grading.py)
    exec python3 -I -S run_tests.py --report-fd 3 --pytest /env/site -- toolz/tests/test_x.py
                                     # the grader on a real repository: its pytest suite (below)

The agent's mode imports each test file and prints what failed. The grader's mode is built so that
the code under test can neither write nor impersonate the verdict:

    host (grading.py) --fd 3, an unlinked file--> supervisor (this file, `--report-fd`)
                                                     | fork per hidden test file, fd 3 closed first
                                                     v
                                                  child: imports the workspace, runs the tests;
                                                  after each test that returned it reads that test's
                                                  token from its pipe and writes it back

- The supervisor runs no workspace code: `-I -S` keeps the workspace off `sys.path` and skips
  `site` (so a planted `sitecustomize.py` or `.pth` never runs), and it reads and compiles every
  hidden test before the first child starts, so deleting or rewriting them later changes nothing.
- It makes itself non-dumpable (prctl PR_SET_DUMPABLE 0): its memory and descriptors under
  /proc/<pid> and ptrace are closed to every other process of the jail, though they run as the
  same user. So the report descriptor, which only it holds (the command starts with `exec`, and
  bwrap's init does not keep it), is out of the children's reach. The jail's output is no channel:
  any process of the jail can write to it (bwrap's init holds it at /proc/1/fd/1), so the grader
  keeps it as a log only.
- A test counts as passed only when its child writes back the test's token: 16 random bytes made
  after the fork, so they are in no memory the child inherited. Printing, exiting at import
  (`os._exit(0)`, `sys.exit`), killing the supervisor, skipping or never reaching a test: no token,
  a failure. The grader counts the outcomes against the test names it computes itself from the
  hidden tests (`defined_tests`), so a test that is missing from the report is a failure too.
- Each child installs an audit hook (PEP 578; it cannot be removed) before importing workspace
  code. It refuses `sys.settrace`/`sys.setprofile` (a tracer can jump past a failing assert),
  replacing a function's `__code__`, ctypes, and opening the /proc entries of processes (memory
  writes through /proc/self/mem). A test function runs only if it is still the function its file
  defined (same code object, same globals), and the child binds the builtins it uses before the
  workspace can patch them.

What it does not protect against, inside a child (the workspace code runs in the same process as
the tests that check it):
- code that reads its own descriptors to find the token pipe and echoes what it reads; the tokens
  are random, so this takes reading the protocol, not guessing it.
- results that lie about themselves: an object whose `__eq__` always holds passes `==` asserts.
- deliberate work-arounds of the audit hook, which is CPython's monitoring, not a sandbox (a
  path object that names another file each time it is asked slips past the /proc check).
The first two would take running the assertions in a process apart from the code they check.
In the pytest mode (real repositories) also: ctypes is allowed (real libraries load it), so code
that reads its own process's memory can find a token; and a conftest.py that replaces what a test
item runs (`item.runtest`) passes it, unless the task's own conftest.py files are what the grader
restores (it does: grading.py).

Both modes append the workspace to the end of `sys.path`, so a workspace file named like a
standard module (`json.py`) cannot shadow the runner's own imports. In the grader's mode a test
is a plain top-level `def test_*`: a decorated one is not the function its code defines and fails.
Measured with `bench/sandbox.py` (grading): within about 1.1x of one plain in-process run of the
same hidden tests in a fresh sandbox; the nonce-line design it replaced was about 1.0x.
This file must keep to the standard library: it is copied into workspaces verbatim (pytest is
imported only in the pytest mode's child, from the task's environment).
"""

import functools
import json
import os
import sys


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
    import importlib.util
    import traceback

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


TOKEN_BYTES = 16
PR_SET_DUMPABLE = 4


def defined_tests(code):
    """The `test_*` functions a compiled test file defines at top level, in the order they run."""
    return sorted({c.co_name for c in code.co_consts if isinstance(c, type(code)) and c.co_name.startswith("test_")})


def make_undumpable():
    """Close this process's /proc entries and ptrace to the other processes of the jail."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed; the grader needs Linux")


def supervise(report_fd, paths):
    """The grader's mode: run each hidden test file in a child and write {"tests": {name: passed}}."""
    make_undumpable()
    suites = []
    for path in paths:  # all read and compiled before any workspace code runs
        with open(path, "rb") as f:
            suites.append((path, compile(f.read(), path, "exec", dont_inherit=True)))
    workspace = os.getcwd()
    results = {}
    for path, code in suites:
        passed = run_suite_in_child(path, code, report_fd, workspace)
        results.update({path + "::" + name: name in passed for name in defined_tests(code)})
    write_report(report_fd, results)
    return 0


def write_report(report_fd, tests):
    """The verdict, {"tests": {name: passed}}, whole on the report descriptor only the supervisor holds."""
    record = json.dumps({"tests": tests}).encode()
    while record:
        record = record[os.write(report_fd, record) :]


def fork_child(report_fd, run):
    """Fork a child that calls `run(tokens_r, echo_w)` with the report descriptor closed; return
    (pid, tokens_w, echo_r), the supervisor's ends of the token pipe and of the echo pipe.

    The child reads each passed test's token from `tokens_r` and writes it back on `echo_w`. It
    never returns into the supervisor's loop: whatever `run` does, it ends in `os._exit`, bound
    before any workspace code runs (which may patch `os`), and an exception's traceback goes to
    the child's stderr (the run's log), never to the report."""
    tokens_r, tokens_w = os.pipe()
    echo_r, echo_w = os.pipe()
    leave = os._exit
    pid = os.fork()
    if pid == 0:
        try:
            os.close(report_fd)
            os.close(tokens_w)
            os.close(echo_r)
            run(tokens_r, echo_w)
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            leave(0)
    os.close(tokens_r)
    os.close(echo_w)
    return pid, tokens_w, echo_r


def run_suite_in_child(path, code, report_fd, workspace):
    """Fork a child that runs one test file; return the names of the tests whose token came back."""
    pid, tokens_w, echo_r = fork_child(
        report_fd, lambda tokens_r, echo_w: run_suite(path, code, tokens_r, echo_w, workspace))
    # Made after the fork: the child's memory never held them.
    tokens = {os.urandom(TOKEN_BYTES).hex(): name for name in defined_tests(code)}
    try:
        os.write(tokens_w, "".join(tokens).encode())  # 32 bytes a test: far under a pipe's 64 KiB
    except BrokenPipeError:
        pass  # the child is gone already: nothing came back
    os.close(tokens_w)
    echoed = bytearray()
    while chunk := os.read(echo_r, 1 << 16):
        echoed += chunk
    os.close(echo_r)
    os.waitpid(pid, 0)
    return {tokens[t] for t in echoed.decode("ascii", "replace").split("\n") if t in tokens}


def run_suite(path, code, tokens_r, echo_w, workspace):
    """In the child: import the test file from the compiled code and run its tests, echoing tokens."""
    # Bound now: once workspace code runs, module attributes and builtins may be patched.
    read, write, length, type_of, base_exception = os.read, os.write, len, type, BaseException
    function_type = type_of(run_suite)
    names = defined_tests(code)
    expected = {c.co_name: c for c in code.co_consts if isinstance(c, type_of(code))}
    for name in [m for m in sys.modules if m in ("ctypes", "_ctypes") or m.startswith("ctypes.")]:
        del sys.modules[name]  # the supervisor's prctl loaded them; importing them again is refused
    sys.addaudithook(refuse_tampering)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # output of the code under test goes nowhere anyone reads
        os.dup2(devnull, fd)
    sys.path.append(workspace)
    module_name = "flywheel_test_" + os.path.splitext(os.path.basename(path))[0]
    module = type_of(sys)(module_name)
    module.__file__ = path
    namespace = module.__dict__
    sys.modules[module_name] = module
    try:
        exec(code, namespace)
        imported = True
    except base_exception:
        imported = False
    for name in names:
        passed = False
        func = namespace.get(name) if imported else None
        if type_of(func) is function_type and func.__code__ is expected[name] and func.__globals__ is namespace:
            try:
                func()
                passed = True
            except base_exception:
                pass
        token = b""
        while length(token) < 2 * TOKEN_BYTES:
            chunk = read(tokens_r, 2 * TOKEN_BYTES - length(token))
            if not chunk:
                return
            token += chunk
        if passed:
            write(echo_w, token + b"\n")


def is_process_entry(path):
    """Whether a resolved path leads into /proc/<pid>/ (self and thread-self resolve there)."""
    parts = path.split("/")
    return parts[1:2] == ["proc"] and parts[2:3] != [] and parts[2].isdigit()


DOCTEST_FILE = os.path.join(os.path.dirname(os.__file__), "doctest.py")  # the stdlib's, read before any workspace code


def refuse_tampering(event, args, *, libraries=False, realpath=os.path.realpath, fsdecode=os.fsdecode,
                     in_proc=is_process_entry, error=RuntimeError, frame=sys._getframe, doctest_file=DOCTEST_FILE):
    """Audit hook of a grading child: refuse the means to change how a test's outcome is observed.

    Always refused: `sys.settrace`/`sys.setprofile` (a tracer can jump past a failing assert),
    replacing a function's `__code__`, and opening the /proc entries of processes (memory writes
    through /proc/self/mem). In the file mode also ctypes and setting `__defaults__` or
    `__kwdefaults__`. `libraries=True` (the pytest mode: a repository's own suite and the packages
    it imports) allows those two, which real libraries do at import (namedtuple sets `__defaults__`,
    many load ctypes), and the stdlib doctest's own `sys.settrace` (it saves and restores the tracer
    around every example). There ctypes can read the process's memory, and code compiled under
    doctest's file name passes the tracer check: a forged result takes deliberate work, not a guess.

    What it calls is bound as keyword defaults, and in the file mode setting them is refused, so
    patching `os`, this module or the builtins does not change what it checks."""
    if libraries and event == "sys.settrace" and frame(1).f_code.co_filename == doctest_file:
        return
    if (
        event in ("sys.settrace", "sys.setprofile")
        or (event == "object.__setattr__" and (args[1] == "__code__" or (
            not libraries and args[1] in ("__defaults__", "__kwdefaults__"))))
        or (event == "open" and args[0].__class__ is not int and in_proc(realpath(fsdecode(args[0]))))
        or (not libraries and (event.startswith("ctypes.") or (event == "import" and args[0] in ("ctypes", "_ctypes"))))
    ):
        raise error(f"{event} is not allowed while the hidden tests run")


# ---- the grader's pytest mode: a repository's own suite (real-repository tasks) ----------------
#
#     exec python3 -I -S run_tests.py --report-fd 3 --pytest /env/site -- toolz/tests/test_x.py ...
#
# The same supervisor, one child: it puts the workspace and the environment's packages on sys.path
# the way `python -m pytest` in the workspace would (PYTHONPATH=/env/site), and runs pytest.main
# in-process with `TokenReporter` as a plugin object (a class of this file, already in the child's
# memory: nothing is imported to make the report). For each test whose setup, call and teardown all
# passed, the reporter reads the one outstanding token from its pipe and writes back "token nodeid";
# the supervisor accepts a line only with the outstanding token, then issues the next (made after
# the fork, like every token). The report holds the node ids proven to pass; the grader counts them
# against the ids the task names (FAIL_TO_PASS, PASS_TO_PASS), so a test that is missing, skipped,
# xfailed or never collected fails. The file mode's audit hook, with `libraries=True`; same limits
# (docstring).


class TokenReporter:
    """pytest plugin of a grading child: proves each passing test with the supervisor's token.

    Whether a test's call raised is observed by the innermost wrapper of `pytest_runtest_call`
    (trylast: it sits directly around pytest's own call of the test), so a conftest.py hook that
    rewrites reports cannot turn a failure into a pass; reports can only add failures (setup,
    teardown). The grader also restores the task's conftest.py and pytest config files."""

    def __init__(self, tokens_r, echo_w):
        self.tokens_r, self.echo_w = tokens_r, echo_w
        self.read, self.write, self.length = os.read, os.write, len
        self.failed = set()
        self.called = set()

    def call_wrapper(self, item):
        """`pytest_runtest_call`, made a trylast wrapper by `run_pytest` once pytest is imported."""
        result = yield  # raises what the test raised
        self.called.add(item.nodeid)
        return result

    def pytest_runtest_logreport(self, report):
        if report.outcome != "passed":
            self.failed.add(report.nodeid)

    def pytest_runtest_logfinish(self, nodeid, location):
        del location
        if nodeid not in self.called or nodeid in self.failed:
            return
        token = b""
        while self.length(token) < 2 * TOKEN_BYTES:
            chunk = self.read(self.tokens_r, 2 * TOKEN_BYTES - self.length(token))
            if not chunk:
                return
            token += chunk
        self.write(self.echo_w, token + b" " + nodeid.encode("utf-8", "replace") + b"\n")


def supervise_pytest(report_fd, site_dir, args):
    """The grader's pytest mode: one child runs pytest over `args`; write {"tests": {nodeid: True}}."""
    make_undumpable()
    workspace = os.getcwd()
    pid, tokens_w, echo_r = fork_child(
        report_fd, lambda tokens_r, echo_w: run_pytest(site_dir, args, tokens_r, echo_w, workspace))
    passed = {}
    token = os.urandom(TOKEN_BYTES).hex().encode()
    pending = bytearray()
    alive = True
    try:
        os.write(tokens_w, token)
    except BrokenPipeError:
        alive = False
    while chunk := os.read(echo_r, 1 << 16):
        pending += chunk
        while b"\n" in pending:
            line, _, rest = bytes(pending).partition(b"\n")
            pending = bytearray(rest)
            if line[: 2 * TOKEN_BYTES] != token or line[2 * TOKEN_BYTES : 2 * TOKEN_BYTES + 1] != b" ":
                continue
            passed[line[2 * TOKEN_BYTES + 1 :].decode("utf-8", "replace")] = True
            token = os.urandom(TOKEN_BYTES).hex().encode()
            if alive:
                try:
                    os.write(tokens_w, token)
                except BrokenPipeError:
                    alive = False
    os.close(tokens_w)
    os.close(echo_r)
    os.waitpid(pid, 0)
    write_report(report_fd, passed)
    return 0


def run_pytest(site_dir, args, tokens_r, echo_w, workspace):
    """In the child: the import path of `python -m pytest` in the workspace, the hook, then pytest."""
    reporter = TokenReporter(tokens_r, echo_w)  # binds what it calls before workspace code runs
    sys.addaudithook(functools.partial(refuse_tampering, libraries=True))  # a partial has no __defaults__ to set
    sys.path[:0] = [workspace, site_dir]
    import site

    site.addsitedir(site_dir)  # its .pth files, as PYTHONPATH plus site would not: installed packages need them
    import importlib

    pytest = importlib.import_module("pytest")  # the task's environment's pytest, no dependency of flywheel

    TokenReporter.pytest_runtest_call = pytest.hookimpl(wrapper=True, trylast=True)(TokenReporter.call_wrapper)
    pytest.main(["--rootdir", workspace, "-p", "no:cacheprovider", "-q", *args], plugins=[reporter])
    sys.stdout.flush()  # os._exit follows: pytest's summary would be lost from the log


def main(argv):
    if argv[:1] == ["--report-fd"] and argv[2:3] == ["--pytest"]:
        rest = argv[4:]
        return supervise_pytest(int(argv[1]), argv[3], rest[1:] if rest[:1] == ["--"] else rest)
    if argv[:1] == ["--report-fd"]:
        return supervise(int(argv[1]), argv[2:])
    targets = argv or ["tests"]
    workspace = os.getcwd()
    if workspace not in sys.path:
        sys.path.append(workspace)
    results = []
    for path in discover(targets):
        results.extend(run_file(path))
    passed = sum(1 for _, ok, _ in results if ok)
    failed = len(results) - passed
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
