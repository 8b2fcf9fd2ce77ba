"""Fixtures shared by the whole suite."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: Read-only data from other programs, beside the project; tests that use it skip without it.
SHARED = ROOT.parent / "shared"
FIXTURES = SHARED / "fixtures" / "tannic-nn"


@pytest.fixture
def tannic_nn() -> Path:
    """The directory of real .tannic pairs written by pytannic (skips when absent)."""
    if not FIXTURES.is_dir():
        pytest.skip(f"{FIXTURES} is absent")
    return FIXTURES
