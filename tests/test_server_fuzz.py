"""Server-level fuzzing: thousands of seeded malformed requests of every RPC against one real server.

The Store fuzzer keeps a model of what must be stored (archive -> entry -> payload bytes):
a call that answers OK updates it (and must have been one that may succeed), a call that
fails leaves it alone. Mixed in are valid Stores, Unions and Deletes, so the malformed
Fetches, Describes and Unions meet real archives. At the end the server must be alive,
list exactly the model (every archive whole, fetching byte-exact), hold no temporary file
and no blob nothing references, and scrub clean once stopped. No answer may be UNKNOWN or
INTERNAL (a handler that raised) and no call may hang.

``TANNERY_FUZZ_SEED`` picks the seed (printed with every failure), ``TANNERY_FUZZ_CASES``
the number of cases (``make fuzz`` runs many more than CI does). Channels are fuzzed in a
separate test, with malformed payloads only (the service is being rewritten).
"""

from __future__ import annotations

import gc
import logging
import os
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Sequence

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tannery_protocol import codec
from tannery_protocol.names import join, owns
from tannery_protocol.v1 import archives_pb2 as pb
from tannery_protocol.v1 import archives_pb2_grpc, channels_pb2
from tannery_protocol.wire import encode_varint

from .server_harness import running_server, wait_for
from .store_checks import digest, random_payload, scrub, store_problems, temporary_files

