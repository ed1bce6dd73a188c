"""The packages stay in small modules, and the server's modules import one another one way (no cycle)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("dflash_core", "server")
MAX_LINES = 500


def _modules(package: str) -> dict[str, Path]:
    """Dotted name -> file of every module of ``package`` (a package's ``__init__.py`` under the package's name)."""
    out = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        name = path.relative_to(ROOT).with_suffix("").as_posix().replace("/", ".")
        out[name.removesuffix(".__init__")] = path
    return out


def _module_level_imports(tree: ast.Module) -> Iterator[ast.Import | ast.ImportFrom]:
    """Imports that run (or, under ``if TYPE_CHECKING:``, are read) when the module loads: not those inside a
    function or a class."""
    stack: list[ast.stmt] = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.If | ast.Try | ast.With):
            stack.extend(node.body)
            stack.extend(getattr(node, "orelse", []))
            stack.extend(getattr(node, "finalbody", []))
            for handler in getattr(node, "handlers", []):
                stack.extend(handler.body)


def import_graph(package: str) -> dict[str, set[str]]:
    """Module -> the modules of ``package`` it imports at module level."""
    modules = _modules(package)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps: set[str] = set()
        for node in _module_level_imports(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:  # relative: from the module's package, one level up per extra dot
                    parts = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                    parts = parts[: len(parts) - node.level + 1]
                    base = ".".join([*parts, base] if base else parts)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            deps |= {t for t in targets if t in modules and t != name}
        graph[name] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (``[a, b, ..., a]``), or None."""
    state: dict[str, str] = {}  # "open" while on the path, "done" after

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                return [*path[path.index(dep):], dep]
            if dep not in state and (cycle := visit(dep, path)):
                return cycle
        path.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node, [])):
            return cycle
    return None


def test_no_module_passes_the_line_limit() -> None:
    too_long = {
        path.relative_to(ROOT).as_posix(): n
        for pkg in PACKAGES for path in _modules(pkg).values()
        if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    }
    assert not too_long, f"modules over {MAX_LINES} lines (split them by what they do): {too_long}"


def test_server_modules_import_one_another_one_way() -> None:
    cycle = find_cycle(import_graph("server"))
    assert cycle is None, f"import cycle among server modules: {' -> '.join(cycle or [])}"


def test_engine_modules_import_one_another_one_way() -> None:
    cycle = find_cycle(import_graph("dflash_core"))
    assert cycle is None, f"import cycle among dflash_core modules: {' -> '.join(cycle or [])}"


def test_the_cycle_check_sees_type_checking_imports() -> None:
    """``if TYPE_CHECKING:`` imports count (a cycle through them is a cycle of the design), local imports do not."""
    graph = {"a": {"b"}, "b": {"a"}}
    assert find_cycle(graph) == ["a", "b", "a"]
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import x\ndef f():\n    import y\n")
    assert sorted(a.name for n in _module_level_imports(tree) for a in n.names) == ["TYPE_CHECKING", "x"]
