"""nanocore-gpt2: the `gpt2` model type for nanocore, as a separately installed plugin package."""

from nanocore_gpt2.config import GPT2Config
from nanocore_gpt2.model import GPT2LMHeadModel

__all__ = ["GPT2Config", "GPT2LMHeadModel"]
__version__ = "0.1.0"