ARCHIVES = "/tannery.v1.Archives/"
CHANNELS = "/tannery.v1.Channels/"
SEED = int(os.environ.get("TANNERY_FUZZ_SEED", "1101"))
CASES = int(os.environ.get("TANNERY_FUZZ_CASES", "3000"))
PUBLISH_CASES = max(200, CASES // 8)
#: A call that takes longer than this is counted as a hang.
CALL_TIMEOUT = 60.0
U64_MAX = 2**64 - 1

ARCHIVE_POOL = ["fuzz/a", "fuzz/b", "fuzz/c", "fuzz/d", "fuzz/e", "model", "model.v2", "ünï/cödé", "a b", "z"]
ENTRY_POOL = ["w", "b", "layer.0.weight", "layer.0.bias", "layer.1", "layer", "é", "x/y", "emb", "0"]
GOOD_PREFIXES = ["", "p", "layer", "q.r", "é"]
BAD_ARCHIVE_NAMES = ["", "a//b", "/lead", "trail/", ".", "..", "a/../b", "a\\b", "tab\tname", "nul\x00", "\x7f",
                     "x" * 1025, "ü" * 513]
BAD_ENTRY_NAMES = ["", "tab\t", "new\nline", "nul\x00", "\x1b[31m", "é" * 513, "y" * 1025]
BAD_PREFIXES = ["\t", "a\x00b", "p" * 1025]
NON_UTF8 = [b"\xff\xfe", b"a\xc3", b"\xed\xa0\x80", b"\xc0\xaf", b"ok\x80"]
BAD_DTYPES = ["float33", "", "FLOAT32", "int4", "\x00"]


def identity(data: bytes) -> bytes:
    return data


def field_bytes(number: int, value: bytes) -> bytes:
    """One length-delimited protobuf field (how names of any bytes are sent)."""
    return encode_varint(number << 3 | 2) + encode_varint(len(value)) + value


def begin_message(archive: str | bytes, replace: bool = False) -> bytes:
    name = archive.encode() if isinstance(archive, str) else archive
    inner = field_bytes(1, name) + (b"\x10\x01" if replace else b"")
    return field_bytes(1, inner)


def entry_message(name: str | bytes | None, chunk: bytes = b"") -> bytes:
    out = b""
    if name is not None:
        out += field_bytes(2, name.encode() if isinstance(name, str) else name)
    if chunk:
        out += field_bytes(3, chunk)
    return out


def commit_message(entries: int, payload_bytes: int) -> bytes:
    return pb.StoreRequest(commit=pb.StoreCommit(entries=entries, payload_bytes=payload_bytes)).SerializeToString()


def cut_points(rng: random.Random, size: int) -> list[int]:
    """Random chunk boundaries of a payload of ``size`` bytes: one chunk, a few, or many small
    ones, so headers are split anywhere."""
    style = rng.random()
    if size == 0 or style < 0.3:
        return [0, size]
    count = rng.randint(1, 4) if style < 0.8 else rng.randint(5, 40)
    inner = sorted(rng.sample(range(1, size), min(count, size - 1))) if size > 1 else []
    return [0, *inner, size]


def entry_messages(rng: random.Random, name: str | bytes, payload: bytes) -> list[bytes]:
    """An entry's messages: its name (with the first chunk, or alone) and its payload in random chunks."""
    points = cut_points(rng, len(payload))
    chunks = [payload[a:b] for a, b in zip(points, points[1:])]
    if rng.random() < 0.2:
        messages = [entry_message(name)] + [entry_message(None, c) for c in chunks]
    else:
        messages = [entry_message(name, chunks[0])] + [entry_message(None, c) for c in chunks[1:]]
    return messages


def mutate(rng: random.Random, payload: bytes) -> bytes:
    """``payload`` after one to three truncations, bit flips, byte sets, insertions or deletions."""
    data = bytearray(payload)
    for _ in range(rng.randint(1, 3)):
        at = rng.randint(0, len(data))
        kind = rng.choice(["truncate", "flip", "flip", "set", "insert", "delete"])
        if kind == "truncate":
            del data[at:]
        elif kind == "flip" and at < len(data):
            data[at] ^= 1 << rng.randint(0, 7)
        elif kind == "set" and at < len(data):
            data[at] = rng.randint(0, 255)
        elif kind == "insert":
            data[at:at] = rng.randbytes(rng.randint(1, 16))
        elif kind == "delete":
            del data[at : at + rng.randint(1, 16)]
    return bytes(data)


def hostile_header(rng: random.Random) -> bytes:
    """A tannic prefix with absurd numbers: rank up to 255, dims up to 2**64-1, any dcode,
    nbytes and header size, sometimes followed by a few bytes."""
    rank = rng.choice([0, 1, 2, 3, 64, 65, 200, 255, rng.randint(0, 255)])
    dims = [rng.choice([0, 1, 2, 3, 2**31, 2**32, 2**63, U64_MAX, rng.getrandbits(64)]) for _ in range(rank)]
    code = rng.choice([0, 1, 24, 35, 36, 99, 221, 255, rng.randint(0, 255)])
    nbytes = rng.choice([0, 4, U64_MAX, 2**63, rng.getrandbits(64), rng.randint(0, 4096)])
    consistent = codec.METADATA.size + codec.DIM.size * rank + (nbytes if nbytes < 2**40 else 0)
    after = rng.choice([consistent, 0, 17, U64_MAX, rng.getrandbits(64), consistent + 1])
    version = rng.choice([codec.VERSION] * 5 + [0, 2, 255])
    prefix = (codec.HEADER.pack(codec.MAGIC, version, rng.getrandbits(16), after)
              + codec.METADATA.pack(code, rng.getrandbits(64), nbytes, rank)
              + b"".join(codec.DIM.pack(d) for d in dims))
    if rng.random() < 0.3:
        prefix = prefix[: rng.randint(0, len(prefix))]
    return prefix + rng.randbytes(rng.choice([0, 0, 1, 8, 64]))


@dataclass
class Result:
    """How a call ended: its status code, details, and the response when OK."""

    code: grpc.StatusCode
    details: str = ""
    value: Any = None


def outcome(call: Callable[[], Any]) -> Result:
    """Run one call; its status (grpc.RpcError caught)."""
    try:
        return Result(grpc.StatusCode.OK, "", call())
    except grpc.RpcError as error:
        return Result(error.code(), error.details() or "")
    except grpc.FutureCancelledError:
        return Result(grpc.StatusCode.CANCELLED, "cancelled by the client")


def fetched_entries(responses: Iterable[pb.FetchResponse]) -> list[tuple[str, bytes]]:
    """A Fetch stream's entries in the order they came (names may repeat)."""
    out: list[tuple[str, bytearray]] = []
    for response in responses:
        if response.entry:
            out.append((response.entry, bytearray()))
        if response.chunk:
            assert out, "payload bytes before any entry name"
            out[-1][1].extend(response.chunk)
    return [(name, bytes(data)) for name, data in out]


@dataclass
class Tally:
    """What a fuzz run saw: statuses by code, answers that are bugs, and model violations."""

    seed: int
    codes: Counter = field(default_factory=Counter)
    kinds: Counter = field(default_factory=Counter)
    #: UNKNOWN or INTERNAL answers (a handler that raised) and hangs.
    bad: list[str] = field(default_factory=list)
    hangs: list[str] = field(default_factory=list)
    #: Outcomes that contradict the model (something stored that must not be, a valid call refused).
    violations: list[str] = field(default_factory=list)
    case: int = 0
    kind: str = ""

    def note(self, result: Result, timed_out_is_hang: bool = True) -> Result:
        self.codes[result.code.name] += 1
        where = f"seed {self.seed} case {self.case} ({self.kind})"
        if result.code in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL):
            self.bad.append(f"{where}: {result.code.name} {result.details[:300]!r}")
        if timed_out_is_hang and result.code is grpc.StatusCode.DEADLINE_EXCEEDED:
            self.hangs.append(f"{where}: no answer in {CALL_TIMEOUT} s")
        return result

    def violation(self, what: str) -> None:
        self.violations.append(f"seed {self.seed} case {self.case} ({self.kind}): {what}")

    def summary(self, cases: int, seconds: float) -> str:
        codes = " ".join(f"{code}={n}" for code, n in sorted(self.codes.items()))
        return (f"fuzz seed {self.seed}: {cases} cases, {sum(self.codes.values())} calls in {seconds:.1f} s; "
                f"{codes}; UNKNOWN/INTERNAL {len(self.bad)}, hangs {len(self.hangs)}, "
                f"violations {len(self.violations)}")


