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
    return imports_in(path.read_text(), module, is_package=path.name == "__init__.py")


def imports_in(source: str, module: str, is_package: bool = False) -> set[str]:
    """Every fedmerge module ``source`` (the text of ``module``) imports: import statements, and calls of
    ``importlib.import_module``/``import_module``/``__import__`` whose name is a string literal or an f-string
    (its text up to the first placeholder, ``{__name__}`` read as ``module``)."""
    package = module if is_package else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(source)):
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
        elif isinstance(node, ast.Call) and _is_import_call(node.func) and node.args:
            name = _literal_prefix(node.args[0], module)
            if name is not None and name.startswith("fedmerge"):
                found.add(name)
    return found


def _is_import_call(func: ast.expr) -> bool:
    if isinstance(func, ast.Name):
        return func.id in ("import_module", "__import__")
    return isinstance(func, ast.Attribute) and func.attr == "import_module"


def _literal_prefix(arg: ast.expr, module: str) -> str | None:
    """The module a string argument names: a literal whole; an f-string up to its first unknown placeholder,
    cut back to whole dotted parts (``f"fedmerge.cli.{m}"``: ``fedmerge.cli``)."""
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    if not isinstance(arg, ast.JoinedStr):
        return None
    text = ""
    for part in arg.values:
        if isinstance(part, ast.Constant) and isinstance(part.value, str):
            text += part.value
        elif isinstance(part, ast.FormattedValue) and isinstance(part.value, ast.Name) and part.value.id == "__name__":
            text += module
        else:
            return text.rpartition(".")[0] if "." in text else None
    return text


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in SRC.rglob("*.py")}
    return {m: {i for i in _imports(p) if i in files and i != m} for m, p in files.items()}


def _top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 else parts[1].removesuffix(".py")


def test_imports_by_name_count_as_imports():
    """A higher floor reached through importlib or ``__import__`` is an import all the same."""
    source = """
import importlib
from importlib import import_module
importlib.import_module("fedmerge.cli.app")
import_module(f"fedmerge.report.{name}")
__import__("fedmerge.study.spec")
importlib.import_module(f"{__name__}.fedavg")
importlib.import_module(plugin_name)
"""
    got = imports_in(source, "fedmerge.core.thing")
    assert got == {"fedmerge.cli.app", "fedmerge.report", "fedmerge.study.spec", "fedmerge.core.thing.fedavg"}


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
