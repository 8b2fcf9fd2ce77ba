"""A Store is what its client was told: it commits only once the client has finished the call.

The client's ``commit`` message is not enough: the call must also have ended its request
stream (half-close) while alive. A client that cancels with its stream still open, or whose
process dies right after sending its commit, stores nothing and leaves no blob behind, on
both storage backends (grpc.aio ends a cancelled call's requests as if the client had
half-closed: the server must not take that for a finished call).
"""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import grpc
import pytest

from tannery_protocol.v1 import archives_pb2 as pb

from .server_harness import running_server, store_requests, wait_for
from .store_checks import leftovers, sized_payload, stored_blobs

ATTEMPTS = 20
#: Seconds between the commit's send and the cancel: at once, and while the server waits.
DELAYS = (0.0, 0.001, 0.005, 0.02, 0.1)


def payloads(seed: int) -> dict[str, bytes]:
    rng = random.Random(seed)
    return {"a": sized_payload(rng, 50_000), "b": sized_payload(rng, 70_000)}


def committed_then_open(archive: str, entries: dict[str, bytes], sent: threading.Event, release: threading.Event):
    """begin, the whole entries and a matching commit, then no half-close until ``release``."""
    yield from store_requests(archive, entries, 64 * 1024)
    sent.set()
    release.wait(30)


def settled(srv, names: list[str], blobs: set[str]) -> bool:
    stub = srv.archives()
    listed = [a.name for a in stub.List(pb.ListRequest()).archives]
    return listed == names and stored_blobs(srv) == blobs and not leftovers(srv)


def test_a_store_cancelled_after_its_commit_with_the_stream_open_stores_nothing(tmp_path, backend):
    with running_server(tmp_path, **backend) as srv:
        stub = srv.archives()
        stub.Store(store_requests("kept", payloads(0)))
        kept = stored_blobs(srv)
        for attempt in range(ATTEMPTS):
            sent, release = threading.Event(), threading.Event()
            future = stub.Store.future(committed_then_open(f"cut-{attempt}", payloads(attempt + 1), sent, release))
            assert sent.wait(30)
            time.sleep(DELAYS[attempt % len(DELAYS)])
            future.cancel()
            release.set()
            with pytest.raises(grpc.FutureCancelledError):
                future.result()
        time.sleep(0.2)  # a commit the cancel failed to stop would be done by now
        stored = len(stub.List(pb.ListRequest(prefix="cut-")).archives)
        assert stored == 0, f"{stored} of {ATTEMPTS} cancelled Stores were stored"
        assert wait_for(lambda: settled(srv, ["kept"], kept), timeout=30), (
            sorted(stored_blobs(srv) - kept), leftovers(srv))


def test_a_store_still_finishes_when_the_client_half_closes(tmp_path, backend):
    """The other side of the rule: commit then half-close, even slowly, stores the archive."""
    with running_server(tmp_path, **backend) as srv:
        stub = srv.archives()

        def slow_end():
            yield from store_requests("slow", payloads(1), 64 * 1024)
            time.sleep(0.3)

        info = stub.Store(slow_end())
        assert info.entries == 2
        assert [a.name for a in stub.List(pb.ListRequest()).archives] == ["slow"]


CLIENT = textwrap.dedent("""
    import os, random, sys, threading
    import grpc
    sys.path[:0] = [{root!r}]
    from tests.server_harness import store_requests
    from tests.store_checks import sized_payload
    from tannery_protocol.v1 import archives_pb2_grpc

    rng = random.Random(int(sys.argv[2]))
    entries = {{"a": sized_payload(rng, 50_000), "b": sized_payload(rng, 70_000)}}

    def requests():
        yield from store_requests(sys.argv[1], entries, 64 * 1024)
        print("committed", flush=True)
        threading.Event().wait(60)

    stub = archives_pb2_grpc.ArchivesStub(grpc.insecure_channel({target!r}))
    stub.Store(requests())
""")


def test_a_client_killed_after_its_commit_stores_nothing(tmp_path, backend):
    root = str(Path(__file__).resolve().parents[1])
    with running_server(tmp_path, **backend) as srv:
        stub = srv.archives()
        script = CLIENT.format(root=root, target=srv.target)
        for attempt in range(ATTEMPTS):
            client = subprocess.Popen([sys.executable, "-c", script, f"killed-{attempt}", str(attempt)],
                                      stdout=subprocess.PIPE, text=True)
            try:
                assert client.stdout.readline().strip() == "committed"
                time.sleep(DELAYS[attempt % len(DELAYS)])
            finally:
                client.kill()
                client.wait()
        time.sleep(0.2)
        stored = len(stub.List(pb.ListRequest(prefix="killed-")).archives)
        assert stored == 0, f"{stored} of {ATTEMPTS} Stores of killed clients were stored"
        assert wait_for(lambda: settled(srv, [], set()), timeout=30), (sorted(stored_blobs(srv)), leftovers(srv))
