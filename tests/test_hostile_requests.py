"""Requests no honest client sends: every one is INVALID_ARGUMENT naming what is wrong.

Undecodable protobuf bytes, names that are not UTF-8 and headers whose numbers are absurd
never answer UNKNOWN or INTERNAL, and no error message prints an unbounded number.
"""

from __future__ import annotations

import errno
import sqlite3
import struct

import grpc
import pytest

from tannery_protocol import codec
from tannery_protocol.v1 import archives_pb2 as pb
from tannery_protocol.wire import WireError
from tannery_server.handling import internal
from tannery_server.storage import ArchiveExists, Damaged, InvalidRequest, NoSuchArchive, Storage, TooManyEntries
from tannery_server.storage_failures import failure_of

from .server_harness import commit_request, running_server

ARCHIVES = "/tannery.v1.Archives/"
U64_MAX = 2**64 - 1


def raw_unary(channel: grpc.Channel, method: str):
    return channel.unary_unary(ARCHIVES + method, request_serializer=lambda b: b, response_deserializer=lambda b: b)


def raw_store(channel: grpc.Channel):
    return channel.stream_unary(ARCHIVES + "Store", request_serializer=lambda b: b, response_deserializer=lambda b: b)


def hostile_header(rank: int = 255, dim: int = U64_MAX, code: int = 24) -> bytes:
    """A tannic prefix of ``rank`` dimensions of ``dim``, its sizes as consistent as they can be."""
    after_header = codec.METADATA.size + codec.DIM.size * rank
    header = codec.HEADER.pack(codec.MAGIC, codec.VERSION, 0, after_header)
    metadata = codec.METADATA.pack(code, 0, 0, rank)
    return header + metadata + struct.pack(f"<{rank}Q", *[dim] * rank)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("hostile")) as srv:
        yield srv


def expect_invalid(error: grpc.RpcError, *words: str) -> None:
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (error.code(), error.details())
    for word in words:
        assert word in error.details()
    assert len(error.details()) < 1000, "error messages stay short"


def test_a_begin_whose_archive_name_is_not_utf8(server):
    with pytest.raises(grpc.RpcError) as caught:
        raw_store(server.channel())(iter([bytes.fromhex("0a050a0361fffe")]), timeout=10)
    expect_invalid(caught.value, "begin", "UTF-8")


@pytest.mark.parametrize("method", ["Union", "Fetch", "Describe", "List", "Delete"])
@pytest.mark.parametrize("data", [bytes.fromhex("0a0361fffe"), b"\xff\xff\xff", bytes.fromhex("0a05616263")])
def test_undecodable_unary_requests(server, method, data):
    with pytest.raises(grpc.RpcError) as caught:
        raw_unary(server.channel(), method)(data, timeout=10)
    expect_invalid(caught.value, "is not a valid", "Request")


@pytest.mark.parametrize("data", [b"\x1a\xff\xff\xff\xff\x0f", b"\x12\x02\xc3", b"\x0f", b"\x22\x03\x08\xff"])
def test_undecodable_store_messages(server, data):
    begin = pb.StoreRequest(begin=pb.StoreBegin(archive="undecodable")).SerializeToString()
    with pytest.raises(grpc.RpcError) as caught:
        raw_store(server.channel())(iter([begin, data, commit_request(0, 0).SerializeToString()]), timeout=10)
    expect_invalid(caught.value)
    assert not server.archives().List(pb.ListRequest()).archives


@pytest.mark.parametrize("max_rank", [64, 255])
def test_a_header_of_rank_255_with_every_dimension_2_to_the_64(tmp_path, max_rank):
    """Refused with a short message whatever the server's rank limit: the shape's product,
    thousands of digits long, is never computed into a message."""
    with running_server(tmp_path, max_rank=max_rank) as srv:
        begin = pb.StoreRequest(begin=pb.StoreBegin(archive="hostile"))
        entry = pb.StoreRequest(entry="w", chunk=hostile_header())
        with pytest.raises(grpc.RpcError) as caught:
            srv.archives().Store(iter([begin, entry]), timeout=10)
        expect_invalid(caught.value, "entry 'w'", "rank 255" if max_rank == 64 else "too large for an array")
        assert not srv.archives().List(pb.ListRequest()).archives


def test_the_codec_names_an_absurd_shape_briefly():
    with pytest.raises(codec.FormatError) as caught:
        codec.read_info(hostile_header(), codec.Limits(max_rank=255))
    message = str(caught.value)
    assert "rank 255" in message and "too large for an array" in message and len(message) < 300
    with pytest.raises(codec.OverLimit, match="rank 255 is over the limit of 64"):
        codec.read_info(hostile_header())


@pytest.mark.parametrize("exc, code, words", [
    (OSError(errno.ENOSPC, "No space left on device"), grpc.StatusCode.RESOURCE_EXHAUSTED, "storage is full"),
    (OSError(errno.EFBIG, "File too large"), grpc.StatusCode.RESOURCE_EXHAUSTED, "a file size limit"),
    (OSError(errno.EMFILE, "Too many open files"), grpc.StatusCode.RESOURCE_EXHAUSTED, "out of resources"),
    (OSError(errno.EIO, "Input/output error"), grpc.StatusCode.UNAVAILABLE, "storage error in"),
    (sqlite3.OperationalError("database is locked"), grpc.StatusCode.UNAVAILABLE, "database is locked"),
    (RuntimeError("a bug"), grpc.StatusCode.INTERNAL, "RuntimeError: a bug"),
    (WireError("truncated varint"), grpc.StatusCode.INVALID_ARGUMENT, "truncated varint"),
    (ArchiveExists("archive 'a' already exists"), grpc.StatusCode.ALREADY_EXISTS, "archive 'a' already exists"),
    (NoSuchArchive("archive 'x' not found"), grpc.StatusCode.NOT_FOUND, "archive 'x' not found"),
    (InvalidRequest("union: 'w' is in two sources"), grpc.StatusCode.INVALID_ARGUMENT, "'w' is in two sources"),
    (TooManyEntries("union 'u': 3 entries"), grpc.StatusCode.RESOURCE_EXHAUSTED, "union 'u': 3 entries"),
    (Damaged("entry 'w': stored blob d is missing"), grpc.StatusCode.DATA_LOSS, "stored blob d is missing"),
])
def test_every_exception_a_handler_raises_has_a_status_other_than_unknown(tmp_path, exc, code, words):
    """Storage turns its drivers' errors and its refusals into the server's failures; the handlers the rest."""
    storage = Storage.open_local(tmp_path)
    try:
        failure = internal(failure_of(exc, storage))
    finally:
        storage.close()
    assert failure.code == code and words in str(failure)