class ArchiveFuzzer:
    """Seeded cases against one server's Archives service, checked against a model of its store."""

    def __init__(self, channel: grpc.Channel, seed: int) -> None:
        self.rng = random.Random(seed)
        self.tally = Tally(seed)
        self.model: dict[str, dict[str, bytes]] = {}
        self.stub = archives_pb2_grpc.ArchivesStub(channel)
        self.store = channel.stream_unary(ARCHIVES + "Store", request_serializer=identity,
                                          response_deserializer=pb.ArchiveInfo.FromString)
        self.raw = {m: channel.unary_unary(ARCHIVES + m, request_serializer=identity, response_deserializer=identity)
                    for m in ("Union", "Fetch", "Describe", "List", "Delete", "Diff", "History")}
        self.raw_fetch = channel.unary_stream(ARCHIVES + "Fetch", request_serializer=identity,
                                              response_deserializer=pb.FetchResponse.FromString)
        #: Case kind -> (weight, method).
        self.kinds: dict[str, tuple[int, Callable[[], None]]] = {
            "store valid": (20, self.store_valid),
            "store mutated payload": (10, self.store_mutated),
            "store hostile header": (6, self.store_hostile),
            "store bad name": (7, self.store_bad_name),
            "store out of order": (9, self.store_out_of_order),
            "store cut off": (5, self.store_cut_off),
            "store cancelled": (4, self.store_cancelled),
            "store deadline": (1, self.store_deadline),
            "store oversized": (1, self.store_oversized),
            "store garbage": (4, self.store_garbage),
            "fetch": (12, self.fetch),
            "fetch cancelled": (2, self.fetch_cancelled),
            "describe": (5, self.describe),
            "list": (4, self.list),
            "union": (9, self.union),
            "delete": (5, self.delete),
            "unary garbage": (6, self.unary_garbage),
        }

    # -- running ---------------------------------------------------------------------------

    def run(self, cases: int) -> None:
        names = list(self.kinds)
        weights = [self.kinds[n][0] for n in names]
        for case in range(cases):
            kind = self.rng.choices(names, weights)[0]
            self.tally.case, self.tally.kind = case, kind
            self.tally.kinds[kind] += 1
            self.kinds[kind][1]()

    # -- helpers ---------------------------------------------------------------------------

    def archive_name(self) -> str:
        return self.rng.choice(ARCHIVE_POOL)

    def some_entries(self, low: int = 1, high: int = 4, max_bytes: int = 4096) -> list[tuple[str, bytes]]:
        names = self.rng.sample(ENTRY_POOL, self.rng.randint(low, high))
        big = self.rng.random() < 0.05
        return [(n, random_payload(self.rng, (256 << 10) if big else self.rng.choice([16, 256, max_bytes])))
                for n in names]

    def stream(self, archive: str | bytes, entries: Sequence[tuple[str | bytes, bytes]], replace: bool = False
               ) -> list[bytes]:
        """Begin, the entries in random chunks, no commit."""
        messages = [begin_message(archive, replace)]
        for name, payload in entries:
            messages += entry_messages(self.rng, name, payload)
            if self.rng.random() < 0.05:
                messages.append(b"")  # an empty message between entries: nothing in it
        return messages

    def send_store(self, messages: Iterable[bytes], timeout: float = CALL_TIMEOUT) -> Result:
        return self.tally.note(outcome(lambda: self.store(iter(messages), timeout=timeout)))

    def judge_store(self, result: Result, archive: str | bytes, entries: Sequence[tuple[str | bytes, bytes]],
                    replace: bool, may_succeed: bool, must_succeed: bool = False) -> None:
        """Update the model from a Store's answer, and note what contradicts it."""
        if result.code is grpc.StatusCode.OK:
            if not may_succeed:
                self.tally.violation(f"a Store that must fail answered OK: {archive!r}")
                return
            assert isinstance(archive, str)
            stored = {str(n): p for n, p in entries}
            if result.value.entries != len(stored) or result.value.name != archive:
                self.tally.violation(f"Store answered {result.value.name!r} of {result.value.entries} entries, "
                                     f"{len(stored)} were sent to {archive!r}")
            there = self.model.get(archive) if not replace else None
            if there is not None and (there != stored or not result.value.already_stored):
                self.tally.violation(f"a Store to existing {archive!r} answered OK (already_stored="
                                     f"{result.value.already_stored}) for {'the same' if there == stored else 'other'} "
                                     "content")
            self.model[archive] = stored
        elif must_succeed:
            # Without replace, only other content than the archive there is refused.
            exists = (result.code is grpc.StatusCode.ALREADY_EXISTS and not replace and archive in self.model
                      and self.model[archive] != {str(n): p for n, p in entries})
            if not exists:
                self.tally.violation(f"a valid Store of {archive!r} was refused: {result.code.name} "
                                     f"{result.details[:200]!r}")

    # -- Store -----------------------------------------------------------------------------

    def store_valid(self) -> None:
        archive, replace = self.archive_name(), self.rng.random() < 0.6
        entries = self.some_entries(0 if self.rng.random() < 0.05 else 1)
        messages = self.stream(archive, entries, replace)
        messages.append(commit_message(len(entries), sum(len(p) for _, p in entries)))
        self.judge_store(self.send_store(messages), archive, entries, replace, True, True)

    def store_mutated(self) -> None:
        """One payload truncated, bit-flipped or spliced; the counts agree with what is sent.
        A mutation that leaves a valid payload may be stored: the model takes what was sent."""
        archive, replace = self.archive_name(), True
        entries = self.some_entries()
        index = self.rng.randrange(len(entries))
        entries[index] = (entries[index][0], mutate(self.rng, entries[index][1]))
        messages = self.stream(archive, entries, replace)
        messages.append(commit_message(len(entries), sum(len(p) for _, p in entries)))
        self.judge_store(self.send_store(messages), archive, entries, replace, True)

    def store_hostile(self) -> None:
        archive = self.archive_name()
        entries = self.some_entries(1, 2)
        entries.insert(self.rng.randint(0, len(entries)), ("hostile", hostile_header(self.rng)))
        messages = self.stream(archive, entries, True)
        messages.append(commit_message(len(entries), sum(len(p) for _, p in entries)))
        self.judge_store(self.send_store(messages), archive, entries, True, True)

    def store_bad_name(self) -> None:
        """Bad archive names, bad or non-UTF-8 entry names, an entry named twice: all refused."""
        entries: list[tuple[str | bytes, bytes]] = list(self.some_entries(1, 3))
        archive: str | bytes = self.archive_name()
        choice = self.rng.randrange(5)
        if choice == 0:
            archive = self.rng.choice(BAD_ARCHIVE_NAMES)
        elif choice == 1:
            archive = self.rng.choice(NON_UTF8)
        elif choice == 2:
            bad = self.rng.choice(BAD_ENTRY_NAMES)
            entries.insert(self.rng.randint(0, len(entries)), (bad, random_payload(self.rng)))
        elif choice == 3:
            entries.insert(self.rng.randint(0, len(entries)), (self.rng.choice(NON_UTF8), random_payload(self.rng)))
        else:
            twin = self.rng.choice(entries)[0]
            entries.insert(self.rng.randint(0, len(entries)), (twin, random_payload(self.rng)))
        messages = self.stream(archive, entries, True)
        messages.append(commit_message(len(entries), sum(len(p) for _, p in entries)))
        self.judge_store(self.send_store(messages), archive, entries, True, False)

    def store_out_of_order(self) -> None:
        """Messages in an order the protocol forbids, or a commit whose counts are wrong."""
        archive = self.archive_name()
        entries = self.some_entries(1, 3)
        body = self.stream(archive, entries, True)
        count, total = len(entries), sum(len(p) for _, p in entries)
        commit = commit_message(count, total)
        payload = random_payload(self.rng)
        variants: list[Callable[[], list[bytes]]] = [
            lambda: body[1:] + [body[0], commit],                                   # entry before begin
            lambda: [body[0]] + body[1:] + [begin_message(archive, True), commit],  # begin twice
            lambda: [body[0], entry_message(None, payload)] + body[1:] + [commit],  # chunk before entry
            lambda: body + [commit, entry_message("late", payload)],                # an entry after commit
            lambda: body + [commit, commit],                                        # commit twice
            lambda: body + [commit, begin_message(archive)],                        # begin after commit
            lambda: body + [commit_message(count + self.rng.choice([-1, 1, 2**63]), total)],
            lambda: body + [commit_message(count, total + self.rng.choice([-1, 1, 2**40]))],
            lambda: body + [commit_message(count, total)[:-1] + entry_message("c", payload)],  # commit not alone
            lambda: body + [entry_message("empty"), commit_message(count + 1, total)],  # an entry with no payload
            lambda: body + [entry_message(None, payload), commit_message(count, total + len(payload))],  # two payloads
            lambda: [commit],                                                       # no begin at all
            lambda: [],                                                             # nothing at all
            lambda: [pb.StoreRequest(begin=pb.StoreBegin(archive=archive), commit=pb.StoreCommit()).SerializeToString()]
            + body[1:] + [commit],                                                  # begin and commit together
        ]
        messages = self.rng.choice(variants)()
        self.judge_store(self.send_store(messages), archive, entries, True, False)

    def store_cut_off(self) -> None:
        """A stream that ends without commit, at an entry boundary or mid-entry."""
        archive = self.archive_name()
        entries = self.some_entries(1, 3)
        messages = self.stream(archive, entries, True)
        cut = self.rng.randint(1, len(messages))
        self.judge_store(self.send_store(messages[:cut]), archive, entries, True, False)

    def _stalled(self, messages: list[bytes], sent: threading.Event, release: threading.Event) -> Iterator[bytes]:
        yield from messages
        sent.set()
        release.wait(CALL_TIMEOUT)

    def store_cancelled(self) -> None:
        """The client cancels the call after some of the messages (at an entry boundary or mid-entry)."""
        archive = self.archive_name()
        entries = self.some_entries(1, 3)
        messages = self.stream(archive, entries, True)
        if self.rng.random() < 0.3:
            messages.append(commit_message(len(entries), sum(len(p) for _, p in entries) + 1))  # wrong: never OK
        cut = self.rng.randint(1, len(messages))
        sent, release = threading.Event(), threading.Event()
        future = self.store.future(self._stalled(messages[:cut], sent, release), timeout=CALL_TIMEOUT)
        sent.wait(CALL_TIMEOUT)
        time.sleep(self.rng.choice([0, 0.001, 0.01]))
        future.cancel()
        release.set()
        result = self.tally.note(outcome(future.result))
        self.judge_store(result, archive, entries, True, False)

    def store_deadline(self) -> None:
        """A Store whose deadline passes while the client waits mid-stream."""
        archive = self.archive_name()
        entries = self.some_entries(1, 2)
        messages = self.stream(archive, entries, True)
        cut = self.rng.randint(1, len(messages))
        sent, release = threading.Event(), threading.Event()
        future = self.store.future(self._stalled(messages[:cut], sent, release), timeout=0.2)
        result = outcome(future.result)
        release.set()
        self.tally.note(result, timed_out_is_hang=False)
        self.judge_store(result, archive, entries, True, False)

    def store_oversized(self) -> None:
        """A message over gRPC's 4 MiB receive limit, first or after a whole entry."""
        archive = self.archive_name()
        entries = self.some_entries(1, 2)
        over = entry_message("big", bytes(5 << 20))
        messages = self.stream(archive, entries, True)
        messages.insert(self.rng.randint(1, len(messages)), over)
        messages.append(commit_message(len(entries), sum(len(p) for _, p in entries)))
        self.judge_store(self.send_store(messages), archive, entries, True, False)

    def store_garbage(self) -> None:
        """Begin, then messages of random bytes (undecodable or of stray fields). Bytes that
        decode to unknown fields only are empty messages, as protobuf has it: with a commit
        of nothing, an empty archive may be stored, but never an entry."""
        archive = self.archive_name()
        messages = [begin_message(archive, True)]
        for _ in range(self.rng.randint(1, 4)):
            messages.append(self.rng.randbytes(self.rng.randint(1, 48)))
        if self.rng.random() < 0.5:
            messages.append(commit_message(0, 0))
        self.judge_store(self.send_store(messages), archive, [], True, True)

    # -- Fetch -----------------------------------------------------------------------------

    def entry_ask(self, entries: dict[str, bytes]) -> tuple[pb.EntryAsk, bool]:
        """An ask of a random name of the archive (or not), with a right or wrong shape, dtype,
        cast and rows; and whether it is plain (answered by the stored bytes themselves)."""
        names = list(entries) or ENTRY_POOL
        name = self.rng.choice(names) if self.rng.random() < 0.8 else self.rng.choice(ENTRY_POOL + BAD_ENTRY_NAMES)
        ask = pb.EntryAsk(name=name)
        info = codec.read_info(entries[name]) if name in entries else None
        plain = True
        if self.rng.random() < 0.25:
            dims = list(info.shape) if info is not None and self.rng.random() < 0.6 else \
                [self.rng.choice([0, 1, 3, U64_MAX]) for _ in range(self.rng.randint(0, 3))]
            ask.shape.dims.extend(dims)
        if self.rng.random() < 0.25:
            ask.dtype = info.dtype.name if info is not None and self.rng.random() < 0.6 else \
                self.rng.choice([*BAD_DTYPES, *codec.FLOAT_NAMES])
        if self.rng.random() < 0.15:
            ask.cast = self.rng.choice([*codec.FLOAT_NAMES, "int8", "bool", *BAD_DTYPES])
            plain = False
        if self.rng.random() < 0.2:
            start = self.rng.choice([0, 1, 2, 5, U64_MAX, self.rng.getrandbits(64)])
            stop = self.rng.choice([start, start + 1, start + 3, 0, U64_MAX]) if start < U64_MAX else U64_MAX
            ask.rows.start, ask.rows.stop = start, min(stop, U64_MAX)
            plain = False
        return ask, plain

    def fetch(self) -> None:
        archive = self.archive_name() if self.rng.random() < 0.9 else self.rng.choice(BAD_ARCHIVE_NAMES)
        entries = self.model.get(archive, {})
        request = pb.FetchRequest(archive=archive)
        plain = True
        style = self.rng.random()
        if style < 0.25:
            request.prefix = self.rng.choice(ENTRY_POOL + ["layer.0", "lay", "", "nope"] + BAD_PREFIXES)
        elif style < 0.9:
            for _ in range(self.rng.randint(1, 4)):
                ask, ask_plain = self.entry_ask(entries)
                request.entries.append(ask)
                plain = plain and ask_plain
        if self.rng.random() < 0.1:
            data = request.SerializeToString()
            result = self.tally.note(outcome(lambda: fetched_entries(self.raw_fetch(mutate(self.rng, data),
                                                                                    timeout=CALL_TIMEOUT))))
            return
        result = self.tally.note(outcome(lambda: fetched_entries(self.stub.Fetch(request, timeout=CALL_TIMEOUT))))
        self.check_fetch(request, entries, plain, result)

    def check_fetch(self, request: pb.FetchRequest, entries: dict[str, bytes], plain: bool, result: Result) -> None:
        """An OK Fetch gives what the model holds; a plain Fetch of what is there must be OK."""
        if request.archive not in self.model:
            if result.code is grpc.StatusCode.OK:
                self.tally.violation(f"Fetch of {request.archive!r}, not stored, answered OK")
            return
        asks = list(request.entries)
        if not asks:
            wanted = sorted(n for n in entries if owns(request.prefix, n))
            expected = [(n, entries[n]) for n in wanted]
            if result.code is grpc.StatusCode.NOT_FOUND and not wanted:
                return  # a prefix that owns no entry is NOT_FOUND
            if result.code is not grpc.StatusCode.OK:
                if not any(c in request.prefix for c in "\t\x00") and len(request.prefix) <= 1024:
                    self.tally.violation(f"Fetch by prefix {request.prefix!r} refused: {result.code.name} "
                                         f"{result.details[:200]!r}")
            elif result.value != expected:
                self.tally.violation(f"Fetch by prefix {request.prefix!r} of {request.archive!r} gave "
                                     f"{[n for n, _ in result.value]}, expected {wanted}")
            return
        answerable = plain and all(a.name in entries for a in asks) and all(
            (not a.HasField("shape") or tuple(a.shape.dims) == codec.read_info(entries[a.name]).shape)
            and (not a.dtype or a.dtype == codec.read_info(entries[a.name]).dtype.name) for a in asks)
        if result.code is not grpc.StatusCode.OK:
            if answerable:
                self.tally.violation(f"a Fetch of stored entries was refused: {result.code.name} "
                                     f"{result.details[:200]!r}")
            return
        if not all(a.name in entries for a in asks):
            self.tally.violation(f"a Fetch of a missing entry answered OK: {[a.name for a in asks]}")
            return
        if [n for n, _ in result.value] != [a.name for a in asks]:
            self.tally.violation(f"Fetch gave {[n for n, _ in result.value]}, asked {[a.name for a in asks]}")
            return
        for ask, (name, payload) in zip(asks, result.value):
            if not ask.cast and not ask.HasField("rows"):
                if payload != entries[name]:
                    self.tally.violation(f"Fetch of {request.archive!r}/{name!r}: bytes differ from those stored")
                continue
            try:
                info = codec.parse(payload)
            except codec.FormatError as exc:
                self.tally.violation(f"Fetch of {name!r} (cast/rows) gave a malformed payload: {exc}")
                continue
            if ask.cast and info.dtype.name != ask.cast:
                self.tally.violation(f"Fetch of {name!r} cast to {ask.cast} gave {info.dtype.name}")
            if ask.HasField("rows") and info.shape and info.shape[0] > ask.rows.stop - ask.rows.start:
                self.tally.violation(f"Fetch of {name!r} rows {ask.rows} gave {info.shape[0]} rows")

    def fetch_cancelled(self) -> None:
        """A Fetch the client cancels after a few messages."""
        archive = self.archive_name()
        call = self.stub.Fetch(pb.FetchRequest(archive=archive), timeout=CALL_TIMEOUT)
        try:
            for _ in range(self.rng.randint(0, 3)):
                next(call, None)
        except grpc.RpcError:
            pass
        call.cancel()
        self.tally.note(outcome(lambda: list(call)))

    # -- Describe, List, Union, Delete -----------------------------------------------------

    def describe(self) -> None:
        style = self.rng.random()
        if style < 0.15:
            data = field_bytes(1, self.rng.choice(NON_UTF8))
            self.tally.note(outcome(lambda: self.raw["Describe"](data, timeout=CALL_TIMEOUT)))
            return
        archive = self.archive_name() if style < 0.85 else self.rng.choice(BAD_ARCHIVE_NAMES)
        result = self.tally.note(outcome(lambda: self.stub.Describe(pb.DescribeRequest(archive=archive),
                                                                    timeout=CALL_TIMEOUT)))
        if archive in self.model:
            expected = {n: digest(p) for n, p in self.model[archive].items()}
            if result.code is not grpc.StatusCode.OK:
                self.tally.violation(f"Describe of stored {archive!r}: {result.code.name}")
            elif {e.name: e.digest for e in result.value.entries} != expected:
                self.tally.violation(f"Describe of {archive!r}: entries differ from those stored")
        elif result.code is grpc.StatusCode.OK:
            self.tally.violation(f"Describe of {archive!r}, not stored, answered OK")

    def list(self) -> None:
        prefix = self.rng.choice(["", "fuzz/", "model", "ü", "zz", "\x00", "a" * 2000])
        page_size = self.rng.choice([0, 1, 2, 3, 1000, 2**32 - 1])
        token = self.rng.choice(["", "", "garbage", "djE6", "dj", "!!!", "v1:x", "djE6ZnV6ei9i"])
        request = pb.ListRequest(prefix=prefix, page_size=page_size, page_token=token)
        result = self.tally.note(outcome(lambda: self.stub.List(request, timeout=CALL_TIMEOUT)))
        if result.code is grpc.StatusCode.OK:
            for info in result.value.archives:
                if info.name not in self.model or not info.name.startswith(prefix):
                    self.tally.violation(f"List({prefix!r}) listed {info.name!r}, not stored whole under it")
                elif info.entries != len(self.model[info.name]):
                    self.tally.violation(f"List listed {info.name!r} with {info.entries} entries, "
                                         f"{len(self.model[info.name])} stored")
        elif not token and "\x00" not in prefix and len(prefix) < 1024:
            self.tally.violation(f"List({prefix!r}, {page_size}) refused: {result.code.name} {result.details!r}")

    def union(self) -> None:
        target = self.archive_name() if self.rng.random() < 0.9 else self.rng.choice(BAD_ARCHIVE_NAMES)
        sources = []
        for _ in range(self.rng.choice([0, 1, 1, 2, 2, 3])):
            archive = self.archive_name() if self.rng.random() < 0.92 else self.rng.choice(BAD_ARCHIVE_NAMES)
            prefix = self.rng.choice(GOOD_PREFIXES) if self.rng.random() < 0.92 else self.rng.choice(BAD_PREFIXES)
            sources.append((archive, prefix))
        replace = self.rng.random() < 0.6
        request = pb.UnionRequest(target=target, replace=replace,
                                  sources=[pb.UnionSource(archive=a, prefix=p) for a, p in sources])
        result = self.tally.note(outcome(lambda: self.stub.Union(request, timeout=CALL_TIMEOUT)))
        expected = self.union_of(target, sources, replace)
        if result.code is grpc.StatusCode.OK:
            if expected is None:
                self.tally.violation(f"a Union that must fail answered OK: {target!r} <- {sources}")
                return
            if result.value.entries != len(expected):
                self.tally.violation(f"Union {target!r} answered {result.value.entries} entries, {len(expected)} due")
            if result.value.already_stored != (target in self.model and not replace):
                self.tally.violation(f"Union {target!r} answered already_stored={result.value.already_stored}")
            self.model[target] = expected
        elif expected is not None:
            self.tally.violation(f"a valid Union {target!r} <- {sources} (replace={replace}) was refused: "
                                 f"{result.code.name} {result.details[:200]!r}")

    def union_of(self, target: str, sources: list[tuple[str, str]], replace: bool) -> dict[str, bytes] | None:
        """What a Union must make of the model, or None when it must fail (without ``replace``, an
        existing target must already hold exactly what it makes: then it is OK, flagged)."""
        if target not in ARCHIVE_POOL:
            return None
        merged: dict[str, bytes] = {}
        for archive, prefix in sources:
            if archive not in self.model or prefix not in GOOD_PREFIXES:
                return None
            for name, payload in self.model[archive].items():
                joined = join(prefix, name)
                if joined in merged:
                    return None
                merged[joined] = payload
        if target in self.model and not replace and self.model[target] != merged:
            return None
        return merged

    def delete(self) -> None:
        style = self.rng.random()
        if style < 0.1:
            data = field_bytes(1, self.rng.choice(NON_UTF8))
            self.tally.note(outcome(lambda: self.raw["Delete"](data, timeout=CALL_TIMEOUT)))
            return
        archive = self.archive_name() if style < 0.9 else self.rng.choice(BAD_ARCHIVE_NAMES)
        result = self.tally.note(outcome(lambda: self.stub.Delete(pb.DeleteRequest(archive=archive),
                                                                  timeout=CALL_TIMEOUT)))
        if result.code is grpc.StatusCode.OK:
            if archive not in self.model:
                self.tally.violation(f"Delete of {archive!r}, not stored, answered OK")
            self.model.pop(archive, None)
        elif archive in self.model:
            self.tally.violation(f"Delete of stored {archive!r} refused: {result.code.name} {result.details!r}")

    def unary_garbage(self) -> None:
        """Random bytes as the request of a unary RPC; those that would decode to a mutating
        request get an undecodable tail (a length-delimited field cut short)."""
        method = self.rng.choice(["Union", "Fetch", "Describe", "List", "Delete", "Diff", "History"])
        data = self.rng.randbytes(self.rng.randint(0, 64))
        if self.rng.random() < 0.3:
            data = mutate(self.rng, pb.UnionRequest(target="fuzz/a", sources=[pb.UnionSource(archive="fuzz/b")])
                          .SerializeToString() if method == "Union" else field_bytes(1, b"fuzz/a"))
        if method in ("Union", "Delete"):
            data += b"\x0a\xff"
        if method == "Fetch":
            self.tally.note(outcome(lambda: list(self.raw_fetch(data, timeout=CALL_TIMEOUT))))
        else:
            self.tally.note(outcome(lambda: self.raw[method](data, timeout=CALL_TIMEOUT)))


