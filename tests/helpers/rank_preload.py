"""Imported once by the forkserver that `tests.helpers.distributed` forks test ranks from.

Everything a rank would import anyway: torch, its distributed package, the trainer, and the modules
of every installed nanocore plugin (imported only; each rank still loads and registers plugins
itself, honouring the environment of the test that started it).
"""

from importlib import import_module
from importlib.metadata import entry_points

import torch  # noqa: F401
import torch.distributed  # noqa: F401
import torch.distributed.nn  # noqa: F401  before any group exists: see plugins/parallel/grid.py

import tests.helpers.training  # noqa: F401

for _entry in entry_points(group="nanocore"):
    try:
        import_module(_entry.module)
    except Exception:  # a broken plugin fails in the rank that loads it, with its own message
        pass
