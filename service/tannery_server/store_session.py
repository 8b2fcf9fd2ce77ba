"""One Store call: entries named, payloads deframed and written to blobs, the archive committed.

Plain calls, made on a worker thread one at a time: :meth:`~StoreSession.begin_entry`
names an entry, :meth:`~StoreSession.write` gives the next bytes of its payload,
:meth:`~StoreSession.commit` takes the client's counts. Whatever carries them (the gRPC
messages, a data connection) is a thin adapter in :mod:`.dataplane`. Each payload's header
is checked by the codec (and against the server's limits) before any of its bytes are
written; its bytes go straight from the buffer received to a temporary file while they are
hashed. Nothing is visible until :meth:`StoreSession.finish` commits the archive in one
transaction, which it does only after the client's ``commit`` agreed with what arrived; on
any failure (a stream that ended without it included) :meth:`StoreSession.abort` removes
what was written.

Without ``replace``, a name that exists is compared instead (:mod:`.storage.same_content`):
its metadata at ``begin``, each entry's name (and the digest sent ahead) when it begins, its dtype and shape at its payload's header, its payload's digest at its end, and
the whole archive again at commit. Payloads are then only hashed, never written: the same
content answers OK with ``already_stored`` and stores nothing; other content is refused
(ALREADY_EXISTS) at the first difference, naming it.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Mapping
from dataclasses import dataclass

from tannery_protocol.codec import FormatError, Limits, OverLimit
from tannery_protocol.framing import Deframer

from .config import Config
from .failures import BadPayload, LimitExceeded, Malformed, Unavailable
from .storage import ArchiveExists, ArchiveRecord, BlobInfo, DigestMismatch, EntryRecord, PayloadWriter, Storage
from .storage.packs import PACK_BELOW, PACK_BLOCK_SIZE, PACK_TARGET, Pack
from .storage.alias_sql import alias_name_refusal
from .storage.same_content import (digest_difference, header_difference, metadata_difference, other_content,
                                   require_same, unknown_entry)
from .validation import check_entry_name

#: The codec checks the format and the rank (before it reads a shape of that rank); the
#: payload size limit is checked separately, so that it answers RESOURCE_EXHAUSTED and a
#: malformed payload INVALID_ARGUMENT.
_ANY_SIZE = 1 << 64


@dataclass(frozen=True)
class Existing:
    """The archive a Store without ``replace`` found under its name, which it compares with."""

    record: ArchiveRecord
    entries: Mapping[str, EntryRecord]


class StoreSession:
    def __init__(self, storage: Storage, config: Config, archive: str, replace: bool,
                 metadata: Mapping[str, str] | None = None) -> None:
        self.storage = storage
        self.config = config
        self.archive = archive
        self.replace = replace
        self.metadata = dict(metadata or {})
        self.bytes_received = 0
        self._deframer = Deframer(Limits(max_payload=_ANY_SIZE, max_rank=config.max_rank))
        self._names: set[str] = set()
        self._entries: list[EntryRecord] = []
        #: Entries whose payloads are in the open pack, whose digest is not known yet.
        self._in_pack: list[EntryRecord] = []
        self._pack: Pack | None = None
        #: The size of the last complete payload (named when more bytes follow it).
        self._last_size = 0
        self._blobs: list[BlobInfo] = []
        self._entry: str | None = None
        self._entry_has_payload = False
        #: The current entry's SHA-256 (hex) as the client gave it ahead, else None.
        self._entry_sha256: str | None = None
        self._writer: PayloadWriter | None = None
        self._payload_size = 0
        self._committed = False
        self._closed = False
        #: Whether :meth:`finish` committed the archive.
        self.stored = False
        #: Names this call's hold on the blobs it sealed (a shared store's leases).
        self._holder = uuid.uuid4().hex
        #: The archive already under this name (no ``replace``): payloads are compared with it.
        self.existing: Existing | None = None

    def check_existing(self) -> None:
        """Before any data is received: find an archive of this name (unless ``replace``), and
        refuse at once when its metadata differs (ALREADY_EXISTS naming the key). Checked
        again at commit. A name that is an alias is refused at once, ``replace`` or not."""
        alias = self.storage.catalog.alias(self.archive)
        if alias is not None:
            raise alias_name_refusal(self.archive, alias.archive)
        if self.replace:
            return
        record = self.storage.catalog.archive(self.archive)
        if record is None:
            return
        self._refuse_if(metadata_difference(record.metadata, self.metadata))
        entries = self.storage.catalog.entries_under(self.archive, "")
        self.existing = Existing(record, {e.name: e for e in entries})

    def _refuse_if(self, difference: str | None) -> None:
        """ALREADY_EXISTS naming ``difference`` (with other content than the archive there), if any."""
        if difference is not None:
            raise other_content(self.archive, difference)

    def begin_entry(self, name: str, sha256: bytes = b"") -> None:
        """The next entry, by its name, with the SHA-256 of its payload when the client sent it ahead."""
        if self._deframer.inside_payload:
            got = f"{self._writer.size} of {self._payload_size} bytes" if self._writer else "in its header"
            raise BadPayload(f"entry {name!r} starts before the payload of entry {self._entry!r} ended: {got}")
        self._require_payload()
        check_entry_name(name, self.config.max_name_bytes)
        if name in self._names:
            raise Malformed(f"entry {name!r} is named twice")
        if len(self._names) >= self.config.max_entries:
            raise LimitExceeded(f"archive {self.archive!r}: more than {self.config.max_entries} entries")
        if sha256 and len(sha256) != 32:
            raise Malformed(f"entry {name!r}: entry_sha256 has {len(sha256)} bytes; a SHA-256 has 32")
        self._names.add(name)
        self._entry = name
        self._entry_has_payload = False
        self._entry_sha256 = sha256.hex() if sha256 else None
        if self.existing is not None:
            self._compare_entry(name)

    def reuse_entry(self, record: EntryRecord, base: str) -> None:
        """An entry taken as it is from archive ``base`` (a Derive's SAME): its blob referenced,
        not a byte read or written. ``record`` comes from a :meth:`~.storage.StorageBase.pinned`
        lookup whose hold lasts until :meth:`finish` or :meth:`abort`."""
        self.begin_entry(record.name, bytes.fromhex(record.digest))
        if not self.storage.reuse(record.blob, self._holder):
            raise Unavailable(f"entry {record.name!r}: its blob in {base!r} was collected meanwhile ({base!r} "
                              "deleted or replaced): nothing was stored; send it again")
        self._entry_has_payload = True
        self._last_size = record.payload_bytes
        self._entries.append(record)

    def write(self, data: memoryview) -> None:
        """The next bytes of the current entry's payload, read whole before this returns (the
        caller may reuse or unmap ``data`` then). Its header is checked before any of its bytes
        are written."""
        if not data.nbytes:
            return
        if self._entry is None:
            raise Malformed("payload bytes before any entry name")
        if self._entry_has_payload and self._writer is None:
            self._extra_bytes()
        self.bytes_received += data.nbytes
        try:
            for fragment in self._deframer.feed(data):
                if fragment.first:
                    self._start_payload(fragment.info)
                assert self._writer is not None
                self._writer.write(fragment.data)
                if fragment.last:
                    self._finish_payload(fragment.info)
        except OverLimit as exc:  # the server's rank limit: not a malformed payload
            raise Malformed(f"entry {self._entry!r}: {exc}") from None
        except FormatError as exc:
            raise BadPayload(f"entry {self._entry!r}: {exc}") from None
        if self._entry_has_payload and self._writer is None and self._deframer.inside_payload:
            self._extra_bytes()  # the start of a second payload's header

    def commit(self, entries: int, payload_bytes: int) -> None:
        """The client's final word: every payload complete, and its counts (``entries`` of
        ``payload_bytes``) those received. :meth:`finish` stores the archive only after it."""
        try:
            self._deframer.close()
        except FormatError as exc:
            raise BadPayload(f"entry {self._entry!r}: {exc}") from None
        self._require_payload()
        if entries != self.entries or payload_bytes != self.bytes_received:
            raise Malformed(
                f"commit says {entries} entries of {payload_bytes} payload bytes were sent, but "
                f"{self.entries} entries of {self.bytes_received} bytes arrived: nothing was stored"
            )
        self._seal_pack()
        self._committed = True

    @property
    def entries(self) -> int:
        """Whole entries received so far."""
        return len(self._entries) + len(self._in_pack)

    def _extra_bytes(self) -> None:
        raise BadPayload(
            f"entry {self._entry!r}: more bytes after its payload of {self._last_size} bytes "
            "(one payload per entry)"
        )

    def _compare_entry(self, name: str) -> None:
        """At an entry's first message, before its payload: refuse a name the archive there
        lacks, or a digest sent ahead that differs from the stored entry's."""
        assert self.existing is not None
        there = self.existing.entries.get(name)
        if there is None:
            self._refuse_if(unknown_entry(name, len(self.existing.entries)))
        elif self._entry_sha256 is not None:
            self._refuse_if(digest_difference(there, self._entry_sha256))

    def _require_payload(self) -> None:
        if self._entry is not None and not self._entry_has_payload:
            raise Malformed(f"entry {self._entry!r} has no payload")

    def _start_payload(self, info) -> None:
        if self._entry_has_payload:
            self._extra_bytes()
        if info.size > self.config.max_payload_bytes:
            raise LimitExceeded(
                f"entry {self._entry!r}: payload of {info.size} bytes ({info.describe()}) is over the limit of "
                f"{self.config.max_payload_bytes} bytes"
            )
        self._entry_has_payload = True
        self._payload_size = info.size
        if self.existing is None and info.size < PACK_BELOW:
            self._writer = self._packed_payload()
            return
        if self.existing is None:
            self._writer = self.storage.new_payload(self._entry_sha256)
            return
        # Compared, never stored: its dtype and shape now, its digest at its end.
        self._refuse_if(header_difference(self.existing.entries[self._entry], info.dtype.name, info.shape))
        self._writer = self.storage.hashing_payload(self._entry_sha256)

    def _finish_payload(self, info) -> None:
        assert self._writer is not None and self._entry is not None
        writer, self._writer = self._writer, None
        self._last_size = info.size
        try:
            if isinstance(writer, _PackedPayload):
                digest, offset = writer.pack.end(self._entry_sha256)
                self._in_pack.append(EntryRecord(self._entry, info.dtype.name, tuple(info.shape), info.nbytes,
                                                 info.size, info.data_offset, digest, blob_offset=offset))
                if writer.pack.size >= PACK_TARGET:
                    self._seal_pack()
                return
            blob = self._seal_or_compare(writer)
        except DigestMismatch as exc:
            raise Malformed(f"entry {self._entry!r}: {exc}; nothing was stored") from None
        self._entries.append(
            EntryRecord(self._entry, info.dtype.name, tuple(info.shape), info.nbytes, info.size, info.data_offset,
                        blob.digest)
        )

    def _packed_payload(self) -> "_PackedPayload":
        """The current payload, written into the open pack (begun here if none is open)."""
        if self._pack is None:
            self._pack = Pack(self.storage.new_payload(block_size=PACK_BLOCK_SIZE))
        self._pack.begin()
        return _PackedPayload(self._pack)

    def _seal_pack(self) -> None:
        """Seal the open pack as a blob (held for this call) and give its entries their blob."""
        pack, self._pack = self._pack, None
        if pack is None:
            return
        try:
            pack.flush()
            blob = self.storage.seal(pack.writer, self._holder)
        except BaseException:
            pack.discard()  # a full disk, a bucket gone: nothing of the pack is left
            raise
        self._blobs.append(blob)
        self._entries.extend(dataclasses.replace(e, blob=blob.digest) for e in self._in_pack)
        self._in_pack.clear()

    def _seal_or_compare(self, writer: PayloadWriter) -> BlobInfo:
        """The current entry's payload, complete: sealed as a blob (pinned for this call), or,
        compared with the archive there, its digest checked against the stored entry's."""
        if self.existing is None:
            blob = self.storage.seal(writer, self._holder)
            self._blobs.append(blob)
            return blob
        blob = writer.finish()
        assert self._entry is not None
        self._refuse_if(digest_difference(self.existing.entries[self._entry], blob.digest))
        return blob

    @property
    def committed(self) -> bool:
        """Whether the client's ``commit`` arrived (and agreed with what arrived)."""
        return self._committed

    def finish(self) -> ArchiveRecord:
        """Commit the archive once the client said so (``commit``) and every payload is durable."""
        if not self._committed:
            raise Malformed(
                f"Store of {self.archive!r} ended without commit, after {self.entries} whole entries "
                f"({self.bytes_received} payload bytes): nothing was stored (a client that sent everything "
                "sends commit as its last message)"
            )
        record = self._commit_archive() if self.existing is None else self._already_there()
        self.stored = not record.already_stored
        self._closed = True
        # Found there already: what this call sealed may be referenced by nothing (a pack made in
        # another order than the archive's), and goes now, not at the next start.
        self.storage.release((b.digest for b in self._blobs), collect=record.already_stored, holder=self._holder)
        return record

    def _commit_archive(self) -> ArchiveRecord:
        """Commit the archive; when another call took the name meanwhile, the archive it made,
        flagged ``already_stored``, if it holds exactly this content (ALREADY_EXISTS otherwise)."""
        try:
            return self.storage.commit_archive(self.archive, self._entries, self._blobs, self.replace,
                                               self._holder, self.metadata)
        except ArchiveExists:
            if self.replace:
                raise
            return self._already_there()

    def _already_there(self) -> ArchiveRecord:
        """The archive under this name, flagged ``already_stored``, when it holds exactly what
        this Store sent, compared in the catalog now (it may have changed since ``begin``);
        ALREADY_EXISTS naming the first difference otherwise."""
        record = self.storage.catalog.archive(self.archive)
        if record is None:
            raise Unavailable(
                f"archive {self.archive!r} was deleted while this Store compared its {len(self._entries)} entries "
                "with it: nothing was stored; send the Store again")
        entries = self.storage.catalog.entries_under(self.archive, "")
        return require_same(record, entries, self._entries, self.metadata)

    def abort(self) -> None:
        """Remove everything this call wrote; safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        if self._writer is not None and not isinstance(self._writer, _PackedPayload):
            self._writer.temp.discard()
        self._writer = None
        if self._pack is not None:
            self._pack.discard()
            self._pack = None
        self.storage.release((b.digest for b in self._blobs), collect=True, holder=self._holder)


class _PackedPayload:
    """The current payload as the open pack takes it: what the session writes to, as it writes
    to a :class:`PayloadWriter` for a payload of its own."""

    def __init__(self, pack: Pack) -> None:
        self.pack = pack

    @property
    def size(self) -> int:
        return self.pack.payload_size

    def write(self, data: memoryview) -> None:
        self.pack.write(data)
