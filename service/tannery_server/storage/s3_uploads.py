"""A payload going to the bucket: held in memory while it fits, else streamed as a multipart
upload, to its digest key when the digest is known ahead, else to a temporary key copied to
it at seal."""

from __future__ import annotations

import queue
from concurrent.futures import Future, wait

from .base import TempBlob
from .errors import StorageUnavailable
from .s3_bucket import S3Bucket


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
    """

    def __init__(self, store: S3Bucket, expected: str | None = None) -> None:
        self._store = store
        self.key = store.temp_key()
        #: The digest key the bytes stream to when their digest is known ahead.
        self._target = store.key(expected) if expected is not None else None
        self.size = 0
        #: The part being filled: grown as bytes arrive (a small payload costs its size, not a
        #: part's); later parts are full-sized buffers, reused.
        self._part = bytearray()
        self._filled = 0
        #: Full parts held while the payload may still end within them.
        self._held: list[bytearray] = []
        self._upload_key = self.key
        self._upload_id: str | None = None
        self._parts: list[Future] = []
        #: Part buffers free for reuse; taking one waits while the others are uploading.
        self._free: queue.Queue[bytearray] = queue.Queue()
        self._buffers = 1
        self._closed = False
        #: The digest's object was in the bucket when this payload outgrew memory: its bytes
        #: are counted (and hashed by the caller), not uploaded again.
        self._already_there = False

    def write(self, data: memoryview | bytes) -> None:
        view = memoryview(data).cast("B")
        if self._already_there:
            self.size += view.nbytes
            return
        part_size = self._store.part_size
        while view.nbytes:
            n = min(part_size - self._filled, view.nbytes)
            self._part[self._filled:self._filled + n] = view[:n]  # extends a grown buffer
            self._filled += n
            self.size += n
            view = view[n:]
            if self._filled == part_size:
                self._part_full()
                if self._already_there:
                    self.size += view.nbytes
                    return

    def _part_full(self) -> None:
        if self._upload_id is None and len(self._held) < self._store.parts_in_flight:
            self._held.append(self._part)
        else:
            if self._upload_id is None and self._target is not None and self._store.exists(self._target):
                self._already_there = True  # equal bytes are stored: upload none of these
                self._held, self._part, self._filled = [], bytearray(), 0
                return
            if self._upload_id is None:  # the payload outgrew what is held: stream from now on
                self._start_upload(self._target or self.key)
                for held in self._held:
                    self._send_part(held)
                self._held = []
            self._send_part(self._part)
        self._part = self._next_buffer()
        self._filled = 0

    def _next_buffer(self) -> bytearray:
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

    def _send_part(self, buffer: bytearray, reuse: bool = True) -> None:
        store = self._store
        self._raise_failed()
        number = len(self._parts) + 1
        key, upload_id = self._upload_key, self._upload_id

        def upload() -> dict:
            try:
                answer = store.call(f"upload part {number} of {key}", store.client.upload_part,
                                     Bucket=store.bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=buffer)
                return {"PartNumber": number, "ETag": answer["ETag"]}
            finally:
                if reuse:
                    self._free.put(buffer)

        self._parts.append(store.uploading.submit(upload))

    def _tail(self) -> bytearray | None:
        """The last, partly filled part, trimmed in place (not copied); None if empty."""
        tail, self._part = self._part, bytearray()
        if not self._filled:
            return None
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
            if self._upload_id is None:  # every byte is held: straight to the digest key
                parts = self._held + [tail for tail in [self._tail()] if tail is not None]
                self._held = []
                if store.exists(target):
                    return False
                if len(parts) <= 1:
                    store.call(f"write {target}", store.client.put_object, Bucket=store.bucket, Key=target,
                                Body=parts[0] if parts else b"")
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
        store = self._store
        if self._upload_id is not None:
            key, upload_id, self._upload_id = self._upload_key, self._upload_id, None
            try:
                store.call(f"abort the upload of {key}", store.client.abort_multipart_upload,
                            Bucket=store.bucket, Key=key, UploadId=upload_id)
            except StorageUnavailable:
                pass  # clear_temporary aborts it later
