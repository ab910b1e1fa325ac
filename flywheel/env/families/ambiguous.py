"""`ambiguous`: requests that leave out a detail needed to pass ("add a function that rounds prices").

Each template has several variants (two decimals half up, banker's rounding, whole units, ...);
a task picks one, keeps the instruction vague, and puts the missing detail, as the user would
say it, in `metadata.clarification`. Hidden tests check the chosen variant with inputs on which
every pair of variants disagrees somewhere, so a guess passes only by luck (about 1 in 3 or 4).
Visible tests only check what all variants agree on. The right first move is one question.

Difficulty 1: the function goes into a module holding only a docstring. 2: a module with other
functions and their tests. 3: the same plus another module and a README.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from flywheel.env.families.functions import TEMPLATES, case_tests, draw_cases, module_name, outcome
from flywheel.env.families.workspace import (
    Draft,
    TaskRef,
    call_text,
    pick,
    python_file,
    test_function,
    to_task,
)
from flywheel.env.task import Edit, Task

Args = tuple


@dataclass(frozen=True)
class Variant:
    clarification: str
    body: str  # indented function body


@dataclass(frozen=True)
class AmbiguousTemplate:
    name: str
    params: str
    summary: str
    packages: tuple[str, ...]
    modules: tuple[str, ...]
    instructions: tuple[str, ...]  # `{path}` is the module to add the function to
    variants: tuple[Variant, ...]
    inputs: Callable[[random.Random], Args]
    discriminating: tuple[Args, ...]  # together they tell every pair of variants apart
    agreed_checks: tuple[str, ...]  # visible assertions that hold for every variant

    def source(self, variant: int) -> str:
        return f'def {self.name}({self.params}):\n    """{self.summary}"""\n{self.variants[variant].body}'

    def compile(self, variant: int) -> Callable:
        namespace: dict = {}
        exec(self.source(variant), namespace)  # our own template text
        return namespace[self.name]


def _amount(rng: random.Random) -> Args:
    cents = rng.randint(100, 9999)
    return ((cents * 10 + rng.choice([5, 5, 2, 7])) / 1000,)


NAMES = ("Ada", "Bram", "Chen", "Dana", "Eli", "Farah", "Goran", "Hana", "Ivo", "June", "Kofi", "Lena")
CITIES = ("Oslo", "Lima", "Pune", "Kyiv", "Rome")


def _records(rng: random.Random) -> Args:
    names = rng.sample(NAMES, rng.randint(3, 5))
    ages = rng.sample(range(18, 80), len(names))
    return ([{"name": n, "age": a, "city": rng.choice(CITIES)} for n, a in zip(names, ages, strict=True)],)


def _date(rng: random.Random) -> Args:
    return (rng.randint(1990, 2030), rng.randint(1, 12), rng.randint(1, 28))


LONG_NAMES = ("Alexandra", "Maximilian", "Bartholomew", "Christopher", "Evangeline", "Konstantinos",
              "Wilhelmina", "Anastasia Romanova", "Jean-Baptiste Clement", "Octavia", "Ferdinand")


def _name(rng: random.Random) -> Args:
    return (rng.choice(LONG_NAMES),)


def _phone(rng: random.Random) -> Args:
    d = "".join(str(rng.randint(0, 9)) for _ in range(10))
    style = rng.randrange(4)
    return ([d, f"{d[:3]} {d[3:6]} {d[6:]}", f"({d[:3]}) {d[3:6]}-{d[6:]}", f"{d[:3]}-{d[3:6]}-{d[6:]}"][style],)


def _ratio(rng: random.Random) -> Args:
    while True:
        n = rng.randint(1, 9999)
        if n % 10 not in (0, 5) and n % 100 not in (49, 50, 51):  # stay clear of rounding ties
            return (n / 10000,)


SLUG_WORDS = ("Hello", "World", "Quick", "Brown", "Fox", "Data", "Report", "Annual", "Plan", "Notes")


def _title(rng: random.Random) -> Args:
    return (" ".join(rng.sample(SLUG_WORDS, rng.randint(2, 4))),)


DECIMAL = "    from decimal import ROUND_HALF_EVEN, ROUND_HALF_UP, Decimal\n\n"
MONTHS = ('    months = ["January", "February", "March", "April", "May", "June", "July", "August",\n'
          '              "September", "October", "November", "December"]\n')
DIGITS = '    d = "".join(c for c in number if c.isdigit())\n'

V = Variant
AMBIGUOUS: tuple[AmbiguousTemplate, ...] = (
    AmbiguousTemplate(
        "round_price", "amount", "Round a price for display.",
        ("shop", "billing", "store", "checkout"), ("pricing", "money", "prices"),
        ("Add a `round_price(amount)` function to `{path}` that rounds prices.",
         "We need a helper `round_price(amount)` in `{path}` for rounding prices before we show them. Can you add it?",
         "Please write `round_price(amount)` in `{path}`; it should round a price."),
        (V("Two decimals, rounding halves up (so 2.345 becomes 2.35).",
           DECIMAL + '    return float(Decimal(str(amount)).quantize(Decimal("0.01"), rounding=ROUND_HALF_UP))\n'),
         V("Two decimals, with banker's rounding: a half goes to the even cent (2.345 becomes 2.34).",
           DECIMAL + '    return float(Decimal(str(amount)).quantize(Decimal("0.01"), rounding=ROUND_HALF_EVEN))\n'),
         V("Round to whole units, halves up, and return an int (2.5 becomes 3).",
           DECIMAL + '    return int(Decimal(str(amount)).quantize(Decimal("1"), rounding=ROUND_HALF_UP))\n'),
         V("Round to the nearest 5 cents (0.05), halves up, and return a float.",
           DECIMAL + '    steps = (Decimal(str(amount)) / Decimal("0.05")).quantize(Decimal("1"), '
                     'rounding=ROUND_HALF_UP)\n'
           '    return float(steps * Decimal("0.05"))\n')),
        _amount, ((2.345,), (2.312,), (7.5,), (3.005,)),
        ("assert round_price(4.0) == 4.0", "assert round_price(12.0) == 12.0"),
    ),
    AmbiguousTemplate(
        "sort_records", "records", "Return the records (dicts with name, age and city) in order.",
        ("people", "crm", "members", "roster"), ("records", "directory", "listing"),
        ("Add `sort_records(records)` to `{path}`: it should return the records sorted.",
         "Can you write a `sort_records(records)` function in `{path}` that sorts the member records? Return a new "
         "list.",
         "I need the records sorted. Please add `sort_records(records)` to `{path}` (it returns the sorted list)."),
        (V("By name, A to Z.", '    return sorted(records, key=lambda r: r["name"])\n'),
         V("By age, oldest first.", '    return sorted(records, key=lambda r: r["age"], reverse=True)\n'),
         V("By age, youngest first.", '    return sorted(records, key=lambda r: r["age"])\n'),
         V("By city A to Z, and by name within the same city.",
           '    return sorted(records, key=lambda r: (r["city"], r["name"]))\n')),
        _records,
        (([{"name": "Bo", "age": 30, "city": "Rome"}, {"name": "Al", "age": 50, "city": "Oslo"},
           {"name": "Cy", "age": 20, "city": "Lima"}],),),
        ("assert sort_records([]) == []",
         "assert sort_records([{'name': 'Ann', 'age': 30, 'city': 'Oslo'}]) == [{'name': 'Ann', 'age': 30, 'city': "
         "'Oslo'}]"),
    ),
    AmbiguousTemplate(
        "format_date", "year, month, day", "Format a calendar date as text.",
        ("scheduling", "events", "booking", "agenda"), ("dates", "formatting", "display"),
        ("Add `format_date(year, month, day)` to `{path}` that formats a date as a string.",
         "Please write a `format_date(year, month, day)` helper in `{path}` so we can show dates in the UI.",
         "We keep formatting dates by hand. Can you add `format_date(year, month, day)` to `{path}`?"),
        (V("ISO format, like 2024-03-07.", '    return f"{year:04d}-{month:02d}-{day:02d}"\n'),
         V("US style with slashes, month first: 03/07/2024.", '    return f"{month:02d}/{day:02d}/{year:04d}"\n'),
         V("Day first with dots: 07.03.2024.", '    return f"{day:02d}.{month:02d}.{year:04d}"\n'),
         V("Spelled out, like March 7, 2024.", MONTHS + '    return f"{months[month - 1]} {day}, {year}"\n')),
        _date, ((2024, 3, 7),),
        ("assert isinstance(format_date(2024, 1, 15), str)",),
    ),
    AmbiguousTemplate(
        "truncate_name", "name", "Shorten a long display name.",
        ("profiles", "accounts", "social", "chat"), ("names", "display", "labels"),
        ("Names are overflowing the sidebar. Add `truncate_name(name)` to `{path}` that truncates long names.",
         "Please add a `truncate_name(name)` function to `{path}` that shortens names that are too long.",
         "Can you write `truncate_name(name)` in `{path}`? Long names should get cut."),
        (V("At most 10 characters in total: if it's longer, keep 7 and add '...'.",
           '    if len(name) <= 10:\n        return name\n    return name[:7] + "..."\n'),
         V("Just cut it to 8 characters, no ellipsis.", "    return name[:8]\n"),
         V("Keep the first 12 characters and add '...' after them when anything was cut.",
           '    if len(name) <= 12:\n        return name\n    return name[:12] + "..."\n'),
         V("At most 6 characters; when you cut, make the last one the single '…' character.",
           '    if len(name) <= 6:\n        return name\n    return name[:5] + "…"\n')),
        _name, (("Christopher",), ("Alexandra",), ("Anastasia Romanova",)),
        ("assert truncate_name('Ann') == 'Ann'", "assert truncate_name('Bo') == 'Bo'"),
    ),
    AmbiguousTemplate(
        "format_phone", "number", "Format a 10-digit phone number (input may contain spaces, dashes or parentheses).",
        ("contacts", "crm", "support", "signup"), ("phones", "contact", "formatting"),
        ("Add `format_phone(number)` to `{path}` so that phone numbers are displayed consistently.",
         "Phone numbers come in all shapes. Please write `format_phone(number)` in `{path}` that normalises them.",
         "Can you add a `format_phone(number)` function to `{path}` for formatting 10-digit phone numbers?"),
        (V("Like (555) 123-4567.", DIGITS + '    return f"({d[:3]}) {d[3:6]}-{d[6:]}"\n'),
         V("With dashes: 555-123-4567.", DIGITS + '    return f"{d[:3]}-{d[3:6]}-{d[6:]}"\n'),
         V("With dots: 555.123.4567.", DIGITS + '    return f"{d[:3]}.{d[3:6]}.{d[6:]}"\n'),
         V("International style: +1 555 123 4567.", DIGITS + '    return f"+1 {d[:3]} {d[3:6]} {d[6:]}"\n')),
        _phone, (("5551234567",),),
        ("assert isinstance(format_phone('5551234567'), str)",),
    ),
    AmbiguousTemplate(
        "format_percent", "ratio", "Format a ratio (0.25 means a quarter) as a percentage string.",
        ("analytics", "dashboard", "metrics", "reports"), ("percent", "formatting", "display"),
        ("Add `format_percent(ratio)` to `{path}` that turns a ratio into a percentage string.",
         "Please write `format_percent(ratio)` in `{path}`; the dashboard should show ratios as percentages.",
         "Can you add a `format_percent(ratio)` helper to `{path}`? e.g. 0.25 should come out as a percentage."),
        (V("One decimal place, like 12.3%.", '    return f"{ratio * 100:.1f}%"\n'),
         V("Whole percent, like 12%.", '    return f"{ratio * 100:.0f}%"\n'),
         V("Two decimals, like 12.34%.", '    return f"{ratio * 100:.2f}%"\n')),
        _ratio, ((0.1234,),),
        ("assert format_percent(0.25).endswith('%')",),
    ),
    AmbiguousTemplate(
        "slugify", "title", "Turn a title of space-separated words into a URL slug.",
        ("blog", "cms", "wiki", "docs"), ("slugs", "urls", "text"),
        ("Add `slugify(title)` to `{path}` so titles can be used in URLs.",
         "Please write `slugify(title)` in `{path}` that makes a URL slug out of a post title.",
         "We need URL slugs for titles; can you add `slugify(title)` to `{path}`?"),
        (V("Lower-case, words joined with hyphens: 'Hello World' -> 'hello-world'.",
           '    return "-".join(title.lower().split())\n'),
         V("Lower-case, words joined with underscores: 'Hello World' -> 'hello_world'.",
           '    return "_".join(title.lower().split())\n'),
         V("Words joined with hyphens but keep their case: 'Hello World' -> 'Hello-World'.",
           '    return "-".join(title.split())\n')),
        _title, (("Hello World",),),
        ("assert slugify('hello') == 'hello'",),
    ),
)
BY_NAME = {t.name: t for t in AMBIGUOUS}


def hidden_inputs(t: AmbiguousTemplate, rng: random.Random) -> list[Args]:
    inputs = list(t.discriminating)
    while len(inputs) < len(t.discriminating) + 4:
        args = t.inputs(rng)
        if repr(args) not in {repr(a) for a in inputs}:
            inputs.append(args)
    fns = [t.compile(v) for v in range(len(t.variants))]
    for a in range(len(fns)):
        for b in range(a + 1, len(fns)):
            if all(outcome(fns[a], x) == outcome(fns[b], x) for x in inputs):
                raise AssertionError(f"{t.name}: variants {a} and {b} agree on every hidden input")
    return inputs


def build(rng: random.Random, difficulty: int, variant: int | None = None) -> Draft:
    t: AmbiguousTemplate = pick(rng, AMBIGUOUS)  # type: ignore[assignment]
    drawn = rng.randrange(len(t.variants))
    v = drawn if variant is None else variant
    pkg, module = pick(rng, t.packages), pick(rng, t.modules)
    path = f"{pkg}/{module}.py"
    inputs = hidden_inputs(t, rng)
    fn = t.compile(v)
    neighbours = rng.sample(TEMPLATES, 2) if difficulty >= 2 else []

    files = {f"{pkg}/__init__.py": ""}
    doc = f"{module.capitalize()} helpers."
    files[path] = python_file(doc, [], [n.source() for n in neighbours])
    names = [t.name] + [n.name for n in neighbours]
    imports = [f"from {pkg}.{module} import {', '.join(names)}"]
    agreed = [test_function(f"test_{t.name}_basic_{i + 1}", [check]) for i, check in enumerate(t.agreed_checks)]
    visible, hidden = list(agreed), list(agreed)
    for n in neighbours:
        seen, extra, _, _ = draw_cases(n, rng, 2, 2)
        visible += case_tests(n.name, n.name, seen)
        hidden += case_tests(n.name, n.name, seen) + case_tests(n.name, n.name, extra, len(seen) + 1)
    hidden += [
        test_function(f"test_{t.name}_{i + 1}", [f"assert {call_text(t.name, x)} == {outcome(fn, x)[1]!r}"])
        for i, x in enumerate(inputs)
    ]
    files[f"tests/test_{module}.py"] = python_file(None, imports, visible)
    if difficulty == 3:
        other = rng.choice(TEMPLATES)
        other_module = module_name(other.category, rng)
        if other_module == module:
            other_module += "_more"
        files[f"{pkg}/{other_module}.py"] = python_file(f"{other_module.capitalize()} helpers.", [], [other.source()])
        files["README.md"] = f"# {pkg}\n\nHelpers for the {pkg} service: `{pkg}.{module}`, `{pkg}.{other_module}`.\n"
    solved = dict(files)
    solved[path] = python_file(doc, [], [n.source() for n in neighbours] + [t.source(v)])
    return Draft(
        instruction=pick(rng, t.instructions).format(path=path),
        files=files,
        solved=solved,
        hidden_tests={f"tests_hidden/test_{module}.py": python_file(None, imports, hidden)},
        difficulty=difficulty,
        ambiguous=True,
        clarification=t.variants[v].clarification,
        extra={"template": t.name, "variant": v, "variants": len(t.variants)},
    )


def variant_edits(task: Task, variant: int) -> tuple[Edit, ...]:
    """The reference edits `task` would have if the user had meant `variant`: a plausible wrong
    answer when `variant` is not the task's own (used to check that guessing fails)."""
    ref = TaskRef.parse(task.id)
    draft = build(ref.rng(), ref.difficulty, variant=variant)
    return to_task(task.family, draft, task.id, task.split).reference_edits
