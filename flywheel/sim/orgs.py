"""Simulated organizations: codebases whose conventions differ from the general distribution.

    acme = HouseRules(org_id="acme", helper="audit", call="record", tests_dir="checks")
    task = acme.adapt(generate("bugfix", "train", 1, seed=5)[0])      # the same bug, in acme's codebase
    general_fix = task.metadata.extra["general_fix"]                     # what a general model writes

An organization's task is a general task rewritten into its house style, and graded by its rules:

- a house helper every fix must use: the package ships `<helper>.py` with `<call>(name)`, whose
  docstring states the rule (a function that is fixed calls it first thing, with its own name), so
  the convention can be read from the workspace;
- a required logging call: its hidden tests check that the fixed function called `<call>` with its
  own name (a fix without it fails, however right the logic);
- a different test layout: tests live in `<tests_dir>/` (not `tests/`), and the test command runs there.

`reference_edits` of the adapted task follow the house rules (the scripted expert plays an
organization-aware model); `general_fix` in the metadata is the general task's fix alone: applied
to the organization's task it fixes the logic and fails the house rule, which is how "the general
model is measurably worse on their tasks" shows (tests/sim/test_orgs.py grades both).

Only the bugfix family is adapted here (one reference edit inside a top-level function): the
conventions need the function the fix lands in.
"""

from __future__ import annotations

import ast
import json

from pydantic import BaseModel, ConfigDict, Field

from flywheel.env.task import Edit, Task


class HouseRules(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    org_id: str = Field(pattern=r"^[a-z0-9_-]{1,40}$")
    helper: str = Field("audit", pattern=r"^[a-z_]{1,20}$")  # the house helper module in the package
    call: str = Field("record", pattern=r"^[a-z_]{1,20}$")  # the function every fix must call
    tests_dir: str = Field("checks", pattern=r"^[a-z_]{1,20}$")  # where their tests live

    def adapt(self, task: Task) -> Task:
        """`task` rewritten into this organization's codebase (module docstring)."""
        if task.family != "bugfix" or len(task.reference_edits) != 1:
            raise ValueError(f"only bugfix tasks with one reference edit can be adapted, not {task.id} "
                             f"({task.family}, {len(task.reference_edits)} edits)")
        (fix,) = task.reference_edits
        package = fix.path.split("/")[0]
        module = fix.path.removesuffix(".py").replace("/", ".")
        source = task.files[fix.path]
        function = _fixed_function(source, fix)
        helper_path = f"{package}/{self.helper}.py"
        files = {self._test_path(p): text for p, text in task.files.items()}
        files[helper_path] = (f'"""House rule: a function you fix must call {self.call}(its own name) as its first '
                              f'statement, so each change can be traced.\n"""\n\nCALLS = []\n\n\n'
                              f"def {self.call}(name):\n    CALLS.append(name)\n")
        fixed = source.replace(fix.old, fix.new, 1)
        org_fixed = _with_call(fixed, function, package, self.helper, self.call)
        hidden = {p: t for p, t in task.hidden_tests.items()}
        hidden["tests_hidden/test_house_rules.py"] = (
            f"from {package} import {self.helper}\nfrom {module} import {function}\n\n\n"
            f"def test_{function}_calls_{self.call}():\n    {self.helper}.CALLS.clear()\n"
            f"    try:\n        {function}({_sample_argument(task, function)})\n    except Exception:\n        pass\n"
            f"    assert {self.helper}.CALLS[:1] == [{function!r}]\n")
        general_fix = Edit(path=fix.path, old=fix.old, new=fix.new)
        extra = {**task.metadata.extra, "org_id": self.org_id,
                 "general_fix": json.dumps(general_fix.model_dump())}
        return task.model_copy(update={
            "id": f"{self.org_id}/{task.id}", "files": files, "hidden_tests": hidden,
            "test_command": " ".join(self.tests_dir if word == "tests" else word for word in task.test_command.split()),
            "instruction": task.instruction.replace("tests/", f"{self.tests_dir}/"),
            "reference_edits": (Edit(path=fix.path, old=source, new=org_fixed),),
            "metadata": task.metadata.model_copy(update={"extra": extra})})

    def _test_path(self, path: str) -> str:
        return f"{self.tests_dir}/{path.removeprefix('tests/')}" if path.startswith("tests/") else path


def general_fix(task: Task) -> Edit:
    """The general model's fix of an adapted task (its logic only, no house rules)."""
    return Edit.model_validate(json.loads(str(task.metadata.extra["general_fix"])))


def _fixed_function(source: str, fix: Edit) -> str:
    """The top-level function the fix's old text lies in."""
    line = source[: source.index(fix.old)].count("\n") + 1
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and node.lineno <= line <= (node.end_lineno or node.lineno):
            return node.name
    raise ValueError(f"{fix.path}: the fix is not inside a top-level function; the house rules need one")


def _with_call(source: str, function: str, package: str, helper: str, call: str) -> str:
    """`source` with `from package import helper` on top and `helper.call("function")` as the
    function's first statement (after its docstring)."""
    tree = ast.parse(source)
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == function)
    body = node.body
    after = body[0] if isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None),
                                                                        ast.Constant) else None
    lines = source.splitlines(keepends=True)
    first = body[1] if after is not None and len(body) > 1 else body[0]
    indent = " " * first.col_offset
    insert_at = (after.end_lineno if after is not None else node.body[0].lineno - 1)
    lines.insert(insert_at, f"{indent}{helper}.{call}({function!r})\n")
    head = 0
    if isinstance(tree.body[0], ast.Expr) and isinstance(tree.body[0].value, ast.Constant):
        head = tree.body[0].end_lineno or 0
    lines.insert(head, f"\nfrom {package} import {helper}\n" if head else f"from {package} import {helper}\n")
    return "".join(lines)


def _sample_argument(task: Task, function: str) -> str:
    """Arguments the function takes, from its first call in the visible tests."""
    for path, text in task.files.items():
        if path.startswith("tests/"):
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == function:
                    return ", ".join(ast.unparse(a) for a in node.args)
    raise ValueError(f"{task.id}: no call with arguments in its visible tests to exercise the house rule with")
