"""The library of small stdlib functions that the bugfix, implement and crossfile families are built from.

Each template holds a correct implementation as source text, bugs that can be injected into it
(an exact snippet and its buggy replacement), and a generator of random arguments. Expected
values in tests are computed by executing the correct source, so tests and code cannot disagree;
a bug is only used on a task when some visible case shows it.
"""

from __future__ import annotations

import copy
import random
import string
from collections.abc import Callable
from dataclasses import dataclass

from flywheel.env.families.workspace import call_text, test_function

Args = tuple


@dataclass(frozen=True)
class Bug:
    old: str  # a snippet occurring exactly once in the template body
    new: str
    kind: str  # off_by_one, wrong_operator, wrong_comparison, wrong_initial_value, swapped_args, ...


@dataclass(frozen=True)
class FunctionTemplate:
    name: str
    params: str
    summary: str
    body: str  # indented by four spaces; `{name}` stands for the function's own name
    bugs: tuple[Bug, ...]
    inputs: Callable[[random.Random], Args]
    category: str  # text, num or list: picks plausible module names
    renames: tuple[str, ...]
    edges: tuple[Args, ...] = ()

    def source(self, name: str | None = None, bug: Bug | None = None, doc_extra: str = "") -> str:
        name = name or self.name
        body = self.body.replace("{name}", name)
        if bug is not None:
            old = bug.old.replace("{name}", name)
            if body.count(old) != 1:
                raise ValueError(f"bug snippet {bug.old!r} must occur once in {self.name}")
            body = body.replace(old, bug.new.replace("{name}", name))
        return f'def {name}({self.params}):\n    """{self.summary}{doc_extra}"""\n{body}'

    def stub(self, doc_extra: str = "") -> str:
        return f'def {self.name}({self.params}):\n    """{self.summary}{doc_extra}"""\n    raise NotImplementedError\n'

    def compile(self, bug: Bug | None = None) -> Callable:
        namespace: dict = {}
        exec(self.source(bug=bug), namespace)  # our own template text, never agent code
        return namespace[self.name]


def outcome(fn: Callable, args: Args) -> tuple[str, object]:
    """("ok", value) or ("raises", exception name), on a copy so a mutating bug cannot leak."""
    try:
        return "ok", fn(*copy.deepcopy(args))
    except Exception as exc:  # noqa: BLE001 -- a buggy template may raise anything; that is one way it shows
        return "raises", type(exc).__name__


@dataclass(frozen=True)
class Case:
    args: Args
    expected: object


def draw_cases(
    template: FunctionTemplate,
    rng: random.Random,
    n_visible: int,
    n_extra: int,
    bug: Bug | None = None,
) -> tuple[list[Case], list[Case], Case | None, tuple[str, object] | None]:
    """Visible cases (one shows `bug` if given), extra hidden cases, and the showing case with the
    buggy outcome. Cases are distinct by argument text."""
    good = template.compile()
    bad = template.compile(bug) if bug is not None else None
    seen: set[str] = set()
    candidates: list[Args] = []
    for _ in range(60):
        args = template.inputs(rng)
        key = repr(args)
        if key not in seen:
            seen.add(key)
            candidates.append(args)
    edges = [a for a in template.edges if repr(a) not in seen]
    showing: Case | None = None
    shown_as: tuple[str, object] | None = None
    pool = list(candidates)
    if bad is not None:
        for args in candidates + edges:
            kind, value = outcome(good, args)
            if kind != "ok":
                raise AssertionError(f"{template.name}{args!r} raises with the correct template")
            got = outcome(bad, args)
            if got != ("ok", value):  # what the test's `==` sees
                showing, shown_as = Case(args, value), got
                break
        if showing is None:
            raise AssertionError(f"no input shows bug {bug!r} of {template.name}")
        pool = [a for a in candidates if repr(a) != repr(showing.args)]
    chosen = pool[: n_visible - (showing is not None)]
    visible = [Case(a, outcome(good, a)[1]) for a in chosen]
    if showing is not None:
        visible.insert(rng.randrange(len(visible) + 1), showing)
    rest = pool[len(chosen):len(chosen) + n_extra] + edges
    extra = [Case(a, outcome(good, a)[1]) for a in rest if repr(a) not in {repr(c.args) for c in visible}]
    return visible, extra, showing, shown_as


