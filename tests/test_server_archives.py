"""Every RPC of the Archives service and its errors, against the real server on loopback, on
each storage backend (``srv``: the embedded store, and PostgreSQL with a bucket)."""

from __future__ import annotations

import hashlib

import grpc
import pytest
import torch

from tannery_protocol import codec
from tannery.torch import deserialize, serialize
from tannery_protocol.v1 import archives_pb2 as pb

from .server_harness import collect_fetch, commit_request, running_server, store_requests, wait_for
from .store_checks import leftovers, stored_blobs

CHUNK = 4096  # the server's chunk size in these tests, so that payloads span many messages


@pytest.fixture
def srv(tmp_path, backend):
    with running_server(tmp_path, chunk_size=CHUNK, **backend) as server:
        yield server


def shared(srv) -> bool:
    """Whether the server's store is shared by replicas (unreferenced blobs go after a grace
    period, by a sweeper: a test waits for them to go instead of expecting them gone at once)."""
    return bool(srv.config.catalog)


def blobs_become(srv, count: int) -> bool:
    """Whether the store holds ``count`` blobs (at once on the embedded store; within seconds on a
    shared one, whose sweeper collects)."""
    return wait_for(lambda: len(stored_blobs(srv)) == count, timeout=10 if shared(srv) else 0)


@pytest.fixture
def stub(srv):
    return srv.archives()


def store(stub, name, entries, chunk=1000, replace=False):
    return stub.Store(store_requests(name, entries, chunk, replace))


def fetch(stub, archive, *asks, prefix=""):
    return collect_fetch(stub.Fetch(pb.FetchRequest(archive=archive, entries=list(asks), prefix=prefix)))


def ask(name, shape=None, dtype="", cast="", rows=None):
    message = pb.EntryAsk(name=name, dtype=dtype, cast=cast)
    if shape is not None:
        message.shape.CopyFrom(pb.Shape(dims=shape))
    if rows is not None:
        message.rows.CopyFrom(pb.RowRange(start=rows[0], stop=rows[1]))
    return message


def failure(call, *args, **kwargs) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        result = call(*args, **kwargs)
        if not isinstance(result, (pb.ArchiveInfo, pb.ArchiveDescription, pb.ListResponse, pb.DeleteResponse)):
            list(result)
    return info.value


def expect(error: grpc.RpcError, code: grpc.StatusCode, message: str, kind: str | None = None) -> None:
    assert error.code() == code, error.details()
    assert message in error.details()
    metadata = dict(error.trailing_metadata() or ())
    assert metadata.get("tannery-error") == kind


def assert_nothing_left(srv, stub):
    assert list(stub.List(pb.ListRequest()).archives) == []
    assert blobs_become(srv, 0)
    assert leftovers(srv) == []


ALL_DTYPES = [torch.bool, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16,
              torch.uint32, torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2, torch.float16, torch.bfloat16,
              torch.float32, torch.float64, torch.complex64, torch.complex128]


