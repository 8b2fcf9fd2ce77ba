"""One Store call: entries named, payloads deframed and written to blobs, the archive committed.

Runs in a worker thread one message at a time. Each payload's header is checked by the
codec (and against the server's limits) before any of its bytes are written; its bytes
go straight from the received message to a temporary file while they are hashed. Nothing
is visible until :meth:`StoreSession.finish` commits the archive in one transaction, which
it does only after the client's ``commit`` message agreed with what arrived; on any
failure (a stream that ended without it included) :meth:`StoreSession.abort` removes what
was written.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping


from tannery.codec import FormatError, Limits, OverLimit
from tannery.framing import Deframer

from .config import Config
from .failures import BadPayload, LimitExceeded, Malformed, NameTaken
from .storage import ArchiveRecord, BlobInfo, DigestMismatch, EntryRecord, PayloadWriter, Storage
from .validation import check_entry_name
from tannery.v1.archives_pb2 import StoreCommit
from tannery.wire import StoreMessage

#: The codec checks the format and the rank (before it reads a shape of that rank); the
#: payload size limit is checked separately, so that it answers RESOURCE_EXHAUSTED and a
#: malformed payload INVALID_ARGUMENT.
_ANY_SIZE = 1 << 64


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
        self._blobs: list[BlobInfo] = []
        self._entry: str | None = None
        self._entry_has_payload = False
        #: The current entry's SHA-256 (hex) as the client gave it ahead, else None.
        self._entry_sha256: str | None = None
        self._writer: PayloadWriter | None = None
        self._payload_size = 0
        self._commit: StoreCommit | None = None
        self._closed = False
        #: Whether :meth:`finish` committed the archive.
        self.stored = False
        #: Names this call's hold on the blobs it sealed (a shared store's leases).
        self._holder = uuid.uuid4().hex

    def check_name_free(self) -> None:
        """ALREADY_EXISTS before any data is received (checked again at commit)."""
        if not self.replace and self.storage.catalog.archive(self.archive) is not None:
            raise NameTaken(f"archive {self.archive!r} already exists")

    def feed(self, message: StoreMessage, first: bool = False) -> None:
        if self._commit is not None:
            raise Malformed("a message after commit: commit must be the last message of Store")
        if message.commit is not None:
            self._take_commit(message)
            return
        if message.begin is not None and not first:
            raise Malformed("begin is allowed in the first message only")
        if message.entry:
            self._start_entry(message.entry, message.sha256)
        elif message.sha256:
            raise Malformed("entry_sha256 without entry: a payload's SHA-256 comes with its entry's name")
        if message.chunk.nbytes:
            if self._entry is None:
                raise Malformed("payload bytes before any entry name")
            if self._entry_has_payload and self._writer is None:
                self._extra_bytes()
            self.bytes_received += message.chunk.nbytes
            try:
                for fragment in self._deframer.feed(message.chunk):
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

    def _extra_bytes(self) -> None:
        raise BadPayload(
            f"entry {self._entry!r}: more bytes after its payload of {self._entries[-1].payload_bytes} bytes "
            "(one payload per entry)"
        )

    def _start_entry(self, name: str, sha256: bytes = b"") -> None:
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
        self._writer = self.storage.new_payload(self._entry_sha256)

    def _finish_payload(self, info) -> None:
        assert self._writer is not None and self._entry is not None
        writer, self._writer = self._writer, None
        try:
            blob = self.storage.seal(writer, self._holder)
        except DigestMismatch as exc:
            raise Malformed(f"entry {self._entry!r}: {exc}; nothing was stored") from None
        self._blobs.append(blob)
        self._entries.append(
            EntryRecord(self._entry, info.dtype.name, tuple(info.shape), info.nbytes, info.size, info.data_offset,
                        blob.digest)
        )

    def _take_commit(self, message: StoreMessage) -> None:
        """The client's final word: every payload complete, and its counts those received."""
        if message.begin is not None or message.entry or message.chunk.nbytes or message.sha256:
            raise Malformed("commit must come alone, in the last message of Store")
        try:
            self._deframer.close()
        except FormatError as exc:
            raise BadPayload(f"entry {self._entry!r}: {exc}") from None
        self._require_payload()
        commit = message.commit
        assert commit is not None
        if commit.entries != len(self._entries) or commit.payload_bytes != self.bytes_received:
            raise Malformed(
                f"commit says {commit.entries} entries of {commit.payload_bytes} payload bytes were sent, but "
                f"{len(self._entries)} entries of {self.bytes_received} bytes arrived: nothing was stored"
            )
        self._commit = commit

    @property
    def committed(self) -> bool:
        """Whether the client's ``commit`` arrived (and agreed with what arrived)."""
        return self._commit is not None

    def finish(self) -> ArchiveRecord:
        """Commit the archive once the client said so (``commit``) and every payload is durable."""
        if self._commit is None:
            raise Malformed(
                f"Store of {self.archive!r} ended without commit, after {len(self._entries)} whole entries "
                f"({self.bytes_received} payload bytes): nothing was stored (a client that sent everything "
                "sends commit as its last message)"
            )
        record = self.storage.commit_archive(self.archive, self._entries, self._blobs, self.replace, self._holder,
                                             self.metadata)
        self.stored = True
        self._closed = True
        self.storage.release((b.digest for b in self._blobs), holder=self._holder)
        return record

    def abort(self) -> None:
        """Remove everything this call wrote; safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        if self._writer is not None:
            self._writer.temp.discard()
            self._writer = None
        self.storage.release((b.digest for b in self._blobs), collect=True, holder=self._holder)