# ---- random inputs ----------------------------------------------------------------------------

WORDS = ("apple", "Banana", "cherry", "delta", "echo", "kiwi", "Orange", "sky", "rhythm", "idea",
         "queue", "Yarn", "zoo", "tree", "IO", "unit", "owl", "plan")


def _ints(rng: random.Random, lo: int, hi: int, min_len: int, max_len: int) -> list[int]:
    return [rng.randint(lo, hi) for _ in range(rng.randint(min_len, max_len))]


def _text(rng: random.Random, min_words: int = 0, max_words: int = 5) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words)))


def _palindrome_input(rng: random.Random) -> Args:
    if rng.random() < 0.5:
        return (_text(rng, 1, 2),)
    half = "".join(rng.choice("abcxyz") for _ in range(rng.randint(1, 4)))
    core = half + rng.choice(["", "q"]) + half[::-1]
    mixed = "".join(c.upper() if rng.random() < 0.3 else c for c in core)
    if rng.random() < 0.5 and len(mixed) > 2:
        cut = rng.randrange(1, len(mixed))
        mixed = mixed[:cut] + rng.choice([" ", ", ", "!"]) + mixed[cut:]
    return (mixed,)


def _nested(rng: random.Random, depth: int = 0) -> list:
    out: list = []
    for _ in range(rng.randint(0 if depth else 1, 3)):
        if depth < 3 and rng.random() < 0.4:
            out.append(_nested(rng, depth + 1))
        else:
            out.append(rng.randint(0, 9))
    return out


def _runs(rng: random.Random) -> str:
    return "".join(rng.choice("abc") * rng.randint(1, 4) for _ in range(rng.randint(0, 4)))


def _range_input(rng: random.Random) -> Args:
    lo = rng.randint(-3, 3)
    hi = lo + rng.randint(0, 4)
    return (_ints(rng, lo - 2, hi + 2, 0, 9), lo, hi)


def _merge_input(rng: random.Random) -> Args:
    return (sorted(_ints(rng, 0, 12, 0, 5)), sorted(_ints(rng, 0, 12, 0, 5)))


def _caesar_input(rng: random.Random) -> Args:
    letters = string.ascii_lowercase
    text = "".join(rng.choice(letters + "  ,!") for _ in range(rng.randint(1, 10)))
    return (text, rng.randint(0, 30))


