"""nanocore: a minimal, hackable LLM pretraining framework built from plugins, with data, context,
tensor, pipeline and expert parallelism."""

from nanocore.hookspecs import hookimpl

# The one place the version is written: pyproject.toml reads it ([tool.setuptools.dynamic]), so the
# package metadata, `nanocore --version` and this attribute agree (tests/core/test_version.py).
__version__ = "0.2.0"
__all__ = ["hookimpl", "__version__"]
