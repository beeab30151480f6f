"""Run a nanocore command like `run_train.py` does, then record what is left of the process.

    torchrun ... tests/helpers/exit_probe.py --config-file CONFIG [overrides]     (PROBE_DIR=folder)

After `nanocore.commands.cli.run` returns, each rank writes `PROBE_DIR/rank<R>.json` with the exit status it
would exit with, the OS threads still alive (names from /proc), the Python threads, and whether a
default process group is still initialised, then exits with that status. The exit-path tests check
that every way out (success, config error, user error, exception, signal, stall) leaves only the
main thread: process groups destroyed, their threads joined, while the interpreter is fully alive.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path


def os_threads() -> list[str]:
    task = Path("/proc/self/task")
    if not task.is_dir():
        return []
    return sorted((t / "comm").read_text().strip() for t in task.iterdir())


def main() -> int:
    from nanocore.commands.cli import run

    code = run(["train", *sys.argv[1:]], prog="run_train.py")
    import torch.distributed as dist

    report = {
        "rank": int(os.environ.get("RANK", "0")),
        "code": code,
        "os_threads": os_threads(),
        "python_threads": [t.name for t in threading.enumerate()],
        "process_group": dist.is_available() and dist.is_initialized(),
    }
    folder = Path(os.environ["PROBE_DIR"])
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"rank{report['rank']}.json").write_text(json.dumps(report))
    return code


if __name__ == "__main__":
    sys.exit(main())