T = FunctionTemplate
TEMPLATES: tuple[FunctionTemplate, ...] = (
    T("clamp", "x, lo, hi", "Return x limited to the inclusive range [lo, hi].",
      "    if x < lo:\n        return lo\n    if x > hi:\n        return hi\n    return x\n",
      (Bug("if x < lo:", "if x > lo:", "wrong_comparison"),
       Bug("return hi", "return lo", "swapped_args")),
      lambda r: (r.randint(-20, 20), r.randint(-10, 0), r.randint(1, 10)), "num",
      ("clip", "bound_value"), ((5, 0, 5), (-3, -3, 4))),
    T("count_vowels", "s", "Return how many vowels (a, e, i, o, u, in either case) the string s contains.",
      "    count = 0\n    for ch in s.lower():\n        if ch in \"aeiou\":\n            count += 1\n    return "
      "count\n",
      (Bug("count = 0", "count = 1", "wrong_initial_value"),
       Bug("s.lower()", "s", "missing_normalisation"),
       Bug("\"aeiou\"", "\"aeio\"", "off_by_one")),
      lambda r: (_text(r),), "text", ("vowel_count", "num_vowels"), (("",), ("AEIOU",))),
    T("running_max", "xs", "Return a list whose i-th item is the largest of xs[0], ..., xs[i].",
      "    result = []\n    best = None\n    for x in xs:\n        if best is None or x > best:\n"
      "            best = x\n        result.append(best)\n    return result\n",
      (Bug("best = None", "best = 0", "wrong_initial_value"),
       Bug("x > best", "x < best", "wrong_comparison")),
      lambda r: (_ints(r, -9, 9, 1, 7),), "list", ("prefix_max", "cumulative_max"), (([-5, -7, -2],),)),
    T("is_palindrome", "s", "Return True if s reads the same backwards, ignoring case and any character that is not a "
                            "letter or digit.",
      "    chars = [c.lower() for c in s if c.isalnum()]\n    return chars == chars[::-1]\n",
      (Bug("chars[::-1]", "chars[:-1][::-1]", "off_by_one"),
       Bug("c.lower() for", "c for", "missing_normalisation")),
      _palindrome_input, "text", ("palindrome_check", "reads_same_backwards"), (("Abba",), ("",))),
    T("gcd", "a, b", "Return the greatest common divisor of two non-negative integers (gcd(0, 0) is 0).",
      "    while b:\n        a, b = b, a % b\n    return a\n",
      (Bug("return a", "return b", "wrong_variable"),
       Bug("while b:", "while b > 1:", "off_by_one")),
      lambda r: (r.randint(0, 60), r.randint(0, 60)), "num", ("greatest_common_divisor", "gcd_of"),
      ((12, 18), (7, 5))),
    T("chunk", "xs, size", "Split xs into consecutive lists of length size; the last one may be shorter.",
      "    return [xs[i:i + size] for i in range(0, len(xs), size)]\n",
      (Bug("xs[i:i + size]", "xs[i:i + size - 1]", "off_by_one"),
       Bug("range(0, len(xs), size)", "range(0, len(xs) - 1, size)", "off_by_one")),
      lambda r: (list(range(r.randint(0, 10))), r.randint(1, 4)), "list", ("chunked", "split_into_chunks"),
      (([1, 2, 3, 4, 5], 2),)),
    T("dedupe", "xs", "Return xs without repeated items, keeping the first occurrence of each, in order.",
      "    seen = set()\n    result = []\n    for x in xs:\n        if x not in seen:\n            seen.add(x)\n"
      "            result.append(x)\n    return result\n",
      (Bug("            seen.add(x)\n", "", "missing_update"),
       Bug("for x in xs:", "for x in xs[1:]:", "off_by_one")),
      lambda r: (_ints(r, 0, 5, 1, 9),), "list", ("unique_in_order", "remove_duplicates"), (([3, 1, 3, 2, 1],),)),
    T("word_freq", "text", "Return a dict mapping each lower-cased word of text (split on whitespace) to how often it "
                           "occurs.",
      "    counts = {}\n    for word in text.lower().split():\n        counts[word] = counts.get(word, 0) + 1\n"
      "    return counts\n",
      (Bug("counts.get(word, 0)", "counts.get(word, 1)", "wrong_initial_value"),
       Bug("text.lower().split()", "text.split()", "missing_normalisation")),
      lambda r: (_text(r, 1, 6),), "text", ("word_counts", "count_words"), (("a A b",),)),
    T("median", "xs", "Return the median of a non-empty list of numbers (the mean of the two middle values when the "
                      "length is even).",
      "    ordered = sorted(xs)\n    mid = len(ordered) // 2\n    if len(ordered) % 2 == 1:\n"
      "        return ordered[mid]\n    return (ordered[mid - 1] + ordered[mid]) / 2\n",
      (Bug("ordered[mid - 1] + ordered[mid]", "ordered[mid] + ordered[mid + 1]", "off_by_one"),
       Bug("ordered = sorted(xs)", "ordered = list(xs)", "missing_sort")),
      lambda r: (_ints(r, -20, 20, 1, 7),), "num", ("median_of", "middle_value"), (([4, 1, 3, 2],),)),
    T("flatten", "nested", "Flatten arbitrarily nested lists into one flat list, keeping the order of the items.",
      "    flat = []\n    for item in nested:\n        if isinstance(item, list):\n            "
      "flat.extend({name}(item))\n"
      "        else:\n            flat.append(item)\n    return flat\n",
      (Bug("flat.extend({name}(item))", "flat.extend(item)", "missing_recursion"),
       Bug("flat.extend(", "flat.append(", "wrong_call")),
      lambda r: (_nested(r),), "list", ("flatten_list", "deep_flatten"), (([1, [2, [3, [4]]]],),)),
    T("rle_encode", "s", "Run-length encode s as a string where each run is its character followed by its length, e.g. "
                         "'aab' -> 'a2b1'.",
      "    if not s:\n        return \"\"\n    out = []\n    current, count = s[0], 1\n    for ch in s[1:]:\n"
      "        if ch == current:\n            count += 1\n        else:\n            out.append(current + str(count))\n"
      "            current, count = ch, 1\n    out.append(current + str(count))\n    return \"\".join(out)\n",
      (Bug("current, count = s[0], 1", "current, count = s[0], 0", "wrong_initial_value"),
       Bug("for ch in s[1:]:", "for ch in s[2:]:", "off_by_one")),
      lambda r: (_runs(r),), "text", ("run_length_encode", "encode_runs"), (("aaab",),)),
    T("fizzbuzz", "n", "Return the FizzBuzz strings for 1..n: 'Fizz' for multiples of 3, 'Buzz' for multiples of 5, "
                       "'FizzBuzz' for both, else the number.",
      "    out = []\n    for i in range(1, n + 1):\n        if i % 15 == 0:\n            out.append(\"FizzBuzz\")\n"
      "        elif i % 3 == 0:\n            out.append(\"Fizz\")\n        elif i % 5 == 0:\n"
      "            out.append(\"Buzz\")\n        else:\n            out.append(str(i))\n    return out\n",
      (Bug("range(1, n + 1)", "range(1, n)", "off_by_one"),
       Bug("i % 15 == 0", "i % 10 == 0", "wrong_constant")),
      lambda r: (r.randint(1, 20),), "list", ("fizz_buzz", "fizzbuzz_list"), ((15,),)),
    T("pairwise_diffs", "xs", "Return the differences between consecutive items: [xs[1] - xs[0], xs[2] - xs[1], ...].",
      "    return [xs[i + 1] - xs[i] for i in range(len(xs) - 1)]\n",
      (Bug("xs[i + 1] - xs[i]", "xs[i] - xs[i + 1]", "swapped_args"),
       Bug("range(len(xs) - 1)", "range(len(xs) - 2)", "off_by_one")),
      lambda r: (_ints(r, -9, 9, 0, 7),), "list", ("consecutive_diffs", "deltas"), (([1, 4, 9],),)),
    T("argmax", "xs", "Return the index of the largest item of a non-empty list (the first such index on ties).",
      "    best = 0\n    for i in range(1, len(xs)):\n        if xs[i] > xs[best]:\n            best = i\n    return "
      "best\n",
      (Bug("xs[i] > xs[best]", "xs[i] >= xs[best]", "wrong_comparison"),
       Bug("range(1, len(xs))", "range(1, len(xs) - 1)", "off_by_one")),
      lambda r: (_ints(r, 0, 4, 1, 8),), "list", ("index_of_max", "arg_max"), (([1, 3, 3, 0],), ([2, 5],))),
    T("title_case", "s", "Capitalize the first letter of every space-separated word and lower-case the rest.",
      "    return \" \".join(w[:1].upper() + w[1:].lower() for w in s.split(\" \"))\n",
      (Bug("w[1:].lower()", "w[1:]", "missing_normalisation"),
       Bug("w[:1].upper() + w[1:]", "w[:2].upper() + w[2:]", "off_by_one")),
      lambda r: (_text(r, 1, 4),), "text", ("capitalize_words", "to_title"), (("hELLO wORLD",),)),
    T("count_in_range", "xs, lo, hi", "Return how many items of xs lie in the inclusive range [lo, hi].",
      "    return sum(1 for x in xs if lo <= x <= hi)\n",
      (Bug("lo <= x <= hi", "lo < x <= hi", "wrong_comparison"),
       Bug("lo <= x <= hi", "lo <= x < hi", "wrong_comparison")),
      _range_input, "num", ("count_between", "num_in_range"), (([1, 2, 3, 4], 2, 3),)),
    T("second_largest", "xs", "Return the second largest distinct value in xs, or None if there is none.",
      "    distinct = sorted(set(xs))\n    if len(distinct) < 2:\n        return None\n    return distinct[-2]\n",
      (Bug("sorted(set(xs))", "sorted(xs)", "missing_dedupe"),
       Bug("distinct[-2]", "distinct[1]", "off_by_one")),
      lambda r: (_ints(r, 0, 5, 0, 6),), "num", ("runner_up", "second_max"), (([5, 5, 3, 1],), ([2],))),
    T("digit_sum", "n", "Return the sum of the decimal digits of a non-negative integer n.",
      "    total = 0\n    while n > 0:\n        total += n % 10\n        n //= 10\n    return total\n",
      (Bug("total = 0", "total = 1", "wrong_initial_value"),
       Bug("n //= 10", "n //= 100", "wrong_constant")),
      lambda r: (r.randint(0, 10 ** r.randint(1, 6)),), "num", ("sum_digits", "digits_total"), ((909,),)),
    T("rotate_left", "xs, k", "Rotate the list xs left by k positions (k may exceed the length); an empty list stays "
                              "empty.",
      "    if not xs:\n        return []\n    k %= len(xs)\n    return xs[k:] + xs[:k]\n",
      (Bug("xs[k:] + xs[:k]", "xs[:k] + xs[k:]", "swapped_args"),
       Bug("    k %= len(xs)\n", "", "missing_wraparound")),
      lambda r: (list(range(r.randint(0, 6))), r.randint(0, 12)), "list", ("rotate", "shift_left"),
      (([1, 2, 3], 4),)),
    T("merge_sorted", "a, b", "Merge two sorted lists into one sorted list.",
      "    i = j = 0\n    out = []\n    while i < len(a) and j < len(b):\n        if a[i] <= b[j]:\n"
      "            out.append(a[i])\n            i += 1\n        else:\n            out.append(b[j])\n"
      "            j += 1\n    out.extend(a[i:])\n    out.extend(b[j:])\n    return out\n",
      (Bug("    out.extend(b[j:])\n", "", "missing_tail"),
       Bug("a[i] <= b[j]", "a[i] >= b[j]", "wrong_comparison")),
      _merge_input, "list", ("merge_lists", "merge_two_sorted"), (([1, 4], [2, 3, 9]),)),
    T("mean", "xs", "Return the arithmetic mean of xs as a float, or 0.0 for an empty list.",
      "    if not xs:\n        return 0.0\n    return sum(xs) / len(xs)\n",
      (Bug("sum(xs) / len(xs)", "sum(xs) // len(xs)", "wrong_operator"),
       Bug("/ len(xs)", "/ (len(xs) + 1)", "off_by_one")),
      lambda r: (_ints(r, -10, 10, 0, 6),), "num", ("average", "arithmetic_mean"), (([1, 2],),)),
    T("caesar", "s, shift", "Shift each lowercase letter of s forward by shift places in the alphabet, wrapping from z "
                            "to a; other characters stay.",
      "    out = []\n    for ch in s:\n        if \"a\" <= ch <= \"z\":\n"
      "            out.append(chr((ord(ch) - ord(\"a\") + shift) % 26 + ord(\"a\")))\n"
      "        else:\n            out.append(ch)\n    return \"\".join(out)\n",
      (Bug("% 26", "% 25", "off_by_one"),
       Bug("+ shift)", "- shift)", "wrong_operator")),
      _caesar_input, "text", ("caesar_shift", "shift_letters"), (("xyz", 3),)),
)