def tensor_of(dtype, shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(shape, generator=g, dtype=torch.float64) * 50
    if dtype == torch.bool:
        return values > 0
    if dtype.is_complex:
        return torch.complex(values, -values).to(dtype)
    if not dtype.is_floating_point:
        return values.abs().to(torch.int64).to(dtype)
    return values.to(dtype)


# Store, Describe, Fetch ---------------------------------------------------------------


def test_store_and_fetch_every_dtype_byte_for_byte(srv, stub):
    tensors = {f"t.{str(d).removeprefix('torch.')}": tensor_of(d, (3, 5, 7), i) for i, d in enumerate(ALL_DTYPES)}
    tensors["scalar"] = torch.tensor(2.5)
    tensors["empty"] = torch.zeros((0, 4))
    tensors["big"] = torch.arange(40_000, dtype=torch.float32)  # 160 KB: many chunks each way
    payloads = {name: serialize(t) for name, t in tensors.items()}
    info = store(stub, "ckpt", payloads, chunk=777)
    assert (info.name, info.entries) == ("ckpt", len(payloads))
    assert info.payload_bytes == sum(len(p) for p in payloads.values())
    assert info.nbytes == sum(codec.parse(p).nbytes for p in payloads.values())

    got = fetch(stub, "ckpt")
    assert list(got) == sorted(payloads), "a prefix fetch is sorted by name"
    assert got == payloads
    for name, tensor in tensors.items():
        assert torch.equal(deserialize(got[name]), tensor)

    description = stub.Describe(pb.DescribeRequest(archive="ckpt"))
    assert description.info == info
    assert [e.name for e in description.entries] == sorted(payloads)
    for entry in description.entries:
        payload = payloads[entry.name]
        parsed = codec.parse(payload)
        assert entry.dtype == parsed.dtype.name
        assert tuple(entry.shape) == parsed.shape
        assert entry.nbytes == parsed.nbytes and entry.payload_bytes == len(payload)
        assert entry.digest == hashlib.sha256(payload).hexdigest()


def test_fetch_messages_carry_whole_chunks_and_name_each_entry_once(stub):
    payload = serialize(torch.arange(5000, dtype=torch.float64))  # 40 KB
    store(stub, "a", {"x": payload, "y": serialize(torch.tensor([1, 2]))})
    responses = list(stub.Fetch(pb.FetchRequest(archive="a", entries=[ask("x"), ask("y")])))
    named = [r.entry for r in responses if r.entry]
    assert named == ["x", "y"]
    x_chunks = [r.chunk for r in responses[: len(responses) - 1]]
    assert all(len(c) == CHUNK for c in x_chunks[:-1]) and b"".join(x_chunks) == payload


def test_a_payload_may_arrive_in_pieces_of_any_size_header_split_included(stub):
    payload = serialize(torch.arange(12, dtype=torch.int16).reshape(3, 4))
    requests = [pb.StoreRequest(begin=pb.StoreBegin(archive="a"))]
    requests.append(pb.StoreRequest(entry="w"))  # the name alone, payload in later messages
    requests += [pb.StoreRequest(chunk=payload[i : i + 3]) for i in range(0, len(payload), 3)]
    requests.append(commit_request(1, len(payload)))
    stub.Store(iter(requests))
    assert fetch(stub, "a", ask("w")) == {"w": payload}


def test_an_empty_archive_can_be_stored(stub):
    info = stub.Store(iter([pb.StoreRequest(begin=pb.StoreBegin(archive="empty")), commit_request(0, 0)]))
    assert info.entries == 0
    assert fetch(stub, "empty") == {}


def test_equal_tensors_are_stored_once(srv, stub):
    shared = serialize(torch.ones(1000))
    store(stub, "a", {"w": shared, "v": shared})
    store(stub, "b", {"w": shared, "u": serialize(torch.zeros(3))})
    assert len(stored_blobs(srv)) == 2


def test_already_exists_unless_replace(srv, stub):
    store(stub, "a", {"w": serialize(torch.ones(3))})
    error = failure(store, stub, "a", {"w": serialize(torch.zeros(3))})
    expect(error, grpc.StatusCode.ALREADY_EXISTS, "archive 'a' already exists with other content: entry 'w' differs")
    assert fetch(stub, "a")["w"] == serialize(torch.ones(3))
    store(stub, "a", {"v": serialize(torch.zeros(3))}, replace=True)
    assert fetch(stub, "a") == {"v": serialize(torch.zeros(3))}
    assert blobs_become(srv, 1), "the replaced archive's blob is collected"


# A Store repeated: idempotent -----------------------------------------------------------

W = serialize(tensor_of(torch.float32, (4, 8), seed=1))
B = serialize(tensor_of(torch.float32, (8,), seed=2))
CKPT = {"layer.0.bias": B, "layer.0.weight": W}
META = {"format": "pt"}
#: The seeds of :data:`CKPT`'s entries, for a copy of it in payloads of a blob each.
CKPT_SEEDS = (("layer.0.bias", 2), ("layer.0.weight", 3))


def sha(payload: bytes) -> str:
    return hashlib.sha256(payload).hexdigest()


def shown(payload: bytes) -> str:
    """A payload's digest as a refusal shows it (its first 16 hex digits)."""
    return sha(payload)[:16] + "..."


def ckpt_requests(entries, metadata=META, name="ckpt", digests=False, chunk=CHUNK // 2):
    """A Store of ``entries`` (in this order) with ``metadata``, each entry's SHA-256 sent ahead
    with ``digests``, payloads in chunks of ``chunk`` bytes, then the commit."""
    yield pb.StoreRequest(begin=pb.StoreBegin(archive=name, metadata=metadata))
    sent = 0
    for entry, payload in entries.items():
        for start in range(0, len(payload), chunk):
            piece = payload[start:start + chunk]
            yield (pb.StoreRequest(entry=entry, chunk=piece, entry_sha256=hashlib.sha256(payload).digest() if digests
                                   else b"") if start == 0 else pb.StoreRequest(chunk=piece))
            sent += len(piece)
    yield commit_request(len(entries), sent)


def blob_count(srv) -> int:
    """The blobs the store holds: files under data_dir/blobs (embedded), objects in the bucket (shared)."""
    if shared(srv):
        return len(stored_blobs(srv))
    return sum(1 for p in (srv.data_dir / "blobs").rglob("*") if p.is_file())


def calls_logged(caplog, method: str) -> list[dict]:
    return [r.fields for r in caplog.records if r.name == "tannery_server.calls" and r.fields["method"] == method]


@pytest.mark.parametrize("digests", [False, True], ids=["hashed-on-arrival", "digests-ahead"])
def test_a_store_repeated_identically_answers_ok_flagged_and_stores_nothing(srv, stub, digests, caplog):
    caplog.set_level("INFO", logger="tannery_server.calls")
    first = stub.Store(ckpt_requests(CKPT))
    assert not first.already_stored
    blobs, totals = blob_count(srv), srv.storage.catalog.totals()
    again = stub.Store(ckpt_requests(CKPT, digests=digests))
    assert again.already_stored
    assert (again.name, again.entries, again.nbytes, again.payload_bytes, again.created) == (
        first.name, first.entries, first.nbytes, first.payload_bytes, first.created)
    assert blob_count(srv) == blobs == 1  # both entries are small: one pack (docs/packs.md)
    assert srv.storage.catalog.totals() == totals
    assert leftovers(srv) == []
    assert fetch(stub, "ckpt") == CKPT
    assert stub.Describe(pb.DescribeRequest(archive="ckpt")).metadata == META
    stores = calls_logged(caplog, "Store")
    assert [c.get("already_stored") for c in stores] == [None, True], stores


def test_an_identical_store_in_another_entry_order_and_chunking_is_the_same_content(srv, stub):
    stub.Store(ckpt_requests(CKPT))
    reordered = dict(reversed(list(CKPT.items())))
    assert stub.Store(ckpt_requests(reordered, chunk=7)).already_stored
    assert fetch(stub, "ckpt") == CKPT


W_BYTES = serialize(tensor_of(torch.float32, (4, 8), seed=3))
W_DTYPE = serialize(tensor_of(torch.float64, (4, 8), seed=1))
W_SHAPE = serialize(tensor_of(torch.float32, (8, 4), seed=1))


def digest_differs(payload: bytes) -> str:
    """The refusal's words for entry layer.0.weight sent as ``payload``, compared by digest."""
    return f"entry 'layer.0.weight' differs (sha256 {shown(W)} there, {shown(payload)} sent)"


@pytest.mark.parametrize(
    "entries, metadata, message",
    [
        ({**CKPT, "layer.0.weight": W_BYTES}, META, digest_differs(W_BYTES)),
        ({**CKPT, "layer.0.weight": W_DTYPE}, META,
         "entry 'layer.0.weight' differs (float32 [4, 8] there, float64 [4, 8] sent)"),
        ({**CKPT, "layer.0.weight": W_SHAPE}, META,
         "entry 'layer.0.weight' differs (float32 [4, 8] there, float32 [8, 4] sent)"),
        ({**CKPT, "layer.1.weight": W}, META, "entry 'layer.1.weight' sent is not there (it has 2 entries)"),
        ({"layer.0.bias": B}, META, "entry 'layer.0.weight' is missing (2 entries there, 1 sent)"),
        (CKPT, {"format": "np"}, "metadata key 'format' differs ('pt' there, 'np' sent)"),
        (CKPT, {**META, "step": "7"}, "metadata key 'step' is not there (1 key there, 2 sent)"),
        (CKPT, {}, "metadata key 'format' is missing (1 key there, 0 sent)"),
    ],
    ids=["bytes", "dtype", "shape", "extra-entry", "missing-entry", "metadata-value", "metadata-extra",
         "metadata-missing"],
)
@pytest.mark.parametrize("digests", [False, True], ids=["hashed-on-arrival", "digests-ahead"])
def test_other_content_under_the_name_is_already_exists_naming_what_differs_and_stores_nothing(
        srv, stub, entries, metadata, message, digests):
    stub.Store(ckpt_requests(CKPT))
    blobs = blob_count(srv)
    if digests and "float" in message:  # the digest sent ahead differs first, before the header arrives
        message = digest_differs(entries["layer.0.weight"])
    error = failure(stub.Store, ckpt_requests(entries, metadata, digests=digests))
    expect(error, grpc.StatusCode.ALREADY_EXISTS, f"archive 'ckpt' already exists with other content: {message}")
    assert blob_count(srv) == blobs
    assert leftovers(srv) == []
    assert fetch(stub, "ckpt") == CKPT
    assert stub.Describe(pb.DescribeRequest(archive="ckpt")).metadata == META


def test_a_digest_sent_ahead_that_the_bytes_do_not_match_is_invalid_even_when_it_is_the_stored_one(srv, stub):
    """The digest ahead is checked against the bytes: a client cannot pass other bytes off as the stored entry."""
    stub.Store(ckpt_requests(CKPT))
    other = serialize(tensor_of(torch.float32, (4, 8), seed=9))
    messages = [pb.StoreRequest(begin=pb.StoreBegin(archive="ckpt", metadata=META)),
                pb.StoreRequest(entry="layer.0.bias", chunk=B, entry_sha256=hashlib.sha256(B).digest()),
                pb.StoreRequest(entry="layer.0.weight", chunk=other, entry_sha256=hashlib.sha256(W).digest()),
                commit_request(2, len(B) + len(other))]
    expect(failure(stub.Store, iter(messages)), grpc.StatusCode.INVALID_ARGUMENT,
           f"entry 'layer.0.weight': its {len(other)} bytes hash to SHA-256 {sha(other)}, not to {sha(W)}")
    assert fetch(stub, "ckpt") == CKPT
    assert leftovers(srv) == []


def held_store(messages_before, messages_after, reached: list[str], release):
    """Requests that record in ``reached`` what they handed to gRPC (``messages_before``: (label,
    message) pairs), then wait for ``release`` before the rest (the payload still unsent)."""
    for label, message in messages_before:
        reached.append(label)
        yield message
    if release.wait(20):
        reached.append("payload")
        yield from messages_after


@pytest.mark.parametrize(
    "entry, sha256, first_chunk, message",
    [
        ("layer.0.weight", hashlib.sha256(W[:-4] + b"\0\0\0\0").digest(), b"",
         f"entry 'layer.0.weight' differs (sha256 {shown(W)} there, {shown(W[:-4] + bytes(4))} sent)"),
        ("layer.9.weight", b"", b"", "entry 'layer.9.weight' sent is not there (it has 2 entries)"),
        ("layer.0.weight", b"", codec.encode_prefix(codec.DTYPES["float32"], [1 << 16]),  # its header only
         "entry 'layer.0.weight' differs (float32 [4, 8] there, float32 [65536] sent)"),
    ],
    ids=["digest-ahead", "unknown-name", "header"],
)
def test_other_content_is_refused_before_the_entrys_payload_is_sent(srv, stub, entry, sha256, first_chunk, message):
    import threading
    import time

    stub.Store(ckpt_requests(CKPT))
    blobs = blob_count(srv)
    reached: list[str] = []
    release = threading.Event()
    rest = serialize(torch.zeros(1 << 16))[len(first_chunk):]
    before = [("begin", pb.StoreRequest(begin=pb.StoreBegin(archive="ckpt", metadata=META))),
              ("entry", pb.StoreRequest(entry=entry, entry_sha256=sha256, chunk=first_chunk))]
    started = time.monotonic()
    try:
        error = failure(stub.Store, held_store(before, [pb.StoreRequest(chunk=rest), commit_request(1, 1 << 18)],
                                               reached, release))
    finally:
        release.set()
    assert time.monotonic() - started < 15, "the refusal waited for the payload"
    assert reached == ["begin", "entry"], "refused before the payload was sent"
    expect(error, grpc.StatusCode.ALREADY_EXISTS, f"archive 'ckpt' already exists with other content: {message}")
    assert blob_count(srv) == blobs
    assert wait_for(lambda: leftovers(srv) == [])


@pytest.mark.parametrize("identical", [True, False], ids=["identical", "different"])
def test_a_name_taken_by_another_store_before_commit_is_compared_then(srv, stub, identical):
    """Two Stores of one name at once, both begun before either committed: the second to commit
    finds the name taken, and answers OK flagged when the first stored exactly its content."""
    import threading

    # Payloads of 1.2 MB, each a blob of its own (smaller ones wait in the Store's pack until its
    # commit, docs/packs.md), so that the held Store's blobs show it has begun.
    base = {name: serialize(tensor_of(torch.float32, (300_000,), seed=seed)) for name, seed in CKPT_SEEDS}
    other = {**base, "layer.0.bias": serialize(tensor_of(torch.float32, (300_000,), seed=5))}
    mine = base if identical else other
    release, reached = threading.Event(), []
    messages = list(ckpt_requests(mine))
    held = stub.Store.future(held_store([(str(i), m) for i, m in enumerate(messages[:-1])], messages[-1:],
                                        reached, release))
    try:
        # Its payloads are written as blobs (no archive there to compare with when it began).
        assert wait_for(lambda: blob_count(srv) == len(mine))
        assert not stub.Store(ckpt_requests(base)).already_stored  # begun after the held one, committed first
    finally:
        release.set()
    if identical:
        assert held.result(timeout=30).already_stored
    else:
        expect(held.exception(timeout=30), grpc.StatusCode.ALREADY_EXISTS,
               f"archive 'ckpt' already exists with other content: entry 'layer.0.bias' differs (sha256 {shown(base['layer.0.bias'])} "
               f"there, {shown(other['layer.0.bias'])} sent)")
    assert fetch(stub, "ckpt") == base
    assert wait_for(lambda: leftovers(srv) == [])
    assert blobs_become(srv, len(base)), "the refused Store's blob is collected; an identical one's were the same"


def test_replace_still_replaces_whatever_is_there(srv, stub):
    stub.Store(ckpt_requests(CKPT))
    info = stub.Store(store_requests("ckpt", {"w": B}, replace=True))
    assert not info.already_stored and info.entries == 1
    assert not stub.Store(store_requests("ckpt", {"w": B}, replace=True)).already_stored
    assert fetch(stub, "ckpt") == {"w": B}


# Store errors -------------------------------------------------------------------------

GOOD = serialize(torch.arange(6, dtype=torch.float32).reshape(2, 3))


def raw_store(stub, *messages):
    """A Store of ``messages`` and the commit a client would send after them (their counts)."""
    entries = sum(1 for m in messages if m.entry)
    sent = sum(len(m.chunk) for m in messages)
    return stub.Store(iter([*messages, commit_request(entries, sent)]))


def begin(name="a"):
    return pb.StoreRequest(begin=pb.StoreBegin(archive=name))


@pytest.mark.parametrize(
    "messages, message",
    [
        ([pb.StoreRequest(entry="w", chunk=GOOD)], "the first message of Store must carry begin"),
        ([begin(), pb.StoreRequest(chunk=GOOD)], "payload bytes before any entry name"),
        ([begin(), pb.StoreRequest(entry="w")], "entry 'w' has no payload"),
        ([begin(), pb.StoreRequest(entry="w"), pb.StoreRequest(entry="v", chunk=GOOD)], "entry 'w' has no payload"),
        ([begin(), pb.StoreRequest(entry="w", chunk=GOOD), pb.StoreRequest(entry="w", chunk=GOOD)],
         "entry 'w' is named twice"),
        ([begin(), pb.StoreRequest(entry="w", chunk=GOOD), begin()], "begin is allowed in the first message only"),
        ([begin(), pb.StoreRequest(entry="bad\nname", chunk=GOOD)], "control character"),
        ([begin(), pb.StoreRequest(entry="w", chunk=GOOD, entry_sha256=b"short")],
         "entry 'w': entry_sha256 has 5 bytes; a SHA-256 has 32"),
        ([begin(), pb.StoreRequest(entry="w"), pb.StoreRequest(chunk=GOOD, entry_sha256=bytes(32))],
         "entry_sha256 without entry"),
        ([begin(), pb.StoreRequest(entry="w", chunk=GOOD, entry_sha256=bytes(32))],
         f"entry 'w': its 73 bytes hash to SHA-256 {hashlib.sha256(GOOD).hexdigest()}, not to {'00' * 32}"),
        ([begin("")], "archive name: an empty name"),
        ([begin("a/../b")], "must not be empty, '.' or '..'"),
        ([begin("..")], "must not be empty, '.' or '..'"),
        ([begin("a//b")], "must not be empty, '.' or '..'"),
        ([begin("tab\tname")], "control character"),
        ([begin("x" * 2000)], "2000 bytes, over the limit of 1024"),
    ],
)
def test_malformed_store_streams_are_invalid_argument_and_store_nothing(srv, stub, messages, message):
    expect(failure(raw_store, stub, *messages), grpc.StatusCode.INVALID_ARGUMENT, message)
    assert_nothing_left(srv, stub)


def test_a_commit_that_carries_a_digest_is_refused(srv, stub):
    commit = commit_request(1, len(GOOD))
    commit.entry_sha256 = hashlib.sha256(GOOD).digest()
    messages = [begin(), pb.StoreRequest(entry="w", chunk=GOOD), commit]
    expect(failure(lambda s, *m: s.Store(iter(m)), stub, *messages), grpc.StatusCode.INVALID_ARGUMENT,
           "commit must come alone")
    assert_nothing_left(srv, stub)


@pytest.mark.parametrize(
    "chunks, message",
    [
        ([b"NOPE" + GOOD[4:]], "bad magic"),
        ([GOOD[:-1]], "stream ended inside a payload: 72 of 73 bytes"),
        ([GOOD[:20]], "stream ended inside a payload header"),
        ([GOOD + GOOD[:10]], "more bytes after its payload of 73 bytes"),
        ([GOOD, GOOD], "more bytes after its payload of 73 bytes"),
        ([GOOD + GOOD], "more bytes after its payload of 73 bytes"),
        ([GOOD[:15] + b"\x05" + GOOD[16:]], "unknown dcode 5"),
    ],
)
def test_malformed_payloads_are_invalid_argument_with_format_metadata(srv, stub, chunks, message):
    stub.Store(store_requests("other", {"w": GOOD}))  # stored blobs of other archives survive
    error = failure(raw_store, stub, begin(), *[pb.StoreRequest(entry="w", chunk=c) if i == 0 else
                                                pb.StoreRequest(chunk=c) for i, c in enumerate(chunks)])
    expect(error, grpc.StatusCode.INVALID_ARGUMENT, message, kind="format")
    assert "entry 'w'" in error.details()
    assert [a.name for a in stub.List(pb.ListRequest()).archives] == ["other"]
    assert blobs_become(srv, 1) and leftovers(srv) == []


def test_an_entry_starting_inside_the_previous_payload_is_a_format_error(srv, stub):
    error = failure(raw_store, stub, begin(), pb.StoreRequest(entry="w", chunk=GOOD[:60]),
                    pb.StoreRequest(entry="v", chunk=GOOD))
    expect(error, grpc.StatusCode.INVALID_ARGUMENT,
           "entry 'v' starts before the payload of entry 'w' ended: 60 of 73 bytes", kind="format")
    error = failure(raw_store, stub, begin(), pb.StoreRequest(entry="w", chunk=GOOD[:40]),
                    pb.StoreRequest(entry="v", chunk=GOOD))
    expect(error, grpc.StatusCode.INVALID_ARGUMENT,
           "entry 'v' starts before the payload of entry 'w' ended: in its header", kind="format")
    assert_nothing_left(srv, stub)


def test_limits(tmp_path):
    with running_server(tmp_path, max_payload_bytes=1000, max_rank=3, max_entries=2, max_name_bytes=16) as srv:
        stub = srv.archives()
        big = serialize(torch.zeros(300))  # 1241 bytes
        error = failure(store, stub, "a", {"w": big})
        expect(error, grpc.StatusCode.RESOURCE_EXHAUSTED,
               "entry 'w': payload of 1241 bytes (float32 [300]) is over the limit of 1000 bytes")
        error = failure(store, stub, "a", {"w": serialize(torch.zeros(1, 1, 1, 1))})
        expect(error, grpc.StatusCode.INVALID_ARGUMENT, "entry 'w': rank 4 is over the limit of 3")
        error = failure(store, stub, "a", {"x": GOOD, "y": GOOD, "z": GOOD})
        expect(error, grpc.StatusCode.RESOURCE_EXHAUSTED, "archive 'a': more than 2 entries")
        error = failure(store, stub, "a", {"a-very-long-entry-name": GOOD})
        expect(error, grpc.StatusCode.INVALID_ARGUMENT, "22 bytes, over the limit of 16")
        assert_nothing_left(srv, stub)


def test_a_limit_is_answered_before_the_payload_is_received(tmp_path):
    """The header alone decides: the server fails the call although the client has only sent it."""
    with running_server(tmp_path, max_payload_bytes=1 << 20) as srv:
        stub = srv.archives()
        header = codec.encode_prefix(codec.DTYPES["float32"], (1 << 30,))  # claims 4 GiB
        sent = []

        def requests():
            yield begin()
            yield pb.StoreRequest(entry="w", chunk=header)
            for _ in range(10_000):  # never this many: the call fails first
                sent.append(1)
                yield pb.StoreRequest(chunk=bytes(1 << 20))

        expect(failure(stub.Store, requests()), grpc.StatusCode.RESOURCE_EXHAUSTED, "over the limit of 1048576")
        assert len(sent) < 100
        assert_nothing_left(srv, stub)


# Fetch --------------------------------------------------------------------------------


@pytest.fixture
def model(stub):
    tensors = {
        "model": torch.tensor(1.0),
        "model.w": torch.arange(4, dtype=torch.float32).reshape(2, 2),
        "model.blocks.0.w": torch.ones(3),
        "models.w": torch.zeros(2),
        "half": torch.tensor([1.5, -2.25], dtype=torch.bfloat16),
        "count": torch.tensor([3, 4], dtype=torch.int32),
        "x64": torch.randn(50, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) * 1e3,
    }
    store(stub, "m", {k: serialize(v) for k, v in tensors.items()})
    return tensors


def test_fetch_by_names_in_the_order_asked(stub, model):
    got = stub.Fetch(pb.FetchRequest(archive="m", entries=[ask("models.w"), ask("model"), ask("half")]))
    payloads = collect_fetch(got)
    assert list(payloads) == ["models.w", "model", "half"]
    assert torch.equal(deserialize(payloads["half"]), model["half"])


def test_fetch_by_prefix_follows_the_owned_names_rule(stub, model):
    assert list(fetch(stub, "m", prefix="model")) == ["model", "model.blocks.0.w", "model.w"]
    assert list(fetch(stub, "m", prefix="model.blocks")) == ["model.blocks.0.w"]
    expect(failure(fetch, stub, "m", prefix="mod"), grpc.StatusCode.NOT_FOUND,
           "archive 'm': no entry under prefix 'mod'")


def test_fetch_checks_shape_and_dtype(stub, model):
    got = fetch(stub, "m", ask("model.w", shape=[2, 2], dtype="float32"), ask("model", shape=[]))
    assert torch.equal(deserialize(got["model.w"]), model["model.w"])
    cases = [
        (ask("model.w", shape=[4]), grpc.StatusCode.FAILED_PRECONDITION,
         "Archive.tensor: model.w: shape [2, 2] in the archive, [4] asked for", "archive"),
        (ask("model", shape=[1]), grpc.StatusCode.FAILED_PRECONDITION,
         "Archive.tensor: model: shape [] in the archive, [1] asked for", "archive"),
        (ask("half", dtype="float32"), grpc.StatusCode.FAILED_PRECONDITION,
         "Archive.tensor: half: bfloat16 in the archive, float32 asked for", "archive"),
        (ask("count", cast="float32"), grpc.StatusCode.FAILED_PRECONDITION,
         "Archive.float: count: int32 in the archive, not float16, bfloat16, float32 or float64", "archive"),
        (ask("half", cast="float8_e5m2"), grpc.StatusCode.INVALID_ARGUMENT,
         "Archive.float: float8_e5m2 is not float16, bfloat16, float32 or float64", None),
        (ask("half", dtype="float33"), grpc.StatusCode.INVALID_ARGUMENT, "unknown dtype 'float33' in dtype", None),
        (ask("absent"), grpc.StatusCode.NOT_FOUND, "Archive.tensor: absent: no entry in the archive", None),
        (ask("absent", cast="float32"), grpc.StatusCode.NOT_FOUND, "Archive.float: absent: no entry in the archive",
         None),
    ]
    for entry_ask, code, message, kind in cases:
        expect(failure(fetch, stub, "m", entry_ask), code, message, kind)
    expect(failure(fetch, stub, "nope", ask("w")), grpc.StatusCode.NOT_FOUND, "archive 'nope' not found")


def test_every_ask_is_checked_before_the_first_byte_is_sent(stub, model):
    responses = stub.Fetch(pb.FetchRequest(archive="m", entries=[ask("model.w"), ask("x64"), ask("half", shape=[3])]))
    received = []
    with pytest.raises(grpc.RpcError) as info:
        for response in responses:
            received.append(response)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert received == []


@pytest.mark.parametrize("source", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("target", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_a_float_cast_on_the_server_equals_torch_to(stub, source, target):
    values = torch.randn(3000, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 1e3
    values[:4] = torch.tensor([1e300, -1e-300, float("nan"), 65519.99])  # overflow, underflow, nan, rounding
    tensor = values.to(source)
    store(stub, "f", {"w": serialize(tensor)})
    name = str(target).removeprefix("torch.")
    got = deserialize(fetch(stub, "f", ask("w", cast=name))["w"])
    assert got.dtype == target and got.shape == tensor.shape
    assert torch.equal(got.view(torch.uint8) if False else got.to(torch.float64).nan_to_num(7.0),
                       tensor.to(target).to(torch.float64).nan_to_num(7.0))
    if source == target:
        assert fetch(stub, "f", ask("w", cast=name))["w"] == serialize(tensor)


def test_a_float_cast_of_a_large_entry_is_streamed_in_chunks(stub):
    tensor = torch.randn(100_000, generator=torch.Generator().manual_seed(4))  # 400 KB float32
    store(stub, "f", {"w": serialize(tensor)})
    responses = list(stub.Fetch(pb.FetchRequest(archive="f", entries=[ask("w", cast="float64")])))
    assert all(len(r.chunk) <= CHUNK for r in responses) and len(responses) > 100
    got = deserialize(b"".join(r.chunk for r in responses))
    assert torch.equal(got, tensor.to(torch.float64))


def test_rows(stub, model):
    table = torch.arange(10 * 3 * 5, dtype=torch.int64).reshape(10, 3, 5)
    store(stub, "t", {"emb": serialize(table), "x64": serialize(model["x64"])})
    for start, stop in [(0, 10), (3, 7), (9, 10), (4, 4)]:
        got = deserialize(fetch(stub, "t", ask("emb", rows=(start, stop), shape=[10, 3, 5]))["emb"])
        assert torch.equal(got, table[start:stop])
    got = deserialize(fetch(stub, "t", ask("x64", rows=(10, 30), cast="bfloat16"))["x64"])
    assert torch.equal(got, model["x64"][10:30].to(torch.bfloat16))
    expect(failure(fetch, stub, "t", ask("emb", rows=(5, 12))), grpc.StatusCode.FAILED_PRECONDITION,
           "Archive.tensor: emb: rows [5, 12) asked for, 10 rows in the archive (shape [10, 3, 5])", "archive")
    expect(failure(fetch, stub, "t", ask("emb", rows=(7, 3))), grpc.StatusCode.INVALID_ARGUMENT,
           "Archive.tensor: emb: rows [7, 3): start is after stop")
    expect(failure(fetch, stub, "m", ask("model", rows=(0, 1))), grpc.StatusCode.FAILED_PRECONDITION,
           "Archive.tensor: model: rows [0, 1) asked for, but the entry is a scalar", "archive")


@pytest.mark.parametrize("row_elements", [1, 3, 8, 13])
def test_rows_of_bit_packed_bools(stub, row_elements):
    mask = torch.rand(37, row_elements, generator=torch.Generator().manual_seed(row_elements)) > 0.5
    store(stub, "b", {"mask": serialize(mask)})
    for start, stop in [(0, 37), (1, 2), (5, 30), (36, 37), (8, 16), (3, 3)]:
        payload = fetch(stub, "b", ask("mask", rows=(start, stop)))["mask"]
        assert payload == serialize(mask[start:stop]), (start, stop)  # pad bits cleared too


def test_rows_of_a_table_spanning_several_checksum_blocks(stub):
    table = torch.randn(3000, 257, generator=torch.Generator().manual_seed(5))  # 3 MB: 3 blocks of 1 MiB
    store(stub, "big", {"emb": serialize(table)}, chunk=65536)
    for start, stop in [(0, 3000), (1000, 1021), (1019, 2041), (2999, 3000)]:
        got = deserialize(fetch(stub, "big", ask("emb", rows=(start, stop)))["emb"])
        assert torch.equal(got, table[start:stop])
    got = deserialize(fetch(stub, "big", ask("emb", rows=(1000, 1100), cast="float16"))["emb"])
    assert torch.equal(got, table[1000:1100].half())


# Union --------------------------------------------------------------------------------


def test_union_under_prefixes_copies_no_blob(srv, stub):
    a = {"w": serialize(torch.ones(3)), "b": serialize(torch.zeros(2))}
    c = {"w": serialize(torch.full((2,), 7.0))}
    store(stub, "a", a)
    store(stub, "c", c)
    before = stored_blobs(srv)
    info = stub.Union(pb.UnionRequest(target="u", sources=[pb.UnionSource(archive="a", prefix="model"),
                                                          pb.UnionSource(archive="c")]))
    assert (info.name, info.entries) == ("u", 3)
    assert stored_blobs(srv) == before
    assert fetch(stub, "u") == {"model.b": a["b"], "model.w": a["w"], "w": c["w"]}
    stub.Delete(pb.DeleteRequest(archive="a"))
    assert fetch(stub, "u", prefix="model") == {"model.b": a["b"], "model.w": a["w"]}


def test_union_errors_create_nothing(stub):
    store(stub, "a", {"w": GOOD})
    store(stub, "c", {"w": GOOD, "v": GOOD})

    def union(target, *sources, replace=False):
        return stub.Union(pb.UnionRequest(target=target, replace=replace,
                                          sources=[pb.UnionSource(archive=s, prefix=p) for s, p in sources]))

    expect(failure(union, "u", ("a", ""), ("c", "")), grpc.StatusCode.INVALID_ARGUMENT,
           "union: 'w' is in two sources, 'a' and 'c'")
    expect(failure(union, "u", ("a", "p"), ("c", ""), ("a", "p")), grpc.StatusCode.INVALID_ARGUMENT,
           "union: 'p.w' is in two sources, 'a' and 'a'")
    expect(failure(union, "u", ("a", ""), ("absent", "")), grpc.StatusCode.NOT_FOUND, "archive 'absent' not found")
    expect(failure(union, "a", ("c", "")), grpc.StatusCode.ALREADY_EXISTS, "archive 'a' already exists")
    expect(failure(union, "u", ("a", "bad\x00prefix")), grpc.StatusCode.INVALID_ARGUMENT, "control character")
    expect(failure(union, "../u", ("a", "")), grpc.StatusCode.INVALID_ARGUMENT, "'..'")
    assert sorted(a.name for a in stub.List(pb.ListRequest()).archives) == ["a", "c"]
    info = union("a", ("a", "old"), ("c", ""), replace=True)
    assert info.entries == 3
    assert list(fetch(stub, "a")) == ["old.w", "v", "w"]


def union_of(stub, target, *sources, metadata=None, replace=False):
    return stub.Union(pb.UnionRequest(target=target, replace=replace, metadata=metadata or {},
                                      sources=[pb.UnionSource(archive=a, prefix=p) for a, p in sources]))


def test_a_union_repeated_identically_answers_ok_flagged_and_writes_nothing(srv, stub, caplog):
    caplog.set_level("INFO", logger="tannery_server.calls")
    stub.Store(ckpt_requests(CKPT, name="model"))
    store(stub, "optim", {"m": B})
    sources = (("model", "model"), ("optim", "optim"))
    first = union_of(stub, "both", *sources, metadata=META)
    assert not first.already_stored
    totals, blobs = srv.storage.catalog.totals(), blob_count(srv)
    again = union_of(stub, "both", *reversed(sources), metadata=META)
    assert again.already_stored
    assert (again.entries, again.nbytes, again.created) == (first.entries, first.nbytes, first.created)
    assert (srv.storage.catalog.totals(), blob_count(srv)) == (totals, blobs)
    assert fetch(stub, "both") == {"model.layer.0.bias": B, "model.layer.0.weight": W, "optim.m": B}
    assert [c.get("already_stored") for c in calls_logged(caplog, "Union")] == [None, True]


def test_a_union_to_a_stored_archive_of_the_same_content_is_already_there(stub):
    """A Union whose result is exactly an archive a Store made (entries, digests, metadata)."""
    stub.Store(ckpt_requests(CKPT, name="model"))
    stub.Store(ckpt_requests(CKPT, name="copy"))
    assert union_of(stub, "copy", ("model", ""), metadata=META).already_stored
    expect(failure(union_of, stub, "copy", ("model", "")), grpc.StatusCode.ALREADY_EXISTS,
           "archive 'copy' already exists with other content: metadata key 'format' is missing "
           "(1 key there, 0 in the union)")


def test_a_union_with_other_content_is_already_exists_naming_the_entry(srv, stub):
    stub.Store(ckpt_requests(CKPT, name="model"))
    store(stub, "optim", {"m": B})
    store(stub, "optim2", {"m": W})
    union_of(stub, "both", ("model", "model"), ("optim", "optim"))
    totals = srv.storage.catalog.totals()
    prefix = "archive 'both' already exists with other content: "
    expect(failure(union_of, stub, "both", ("model", "model")), grpc.StatusCode.ALREADY_EXISTS,
           prefix + "entry 'optim.m' is missing (3 entries there, 2 in the union)")
    expect(failure(union_of, stub, "both", ("model", "model"), ("optim", "optim"), ("optim2", "extra")),
           grpc.StatusCode.ALREADY_EXISTS, prefix + "entry 'extra.m' in the union is not there (3 entries there, 4 in "
           "the union)")
    expect(failure(union_of, stub, "both", ("model", "model"), ("optim2", "optim")), grpc.StatusCode.ALREADY_EXISTS,
           prefix + f"entry 'optim.m' differs (float32 [8] there, float32 [4, 8] in the union)")
    expect(failure(union_of, stub, "both", ("model", "model"), ("optim", "optim"), metadata={"step": "1"}),
           grpc.StatusCode.ALREADY_EXISTS, prefix + "metadata key 'step' is not there (0 keys there, 1 in the union)")
    assert srv.storage.catalog.totals() == totals
    assert fetch(stub, "both") == {"model.layer.0.bias": B, "model.layer.0.weight": W, "optim.m": B}


def test_a_union_whose_entry_has_the_same_shape_but_other_bytes_is_refused_by_digest(stub):
    store(stub, "one", {"w": W})
    store(stub, "two", {"w": W_BYTES})
    union_of(stub, "u", ("one", ""))
    expect(failure(union_of, stub, "u", ("two", "")), grpc.StatusCode.ALREADY_EXISTS,
           f"archive 'u' already exists with other content: entry 'w' differs (sha256 {shown(W)} there, "
           f"{shown(W_BYTES)} in the union)")
    assert union_of(stub, "u", ("two", ""), replace=True).entries == 1
    assert fetch(stub, "u") == {"w": W_BYTES}


def test_a_union_onto_an_existing_name_compares_before_it_builds(srv, stub, monkeypatch):
    """A union that finds its target holding the same content, or other content, answers from
    a comparison: no archive is begun (no entry copied) for a union that writes nothing."""
    store(stub, "one", {"w": W})
    store(stub, "two", {"w": W_BYTES})
    union_of(stub, "u", ("one", ""))
    catalog = srv.storage.catalog
    real = catalog._begin_archive
    begun = []
    monkeypatch.setattr(catalog, "_begin_archive", lambda *args: (begun.append(args[1]), real(*args))[1])
    assert union_of(stub, "u", ("one", "")).already_stored
    expect(failure(union_of, stub, "u", ("two", "")), grpc.StatusCode.ALREADY_EXISTS,
           "archive 'u' already exists with other content: entry 'w' differs")
    expect(failure(union_of, stub, "u", ("one", ""), ("two", "")), grpc.StatusCode.INVALID_ARGUMENT,
           "union: 'w' is in two sources, 'one' and 'two'")  # still found by the build, as before
    assert begun == ["u"]  # the last union only: the build is what names a duplicate
    assert union_of(stub, "u", ("two", ""), replace=True).entries == 1 and begun == ["u", "u"]
    assert fetch(stub, "u") == {"w": W_BYTES}


# Describe, List, Delete ---------------------------------------------------------------


def test_describe_and_list_and_delete(srv, stub):
    for name in ["run/3", "run/1", "run/2", "other", "run/4", "runs"]:
        store(stub, name, {"w": serialize(torch.tensor([1 if name.startswith("run/") else len(name)]))})
    expect(failure(stub.Describe, pb.DescribeRequest(archive="absent")), grpc.StatusCode.NOT_FOUND,
           "archive 'absent' not found")

    pages, token = [], ""
    while True:
        page = stub.List(pb.ListRequest(prefix="run/", page_size=2, page_token=token))
        pages.append([a.name for a in page.archives])
        token = page.next_page_token
        if not token:
            break
    assert pages == [["run/1", "run/2"], ["run/3", "run/4"]]
    everything = stub.List(pb.ListRequest())
    assert [a.name for a in everything.archives] == ["other", "run/1", "run/2", "run/3", "run/4", "runs"]
    assert everything.next_page_token == ""
    assert all(a.entries == 1 and a.created.seconds > 0 for a in everything.archives)
    expect(failure(stub.List, pb.ListRequest(page_token="garbage!")), grpc.StatusCode.INVALID_ARGUMENT,
           "page_token 'garbage!' is not one this server gave")

    deleted = stub.Delete(pb.DeleteRequest(archive="run/1"))
    assert deleted.deleted.name == "run/1"
    assert deleted.blobs_removed == 0, "run/2 holds the same tensor"
    deleted = stub.Delete(pb.DeleteRequest(archive="other"))
    if shared(srv):  # freed by the sweeper after the grace period; the answer says nothing yet
        assert (deleted.blobs_removed, deleted.bytes_freed) == (0, 0)
        assert blobs_become(srv, 2)  # run/*'s tensor and runs' are left
    else:
        assert (deleted.blobs_removed, deleted.bytes_freed) == (1, len(serialize(torch.tensor([5]))))
    expect(failure(stub.Delete, pb.DeleteRequest(archive="other")), grpc.StatusCode.NOT_FOUND,
           "archive 'other' not found")
    expect(failure(fetch, stub, "other"), grpc.StatusCode.NOT_FOUND, "archive 'other' not found")
