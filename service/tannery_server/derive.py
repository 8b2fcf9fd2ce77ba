"""Derive: an archive built on the server from an existing one (its base) and per-entry changes,
so that a client sends only what changed (weight sync stores each version so).

A :class:`DeriveSession` is a :class:`~.store_session.StoreSession` fed by the changes: a SAME
entry is the base's entry, its blob reused (:meth:`StoreSession.reuse_entry`, no byte read);
a WHOLE entry's payload is written to the session as Store writes one; a DELTA entry's two
payloads (flat indices, new bits) are applied to the base entry's payload, read through the
block reader every Fetch reads with (:class:`~.dataplane.blocks.VerifiedBlob`), then checked
against the CRC-32C the client sent, and written to the session as if it had come whole. The
codec's checks, hashing, dedup and the whole-or-nothing commit are thus Store's own. One entry's
bytes are in memory at a time at most. The base's blobs are held (pinned) from ``begin`` until
the archive is committed or the call fails.

Plain calls, made on a worker thread one at a time, as a Store session's.
"""

from __future__ import annotations

from collections.abc import Mapping

import crc32c
import numpy as np

from tannery_protocol.codec import DTYPES, FormatError, buffer_to_numpy, parse
from tannery_protocol.v1 import archives_pb2

from .config import Config
from .dataplane.blocks import VerifiedBlob
from .failures import BadPayload, LimitExceeded, Malformed, Missing
from .fetching import Plan, gone_while_read
from .storage import ArchiveRecord, EntryRecord, Storage
from .store_session import StoreSession

Change = archives_pb2.DeriveEntry
#: The integer dtype of the bits a delta sets, by element width (wider elements: int64 pieces).
BITS = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}
INDEX_DTYPES = ("int32", "int64")


class DeriveSession:
    """One Derive call: ``begin`` (the base looked up and held), then each message, then
    ``finish`` (the archive committed) or ``abort`` (nothing stored)."""

    def __init__(self, storage: Storage, config: Config, archive: str, base: str, replace: bool,
                 metadata: Mapping[str, str] | None = None) -> None:
        self.storage = storage
        self.config = config
        self.archive = archive
        self.base = base
        self.session = StoreSession(storage, config, archive, replace, metadata)
        self.base_entries: dict[str, EntryRecord] = {}
        self._held: list[str] | None = None
        #: The entry under way: its message, and the bytes of its payloads so far.
        self._entry: archives_pb2.DeriveEntry | None = None
        self._received = 0
        self._buffer: bytearray | None = None
        self.committed = False

    @property
    def stored(self) -> bool:
        return self.session.stored

    def _what(self, name: str) -> str:
        return f"Derive of {self.archive!r} from {self.base!r}: entry {name!r}"

    def begin(self) -> None:
        """Refuse what Store refuses at ``begin`` (an alias's name, other metadata under the name),
        then find the base (an alias resolved once) and hold its blobs."""
        self.session.check_existing()
        catalog = self.storage.catalog

        def lookup() -> tuple[ArchiveRecord, list[EntryRecord]]:
            record = catalog.lookup(self.base)
            if record is None:
                raise Missing(f"Derive of {self.archive!r}: base archive {self.base!r} not found")
            entries = catalog.entries_under(record.name, "")
            if not entries and record.entries:
                raise gone_while_read(self.base, record.name)
            return record, entries

        _record, entries = self.storage.pinned(lookup, lambda found: [e.blob for e in found[1]])
        self._held = [e.blob for e in entries]
        self.base_entries = {e.name: e for e in entries}

    def message(self, message: archives_pb2.DeriveRequest, first: bool) -> None:
        """One message of the call, as the session's calls."""
        if self.committed:
            raise Malformed("a message after commit: commit must be the last message of Derive")
        if message.HasField("commit"):
            if message.HasField("begin") or message.HasField("entry") or message.chunk:
                raise Malformed("commit must come alone, in the last message of Derive")
            self.commit(message.commit.entries)
            return
        if message.HasField("begin") and not first:
            raise Malformed("begin is allowed in the first message of Derive only")
        if message.HasField("entry"):
            self.begin_entry(message.entry)
        if message.chunk:
            self.write(memoryview(message.chunk))

    def begin_entry(self, entry: archives_pb2.DeriveEntry) -> None:
        self._end_entry()
        name, what = entry.name, self._what(entry.name)
        sizes = list(entry.payload_bytes)
        wanted = {Change.SAME: 0, Change.DELTA: 2, Change.WHOLE: 1}.get(entry.change)
        if wanted is None:
            raise Malformed(f"{what}: change {entry.change} is not SAME, DELTA or WHOLE")
        if len(sizes) != wanted:
            raise Malformed(f"{what}: a {Change.Change.Name(entry.change)} entry has {wanted} payloads; "
                            f"payload_bytes gives {len(sizes)}")
        for size in sizes:
            if size > self.config.max_payload_bytes:
                raise LimitExceeded(f"{what}: payload of {size} bytes is over the limit of "
                                    f"{self.config.max_payload_bytes} bytes")
        base = self.base_entries.get(name)
        if entry.change != Change.WHOLE and base is None:
            raise Missing(f"{what}: the base has no entry {name!r} (a {Change.Change.Name(entry.change)} entry "
                          f"is taken from the base's entry of the same name; the base has {len(self.base_entries)} "
                          "entries)")
        self._entry, self._received, self._buffer = entry, 0, None
        if entry.change == Change.SAME:
            self.session.reuse_entry(base, self.base)
            return
        self.session.begin_entry(name)
        if entry.change == Change.DELTA:
            self._buffer = bytearray()

    def write(self, data: memoryview) -> None:
        entry = self._entry
        if entry is None:
            raise Malformed(f"Derive of {self.archive!r}: payload bytes before any entry")
        declared = sum(entry.payload_bytes)
        if self._received + data.nbytes > declared:
            raise BadPayload(f"{self._what(entry.name)}: more than the {declared} payload bytes its "
                             f"payload_bytes ({', '.join(map(str, entry.payload_bytes)) or 'none'}) announced")
        self._received += data.nbytes
        if self._buffer is not None:
            self._buffer += data
        else:
            self.session.write(data)

    def _end_entry(self) -> None:
        """The entry under way is whole: a DELTA's result written to the session."""
        entry, self._entry = self._entry, None
        if entry is None:
            return
        declared = sum(entry.payload_bytes)
        if self._received != declared:
            raise BadPayload(f"{self._what(entry.name)}: {self._received} of the {declared} payload bytes "
                             "announced arrived")
        if entry.change != Change.DELTA:
            return
        buffer, self._buffer = self._buffer, None
        assert buffer is not None
        split = entry.payload_bytes[0]
        base = self.base_entries[entry.name]
        payload = self._base_payload(base)
        apply_delta(self._what(entry.name), base, payload, memoryview(buffer)[:split], memoryview(buffer)[split:],
                    entry.crc32c)
        del buffer
        self.session.write(memoryview(payload))

    def _base_payload(self, entry: EntryRecord) -> bytearray:
        """The base entry's whole payload, read in checked blocks, as a Fetch reads it."""
        plan = Plan(entry, None, 0, entry.payload_bytes, DTYPES[entry.dtype])
        payload = bytearray(entry.payload_bytes)
        at = 0
        with VerifiedBlob(self.storage, plan) as blob:
            for piece in blob.blocks(0, entry.payload_bytes):
                payload[at : at + piece.nbytes] = piece
                at += piece.nbytes
        return payload

    def commit(self, entries: int) -> None:
        self._end_entry()
        if entries != self.session.entries:
            raise Malformed(f"Derive of {self.archive!r}: commit says {entries} entries were sent, but "
                            f"{self.session.entries} arrived: nothing was stored")
        self.session.commit(self.session.entries, self.session.bytes_received)
        self.committed = True

    def finish(self) -> ArchiveRecord:
        if not self.committed:
            raise Malformed(f"Derive of {self.archive!r} ended without commit, after {self.session.entries} "
                            "entries: nothing was stored (a client that sent everything sends commit last)")
        try:
            return self.session.finish()
        finally:
            self._release()

    def abort(self) -> None:
        try:
            self.session.abort()
        finally:
            self._release()

    def _release(self) -> None:
        held, self._held = self._held, None
        if held:
            self.storage.release(held)


