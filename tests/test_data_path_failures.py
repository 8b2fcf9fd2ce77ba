"""The data paths under attack and in crashes: tickets presented by hand, clients and servers
killed with SIGKILL in the middle of a transfer (real server on loopback, no mocks).

Raw data connections are made with :mod:`tannery_protocol.datalink`, as a hostile or broken client
would: read the server's welcome, send a hello with some ticket, read the answer.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import grpc
import pytest
import torch

import tannery
from tannery_protocol.datalink import TICKET_KEY, TRANSPORT_KEY, Link, LinkError, PeerFailed, connect_unix, expect, frame
from tannery.dataplane.links import receive_fetch
from tannery_protocol.v1 import archives_pb2
from tannery.torch import serialize
from tannery_protocol.v1.data_pb2 import DataEnd, EntryBytes, Hello, SealedPiece

from .server_harness import ServerProcess, running_server, wait_for

MiB = 1 << 20


#: The caller's TANNERY_* client variables do not apply (conftest.no_client_environment).
pytestmark = pytest.mark.usefixtures("no_client_environment")


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Any]:
    """One server for the ticket tests, with archive "m" (three small entries)."""
    with running_server(tmp_path_factory.mktemp("tickets")) as running:
        with tannery.Client(running.target, transport="grpc") as client:
            client.store("m", {"a": torch.arange(10), "b": torch.ones(3, 4), "c": torch.tensor(True)})
        yield running


def open_link(server: Any, transport: str) -> tuple[Link, str]:
    """A raw data connection to ``server`` and the server id its welcome gave."""
    paths = server.data_paths
    if transport == "local":
        link = connect_unix(paths.socket_path)
    else:
        link = Link(socket.create_connection(("127.0.0.1", paths.data_port), timeout=10), local=False)
    welcome, _ = link.receive()
    expect(welcome, "welcome")
    return link, welcome.welcome.server_id


def present(link: Link, ticket: bytes) -> Any:
    """Send a hello with ``ticket``; the server's next frame."""
    link.send(frame(hello=Hello(ticket=ticket)))
    answer, fds = link.receive(expect_fds=1 if link.local else 0)
    for fd in fds:
        os.close(fd)
    return answer


def assert_refused(answer: Any, message: str, link: Link) -> None:
    """A failure frame PERMISSION_DENIED whose message has ``message``, then the end of the connection."""
    assert answer.WhichOneof("kind") == "failure", answer
    assert answer.failure.code == "PERMISSION_DENIED" and message in answer.failure.message, answer.failure
    with pytest.raises(LinkError, match="closed by the peer"):
        link.receive()


def fetch_call(server: Any, transport: str, archive: str = "m") -> tuple[Any, bytes]:
    """A raw gRPC Fetch asking for a data path, and the ticket its initial metadata gave."""
    stub = server.archives()
    call = stub.Fetch(archives_pb2.FetchRequest(archive=archive), metadata=((TRANSPORT_KEY, transport),), timeout=60)
    ticket = dict(call.initial_metadata()).get(TICKET_KEY)
    assert ticket, "no ticket in the initial metadata"
    return call, bytes.fromhex(ticket)


def settled(server: Any) -> bool:
    """No call holds a pin or waits with a ticket."""
    return not server.storage._pins and not server.data_paths._tickets


# -- tickets --------------------------------------------------------------------------------------


@pytest.mark.parametrize("transport", ["local", "tcp"])
def test_a_ticket_moves_one_fetch_once(server, transport):
    call, ticket = fetch_call(server, transport)
    link, server_id = open_link(server, transport)
    assert server_id == server.data_paths.server_id
    with link:
        link.send(frame(hello=Hello(ticket=ticket)))
        arrived = list(receive_fetch(link))
    assert [entry.name for entry in arrived] == ["a", "b", "c"]
    assert list(call) == [] and call.code() is grpc.StatusCode.OK  # no byte on gRPC; the status is the outcome
    again, _ = open_link(server, transport)
    with again:
        assert_refused(present(again, ticket), "unknown ticket: it was used already", again)
    assert wait_for(lambda: settled(server))


