"""The core's modules import each other without cycles (top-level, deferred and `TYPE_CHECKING`
imports alike: an import kept for annotations is still a dependency of meaning), and the core never
imports a built-in plugin, nor one built-in plugin another: it stays readable from the bottom up
(docs/code_map.md). The one test of the core/plugins boundary."""

from __future__ import annotations

import ast
from pathlib import Path

CORE = Path(__file__).resolve().parents[2] / "nanocore"
PLUGINS = CORE.parent / "plugins"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(CORE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in CORE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            found |= {t for t in targets if t in modules and t != name}
        graph[name] = found
    return graph


def test_no_import_cycles_in_the_core():
    graph = imports()
    # a package's __init__ re-exporting its modules is not a cycle of meaning; skip those edges
    edges = {m: {t for t in ts if not t.startswith(m + ".")} for m, ts in graph.items()}
    cycles = []

    def visit(node: str, stack: list[str], done: set[str]) -> None:
        if node in stack:
            cycles.append(stack[stack.index(node) :] + [node])
            return
        if node in done:
            return
        for target in sorted(edges[node]):
            visit(target, [*stack, node], done)
        done.add(node)

    done: set[str] = set()
    for module in sorted(edges):
        visit(module, [], done)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def imported_names(path: Path) -> list[str]:
    """Every module `path` names in an import, and every string constant (importlib.import_module("..."))."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and " " not in node.value:
            names.append(node.value)
    return names


def test_the_core_never_imports_a_builtin_plugin():
    offenders = [
        f"{path.relative_to(CORE.parent)}: {name}"
        for path in sorted(CORE.rglob("*.py"))
        for name in imported_names(path)
        if name.split(".")[0] == "nanocore_plugins"
    ]
    assert offenders == []


def test_no_builtin_plugin_imports_another():
    """A plugin needs something of another? The core's contract grows (GUIDE: small core)."""
    offenders = []
    for folder in sorted(p for p in PLUGINS.iterdir() if (p / "__init__.py").is_file()):
        for path in sorted(folder.rglob("*.py")):
            for name in imported_names(path):
                parts = name.split(".")
                if parts[0] == "nanocore_plugins" and len(parts) > 1 and parts[1] != folder.name:
                    offenders.append(f"{path.relative_to(PLUGINS.parent)}: {name}")
    assert offenders == []
