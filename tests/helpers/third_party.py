"""The two example third-party plugin packages under examples/plugins/, and how the tests find them.

They are separate distributions: the tests use them only as installed packages (through the
`nanocore` entry-point group, as a user would), and fail, never skip, when one is missing.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from types import ModuleType
from typing import Any

import pytest

# distribution name -> (folder under examples/plugins, import package, entry-point name, registry kind)
PACKAGES = {
    "nanocore-gpt2": ("nanocore-gpt2", "nanocore_gpt2", "gpt2", "model"),
    "nanocore-looped-bfs": ("nanocore-looped-bfs", "nanocore_looped_bfs", "looped_bfs", "pipeline_schedule"),
}

TINY_GPT2 = {
    "model_type": "gpt2",
    "n_embd": 32,
    "n_head": 4,
    "n_layer": 4,
    "vocab_size": 64,
    "n_positions": 32,
}


def require(distribution: str) -> ModuleType:
    """The installed package's import module; the test fails with the install command if it is missing."""
    folder, module, entry_point, _ = PACKAGES[distribution]
    install = f"pip install ./examples/plugins/{folder}  (or -e for an editable install)"
    try:
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        pytest.fail(f"the example plugin package {distribution!r} is not installed; run: {install}")
    names = {ep.name for ep in dist.entry_points if ep.group == "nanocore"}
    if entry_point not in names:
        pytest.fail(
            f"{distribution} is installed without its 'nanocore' entry point {entry_point!r}; reinstall: {install}"
        )
    return importlib.import_module(module)


def gpt2_config(tmp, model_config: dict[str, Any] | None = None, **sections: Any) -> dict:
    """tests.helpers.training.tiny_config with the tiny LLaMA replaced by a tiny GPT-2."""
    from tests.helpers.training import tiny_config

    config = tiny_config(tmp, **sections)
    config["model"]["model_config"] = {**TINY_GPT2, **(model_config or {})}
    return config