def health_status(channel: grpc.Channel) -> int:
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=30).status


@pytest.mark.slow  # thousands of cases: a minute or more
def test_fuzz_archives_against_one_server(tmp_path, record_property):
    """Thousands of seeded cases; no UNKNOWN/INTERNAL, no hang, nothing partial, nothing leaked."""
    started = time.monotonic()
    with running_server(tmp_path) as srv:
        channel = srv.channel()
        fuzzer = ArchiveFuzzer(channel, SEED)
        fuzzer.run(CASES)
        tally = fuzzer.tally
        assert health_status(channel) == health_pb2.HealthCheckResponse.SERVING
        problems: list[str] = []

        def consistent() -> bool:
            problems[:] = store_problems(fuzzer.stub, srv.data_dir, fuzzer.model)
            return not problems

        wait_for(consistent, timeout=30, interval=0.2)
    bad_blobs = scrub(tmp_path / "data")
    summary = tally.summary(CASES, time.monotonic() - started) + f"; {len(fuzzer.model)} archives at the end"
    print("\n" + summary)
    record_property("fuzz_summary", summary)
    record_property("fuzz_kinds", dict(tally.kinds))
    context = f"(seed {SEED}; rerun with TANNERY_FUZZ_SEED={SEED} TANNERY_FUZZ_CASES={CASES}) {summary}"
    assert not tally.bad, f"UNKNOWN/INTERNAL answers {context}:\n" + "\n".join(tally.bad[:30])
    assert not tally.hangs, f"hangs {context}:\n" + "\n".join(tally.hangs[:30])
    assert not tally.violations, f"model violations {context}:\n" + "\n".join(tally.violations[:30])
    assert not problems, f"store inconsistent with the model after the run {context}:\n" + "\n".join(problems)
    assert not bad_blobs, f"scrub found {len(bad_blobs)} bad blobs {context}"
    assert tally.codes["OK"] > CASES // 10 and len(tally.codes) >= 5, f"the run exercised too little: {summary}"