@pytest.mark.parametrize("transport", ["local", "tcp"])
def test_made_up_tickets_and_frames_are_refused(server, transport):
    for ticket in (b"", b"\0" * 16, os.urandom(16), os.urandom(4096)):
        link, _ = open_link(server, transport)
        with link:
            assert_refused(present(link, ticket), "unknown ticket", link)
    # A first frame that is not a hello, a frame over the limit, bytes that are no frame: the
    # connection is closed without an answer.
    for garbage in (b"\x02\x00\x00\x00\x32\x00", b"\xff\xff\xff\x7f", b"\x05\x00\x00\x00\xff\xff\xff\xff\xff"):
        link, _ = open_link(server, transport)
        with link:
            link.send_bytes(garbage)
            with pytest.raises(LinkError, match="closed by the peer"):
                link.receive()
    # The server goes on serving.
    with tannery.Client(server.target, transport=transport) as client:
        assert client.fetch("m").names() == ["a", "b", "c"]


def test_a_ticket_for_the_socket_is_refused_on_the_data_port_and_the_reverse(server):
    for asked, presented in (("local", "tcp"), ("tcp", "local")):
        call, ticket = fetch_call(server, asked)
        link, _ = open_link(server, presented)
        with link:
            assert_refused(present(link, ticket), f"a ticket for the {asked} data path, presented on the "
                                                  f"{presented} one", link)
        call.cancel()
    assert wait_for(lambda: settled(server))


def test_an_expired_ticket_is_refused_and_its_call_ends_unavailable(server, monkeypatch):
    from tannery_server.dataplane import listeners as data_paths

    monkeypatch.setattr(data_paths, "CONNECT_SECONDS", 0.5)
    call, ticket = fetch_call(server, "tcp")
    with pytest.raises(grpc.RpcError) as ended:
        list(call)  # nobody connects: the call gives up
    assert ended.value.code() is grpc.StatusCode.UNAVAILABLE
    assert "did not open its tcp data connection within 0.5 s" in ended.value.details()
    link, _ = open_link(server, "tcp")
    with link:
        assert_refused(present(link, ticket), "unknown ticket", link)
    # A ticket presented after its time but before its call gave up.
    monkeypatch.setattr(data_paths, "CONNECT_SECONDS", 30.0)
    call, ticket = fetch_call(server, "local")
    server.data_paths._tickets[ticket].expires = time.monotonic() - 1
    link, _ = open_link(server, "local")
    with link:
        assert_refused(present(link, ticket), "the ticket has expired", link)
    call.cancel()
    assert wait_for(lambda: settled(server))


def test_a_connection_that_says_nothing_is_closed_after_the_handshake_time(server, monkeypatch):
    from tannery_server.dataplane import listeners as data_paths

    monkeypatch.setattr(data_paths, "HANDSHAKE_SECONDS", 0.3)
    for transport in ("local", "tcp"):
        link, _ = open_link(server, transport)
        with link:
            started = time.monotonic()
            with pytest.raises(LinkError, match="closed by the peer"):
                link.receive()
            assert time.monotonic() - started < 5, transport


def store_call(server: Any, transport: str, archive: str) -> tuple[Any, bytes, threading.Event]:
    """A raw gRPC Store asking for a data path (its begin sent, no commit until ``release``
    is set, and then none), and its ticket."""
    release = threading.Event()

    def messages() -> Iterator[archives_pb2.StoreRequest]:
        yield archives_pb2.StoreRequest(begin=archives_pb2.StoreBegin(archive=archive))
        release.wait(30)

    call = server.archives().Store.future(messages(), metadata=((TRANSPORT_KEY, transport),), timeout=60)
    ticket = dict(call.initial_metadata()).get(TICKET_KEY)
    assert ticket, "no ticket in the initial metadata"
    return call, bytes.fromhex(ticket), release


