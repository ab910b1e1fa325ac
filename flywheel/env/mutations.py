"""Procedural bugs for real code: AST mutations, each one edit of one expression or statement.

    for m in mutations(source, "toolz/itertoolz.py"):   # every site, in source order
        broken = m.apply(source)                         # the text with that one span replaced
        assert m.undo(broken) == source                  # one edit restores it

A mutation names a span of the source (line/column of an AST node, from `ast`'s positions) and
the text that replaces it. Only that span changes, so the rest of the file keeps its formatting and
comments, the reference fix is the inverse replacement, and the diff an agent has to find is one
expression or statement. Kinds (SWE-smith's procedural bugs):

  compare_swap     `<` <-> `<=`, `>` <-> `>=`, `==` <-> `!=`, `is` <-> `is not`, `in` <-> `not in`
  binop_swap       `+` <-> `-`, `*` -> `//`... (arithmetic and bit operators)
  boolop_swap      `and` <-> `or`
  off_by_one       an integer literal n -> n + 1 (in indices, ranges, comparisons)
  removed_branch   an `if` without `else`: its whole statement goes
  removed_call     a statement that is only a call goes (becomes `pass` where the body would be empty)
  swapped_args     the first two positional arguments of a call trade places
  wrong_default    a parameter's literal default changes (True <-> False, n -> n + 1, None -> 0)
  negated_cond     `if c:` -> `if not c:`

Sites inside docstrings, `assert`s and type annotations are skipped, as are mutations whose text
compiles to the same code as the original (a swap of equal arguments, say). Which mutations are
real bugs is for the package's own tests to say (`families/mined.py`).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass

COMPARE_SWAPS: dict[type, type] = {
    ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq,
    ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In,
}
BINOP_SWAPS: dict[type, type] = {
    ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.FloorDiv, ast.FloorDiv: ast.Mult, ast.Div: ast.Mult,
    ast.Mod: ast.FloorDiv, ast.BitAnd: ast.BitOr, ast.BitOr: ast.BitAnd, ast.LShift: ast.RShift,
    ast.RShift: ast.LShift,
}
KINDS = ("compare_swap", "binop_swap", "boolop_swap", "off_by_one", "removed_branch", "removed_call",
         "swapped_args", "wrong_default", "negated_cond")


@dataclass(frozen=True)
class Mutation:
    path: str
    kind: str
    function: str  # the enclosing function's qualified name ("" at module level)
    start: tuple[int, int]  # (line, column) of the span, 1-based line, 0-based UTF-8 byte column
    end: tuple[int, int]
    old: str  # the span's text in the original
    new: str  # what replaces it

    @property
    def key(self) -> str:
        return f"{self.path}:{self.start[0]}:{self.start[1]}:{self.kind}"

    def apply(self, source: str) -> str:
        lo, hi = _offset(source, self.start), _offset(source, self.end)
        if source[lo:hi] != self.old:
            raise ValueError(f"mutation {self.key} does not match the source: it was made for another text")
        return source[:lo] + self.new + source[hi:]

    def undo(self, mutated: str) -> str:
        lo = _offset(mutated, self.start)
        if mutated[lo : lo + len(self.new)] != self.new:
            raise ValueError(f"mutation {self.key} is not applied in this text")
        return mutated[:lo] + self.old + mutated[lo + len(self.new) :]

    def describe(self) -> str:
        where = f" in {self.function}" if self.function else ""
        return f"{self.kind}{where} at {self.path}:{self.start[0]}: {self.old.strip()!r} -> {self.new.strip()!r}"


def _offset(source: str, position: tuple[int, int]) -> int:
    """Character offset of (line, UTF-8 byte column) in `source`."""
    line, col = position
    begin = 0
    for _ in range(line - 1):
        begin = source.index("\n", begin) + 1
    end = source.find("\n", begin)
    text_line = source[begin : end if end >= 0 else len(source)]
    return begin + len(text_line.encode("utf-8")[:col].decode("utf-8", "replace"))


def mutations(source: str, path: str) -> list[Mutation]:
    """Every mutation site of a module, in source order; the same text gives the same list."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    del source
    found = {(m.start, m.end, m.new): m for m in _walk(tree, path, lines) if _changes_code(m)}
    return sorted(found.values(), key=lambda m: (m.start, m.end, m.kind))


