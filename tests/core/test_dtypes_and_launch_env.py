"""Decisions made once in the core: what a dtype name means on a device, where this process stands in
a launch, and whether a plugin spec names a file."""

from __future__ import annotations

import pytest
import torch

from nanocore.dtypes import DTYPE_NAMES, resolve_dtype, resolve_dtype_name
from nanocore.launch_env import launch_env
from nanocore.plugins import is_plugin_file


def test_auto_is_bfloat16_on_cuda_and_float32_elsewhere():
    assert resolve_dtype_name("auto", "cuda") == "bfloat16"
    assert resolve_dtype_name("auto", "cpu") == "float32"
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", "cuda") == torch.bfloat16  # a name is enough: nothing is allocated
    for name in ("float32", "bfloat16", "float16"):
        assert resolve_dtype(name, "cpu") == getattr(torch, name)
        assert resolve_dtype_name(name, "cuda") == name
    assert DTYPE_NAMES == ("auto", "float32", "bfloat16", "float16")
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        resolve_dtype_name("fp8", "cpu")


def test_launch_env_defaults_to_one_process_and_reads_the_launcher(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    env = launch_env()
    assert (env.rank, env.world_size, env.local_rank) == (0, 1, 0)
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", "1")
    env = launch_env()
    assert (env.rank, env.world_size, env.local_rank) == (5, 8, 1)


def test_a_plugin_spec_is_a_file_when_it_ends_in_py_or_has_a_path():
    assert is_plugin_file("my_plugin.py")
    assert is_plugin_file("plugins/my_plugin")
    assert is_plugin_file("../local/thing.py")
    assert not is_plugin_file("my_package.plugin")
    assert not is_plugin_file("nanocore_looped_bfs")
