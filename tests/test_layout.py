"""The tree's shape, enforced: no import cycle, short functions, files of readable size.

(import-linter, run by .ci/run, enforces the layers; these are the limits it does not check.)
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "castwise"
MAX_FUNCTION_LINES = 80
MAX_FILE_LINES = 600
# pure data tables may be longer than MAX_FILE_LINES (a table reads best in one place)
DATA_TABLES: frozenset[str] = frozenset()


def _sources() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


def _cycles(adjacency: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(adjacency):
        if root in index:
            continue
        work = [(root, iter(sorted(adjacency[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(adjacency.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycle() -> None:
    graph = grimp.build_graph("castwise", exclude_type_checking_imports=False)  # types count too
    adjacency = {
        m: {x for x in graph.find_modules_directly_imported_by(m) if x.startswith("castwise")} for m in graph.modules
    }
    assert _cycles(adjacency) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(SRC)))
def test_functions_stay_short(path: Path) -> None:
    tree = ast.parse(path.read_text())
    long = [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert long == []


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(SRC)))
def test_files_stay_readable(path: Path) -> None:
    rel = str(path.relative_to(SRC))
    if rel in DATA_TABLES:
        return
    assert len(path.read_text().splitlines()) <= MAX_FILE_LINES


def test_ci_runs_exactly_the_readmes_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", readme, flags=re.S)
    test_block = next(b for b in blocks[:2] if "pytest" in b)
    command = next(line for line in test_block.splitlines() if line and not line.startswith("#"))
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert command in ci, f".ci/run must call the README's test command as written: {command}"


# the eager producer (trace/tracer.py) is read through its parts (attribution, values, recorder:
# one ``Run``), never its own attributes: what may be imported of it, and nothing else
_PRODUCER = "castwise.trace.tracer"
_PRODUCER_API = frozenset({"Tracer", "run", "traced"})


def _producer_reads(tree: ast.Module) -> list[str]:
    """Where a module reads an attribute of a ``Tracer`` it made or was given, or imports more of
    the eager producer than its entry points."""
    found = [
        f"imports {a.name}"
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == _PRODUCER
        for a in node.names
        if a.name not in _PRODUCER_API
    ]
    held: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            func = node.value.func
            if isinstance(func, ast.Name) and func.id == "Tracer":
                held.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.arg) and node.annotation is not None and "Tracer" in ast.unparse(node.annotation):
            held.add(node.arg)
    found += [
        f"line {node.lineno}: {node.value.id}.{node.attr}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in held
    ]
    return found


def test_no_module_but_the_eager_producer_reads_the_tracer() -> None:
    reads = {}
    for path in _sources():
        if path == SRC / "trace" / "tracer.py":
            continue
        found = _producer_reads(ast.parse(path.read_text()))
        if found:
            reads[str(path.relative_to(SRC))] = found
    assert not reads, reads


def test_the_producer_check_finds_a_read() -> None:
    made = "t = Tracer(m, 'cpu', fake=True)\nt.at.phase\n"
    given = "def f(t: Tracer) -> None:\n    t.recorder.trace\n"
    assert _producer_reads(ast.parse(made)) == ["line 2: t.at"]
    assert _producer_reads(ast.parse(given)) == ["line 2: t.recorder"]
    assert _producer_reads(ast.parse("from castwise.trace.tracer import _flat_tensors\n")) == ["imports _flat_tensors"]
    assert _producer_reads(ast.parse("t = Tracer(m, 'cpu', fake=True)\nrun(t, m, (), {}, 'eval')\n")) == []
