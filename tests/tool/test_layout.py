"""The package's layout: no module of mcore_fixes imports, even lazily, one that imports it back
(each can be read, and changed, without the other)."""

from __future__ import annotations

import ast

from toolworld import MAIN

PACKAGE = MAIN / "mcore_fixes"


def imports(path) -> set[str]:
    """The mcore_fixes modules a module imports (`from .x import`, `from . import x`), anywhere
    in it, as dotted names under the package."""
    here = path.relative_to(PACKAGE).with_suffix("").parts
    package = here[:-1] if path.name != "__init__.py" else here[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.ImportFrom) or node.level == 0:
            continue
        base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
        if node.module:
            found.add(".".join((*base, *node.module.split("."))))
        else:
            found |= {".".join((*base, alias.name)) for alias in node.names}
    return found


def modules() -> dict[str, set[str]]:
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        graph[name] = imports(path)
    return graph


def test_no_import_circle_in_the_package():
    graph = modules()
    circles = []

    def walk(node: str, path: list[str]) -> None:
        for dep in sorted(graph.get(node, ())):
            if dep in path:
                circles.append(" -> ".join([*path[path.index(dep) :], dep]))
            elif dep in graph and dep not in seen:
                walk(dep, [*path, dep])
        seen.add(node)

    seen: set[str] = set()
    for name in sorted(graph):
        walk(name, [name])
    assert circles == []


def closure(graph: dict[str, set[str]], name: str) -> set[str]:
    seen, todo = set(), [name]
    while todo:
        node = todo.pop()
        for dep in graph.get(node, ()):
            if dep in graph and dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def test_what_users_run_needs_none_of_the_maintainers_tooling():
    """apply / unapply (checkout), info (installed) and audit import only the core they share
    with the maintainers' tooling (mcore_fixes/maint/), never that tooling: each side reads
    alone."""
    graph = modules()
    assert {n for n in graph if n.startswith("maint.")} >= {"maint.prove", "maint.vendor"}
    for user in ("checkout", "installed", "audit"):
        assert not {n for n in closure(graph, user) if n.startswith("maint")}, user
    for core in ("manifest", "series", "sources", "git", "errors", "progress"):
        assert not {n for n in closure(graph, core) if n.startswith("maint")}, core


def test_every_relative_import_names_a_module_of_the_package():
    graph = modules()
    missing = sorted(
        f"{name}: {dep}" for name, deps in graph.items() for dep in deps if dep not in graph
    )
    assert missing == []
