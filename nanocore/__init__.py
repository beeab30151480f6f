"""nanocore: a minimal, hackable 3D-parallel LLM pretraining framework built from plugins."""

from nanocore.hookspecs import hookimpl

__version__ = "0.1.0"
__all__ = ["hookimpl", "__version__"]
