"""The import graph of nbddp's own modules: the rank-side runtime stands alone and has no import circle.

Every import statement counts, module level or inside a function (a circle imported lazily is still a
circle to read); an import names the module it loads: ``from . import x`` the submodule ``x``, ``from .x
import name`` the module ``x``.
"""

import ast
from pathlib import Path

import nbddp

SRC = Path(nbddp.__file__).resolve().parent.parent


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    path = SRC.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imports_of(path: Path) -> set[str]:
    """The nbddp modules a file imports."""
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if is_module(sub) else base)
    return {name for name in found if name == "nbddp" or name.startswith("nbddp.")}


def graph(under: str) -> dict[str, set[str]]:
    root = SRC.joinpath(*under.split("."))
    files = sorted(root.rglob("*.py")) if root.is_dir() else [root.with_suffix(".py")]
    return {module_name(p): imports_of(p) for p in files}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle, each found once from its first module (depth-first search)."""
    found, done = [], set()

    def visit(name, path):
        if name in path:
            found.append(path[path.index(name):] + [name])
            return
        if name in done:
            return
        for target in sorted(edges.get(name, ())):
            visit(target, path + [name])
        done.add(name)

    for name in edges:
        visit(name, [])
    return found


def test_the_runtime_imports_nothing_of_nbddp_outside_itself():
    outside = {m: sorted(t for t in targets if not t.startswith("nbddp.runtime"))
               for m, targets in graph("nbddp.runtime").items()}
    assert {m: t for m, t in outside.items() if t} == {}


def test_the_runtime_has_no_import_circle():
    assert circles(graph("nbddp.runtime")) == []


def test_the_launcher_needs_nothing_from_the_converter():
    edges = graph("nbddp.launch")
    assert {m: sorted(t for t in targets if t.startswith("nbddp.convert")) for m, targets in edges.items()
            if any(t.startswith("nbddp.convert") for t in targets)} == {}


def test_the_converter_has_no_import_circle():
    assert circles(graph("nbddp.convert")) == []


def test_the_package_has_no_import_circle():
    """Lazy imports and those for type checking count too: a circle is one to read, whenever it loads."""
    assert circles(graph("nbddp")) == []


def test_no_module_at_the_package_root_is_over_400_lines():
    """A root module that grows past this holds more than one job: split it by job, not by line count."""
    long = {p.name: n for p in (SRC / "nbddp").glob("*.py") if (n := len(p.read_text().splitlines())) > 400}
    assert long == {}