class Records(logging.Handler):
    """Messages of the log records a logger emits."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_a_cancelled_store_leaves_no_unretrieved_task_exception(tmp_path):
    """What the fuzzer's cancelled Stores showed: the server's log stays free of asyncio errors."""
    records = Records()
    logging.getLogger("asyncio").addHandler(records)
    try:
        with running_server(tmp_path) as srv:
            store = srv.channel().stream_unary(ARCHIVES + "Store", request_serializer=identity,
                                               response_deserializer=pb.ArchiveInfo.FromString)
            rng = random.Random(SEED)
            for _ in range(5):
                sent, release = threading.Event(), threading.Event()
                payload = random_payload(rng, 1024, "float32")
                messages = [begin_message("cancelled"), entry_message("w", payload[:40])]

                def stalled() -> Iterator[bytes]:
                    yield from messages
                    sent.set()
                    release.wait(CALL_TIMEOUT)

                future = store.future(stalled(), timeout=CALL_TIMEOUT)
                assert sent.wait(CALL_TIMEOUT)
                time.sleep(0.05)
                future.cancel()
                release.set()
            assert wait_for(lambda: not srv.storage._pins and not temporary_files(srv.data_dir))
            gc.collect()  # asyncio reports an unretrieved exception when its task is collected
            time.sleep(0.2)
    finally:
        logging.getLogger("asyncio").removeHandler(records)
    assert not [m for m in records.messages if "never retrieved" in m], records.messages[:3]


# -- Channels: malformed Publish only (the service is being rewritten) ----------------------


def publish_message(channel: str | bytes | None, chunk: bytes) -> bytes:
    out = b""
    if channel is not None:
        out += field_bytes(1, channel.encode() if isinstance(channel, str) else channel)
    if chunk:
        out += field_bytes(2, chunk)
    return out


def malformed_publish(rng: random.Random, case: int, undecodable: bool) -> list[bytes]:
    """A Publish stream with something wrong: its channel name or its payloads (``undecodable``:
    also names that are not UTF-8 and messages of random bytes, which protobuf cannot decode)."""
    names: list[str | bytes] = [f"fuzz-{case % 7}", "", "tab\t", "n\x00", "c" * 300, f"fuzz-{case % 5}"]
    channel: str | bytes = rng.choice(names + (NON_UTF8 if undecodable else []))
    payloads = [random_payload(rng, rng.choice([16, 512, 4096])) for _ in range(rng.randint(0, 3))]
    bad = rng.choice(["truncate", "mutate", "hostile", "garbage", "none"])
    if bad == "truncate" and payloads:
        payloads[-1] = payloads[-1][: rng.randrange(len(payloads[-1]))]
    elif bad == "mutate" and payloads:
        index = rng.randrange(len(payloads))
        payloads[index] = mutate(rng, payloads[index])
    elif bad == "hostile":
        payloads.insert(rng.randint(0, len(payloads)), hostile_header(rng))
    elif bad == "garbage":
        payloads.insert(rng.randint(0, len(payloads)), rng.randbytes(rng.randint(1, 64)))
    stream = b"".join(payloads)
    points = cut_points(rng, len(stream))
    chunks = [stream[a:b] for a, b in zip(points, points[1:])] or [b""]
    messages = [publish_message(channel, chunks[0])] + [publish_message(None, c) for c in chunks[1:]]
    extra = rng.random()
    if extra < 0.1:
        messages.insert(rng.randint(1, len(messages)), publish_message("another", b""))
    elif extra < 0.15:
        messages = []
    elif extra < 0.35 and undecodable:
        messages.insert(rng.randint(0, len(messages)), rng.randbytes(rng.randint(1, 32)) + b"\x0a\xff")
    return messages


def fuzz_publish(tmp_path, undecodable: bool) -> Tally:
    """Malformed Publish streams against one server, which must then still be serving."""
    rng = random.Random(SEED + undecodable)
    tally = Tally(SEED)
    started = time.monotonic()
    with running_server(tmp_path) as srv:
        channel = srv.channel()
        publish = channel.stream_unary(CHANNELS + "Publish", request_serializer=identity,
                                       response_deserializer=channels_pb2.PublishResponse.FromString)
        for case in range(PUBLISH_CASES):
            tally.case, tally.kind = case, "publish"
            messages = malformed_publish(rng, case, undecodable)
            tally.note(outcome(lambda: publish(iter(messages), timeout=CALL_TIMEOUT)))
        assert health_status(channel) == health_pb2.HealthCheckResponse.SERVING
        assert srv.archives().List(pb.ListRequest(), timeout=30).archives == []
    summary = tally.summary(PUBLISH_CASES, time.monotonic() - started)
    print("\n" + summary)
    assert not tally.hangs, f"hangs (seed {SEED}) {summary}:\n" + "\n".join(tally.hangs[:30])
    return tally


def test_fuzz_publish_with_malformed_payloads(tmp_path, record_property):
    """Malformed payloads and bad (UTF-8) channel names: never UNKNOWN/INTERNAL, no hang, server alive."""
    tally = fuzz_publish(tmp_path, undecodable=False)
    record_property("fuzz_publish_summary", tally.summary(PUBLISH_CASES, 0))
    assert not tally.bad, f"UNKNOWN/INTERNAL answers (seed {SEED}):\n" + "\n".join(tally.bad[:30])
    assert tally.codes["INVALID_ARGUMENT"] > PUBLISH_CASES // 4


def test_fuzz_publish_with_undecodable_requests(tmp_path):
    """Channel names that are not UTF-8 and messages of random bytes: INVALID_ARGUMENT, never UNKNOWN."""
    tally = fuzz_publish(tmp_path, undecodable=True)
    assert not tally.bad, f"UNKNOWN/INTERNAL answers (seed {SEED}):\n" + "\n".join(tally.bad[:30])
