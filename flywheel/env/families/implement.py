"""`implement`: write a function from its docstring (a stub that raises NotImplementedError).

Difficulty 1: a module holding only the stub. 2: the stub sits among implemented functions.
3: two stubs in two modules, among implemented functions.
The docstring's examples are the visible tests; hidden tests repeat them and check more cases.
"""

from __future__ import annotations

import random

from flywheel.env.families.functions import PACKAGES, TEMPLATES, Case, case_tests, draw_cases, module_names
from flywheel.env.families.workspace import Draft, call_text, pick, python_file

ONE = (
    "Implement `{func}` in `{path}`; the docstring explains what it should do.",
    "`{func}` in `{path}` is still a stub. Please write it (see the docstring for the expected behaviour).",
    "Can you fill in `{func}` ({path})? It currently raises NotImplementedError.",
    "Please write the body of `{func}` in `{path}` so it matches its docstring and examples.",
)
TWO = (
    "Two functions are still stubs: `{a}` in `{pa}` and `{b}` in `{pb}`. Please implement both from their docstrings.",
    "Please implement `{a}` ({pa}) and `{b}` ({pb}); both just raise NotImplementedError right now.",
)


def examples(name: str, cases: list[Case]) -> str:
    lines = "".join(f"    >>> {call_text(name, c.args)}\n    {c.expected!r}\n" for c in cases)
    return "\n\n" + lines + "    "


def build(rng: random.Random, difficulty: int) -> Draft:
    pkg = pick(rng, PACKAGES)
    n_modules = 1 if difficulty < 3 else 2
    per_module = 1 if difficulty == 1 else rng.randint(2, 3)
    chosen = rng.sample(TEMPLATES, n_modules * per_module)
    groups = [chosen[i * per_module:(i + 1) * per_module] for i in range(n_modules)]
    modules = module_names(rng, groups)
    stubs = {(m, rng.randrange(per_module)) for m in range(n_modules)}  # one stub per module

    files = {f"{pkg}/__init__.py": f'"""{pkg}: small utilities."""\n'}
    solved = dict(files)
    hidden: dict[str, str] = {}
    targets: list[tuple[str, str]] = []
    for m, (module, group) in enumerate(zip(modules, groups, strict=True)):
        path = f"{pkg}/{module}.py"
        doc = f"{module.capitalize()} helpers."
        start, done, visible_tests, hidden_tests = [], [], [], []
        for i, t in enumerate(group):
            is_stub = (m, i) in stubs
            visible, extra, _, _ = draw_cases(t, rng, 3 if is_stub else 2, 6 if is_stub else 2)
            doc_extra = examples(t.name, visible) if is_stub else ""
            start.append(t.stub(doc_extra) if is_stub else t.source())
            done.append(t.source(doc_extra=doc_extra))
            visible_tests += case_tests(t.name, t.name, visible)
            hidden_tests += case_tests(t.name, t.name, visible) + case_tests(t.name, t.name, extra, len(visible) + 1)
            if is_stub:
                targets.append((t.name, path))
        files[path] = python_file(doc, [], start)
        solved[path] = python_file(doc, [], done)
        imports = [f"from {pkg}.{module} import {', '.join(t.name for t in group)}"]
        files[f"tests/test_{module}.py"] = solved[f"tests/test_{module}.py"] = python_file(None, imports, visible_tests)
        hidden[f"tests_hidden/test_{module}.py"] = python_file(None, imports, hidden_tests)

    if len(targets) == 1:
        instruction = pick(rng, ONE).format(func=targets[0][0], path=targets[0][1])
    else:
        (a, pa), (b, pb) = targets
        instruction = pick(rng, TWO).format(a=a, pa=pa, b=b, pb=pb)
    return Draft(
        instruction=instruction,
        files=files,
        solved=solved,
        hidden_tests=hidden,
        difficulty=difficulty,
        extra={"template": ",".join(name for name, _ in targets), "stubs": len(targets),
               "functions": n_modules * per_module},
    )
