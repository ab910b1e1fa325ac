"""`crossfile`: tasks that need a search across files to find where to act. Two modes:

- `cause`: a report function fails its test, but the bug is in a helper it calls, in another
  module (and, from difficulty 2, through a service layer in a third). Hidden tests also test the
  helper directly, so patching the report instead of the helper does not pass.
- `rename`: rename a function and update every caller, tests included; callers sit in 2, 3 or 5
  modules by difficulty and import it in different styles. Hidden tests import the new name and
  check, by parsing every module of the package, that the old name is gone.
"""

from __future__ import annotations

import random

from flywheel.env.families.functions import (
    PACKAGES,
    TEMPLATES,
    Case,
    FunctionTemplate,
    case_tests,
    draw_cases,
    module_name,
    outcome,
)
from flywheel.env.families.workspace import Draft, call_text, pick, python_file, test_function

TOP_MODULES = ("report", "summary", "views", "render", "output")
MID_MODULES = ("service", "engine", "pipeline", "compute", "stats")
SUBPACKAGES = ("util", "lib", "support", "internal")

CAUSE = (
    "`{test}` fails. The report code looks fine to me, so the problem is probably somewhere underneath; "
    "please find and fix the real cause.",
    "`describe_{func}` in `{top_path}` produces a wrong line: `{call}` {got}, but it should return `{expected}`. "
    "Can you fix it?",
    "The report is wrong for {func}: `{call}` {got} instead of `{expected}`. Please fix the underlying bug.",
    "Tests fail in `tests/test_{top}.py` ({test}). Fix the bug, wherever it lives.",
)
RENAME = (
    "Please rename `{old}` to `{new}` across the codebase and update every caller, tests included. "
    "Don't leave an alias behind.",
    "`{old}` is a bad name: rename it to `{new}` everywhere it is used and drop the old name entirely.",
    "Can you rename the function `{old}` in `{path}` to `{new}`? All call sites (and the tests) need "
    "updating; no backwards-compatible alias please.",
)


def build(rng: random.Random, difficulty: int) -> Draft:
    if rng.random() < 0.5:
        return build_cause(rng, difficulty)
    return build_rename(rng, difficulty)


# ---- cause: the bug is below the function the test names ------------------------------------

def describe(name: str, callee: str) -> str:
    return (
        f"def describe_{name}(*args):\n"
        f'    """One report line: the call and its result."""\n'
        f"    value = {callee}(*args)\n"
        f'    return "{name}(" + ", ".join(repr(a) for a in args) + ") -> " + repr(value)\n'
    )


def described(name: str, case: Case) -> Case:
    return Case(case.args, f"{name}({', '.join(repr(a) for a in case.args)}) -> {case.expected!r}")


