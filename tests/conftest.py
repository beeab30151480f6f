"""The shared helpers' assertions (tests/helpers: parity comparisons, rank checks) report their
operands on failure the way a test module's own assertions do."""

import pytest

pytest.register_assert_rewrite("tests.helpers")
