"""A payload going to the bucket: held in memory while it fits (and the replica's upload memory
has room, else spilled to a file), else streamed as a multipart upload, to its digest key when
the digest is known ahead, else to a temporary key copied to it at seal."""

from __future__ import annotations

import mmap
import queue
from concurrent.futures import FIRST_COMPLETED, Future, wait

from .base import TempBlob
from .errors import StorageUnavailable
from .s3_bucket import S3Bucket
from .upload_memory import STEP, FileRange, MemoryRange, Spill

#: A held part grows in memory up to this many bytes, then moves to a map of a whole part.
MAP_FROM = 1 << 20
#: A part's buffer: reused full-sized memory while streaming; held, a grown one or an anonymous map (its
#: pages become memory only as they are written, and go back to the system when it is dropped).
Buffer = bytearray | mmap.mmap


class S3TempBlob(TempBlob):
    """A payload being written, in parts of ``part_size``.

    Up to ``parts_in_flight`` full parts (and the one filling) are held in memory first: a
    payload that ends within them is uploaded at seal straight to its digest key (one PUT,
    or a multipart upload of the held parts in parallel), with no temporary object and no
    copy. A larger payload streams: a multipart upload starts with the held parts, and each
    later part is uploaded as it fills, at most ``parts_in_flight`` at once. When the digest
    is ``expected`` (its sender gave it ahead) the upload goes to the digest key, and seal
    completes it there (nothing is visible before: an upload whose bytes hash otherwise is
    aborted); else it goes to a temporary key, and seal completes it and copies it to its
    digest key (about 3 s per GiB on SeaweedFS). Either way a call holds at most
    ``parts_in_flight + 1`` parts.

    What is held before the upload starts is taken from the replica's upload memory
    (``store.memory``, :mod:`.upload_memory`); when that has no room, the payload spills: what
    it held and the rest of it go to a temporary file, uploaded from there at seal (or, once
    it holds as much as would start streaming, streamed from there).
    """

    def __init__(self, store: S3Bucket, expected: str | None = None) -> None:
        self._store = store
        self.key = store.temp_key()
        #: The digest key the bytes stream to when their digest is known ahead.
        self._target = store.key(expected) if expected is not None else None
        self.size = 0
        #: The part being filled: grown as bytes arrive (a small payload costs its size, not a
        #: part's); later parts are full-sized buffers, reused.
        self._part: Buffer = bytearray()
        self._filled = 0
        #: Full parts held while the payload may still end within them.
        self._held: list[Buffer] = []
        self._upload_key = self.key
        self._upload_id: str | None = None
        self._parts: list[Future] = []
        #: Part buffers free for reuse; taking one waits while the others are uploading.
        self._free: queue.Queue[Buffer] = queue.Queue()
        self._buffers = 1
        self._closed = False
        #: The digest's object was in the bucket when this payload outgrew memory: its bytes
        #: are counted (and hashed by the caller), not uploaded again.
        self._already_there = False
        #: Bytes taken from the replica's upload memory for what is held (given back at the end).
        self._taken = 0
        #: Where the payload's bytes went when the upload memory had no room for them.
        self._spill: Spill | None = None
        #: A spill whose parts are being uploaded, the payload streaming since.
        self._streamed_from: Spill | None = None

    def write(self, data: memoryview | bytes) -> None:
        view = memoryview(data).cast("B")
        if self._already_there:
            self.size += view.nbytes
            return
        part_size = self._store.part_size
        while view.nbytes:
            if self._spill is not None:
                self._spill.write(view)
                self.size += view.nbytes
                if self._spill.size >= part_size * (self._store.parts_in_flight + 1):
                    self._stream_spilled()
                return
            n = min(part_size - self._filled, view.nbytes)
            if self._upload_id is None:
                if not self._room_for(n):
                    self._spill_held()
                    continue
                if self._filled + n > MAP_FROM and not isinstance(self._part, mmap.mmap):
                    self._part = _mapped(self._part, self._filled, part_size)
            self._part[self._filled:self._filled + n] = view[:n]
            self._filled += n
            self.size += n
            view = view[n:]
            if self._filled == part_size:
                self._part_full()
                if self._already_there:
                    self.size += view.nbytes
                    return

    def _room_for(self, n: int) -> bool:
        """Whether ``n`` more bytes may be held: taken from the upload memory (in steps) if needed."""
        memory = self._store.memory
        if memory is None:
            return True
        needed = len(self._held) * self._store.part_size + self._filled + n - self._taken
        if needed <= 0:
            return True
        step = max(needed, STEP)
        if not memory.try_take(step):
            return False
        self._taken += step
        return True

    def _give_back(self) -> None:
        """Give what is held back to the upload memory (the buffers dropped or streaming)."""
        if self._taken and self._store.memory is not None:
            self._store.memory.give(self._taken)
        self._taken = 0

    def _spill_held(self) -> None:
        """No room in memory: what is held goes to a temporary file, and so will the rest."""
        spill = Spill(self._store.spill_dir)
        try:
            for held in self._held:
                spill.write(held)
            spill.write(memoryview(self._part)[:self._filled])
        except BaseException:
            spill.close()
            raise
        self._spill = spill
        self._held, self._part, self._filled = [], bytearray(), 0
        self._give_back()
        if self._store.memory is not None:
            self._store.memory.spilled(self._store.spill_dir)

    def _stream_spilled(self) -> None:
        """A spilled payload that grew as large as one that streams: its whole parts are uploaded
        from the file, what follows streams from memory as any large payload's does."""
        spill, self._spill = self._spill, None
        assert spill is not None
        self._streamed_from = spill  # closed once its parts are uploaded (at seal or discard)
        part_size = self._store.part_size
        if self._target is not None and self._store.exists(self._target):
            self._already_there = True  # equal bytes are stored: upload none of these
            return
        self._start_upload(self._target or self.key)
        whole = spill.size - spill.size % part_size
        for offset in range(0, whole, part_size):
            self._wait_for_room()
            self._send_part(spill.range(offset, part_size), reuse=False)
        self._buffers = 1
        self._part = self._next_buffer()
        self._filled = spill.size - whole
        spill.read_into(whole, memoryview(self._part)[:self._filled])

    def _wait_for_room(self) -> None:
        """Wait until fewer than ``parts_in_flight`` parts are uploading (parts sent from a file)."""
        while sum(not future.done() for future in self._parts) >= self._store.parts_in_flight:
            wait(self._parts, return_when=FIRST_COMPLETED)
        self._raise_failed()

    def _part_full(self) -> None:
        if self._upload_id is None and len(self._held) < self._store.parts_in_flight:
            self._held.append(self._part)
            self._part = bytearray()  # grows, then maps
            self._filled = 0
            return
        if self._upload_id is None and self._target is not None and self._store.exists(self._target):
            self._already_there = True  # equal bytes are stored: upload none of these
            self._held, self._part, self._filled = [], bytearray(), 0
            self._give_back()
            return
        if self._upload_id is None:  # the payload outgrew what is held: stream from now on
            self._start_upload(self._target or self.key)
            self._buffers = len(self._held) + 1  # they are the streaming buffers from now on
            for held in self._held:
                self._send_part(held)
            self._held = []
        self._send_part(self._part)
        self._part = self._next_buffer()
        self._filled = 0

    def _next_buffer(self) -> Buffer:
        if self._buffers <= self._store.parts_in_flight:
            self._buffers += 1
            return bytearray(self._store.part_size)  # filled by slice assignment, reused
        buffer = self._free.get()  # waits for an upload to finish
        self._raise_failed()
        return buffer

    def _raise_failed(self) -> None:
        for future in self._parts:
            if future.done() and future.exception() is not None:
                raise future.exception()

    def _start_upload(self, key: str) -> None:
        store = self._store
        created = store.call(f"start an upload to {key}", store.client.create_multipart_upload,
                              Bucket=store.bucket, Key=key)
        self._upload_key, self._upload_id = key, created["UploadId"]

    def _send_part(self, buffer: Buffer | FileRange | MemoryRange, reuse: bool = True) -> None:
        store = self._store
        self._raise_failed()
        number = len(self._parts) + 1
        key, upload_id = self._upload_key, self._upload_id

        def upload() -> dict:
            try:
                answer = store.call(f"upload part {number} of {key}", store.client.upload_part,
                                     Bucket=store.bucket, Key=key, UploadId=upload_id, PartNumber=number,
                                     Body=_body(buffer))
                return {"PartNumber": number, "ETag": answer["ETag"]}
            finally:
                if reuse:
                    self._free.put(buffer)

        self._parts.append(store.uploading.submit(upload))

    def _tail(self) -> bytearray | MemoryRange | None:
        """The last, partly filled part, trimmed (not copied); None if empty."""
        tail, self._part = self._part, bytearray()
        if not self._filled:
            return None
        if isinstance(tail, mmap.mmap):
            return MemoryRange(memoryview(tail)[:self._filled])
        del tail[self._filled:]
        return tail

    def _complete(self) -> None:
        store = self._store
        parts = [future.result() for future in self._parts]
        store.call(f"complete the upload of {self._upload_key}", store.client.complete_multipart_upload,
                    Bucket=store.bucket, Key=self._upload_key, UploadId=self._upload_id,
                    MultipartUpload={"Parts": parts})
        self._upload_id = None

    def seal(self, digest: str) -> bool:
        try:
            return self._seal(digest)
        finally:
            self._give_back()
            self._close_spill()

    def _close_spill(self) -> None:
        """Close the spill files (their parts uploaded, or the upload over)."""
        for spill in (self._spill, self._streamed_from):
            if spill is not None:
                spill.close()
        self._spill = self._streamed_from = None

    def _seal_spilled(self, target: str) -> bool:
        """Upload a spilled payload from its file straight to its digest key (unless there already)."""
        store, spill = self._store, self._spill
        assert spill is not None
        if store.exists(target):
            return False
        if spill.size <= store.part_size:
            store.call(f"write {target}", store.client.put_object, Bucket=store.bucket, Key=target,
                       Body=spill.range(0, spill.size))
            return True
        self._start_upload(target)
        for offset in range(0, spill.size, store.part_size):
            self._wait_for_room()
            self._send_part(spill.range(offset, min(store.part_size, spill.size - offset)), reuse=False)
        self._complete()
        return True

    def _seal(self, digest: str) -> bool:
        store = self._store
        target = store.key(digest)
        if self._closed:
            raise ValueError(f"temporary blob {self.key} is sealed or discarded already")
        self._closed = True
        if self._already_there:
            if target != self._target:
                raise ValueError(f"payload known as {self._target} sealed as {digest}")
            if not store.exists(target):  # looked up again now that the caller holds its lease
                raise StorageUnavailable(
                    f"S3 {store.where()}: blob {digest} was in the bucket when this Store began to send it, and was "
                    "collected before the Store ended (its archive deleted meanwhile): run the Store again")
            return False
        try:
            if self._spill is not None:
                return self._seal_spilled(target)
            if self._upload_id is None:  # every byte is held: straight to the digest key
                parts = self._held + [tail for tail in [self._tail()] if tail is not None]
                self._held = []
                if store.exists(target):
                    return False
                if len(parts) <= 1:
                    store.call(f"write {target}", store.client.put_object, Bucket=store.bucket, Key=target,
                                Body=_body(parts[0]) if parts else b"")
                    return True
                self._start_upload(target)
                for part in parts:
                    self._send_part(part, reuse=False)
                self._complete()
                return True
            if self._upload_key != self.key:  # streamed to its digest key: complete it unless there already
                if self._upload_key != target:
                    raise ValueError(f"payload streamed to {self._upload_key} sealed as {digest}")
                if store.exists(target):
                    self._closed = False
                    self.discard()
                    return False
            tail = self._tail()
            if tail is not None:
                self._send_part(tail, reuse=False)
            self._complete()
            if self._upload_key != self.key:
                return True
        except BaseException:
            self._closed = False
            self.discard()
            raise
        try:
            stored = not store.exists(target)
            if stored:
                store.copy_object(self.key, target, self.size)
        except BaseException:
            self._drop_completed()
            raise
        self._drop_completed()
        return stored

    def _drop_completed(self) -> None:
        """Delete the completed temporary object (if that fails, clear_temporary does it later)."""
        try:
            self._store.delete_key(self.key)
        except StorageUnavailable:
            pass

    def discard(self) -> None:
        """Abort the upload (after its parts in flight end) and drop what was written."""
        if self._closed:
            return
        self._closed = True
        self._part, self._held = bytearray(), []
        wait(self._parts)
        self._parts = []
        self._give_back()
        self._close_spill()
        store = self._store
        if self._upload_id is not None:
            key, upload_id, self._upload_id = self._upload_key, self._upload_id, None
            try:
                store.call(f"abort the upload of {key}", store.client.abort_multipart_upload,
                            Bucket=store.bucket, Key=key, UploadId=upload_id)
            except StorageUnavailable:
                pass  # clear_temporary aborts it later


def _mapped(part: bytearray, filled: int, size: int) -> mmap.mmap:
    """An anonymous map of ``size`` bytes that starts with ``part``'s ``filled`` bytes."""
    mapped = mmap.mmap(-1, size)
    mapped[:filled] = part[:filled]
    return mapped


def _body(part: Buffer | FileRange | MemoryRange) -> bytearray | FileRange | MemoryRange:
    """A part as a request body: a map read as a file of its own (from its start, whatever read it before)."""
    return MemoryRange(memoryview(part)) if isinstance(part, mmap.mmap) else part
