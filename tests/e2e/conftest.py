import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from harness import WASM  # noqa: E402


def pytest_sessionstart(session):
    if not WASM.exists():
        pytest.exit(f"{WASM} is missing: run scripts/build first", returncode=2)
