"""Commands and library apart: the run path (nanocore.trainer, everything it imports and the plugins
it loads) never imports a command module, and no library module of the core imports one."""

from __future__ import annotations

import ast
import json
import subprocess
import sys

from tests.helpers.paths import REPO

CORE = REPO / "nanocore"
COMMANDS = "nanocore.commands"


def is_command(module: str) -> bool:
    return module == COMMANDS or module.startswith(COMMANDS + ".")


def test_the_run_path_never_imports_a_command_module():
    code = (
        "import json, sys\n"
        "import nanocore.trainer\n"
        "from nanocore.plugins import load_plugins\n"
        "load_plugins().registries\n"  # every installed plugin, as a run loads them
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    modules = json.loads(done.stdout.strip().splitlines()[-1])
    assert "nanocore.trainer" in modules
    assert [m for m in modules if is_command(m)] == []


def test_no_library_module_imports_a_command_module():
    offenders = []
    for path in CORE.rglob("*.py"):
        module = ".".join(path.relative_to(REPO).with_suffix("").parts)
        if is_command(module.removesuffix(".__init__")) or module == "nanocore.__main__":
            continue  # `python -m nanocore` is the command line
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            offenders += [f"{module} imports {n}" for n in names if is_command(n)]
    assert offenders == []
