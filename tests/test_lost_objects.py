"""A blob whose bytes are gone from the bucket is DATA_LOSS naming the archive, the entry and
the object (issue 43), not UNAVAILABLE (which clients retry) with "storage error in None"."""

from __future__ import annotations

from urllib.parse import urlsplit

import grpc
import pytest

from .server_harness import running_server
from .test_replicas import SHORT, fetch, objects, payload, store

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("size", [1 << 10, 3 << 20], ids=["packed", "own-blob"])
def test_a_fetch_of_an_entry_whose_object_was_deleted_is_data_loss_naming_it(
        tmp_path, postgres_url, s3_url, seaweedfs, size):
    parts = urlsplit(s3_url)
    with running_server(tmp_path, catalog=postgres_url, blobs=s3_url, **SHORT) as server:
        store(server, "model", {"w": payload(1, size)})
        (digest,) = objects(server)
        seaweedfs.client().delete_object(Bucket=parts.netloc,
                                         Key=f"{parts.path.strip('/')}/blobs/{digest[:2]}/{digest[2:4]}/{digest}")
        with pytest.raises(grpc.RpcError) as lost:
            fetch(server, "model")
        print(lost.value.code(), lost.value.details())
        assert lost.value.code() == grpc.StatusCode.DATA_LOSS, lost.value.details()
        assert "'model'" in lost.value.details() and "'w'" in lost.value.details(), lost.value.details()
        assert digest in lost.value.details(), lost.value.details()