BY_NAME = {t.name: t for t in TEMPLATES}

# Module names that fit each category of template.
MODULES = {
    "text": ("strings", "text", "words", "formatting", "textutil"),
    "num": ("numbers", "arith", "numeric", "calc", "mathutil"),
    "list": ("lists", "sequences", "listutil", "seq", "iterables"),
}
PACKAGES = ("textkit", "mathx", "listops", "corelib", "toolbox", "datakit", "seqtools", "numkit",
            "pyutils", "common", "kit", "mylib", "basics", "smallutils")


def module_name(category: str, rng: random.Random) -> str:
    pool = MODULES[category]
    return pool[rng.randrange(len(pool))]


def module_names(rng: random.Random, groups: list[list[FunctionTemplate]]) -> list[str]:
    names: list[str] = []
    for group in groups:
        name = module_name(group[0].category, rng)
        while name in names:
            name = module_name(rng.choice(("text", "num", "list")), rng)
        names.append(name)
    return names


def case_tests(label: str, call_name: str, cases: list[Case], start: int = 1) -> list[str]:
    """One test function per case, numbered from `start`: `test_<label>_<k>`."""
    return [
        test_function(f"test_{label}_{start + i}", [f"assert {call_text(call_name, c.args)} == {c.expected!r}"])
        for i, c in enumerate(cases)
    ]
