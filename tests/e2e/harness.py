"""The end-to-end tests' helpers, imported as `harness`.

They live in testkit/harness.py (at the repository root), shared with the
benchmark (bench/) and the demo (scripts/demo.py), which must not import the
tests. Every name is re-exported here, so `from harness import ...` keeps
working; helpers only the tests need may also be added below.
"""
from __future__ import annotations

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from testkit.harness import *  # noqa: E402,F401,F403  (the whole public API)
