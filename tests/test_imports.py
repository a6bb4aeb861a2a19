"""The import graph of ``niah/``, read from the source with :mod:`ast` (nothing is imported): no import cycle but
the KV method registry's, and every import inside a function says why it is there.

The graph has an edge for every ``import`` of a ``niah`` module, at module level and inside functions alike (a lazy
import still ties the two modules together), with relative imports resolved.  The one cycle allowed is the KV
method registry's: each module of ``niah/kv/methods/`` imports :mod:`niah.kv.registry` at its top to ``@register``
its names, and the registry imports those modules inside a function, on first use.

An import inside a function body needs its reason in a comment on its line or on the line just above (one comment
above a run of consecutive imports covers the run), starting with one of :data:`REASONS`: ``# optional extra: ray``
(an extra of pyproject.toml), ``# optional: ...`` (a package whose absence the code handles), ``# heavy: ...`` (what
it would load at the module's import, and when it is needed) or ``# cycle: ...`` (the modules that import this one).
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "niah"
REASONS = ("optional extra", "optional", "heavy", "cycle")
REASON = re.compile(r"#\s*(?:" + "|".join(REASONS) + r")\s*:\s*\S")
REGISTRY, METHODS = "niah.kv.registry", "niah.kv.methods."


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _package_of(module: str) -> str:
    return module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]


def _targets(module: str, node: ast.Import | ast.ImportFrom) -> set[str]:
    """The ``niah`` modules an import statement of ``module`` loads (the deepest module of each dotted name)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = _package_of(module).split(".")
            base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
    out = set()
    for name in names:
        while name not in MODULES and "." in name:
            name = name.rpartition(".")[0]
        if name in MODULES and name != module:
            out.add(name)
    return out


def _imports(module: str) -> list[tuple[ast.Import | ast.ImportFrom, list[ast.stmt] | None]]:
    """Every import statement of ``module`` with, for one inside a function, the statement list that holds it."""
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for field in ("body", "orelse", "finalbody"):
            block = getattr(node, field, None)
            for child in block if isinstance(block, list) else []:
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    found.append((child, block if in_function else None))
        for child in ast.iter_child_nodes(node):
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

    visit(ast.parse(MODULES[module].read_text(encoding="utf-8")), False)
    return found


def import_graph() -> dict[str, dict[str, list[tuple[int, bool]]]]:
    """``{module: {imported module: [(line, inside a function), ...]}}`` over ``niah/``."""
    graph: dict[str, dict[str, list[tuple[int, bool]]]] = {m: {} for m in MODULES}
    for module in MODULES:
        for node, block in _imports(module):
            for target in _targets(module, node):
                graph[module].setdefault(target, []).append((node.lineno, block is not None))
    return graph


def cycles(graph: dict[str, dict]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            connect(v)
    return out


def _is_the_registry_cycle(component: list[str], graph: dict[str, dict]) -> bool:
    """The registry and method modules only, the registry reaching the methods from inside functions only."""
    if REGISTRY not in component or not all(m == REGISTRY or m.startswith(METHODS) for m in component):
        return False
    return all(lazy for m, where in graph[REGISTRY].items() if m in component for _, lazy in where)


def _describe(component: list[str], graph: dict[str, dict]) -> str:
    edges = [
        f"  {a} -> {b} (line {line}{', in a function' if lazy else ''})"
        for a in component
        for b, where in sorted(graph[a].items())
        if b in component
        for line, lazy in where
    ]
    return "\n".join([" <-> ".join(component), *edges])


def test_the_import_graph_sees_lazy_and_relative_imports():
    graph = import_graph()
    assert [lazy for _, lazy in graph["niah.kv.methods.fp16"][REGISTRY]] == [False]  # from ..registry import register
    assert all(lazy for _, lazy in graph[REGISTRY]["niah.kv.methods.fp16"])  # from .methods import (fp16, ...)
    assert {"niah.report.stats", "niah.weightquant.schemes"} <= set(graph["niah.report.tables"])


def test_no_import_cycle_but_the_kv_method_registry():
    graph = import_graph()
    found = cycles(graph)
    assert any(_is_the_registry_cycle(c, graph) for c in found), "the registry cycle is gone: update this test"
    bad = [_describe(c, graph) for c in found if not _is_the_registry_cycle(c, graph)]
    assert not bad, "import cycles:\n" + "\n".join(bad)


def _comments(source: str) -> dict[int, str]:
    """``{line: comment}`` of the comments of ``source``."""
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return {t.start[0]: t.string for t in tokens if t.type == tokenize.COMMENT}


def unexplained_lazy_imports(module: str) -> list[str]:
    """``path:line: statement`` of each import inside a function of ``module`` without a reason comment."""
    path = MODULES[module]
    source = path.read_text(encoding="utf-8")
    lines, comments = source.splitlines(), _comments(source)
    bad = []
    for node, block in _imports(module):
        if block is None:
            continue
        i = next(i for i, stmt in enumerate(block) if stmt is node)
        run = set()  # the lines of the imports just before it in the same body
        while i and isinstance(block[i - 1], (ast.Import, ast.ImportFrom)):
            i -= 1
            run.update(range(block[i].lineno, block[i].end_lineno + 1))
        said = [comments.get(n, "") for n in range(node.lineno, node.end_lineno + 1)]
        above = node.lineno - 1
        while above and (above in run or not lines[above - 1].strip()):
            above -= 1
        if above and lines[above - 1].lstrip().startswith("#"):
            said.append(comments.get(above, ""))
        if not any(REASON.search(c) for c in said):
            bad.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    return bad


@pytest.mark.parametrize("module", sorted(MODULES))
def test_every_import_inside_a_function_says_why(module):
    bad = unexplained_lazy_imports(module)
    assert not bad, f"imports inside functions without a '# {' / '.join(REASONS)}: why' comment:\n" + "\n".join(bad)
