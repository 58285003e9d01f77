import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from harness import WASM, WASM_FAULT  # noqa: E402


def pytest_sessionstart(session):
    for module in (WASM, WASM_FAULT):
        if not module.exists():
            pytest.exit(f"{module} is missing: run scripts/build first", returncode=2)