def apply_delta(what: str, base: EntryRecord, payload: bytearray, indices_payload: memoryview,
                values_payload: memoryview, crc: int) -> None:
    """Set the elements ``indices_payload`` names of the base's ``payload`` (in place) to the bits
    of ``values_payload``, then check the CRC-32C of the new buffer is ``crc``; Malformed naming
    ``what`` and the numbers otherwise."""
    dtype = DTYPES[base.dtype]
    indices, values = (_array(what, name, part) for name, part in (("indices", indices_payload),
                                                                     ("values", values_payload)))
    width = min(dtype.itemsize, 8)
    bits = "uint8" if dtype.is_bool else BITS[width]
    count = int(np.prod(base.shape, dtype=np.int64)) if dtype.is_bool else base.nbytes // width
    if indices.dtype.name not in INDEX_DTYPES or indices.ndim != 1:
        raise Malformed(f"{what}: delta indices are {_described(indices)}; they are int32 or int64, 1-D")
    if values.dtype.name != bits or values.ndim != 1:
        raise Malformed(f"{what}: delta values are {_described(values)}; for {base.dtype} they are {bits}, 1-D")
    if indices.size != values.size:
        raise Malformed(f"{what}: {indices.size} delta indices but {values.size} values")
    if indices.size:
        low, high = int(indices.min()), int(indices.max())
        if low < 0 or high >= count:
            bad = low if low < 0 else high
            raise Malformed(f"{what}: delta index {bad} is out of range: {base.dtype} {list(base.shape)} has "
                            f"{count} {bits} elements (indices 0 to {count - 1})")
    buffer = memoryview(payload)[base.data_offset:]
    if dtype.is_bool:
        if values.size and int(values.max()) > 1:
            raise Malformed(f"{what}: delta value {int(values.max())} for a bool element (0 or 1)")
        elements = np.unpackbits(np.frombuffer(buffer, np.uint8), count=count, bitorder="little")
        elements[indices] = values
        buffer[:] = np.packbits(elements, bitorder="little").tobytes()
    else:
        elements = np.frombuffer(buffer, np.dtype(bits).newbyteorder("<"))
        elements[indices] = values
    got = crc32c.crc32c(memoryview(elements).cast("B")) if elements.size else 0
    if got != crc:
        raise Malformed(f"{what}: CRC-32C of the entry's new buffer is {got:#010x} after the delta "
                        f"({indices.size} elements set), the client sent {crc:#010x}: the base is not the one "
                        "the delta was taken from; nothing was stored")


def _array(what: str, name: str, part: memoryview) -> np.ndarray:
    try:
        info = parse(part)
    except FormatError as exc:
        raise BadPayload(f"{what}: delta {name} payload: {exc}") from None
    return buffer_to_numpy(part[info.data_offset:], info)


def _described(array: np.ndarray) -> str:
    return f"{array.dtype.name} of shape {list(array.shape)}"


__all__ = ["DeriveSession", "apply_delta"]