def _segment(lines: list[str], node: ast.AST) -> tuple[tuple[int, int], tuple[int, int], str]:
    start = (node.lineno, node.col_offset)
    end = (node.end_lineno, node.end_col_offset)
    if start[0] == end[0]:
        text = lines[start[0] - 1].encode()[start[1] : end[1]].decode()
    else:
        first = lines[start[0] - 1].encode()[start[1] :].decode()
        last = lines[end[0] - 1].encode()[: end[1]].decode()
        text = first + "".join(lines[start[0] : end[0] - 1]) + last
    return start, end, text


def _walk(tree: ast.Module, path: str, lines: list[str]) -> Iterator[Mutation]:
    skip: set[int] = set()  # ids of nodes under asserts, annotations and docstrings

    def mark(node: ast.AST | None) -> None:
        for sub in ast.walk(node) if node is not None else ():
            skip.add(id(sub))

    stack: list[tuple[ast.AST, str]] = [(tree, "")]
    while stack:
        node, scope = stack.pop()
        if isinstance(node, ast.Assert):
            mark(node)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                mark(body[0])
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            mark(node.returns)
            for a in node.args.args + node.args.kwonlyargs + node.args.posonlyargs:
                mark(a.annotation)
        if isinstance(node, ast.AnnAssign):
            mark(node.annotation)
        if id(node) not in skip:
            yield from _sites(node, path, scope, lines)
        inner = f"{scope}.{node.name}" if scope and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                       ast.ClassDef)) else (
            node.name if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else scope)
        for child in reversed(list(ast.iter_child_nodes(node))):
            stack.append((child, inner))


def _mutation(path, kind, scope, lines, node, new: str) -> Mutation:
    start, end, old = _segment(lines, node)
    return Mutation(path, kind, scope, start, end, old, new)


def _sites(node: ast.AST, path: str, scope: str, lines: list[str]) -> Iterator[Mutation]:
    if not scope:  # module-level code runs at import: a bug there breaks every test, not one behaviour
        return
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in COMPARE_SWAPS:
        yield _mutation(path, "compare_swap", scope, lines, node,
                        ast.unparse(ast.Compare(node.left, [COMPARE_SWAPS[type(node.ops[0])]()], node.comparators)))
    elif isinstance(node, ast.BinOp) and type(node.op) in BINOP_SWAPS:
        formatting = isinstance(node.op, ast.Mod) and isinstance(node.left, ast.Constant)  # "%s" % x
        if not formatting:
            yield _mutation(path, "binop_swap", scope, lines, node,
                            ast.unparse(ast.BinOp(node.left, BINOP_SWAPS[type(node.op)](), node.right)))
    elif isinstance(node, ast.BoolOp):
        other = ast.Or() if isinstance(node.op, ast.And) else ast.And()
        yield _mutation(path, "boolop_swap", scope, lines, node, ast.unparse(ast.BoolOp(other, node.values)))
    elif isinstance(node, ast.Constant) and type(node.value) is int and 0 <= node.value < 1000:
        yield _mutation(path, "off_by_one", scope, lines, node, repr(node.value + 1))
    elif isinstance(node, ast.If):
        if not node.orelse:
            yield _mutation(path, "removed_branch", scope, lines, node, "pass")
        yield _mutation(path, "negated_cond", scope, lines, node.test, ast.unparse(ast.UnaryOp(ast.Not(), node.test)))
    elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
        yield _mutation(path, "removed_call", scope, lines, node, "pass")
    if isinstance(node, ast.Call) and len(node.args) >= 2 and not any(isinstance(a, ast.Starred)
                                                                       for a in node.args[:2]):
        a, b = node.args[0], node.args[1]
        call = ast.Call(node.func, [b, a, *node.args[2:]], node.keywords)
        yield _mutation(path, "swapped_args", scope, lines, node, ast.unparse(call))
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        for default in node.args.defaults + [d for d in node.args.kw_defaults if d is not None]:
            if isinstance(default, ast.Constant):
                new = _wrong_default(default.value)
                if new is not None:
                    yield _mutation(path, "wrong_default", scope, lines, default, new)


def _wrong_default(value: object) -> str | None:
    if value is True or value is False:
        return repr(not value)
    if value is None:
        return "0"
    if type(value) is int:
        return repr(value + 1)
    return None


def _changes_code(mutation: Mutation) -> bool:
    """Whether the new text is other code than the old, not only other text (statement removals
    always are; an expression is compared as parsed)."""
    if mutation.kind in ("removed_branch", "removed_call"):
        return True
    try:
        old = ast.parse(f"({mutation.old})", mode="eval")
        new = ast.parse(f"({mutation.new})", mode="eval")
    except SyntaxError:
        return False
    return ast.dump(old) != ast.dump(new)
