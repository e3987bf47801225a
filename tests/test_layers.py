"""The package's floors: each imports only from the floors below it, and no two modules import each other
in a circle. Read from the source (module-level and function-level imports alike), so it holds for code
that is imported lazily too."""

from __future__ import annotations

import ast
from pathlib import Path

import fedmerge

SRC = Path(fedmerge.__file__).parent

# Lowest first. A package may import its own floor and the ones before it.
FLOORS = [
    {"core"},
    {"data", "models", "metrics"},
    {"algorithms"},
    {"engines"},
    {"config"},
    {"run", "calibrate"},
    {"sweep"},
    {"report", "study"},  # side by side: the study protocol writes its own report and never imports report/
    {"cli", "apps"},
    # fedmerge/api.py: the public surface for plugins, re-exported from the floors below; nothing in the package
    # imports it (a plugin does)
    {"api"},
]
# the text datasets tokenize with the tokenizer that models/text.py loads (docs/architecture.md)
ALLOWED = {("data", "models")}


def _floor(package: str) -> int:
    return next(i for i, names in enumerate(FLOORS) if package in names)


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every fedmerge module ``path`` imports, relative imports resolved."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("fedmerge")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                name = ".".join([*base, node.module] if node.module else base)
            else:
                name = node.module or ""
            if name.startswith("fedmerge"):
                found.add(name)
                found |= {f"{name}.{a.name}" for a in node.names}  # `from pkg import module`
    return found


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in SRC.rglob("*.py")}
    return {m: {i for i in _imports(p) if i in files and i != m} for m, p in files.items()}


def _top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 else parts[1].removesuffix(".py")


def test_every_package_is_on_a_floor():
    packages = {p.name for p in SRC.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert packages <= set().union(*FLOORS), packages - set().union(*FLOORS)


def test_no_import_from_a_higher_floor():
    wrong = []
    for module, imported in _graph().items():
        if module.count(".") < 2 and module not in ("fedmerge.cli", "fedmerge.apps", "fedmerge.api"):
            continue  # fedmerge/__init__.py, __main__.py
        for other in imported:
            a, b = _top(module), _top(other)
            if a != b and (a, b) not in ALLOWED and _floor(b) > _floor(a):
                wrong.append(f"{module} imports {other}")
    assert not wrong, "\n".join(sorted(wrong))


def test_no_import_circles():
    graph = _graph()
    # a circle through package __init__ re-exports is not a circle of the code; drop __init__ edges
    graph = {
        m: {i for i in deps if not (SRC / Path(*i.split(".")[1:]) / "__init__.py").exists()}
        for m, deps in graph.items()
    }
    state: dict[str, int] = {}
    circles = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                circles.append(" -> ".join([*stack[stack.index(nxt) :], nxt]))
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not circles, "\n".join(circles)