def memory_file(data: bytes, sealed: bool) -> int:
    import fcntl

    fd = os.memfd_create("test-piece", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.write(fd, data)
    if sealed:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    return fd


PAYLOAD = serialize(torch.arange(100.0))


def _closed_mid_payload(link: Link) -> None:
    link.send(frame(entry=EntryBytes(name="w", payload_bytes=len(PAYLOAD))))
    if not link.local:  # a local Store's bytes come in pieces
        link.send_bytes(PAYLOAD[:50])
    link.close()


#: A payload of several receive windows (the server receives it on a thread of its own).
BIG_PAYLOAD = serialize(torch.arange(3 * MiB, dtype=torch.float32))  # 12 MiB


def _junk_after_a_big_payload(link: Link) -> None:
    """The session refuses the bytes after the payload while the receiving thread still runs."""
    link.send(frame(entry=EntryBytes(name="w", payload_bytes=len(BIG_PAYLOAD) + 8 * MiB)))
    link.send_bytes(BIG_PAYLOAD)
    link.send_bytes(bytes(8 * MiB))


def _closed_in_a_later_window(link: Link) -> None:
    link.send(frame(entry=EntryBytes(name="w", payload_bytes=len(BIG_PAYLOAD))))
    link.send_bytes(BIG_PAYLOAD[:9 * MiB])
    link.close()


def _frame_out_of_turn(link: Link) -> None:
    link.send(frame(hello=Hello(ticket=b"again")))


def _end_that_disagrees(link: Link) -> None:
    link.send(frame(entry=EntryBytes(name="w", payload_bytes=len(PAYLOAD))))
    link.send_bytes(PAYLOAD)
    link.send(frame(end=DataEnd(entries=2, payload_bytes=len(PAYLOAD))))


def _piece(sealed: bool):
    def send(link: Link) -> None:
        link.send(frame(entry=EntryBytes(name="w", payload_bytes=len(PAYLOAD))))
        fd = memory_file(PAYLOAD, sealed)
        try:
            link.send(frame(piece=SealedPiece(size=len(PAYLOAD))), [fd])
        finally:
            os.close(fd)
        link.send(frame(end=DataEnd(entries=1, payload_bytes=len(PAYLOAD))))

    return send


def _piece_without_its_file(link: Link) -> None:
    link.send(frame(entry=EntryBytes(name="w", payload_bytes=len(PAYLOAD))))
    link.send(frame(piece=SealedPiece(size=len(PAYLOAD))))


@pytest.mark.parametrize("transport, send, code, message", [
    ("tcp", _closed_mid_payload, "UNAVAILABLE", "the tcp data connection broke: data connection closed by the peer"),
    ("tcp", _frame_out_of_turn, "INVALID_ARGUMENT", "a hello frame where entry or end or piece was expected"),
    ("tcp", _end_that_disagrees, "INVALID_ARGUMENT", "end says 2 entries"),
    ("tcp", _junk_after_a_big_payload, "INVALID_ARGUMENT",
     "entry 'w': bad magic 0x00000000"),  # zeros after the payload: read as a second payload's header
    ("tcp", _closed_in_a_later_window, "UNAVAILABLE",
     f"data connection closed by the peer after {9 * MiB - 8 * MiB} of {4 * MiB} bytes"),
    ("local", _piece(sealed=False), "INVALID_ARGUMENT", "entry 'w': a piece's memory file is not sealed"),
    ("local", _piece_without_its_file, "INVALID_ARGUMENT", "entry 'w': a piece came without its memory file"),
    ("local", _closed_mid_payload, "UNAVAILABLE", "the local data connection broke"),
], ids=["tcp-closed", "tcp-out-of-turn", "tcp-end", "tcp-junk-after-big", "tcp-closed-later", "local-unsealed", "local-no-file", "local-closed"])
def test_a_store_whose_data_connection_breaks_is_refused_for_what_it_is_and_stores_nothing(
        server, transport, send, code, message, caplog):
    call, ticket, release = store_call(server, transport, "broken")
    link, _ = open_link(server, transport)
    try:
        link.send(frame(hello=Hello(ticket=ticket)))
        try:
            send(link)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server refused what came first and closed the connection
        with pytest.raises(grpc.RpcError) as ended:
            call.result(timeout=30)
    finally:
        release.set()
        link.close()
    assert (ended.value.code().name, message in ended.value.details()) == (code, True), ended.value.details()
    assert "storage error" not in ended.value.details()
    assert not [r for r in caplog.records if "storage error" in r.getMessage()]
    with tannery.Client(server.target, transport="grpc") as client:
        assert [info.name for info in client.list()] == ["m"]
    assert wait_for(lambda: settled(server) and list((server.data_dir / "tmp").iterdir()) == [])
    assert wait_for(lambda: not [t for t in threading.enumerate() if t.name == "tannery-store-receive"])
    # A sealed piece is what the server takes.
    call, ticket, release = store_call(server, "local", "sealed")
    link, _ = open_link(server, "local")
    with link:
        link.send(frame(hello=Hello(ticket=ticket)))
        _piece(sealed=True)(link)
        assert expect(link.receive()[0], "end") == "end"
    release.set()  # no commit: nothing is stored
    with pytest.raises(grpc.RpcError):
        call.result(timeout=30)
    with tannery.Client(server.target, transport="grpc") as client:
        assert [info.name for info in client.list()] == ["m"]


# -- a client killed in the middle of a transfer ---------------------------------------------------

#: The client, in a process of its own: it starts a fetch or a store, says "started" once its
#: transfer is under way, and waits to be killed.
CLIENT = r"""
import sys, time, tannery

target, transport, mode = sys.argv[1:4]
client = tannery.Client(target, transport=transport)
if mode == "fetch":  # pieces: no torch to import
    for piece in client.fetch_pieces("big"):
        print("started", flush=True)
        time.sleep(600)
else:
    import tannery.archive, torch

    class Slow(tannery.archive.MemoryArchive):
        def _fetch(self, names):
            if names == ["b"]:  # the first entry has gone: hold the second
                print("started", flush=True)
                time.sleep(600)
            return super()._fetch(names)

    client.store("partial", Slow({"a": torch.full((8 << 20,), 7.0), "b": torch.zeros(8 << 20)}))
"""


def run_client(target: str, transport: str, mode: str) -> subprocess.Popen:
    """The client process, once it has said its transfer started."""
    process = subprocess.Popen([sys.executable, "-c", CLIENT, target, transport, mode], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    line = process.stdout.readline()
    if line.strip() != "started":
        process.kill()
        raise AssertionError(f"the client did not start its transfer: {line!r} {process.stderr.read()}")
    return process


def server_files(server: Any) -> list[str]:
    """Files of the data directory this process holds open (the in-process server's)."""
    data = str(server.data_dir.resolve()) + "/"
    held = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(data) and target.removeprefix(data).split("/")[0] in ("blobs", "tmp"):
            held.append(target)
    return held


def store_maps() -> list[str]:
    """Memory files of local Stores this process still maps."""
    gc.collect()
    return [line for line in Path("/proc/self/maps").read_text().splitlines() if "tannery-store" in line]


@pytest.mark.parametrize("transport", ["local", "tcp"])
def test_a_client_killed_in_the_middle_of_a_fetch_leaves_nothing_held(tmp_path, transport, caplog):
    with running_server(tmp_path) as server:
        with tannery.Client(server.target, transport="grpc") as client:
            # tcp: one entry larger than the socket buffers; local: more entries (each a frame
            # with a descriptor) than the socket holds.
            value = {"x": torch.zeros(64 * MiB // 4)} if transport == "tcp" else {
                f"e{i:04}": torch.ones(16) for i in range(500)}
            client.store("big", value)
        process = run_client(server.target, transport, "fetch")
        assert server.storage._pins, "the fetch is not under way"
        process.send_signal(signal.SIGKILL)
        process.wait(30)
        assert wait_for(lambda: settled(server), timeout=15), (server.storage._pins, server.data_paths._tickets)
        assert wait_for(lambda: server_files(server) == [])
        with tannery.Client(server.target, transport=transport) as client:
            assert len(client.fetch("big").names()) == len(value)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "storage" in r.getMessage()]


@pytest.mark.parametrize("transport", ["local", "tcp"])
def test_a_client_killed_in_the_middle_of_a_store_leaves_nothing_behind(tmp_path, transport, caplog):
    with running_server(tmp_path) as server:
        blobs = server.data_dir / "blobs"
        process = run_client(server.target, transport, "store")
        # Entry "a" went whole: its blob is written (not yet part of any archive).
        assert wait_for(lambda: any(p.is_file() for p in blobs.rglob("*")), timeout=15)
        process.send_signal(signal.SIGKILL)
        process.wait(30)
        assert wait_for(lambda: not any(p.is_file() for p in blobs.rglob("*")), timeout=15), list(blobs.rglob("*"))
        assert wait_for(lambda: list((server.data_dir / "tmp").iterdir()) == [])
        assert wait_for(lambda: settled(server) and server_files(server) == [])
        assert wait_for(lambda: store_maps() == []), store_maps()
        with tannery.Client(server.target, transport=transport) as client:
            assert client.list() == []
            client.store("partial", {"a": torch.arange(5)})
            assert torch.equal(client.fetch("partial").find("a"), torch.arange(5))
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "storage" in r.getMessage()]


# -- a server killed in the middle of a transfer ---------------------------------------------------


#: Entries of archive "many": more frames than a Unix socket's buffer holds (local; about 280
#: with a descriptor each, by default) and more bytes than two TCP buffers (tcp), so that a
#: server killed after the first entry is still sending.
MANY = 500


@pytest.fixture(scope="module")
def killable(tmp_path_factory) -> Iterator[ServerProcess]:
    """A server process holding archive "many" (MANY equal entries of 64 KiB: one blob), killed at the end."""
    process = ServerProcess(tmp_path_factory.mktemp("killable") / "data")
    with process:
        with tannery.Client(process.target, transport="grpc") as client:
            client.store("many", {f"e{i:04}": torch.ones(16384) for i in range(MANY)})
        yield process


@pytest.fixture
def killed_server(killable) -> ServerProcess:
    """:func:`killable`, started again if a test killed it (same data, a new port)."""
    if killable.process.poll() is not None:
        killable.start()
    return killable


@pytest.mark.parametrize("transport", ["grpc", "local", "tcp"])
def test_a_server_killed_in_the_middle_of_a_fetch_is_an_error_not_a_partial_archive(killed_server, transport):
    client = tannery.Client(killed_server.target, transport=transport)
    assert client.transport == transport

    def kill_at_once(nbytes: int) -> None:
        if killed_server.process.poll() is None:
            killed_server.kill()

    got = None
    with pytest.raises(tannery.ServiceError) as caught:
        got = client.fetch("many", progress=kill_at_once)
    assert got is None
    assert isinstance(caught.value, tannery.Unavailable), repr(caught.value)
    assert caught.value.code == "UNAVAILABLE"
    client.close()


def test_a_server_killed_in_the_middle_of_fetch_iter_stops_it_with_an_error(killed_server):
    for transport in ("local", "tcp"):
        if killed_server.process.poll() is not None:
            killed_server.start()
        with tannery.Client(killed_server.target, transport=transport) as client:
            seen = []
            with pytest.raises(tannery.Unavailable):
                for name, tensor in client.fetch_iter("many"):
                    if not seen:
                        killed_server.kill()
                    assert torch.equal(tensor, torch.ones(16384)), name
                    seen.append(name)
            assert 0 < len(seen) < MANY, transport
