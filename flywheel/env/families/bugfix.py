"""`bugfix`: a small package with one bug injected into one of its functions.

Difficulty 1: a module with a single function. 2: a module with several functions.
3: several modules (the clean ones are distractors) and a README.
The visible test for the buggy function fails; the instruction names that test or the symptom.
Hidden tests repeat every visible case and add more.
"""

from __future__ import annotations

import random

from flywheel.env.families.functions import PACKAGES, TEMPLATES, Case, case_tests, draw_cases, module_names
from flywheel.env.families.workspace import Draft, call_text, pick, python_file

INSTRUCTIONS = (
    "`{test}` is failing. Please fix the code (not the test).",
    "Running the tests gives me a failure in `{test}`. Can you find the bug and fix it?",
    "There's a bug in `{func}`: `{call}` {got}, but it should return `{expected}`. Please fix it.",
    "`{call}` {got} — I expected `{expected}`. Can you fix `{func}`?",
    "I think `{path}` has a bug; `{test}` fails. Fix it please?",
    "The test suite is red ({test}). Please make it pass without touching the tests.",
    "Something is off with `{func}` in `{path}`: for `{call}` it {got_short} instead of `{expected}`. Fix it.",
)


def got_text(shown_as: tuple[str, object]) -> tuple[str, str]:
    kind, value = shown_as
    if kind == "raises":
        return f"raises `{value}`", f"raises `{value}`"
    return f"returns `{value!r}`", f"gives `{value!r}`"


def build(rng: random.Random, difficulty: int) -> Draft:
    pkg = pick(rng, PACKAGES)
    n_modules = 1 if difficulty < 3 else rng.randint(2, 3)
    per_module = {1: 1, 2: rng.randint(3, 4), 3: rng.randint(2, 3)}[difficulty]
    chosen = rng.sample(TEMPLATES, n_modules * per_module)
    groups = [chosen[i * per_module:(i + 1) * per_module] for i in range(n_modules)]
    modules = module_names(rng, groups)
    buggy_module = rng.randrange(n_modules)
    buggy_fn = rng.randrange(per_module)
    target = groups[buggy_module][buggy_fn]
    bug = pick(rng, target.bugs)  # type: ignore[arg-type]
    n_visible, n_extra = (3, 4) if difficulty == 1 else (2, 3)

    files = {f"{pkg}/__init__.py": f'"""{pkg}: small utilities."""\n'}
    solved = dict(files)
    hidden: dict[str, str] = {}
    failing: tuple[str, Case, tuple[str, object]] | None = None
    for m, (module, group) in enumerate(zip(modules, groups, strict=True)):
        path = f"{pkg}/{module}.py"
        doc = f"{module.capitalize()} helpers."
        buggy = [t.source(bug=bug if (m, i) == (buggy_module, buggy_fn) else None) for i, t in enumerate(group)]
        files[path] = python_file(doc, [], buggy)
        solved[path] = python_file(doc, [], [t.source() for t in group])
        visible_tests, hidden_tests = [], []
        for i, t in enumerate(group):
            is_target = (m, i) == (buggy_module, buggy_fn)
            visible, extra, showing, shown_as = draw_cases(t, rng, n_visible, n_extra, bug if is_target else None)
            visible_tests += case_tests(t.name, t.name, visible)
            hidden_tests += case_tests(t.name, t.name, visible) + case_tests(t.name, t.name, extra, len(visible) + 1)
            if is_target:
                assert showing is not None and shown_as is not None
                failing = (f"tests/test_{module}.py::test_{t.name}_{visible.index(showing) + 1}", showing, shown_as)
        imports = [f"from {pkg}.{module} import {', '.join(t.name for t in group)}"]
        files[f"tests/test_{module}.py"] = python_file(None, imports, visible_tests)
        hidden[f"tests_hidden/test_{module}.py"] = python_file(None, imports, hidden_tests)
    if difficulty == 3:
        readme = f"# {pkg}\n\nSmall utilities: " + ", ".join(f"`{pkg}.{m}`" for m in modules) + ".\n"
        files["README.md"] = solved["README.md"] = readme
    for path in files:
        solved.setdefault(path, files[path])

    assert failing is not None
    test, case, shown_as = failing
    got, got_short = got_text(shown_as)
    instruction = pick(rng, INSTRUCTIONS).format(
        test=test, func=target.name, call=call_text(target.name, case.args), got=got, got_short=got_short,
        expected=repr(case.expected), path=f"{pkg}/{modules[buggy_module]}.py",
    )
    return Draft(
        instruction=instruction,
        files=files,
        solved=solved,
        hidden_tests=hidden,
        difficulty=difficulty,
        extra={"template": target.name, "bug_kind": bug.kind, "failing_test": test,
               "bug_path": f"{pkg}/{modules[buggy_module]}.py", "modules": n_modules,
               "functions": n_modules * per_module},
    )
