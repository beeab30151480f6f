"""The TP-mode contract lives in the core (`nanocore.tp_api.TPMode`) and is what every TP mode is
typed as where it is passed; the built-in modes implement it."""

from __future__ import annotations

import ast
from pathlib import Path

from nanocore.plugins import load_plugins
from nanocore.tp_api import TPMode

REPO = Path(__file__).resolve().parents[2]


def test_built_in_modes_implement_the_core_contract():
    registry = load_plugins().registries.tp_mode
    for name in ("ALL_REDUCE", "REDUCE_SCATTER"):
        mode = registry.get(name).factory()
        assert isinstance(mode, TPMode)
        assert mode.name == name
    assert registry.get("REDUCE_SCATTER").factory().sequence_parallel is True
    assert registry.get("ALL_REDUCE").factory().sequence_parallel is False


def _annotations(path: Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            for arg in [*node.args.args, *node.args.kwonlyargs]:
                if arg.arg == "tp_mode":
                    yield node.name, arg.annotation
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Attribute) and node.target.attr == "tp_mode":
            yield "self.tp_mode", node.annotation


def test_tp_modes_are_typed_with_the_core_contract_wherever_they_are_passed():
    seen, untyped = 0, []
    for path in [*(REPO / "nanocore").rglob("*.py"), *(REPO / "plugins").rglob("*.py")]:
        for where, annotation in _annotations(path):
            seen += 1
            text = ast.unparse(annotation) if annotation is not None else "nothing"
            if "TPMode" not in text:
                untyped.append(f"{path.relative_to(REPO)}: {where} annotates tp_mode as {text}")
    assert seen >= 5, "the scan found the TP layers' constructors"
    assert not untyped, untyped


def test_the_engine_applies_the_tp_plan_itself():
    """The model builder takes a (TP-parallelised) meta model, not a closure that parallelises it."""
    import inspect

    from nanocore_plugins.parallel import build

    params = inspect.signature(build.build_local_model).parameters
    assert "parallelize_tp" not in params and next(iter(params)) == "model"
