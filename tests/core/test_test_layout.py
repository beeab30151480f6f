"""The tests' own layout: no module under tests/ imports a test module (what tests share lives in
tests/helpers), and every folder of test modules is a package, so each test module has one dotted
name (tests.core.config.test_overrides) and two files may share a name in different folders."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def is_test_module(path: Path) -> bool:
    """What pytest collects (test_*.py, *_test.py), and conftest.py files."""
    return path.name.startswith("test_") or path.name.endswith("_test.py") or path.name == "conftest.py"


def dotted(path: Path) -> str:
    parts = path.relative_to(TESTS.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path, tree: ast.AST) -> tuple[set[str], set[str]]:
    """The module names `path` imports (`import a.b`; `from a import b` as a and a.b; relative imports
    resolved) and its strings (importlib.import_module("tests.e2e.test_resume") imports too)."""
    package = dotted(path).split(".") if path.name == "__init__.py" else dotted(path).split(".")[:-1]
    names: set[str] = set()
    strings: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            names |= {base} | {f"{base}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            strings.add(node.value)
    return names, strings


def test_no_module_under_tests_imports_a_test_module():
    files = sorted(TESTS.rglob("*.py"))
    test_modules = {dotted(p) for p in files if is_test_module(p)}
    stems = {p.stem for p in files if is_test_module(p)}  # `import test_x` from a folder on sys.path
    offenders = []
    for path in files:
        names, strings = imported(path, ast.parse(path.read_text(), filename=str(path)))
        found = {n for n in names if n in test_modules or ("." not in n and n in stems)} | (strings & test_modules)
        offenders += [f"{path.relative_to(TESTS.parent)} imports {n}" for n in sorted(found - {dotted(path)})]
    assert offenders == [], "move what is shared into tests/helpers:\n" + "\n".join(offenders)


def test_every_folder_of_test_modules_is_a_package():
    missing = set()
    for module in TESTS.rglob("*.py"):
        if is_test_module(module) and module.name != "conftest.py":
            folder = module.parent
            while folder != TESTS.parent:
                if not (folder / "__init__.py").exists():
                    missing.add(str(folder.relative_to(TESTS.parent)))
                folder = folder.parent
    assert sorted(missing) == [], f"add an empty __init__.py to each of: {sorted(missing)}"
