"""Where the repository's files are, as absolute paths derived from this file, so that no test
depends on the current directory, on where the checkout lives or on what its folders are called."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
CORE_FIXTURES = REPO / "tests" / "core" / "fixtures"  # small configs and local plugins for the core's tests