def build_cause(rng: random.Random, difficulty: int) -> Draft:
    pkg = pick(rng, PACKAGES)
    n_helpers = {1: 1, 2: 2, 3: 3}[difficulty]
    helpers = rng.sample(TEMPLATES, n_helpers + 1)
    helpers, distractor = helpers[:n_helpers], helpers[n_helpers]
    buggy = rng.randrange(n_helpers)
    bug = pick(rng, helpers[buggy].bugs)  # type: ignore[arg-type]
    top, mid = pick(rng, TOP_MODULES), pick(rng, MID_MODULES)
    helper_mod = module_name(helpers[buggy].category, rng)
    if difficulty == 1:
        helper_pkg = pkg
        files = {f"{pkg}/__init__.py": ""}
    else:
        helper_pkg = f"{pkg}.{pick(rng, SUBPACKAGES)}"
        files = {f"{pkg}/__init__.py": "", f"{helper_pkg.replace('.', '/')}/__init__.py": ""}
    helper_path = f"{helper_pkg.replace('.', '/')}/{helper_mod}.py"
    top_path = f"{pkg}/{top}.py"
    solved = dict(files)
    names = [t.name for t in helpers]

    files[helper_path] = python_file(
        "Small helpers used by the report.", [],
        [t.source(bug=bug if i == buggy else None) for i, t in enumerate(helpers)])
    solved[helper_path] = python_file("Small helpers used by the report.", [], [t.source() for t in helpers])
    if difficulty == 1:
        callee = {n: n for n in names}
        top_imports = [f"from {helper_pkg}.{helper_mod} import {', '.join(names)}"]
    else:
        callee = {n: f"run_{n}" for n in names}
        top_imports = [f"from {pkg}.{mid} import {', '.join(callee[n] for n in names)}"]
        mid_blocks = [
            f'def run_{n}(*args):\n    """Compute {n} for the report layer."""\n    return {n}(*args)\n' for n in names
        ]
        files[f"{pkg}/{mid}.py"] = python_file(
            "Service layer between the report and the helpers.",
            [f"from {helper_pkg}.{helper_mod} import {', '.join(names)}"], mid_blocks)
    files[top_path] = python_file("Report lines.", top_imports, [describe(n, callee[n]) for n in names])
    if difficulty == 3:
        other = module_name(distractor.category, rng)
        if other == helper_mod:
            other += "_extra"
        files[f"{helper_pkg.replace('.', '/')}/{other}.py"] = python_file(
            "More helpers.", [], [distractor.source()])

    visible_tests, hidden_top, hidden_helper = [], [], []
    failing: tuple[str, Case, tuple[str, object]] | None = None
    for i, t in enumerate(helpers):
        visible, extra, showing, shown_as = draw_cases(t, rng, 2, 3, bug if i == buggy else None)
        label = f"describe_{t.name}"
        visible_tests += case_tests(label, label, [described(t.name, c) for c in visible])
        hidden_top += case_tests(label, label, [described(t.name, c) for c in visible + extra])
        hidden_helper += case_tests(t.name, t.name, visible + extra)
        if showing is not None and shown_as is not None:
            failing = (f"tests/test_{top}.py::test_{label}_{visible.index(showing) + 1}", showing, shown_as)
    labels = ", ".join(f"describe_{n}" for n in names)
    files[f"tests/test_{top}.py"] = python_file(None, [f"from {pkg}.{top} import {labels}"], visible_tests)
    for path in files:
        solved.setdefault(path, files[path])
    hidden = {
        f"tests_hidden/test_{top}.py": python_file(None, [f"from {pkg}.{top} import {labels}"], hidden_top),
        f"tests_hidden/test_{helper_mod}.py": python_file(
            None, [f"from {helper_pkg}.{helper_mod} import {', '.join(names)}"], hidden_helper),
    }

    assert failing is not None
    test, case, shown_as = failing
    target = helpers[buggy].name
    if shown_as[0] == "raises":
        got = f"raises `{shown_as[1]}`"
    else:
        got = f"returns `{described(target, Case(case.args, shown_as[1])).expected!r}`"
    instruction = pick(rng, CAUSE).format(
        test=test, func=target, top_path=top_path, top=top, call=call_text(f"describe_{target}", case.args),
        got=got, expected=repr(described(target, case).expected),
    )
    return Draft(
        instruction=instruction, files=files, solved=solved, hidden_tests=hidden, difficulty=difficulty,
        extra={"mode": "cause", "template": target, "bug_kind": bug.kind, "failing_test": test,
               "bug_path": helper_path, "named_path": top_path},
    )


# ---- rename: one function, many callers -------------------------------------------------------

CALLER_MODULES = ("report", "service", "pipeline", "cli", "jobs", "batch", "views", "api", "tasks",
                  "export", "summary", "worker")
CALLER_FUNCTIONS = ("process_batch", "summarize", "render_rows", "run_job", "handle", "collect",
                    "export_all", "compute_all", "apply_all", "evaluate")


def caller_source(func: str, callee: str, pattern: int) -> str:
    if pattern == 0:
        return (f'def {func}(batch):\n    """Apply the core function to each argument tuple."""\n'
                f"    return [{callee}(*args) for args in batch]\n")
    if pattern == 1:
        return (f'def {func}(named):\n    """Map each key to the result for its argument tuple."""\n'
                f"    return {{key: {callee}(*args) for key, args in named.items()}}\n")
    return (f'def {func}(batch):\n    """Pair every argument tuple with its result."""\n    results = []\n'
            f"    for args in batch:\n        value = {callee}(*args)\n        results.append((args, value))\n"
            "    return results\n")


def caller_check(func: str, pattern: int, fn, batch: list[tuple]) -> str:
    values = [outcome(fn, args)[1] for args in batch]
    if pattern == 0:
        return f"assert {func}({batch!r}) == {values!r}"
    if pattern == 1:
        named = {f"k{i}": args for i, args in enumerate(batch)}
        return f"assert {func}({named!r}) == {dict(zip(named, values, strict=True))!r}"
    return f"assert {func}({batch!r}) == {list(zip(batch, values, strict=True))!r}"


