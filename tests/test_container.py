"""The container image, through docker/smoke-test.sh: only when asked and an engine is present.

    TANNERY_CONTAINER_TESTS=1 CONTAINER_ENGINE=podman BASE_IMAGE=localhost/python-base:bookworm \\
        .venv/bin/python -m pytest tests/test_container.py

Building the image takes a minute or more and needs the network (pip), so the suite and CI
skip it by default.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENGINE = os.environ.get("CONTAINER_ENGINE", "docker")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.external,
    pytest.mark.skipif(os.environ.get("TANNERY_CONTAINER_TESTS") != "1",
                       reason="set TANNERY_CONTAINER_TESTS=1 to build and run the image"),
    pytest.mark.skipif(shutil.which(ENGINE) is None, reason=f"no container engine {ENGINE!r} on this machine"),
]


@pytest.mark.timeout(1200)
def test_smoke_test_passes():
    result = subprocess.run([str(ROOT / "docker" / "smoke-test.sh")], capture_output=True, text=True, timeout=1200,
                            env={**os.environ, "CONTAINER_ENGINE": ENGINE})
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "PASSED" in output and "identical after the restart" in output