RENAME_CHECK = '''import ast
import os

import {pkg}
from {pkg} import {core}


def names_in(path):
    with open(path) as f:
        tree = ast.parse(f.read())
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            yield node.id
        elif isinstance(node, ast.Attribute):
            yield node.attr
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node.name
        elif isinstance(node, ast.alias):
            yield node.name.split(".")[-1]
            yield node.asname


def test_new_name_exists():
    assert callable(getattr({core}, "{new}", None))


def test_old_name_is_gone():
    root = os.path.dirname({pkg}.__file__)
    for dirpath, _, filenames in os.walk(root):
        for filename in filenames:
            if filename.endswith(".py"):
                assert "{old}" not in set(names_in(os.path.join(dirpath, filename))), filename
'''


def build_rename(rng: random.Random, difficulty: int) -> Draft:
    pkg = pick(rng, PACKAGES)
    t: FunctionTemplate = pick(rng, TEMPLATES)  # type: ignore[assignment]
    new = pick(rng, t.renames)
    others = [o for o in rng.sample(TEMPLATES, 3) if o.name != t.name][: difficulty - 1]
    core = module_name(t.category, rng)
    n_callers = {1: 2, 2: 3, 3: 5}[difficulty]
    caller_mods = rng.sample(CALLER_MODULES, n_callers)
    caller_funcs = rng.sample(CALLER_FUNCTIONS, n_callers)
    sub = pick(rng, SUBPACKAGES) if difficulty == 3 else None
    fn = t.compile()

    def workspace(name: str) -> dict[str, str]:
        out = {f"{pkg}/__init__.py": ""}
        if sub:
            out[f"{pkg}/{sub}/__init__.py"] = ""
        out[f"{pkg}/{core}.py"] = python_file(
            f"{core.capitalize()} functions.", [], [t.source(name=name)] + [o.source() for o in others])
        for k, (mod, func) in enumerate(zip(caller_mods, caller_funcs, strict=True)):
            where = f"{pkg}.{sub}" if sub and k % 2 == 1 else pkg
            style = (k + difficulty) % 2
            if style == 0:
                imports, callee = [f"from {pkg}.{core} import {name}"], name
            else:
                imports, callee = [f"from {pkg} import {core}"], f"{core}.{name}"
            pattern = (k + len(pkg)) % 3
            out[f"{where.replace('.', '/')}/{mod}.py"] = python_file(
                f"{mod.capitalize()} entry points.", imports, [caller_source(func, callee, pattern)])
        return out

    files, solved = workspace(t.name), workspace(new)
    visible, extra, _, _ = draw_cases(t, rng, 2, 4)
    core_tests = [f"tests/test_{core}.py", f"tests_hidden/test_{core}.py"]
    files[core_tests[0]] = python_file(None, [f"from {pkg}.{core} import {t.name}"],
                                       case_tests(t.name, t.name, visible))
    solved[core_tests[0]] = python_file(None, [f"from {pkg}.{core} import {new}"], case_tests(t.name, new, visible))
    caller_tests, caller_imports = [], []
    for k, (mod, func) in enumerate(zip(caller_mods, caller_funcs, strict=True)):
        where = f"{pkg}.{sub}" if sub and k % 2 == 1 else pkg
        caller_imports.append(f"from {where}.{mod} import {func}")
        batch = [c.args for c in (visible + extra)[k % 2:k % 2 + 2]]
        caller_tests.append(test_function(f"test_{func}", [caller_check(func, (k + len(pkg)) % 3, fn, batch)]))
    files["tests/test_callers.py"] = solved["tests/test_callers.py"] = python_file(None, caller_imports, caller_tests)
    hidden = {
        core_tests[1]: python_file(None, [f"from {pkg}.{core} import {new}"],
                                   case_tests(new, new, visible + extra)),
        "tests_hidden/test_callers.py": files["tests/test_callers.py"],
        "tests_hidden/test_rename.py": RENAME_CHECK.replace("{pkg}", pkg).replace("{core}", core)
        .replace("{new}", new).replace("{old}", t.name),
    }
    instruction = pick(rng, RENAME).format(old=t.name, new=new, path=f"{pkg}/{core}.py")
    return Draft(
        instruction=instruction, files=files, solved=solved, hidden_tests=hidden, difficulty=difficulty,
        extra={"mode": "rename", "template": t.name, "new_name": new, "callers": n_callers,
               "files_to_edit": n_callers + 2},
    )
