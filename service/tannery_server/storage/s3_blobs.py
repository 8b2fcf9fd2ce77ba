"""Content-addressed blobs in an S3-compatible bucket (AWS S3, SeaweedFS, MinIO, Ceph RGW, R2).

``s3://BUCKET/PREFIX`` holds each payload once, at ``PREFIX/blobs/ab/cd/<sha256>`` (two levels
of the digest spread keys over the bucket's partitions); a payload too large to hold in
memory while it is written goes to ``PREFIX/tmp/<time_ns>-<uuid>`` first, because its digest
is known only at its end, unless its sender gave that digest ahead. The
endpoint and credentials come from the standard AWS variables (``AWS_ENDPOINT_URL_S3`` or
``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION``).

- **Writing** streams, holding at most ``(parts_in_flight + 1) * part_size`` bytes per call
  (80 MiB by default), never the payload. A payload that fits in that is held and uploaded at
  seal straight to its digest key (one PUT under a part, else a multipart upload of its parts
  in parallel). A larger one streams as a multipart upload (each part uploaded by a
  background thread as it fills, ``parts_in_flight`` at once): to its digest key when the
  digest was given ahead (``create(expected=...)``), completed there at seal; else to a
  temporary key, completed at seal and copied server-side to its digest key (CopyObject;
  UploadPartCopy past 5 GiB). Either way nothing is written when the digest's object exists
  already (equal payloads are stored once); one whose digest was given ahead is looked up
  when it outgrows memory, and if it is there none of its bytes go to the bucket. The copy
  costs about half a PUT on SeaweedFS (docs/benchmarks.md): payloads held in memory, or
  whose digest is given ahead, skip it.
- **Reading** uses ranged GETs; a large :meth:`S3Blob.read_into` splits into ranges fetched in
  parallel, each read straight into its slice of the caller's buffer, and small sequential
  reads (Fetch's 1 MiB) are served from ranges read ahead in parallel (:class:`S3Blob`).
- **Errors**: botocore's retries (``mode: standard``: backoff, idempotent retries) run first;
  what still fails is raised as :class:`StorageUnavailable` naming the bucket, the endpoint
  and the failure, and a missing blob as FileNotFoundError, as the file store does.

boto3 was chosen over obstore by measurement (docs/benchmarks.md, "S3 blob store"): within the
noise of each other on SeaweedFS, and boto3 also lists and aborts multipart uploads, copies
parts server-side and reads into a given buffer.
"""

from __future__ import annotations

import http.client
import io
import os
import queue
import re
import threading
import time
import uuid
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Callable, Iterable, Iterator, TypeVar
from urllib.parse import urlparse

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

from .errors import StorageUnavailable

_DIGEST = re.compile(r"[0-9a-f]{64}")
_T = TypeVar("_T")
MiB = 1 << 20
# Sizes measured on SeaweedFS (docs/benchmarks.md, "S3 blob store"): 16 MiB parts stored 1 GiB
# about 10 % faster than 8 MiB ones; 4 ranges of 8 MiB read ahead match a plain client's GETs.
#: Part size of uploads.
PART_SIZE = 16 * MiB
#: Parts of one upload in flight at once (the memory of a call: this many parts, plus one filling).
PARTS_IN_FLIGHT = 4
#: Size of the ranges a large read_into splits into, and of those read ahead.
RANGE_SIZE = 8 * MiB
#: Ranges read ahead of sequential small reads, at most (memory per open blob: this many ranges).
READAHEAD = 4
#: S3's largest CopyObject; bigger objects are copied in parts (UploadPartCopy).
_COPY_LIMIT = 5 << 30
_MISSING = ("404", "NoSuchKey", "NotFound", "NoSuchUpload")


def _error_code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code") or exc.response.get("ResponseMetadata", {})
               .get("HTTPStatusCode", "?"))


def _ns(when) -> int:
    """A timestamp of the bucket's (a datetime) in nanoseconds since the epoch."""
    return int(when.timestamp() * 1e9)


class MissingBucket(StorageUnavailable):
    """The bucket of ``--blobs`` does not exist: the message names it, the endpoint and the remedy."""


def _make_bucket(bucket: str, endpoint: str | None) -> str:
    """The command that creates ``bucket`` (the AWS CLI's; any S3 client does)."""
    return f"aws s3 mb s3://{bucket}" + (f" --endpoint-url {endpoint}" if endpoint else "")


def _is_missing(exc: BaseException) -> bool:
    return isinstance(exc, ClientError) and _error_code(exc) in _MISSING


def _reason(exc: BaseException) -> str:
    """What failed, in words (the driver's exception class stays out of it)."""
    if isinstance(exc, ClientError):
        code = _error_code(exc)
        message = exc.response.get("Error", {}).get("Message") or ""
        words = {
            "AccessDenied": "access denied", "InvalidAccessKeyId": "access denied (unknown access key)",
            "SignatureDoesNotMatch": "access denied (wrong secret key)", "NoSuchBucket": "no such bucket",
            "403": "access denied", "404": "not found (no such bucket?)", "NoSuchUpload": "no such multipart upload",
        }.get(code, code)
        return f"{words}: {message}" if message and message != words else words
    if isinstance(exc, NoCredentialsError):
        return "no credentials (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY)"
    text = str(exc)
    if "Could not connect" in text or "Connection refused" in text:
        return f"connection refused or unreachable ({text})"
    return text or type(exc).__name__


class S3Blob:
    """An object of the bucket, read with ranged GETs (no local file: no :meth:`fileno`).

    Small reads that follow one another (a Fetch reads a blob 1 MiB at a time) turn on a
    read-ahead, so a Fetch is not limited by one request's latency: ranges past the read are
    fetched in parallel while the caller consumes the current one. It grows with the run of
    sequential reads (at most about as many bytes ahead as were read in that run, so a short
    row range over-reads little), up to ``readahead`` ranges of ``range_size`` (32 MiB by
    default: the memory of one open blob). A lone read reads only its bytes;
    :meth:`read_ahead_until` bounds the read-ahead where the caller knows its end. One reader
    at a time per open blob.
    """

    def __init__(self, store: "S3BlobStore", key: str, size: int) -> None:
        self._store = store
        self.key = key
        self.size = size
        self._lock = threading.Lock()
        self._last_end = -1  # where the previous read ended: the next starting there is sequential
        self._streak = 0  # bytes read by the current run of sequential reads
        self._ahead_stop = size
        #: Ranges fetched ahead, in order and contiguous: (start, size, future of (buffer, bytes read)).
        self._ahead: deque[tuple[int, int, Future]] = deque()
        #: Consumed full-sized range buffers, reused (fresh 8 MiB buffers from many threads
        #: leave glibc's per-thread arenas holding freed memory: +30 MiB per Fetch measured).
        self._spare: list[bytearray] = []

    def read_ahead_until(self, stop: int) -> None:
        """Read no byte at or past ``stop`` ahead of the reads (the end of a row range)."""
        with self._lock:
            self._ahead_stop = max(0, min(stop, self.size))

    def read(self, offset: int, size: int) -> bytes:
        size = max(0, min(size, self.size - offset))
        if size == 0:
            return b""
        buffer = bytearray(size)
        got = self.read_into(memoryview(buffer), offset)
        return bytes(buffer) if got == size else bytes(buffer[:got])

    def read_into(self, buffer: memoryview, offset: int) -> int:
        """Fill ``buffer`` from ``offset`` (fewer bytes at the end of the blob). Beyond one
        range, the ranges are fetched in parallel, each straight into its slice."""
        view = memoryview(buffer)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        size = max(0, min(view.nbytes, self.size - offset))
        if size == 0:
            return 0
        with self._lock:
            sequential = offset == self._last_end
            self._streak = self._streak + size if sequential else size
            self._last_end = offset + size
            if size < self._store.range_size and self._store.readahead and (sequential or self._ahead):
                try:
                    got = self._from_ahead(view[:size], offset, sequential)
                except BaseException:
                    self._drop_ahead()  # the next read asks again instead of finding this failure
                    raise
                if got is not None:
                    return got
            self._drop_ahead()
        if size <= self._store.range_size:
            return self._read_range(view[:size], offset)
        step = self._store.range_size
        futures = [self._store._reading.submit(self._read_range, view[at:min(size, at + step)], offset + at)
                   for at in range(0, size, step)]
        wait(futures)
        for at, future in zip(range(0, size, step), futures):
            n = future.result()  # raises the first failure
            if n < min(step, size - at):  # the object is shorter than its size: the bytes end here
                return at + n
        return size

    def _from_ahead(self, view: memoryview, offset: int, sequential: bool) -> int | None:
        """``view`` filled from the ranges read ahead (started at ``offset`` by a sequential read,
        topped up after); None when ``offset`` is not among them (the caller reads directly)."""
        while self._ahead and self._ahead[0][0] + self._ahead[0][1] <= offset:
            self._ahead.popleft()  # consumed
        if self._ahead and self._ahead[0][0] > offset:
            return None
        if not self._ahead and not sequential:
            return None
        filled = 0
        while filled < view.nbytes:
            if not self._ahead:  # the first range covers this read and a step past it
                self._fetch(offset + filled, max(view.nbytes - filled, self._step()))
            start, size, future = self._ahead[0]
            data, got = future.result()  # StorageUnavailable as a direct read would raise
            at = offset + filled - start
            n = min(view.nbytes - filled, got - at)
            if n <= 0:
                break  # the object ended early
            view[filled:filled + n] = memoryview(data)[at:at + n]
            filled += n
            if at + n == size:
                self._ahead.popleft()
                if len(data) == self._store.range_size and len(self._spare) < self._store.readahead:
                    self._spare.append(data)
        self._top_up(offset + filled)
        return filled

    def _step(self) -> int:
        """The size of the next range ahead: half the sequential run so far, at most range_size."""
        return max(1, min(self._store.range_size, self._streak // 2))

    def _top_up(self, position: int) -> None:
        """Fetch ranges until about ``streak`` bytes (at most readahead ranges) lie past ``position``."""
        budget = min(self._store.readahead * self._store.range_size, self._streak)
        end = self._ahead[-1][0] + self._ahead[-1][1] if self._ahead else position
        while end - position < budget and end < self._ahead_stop and len(self._ahead) <= 2 * self._store.readahead:
            self._fetch(end, self._step())
            end = self._ahead[-1][0] + self._ahead[-1][1]

    def _fetch(self, start: int, size: int) -> None:
        size = max(0, min(size, self.size - start))
        if size:
            self._ahead.append((start, size, self._store._reading.submit(self._read_ahead, start, size)))

    def _read_ahead(self, start: int, size: int) -> tuple[bytearray, int]:
        data = None
        if size == self._store.range_size:
            try:
                data = self._spare.pop()  # list.pop is atomic: two read-aheads never share one
            except IndexError:
                pass
        if data is None:
            data = bytearray(size)
        return data, self._read_range(memoryview(data), start)

    def _drop_ahead(self) -> None:
        for _, _, future in self._ahead:
            future.cancel()
        self._ahead.clear()

    def _read_range(self, view: memoryview, offset: int) -> int:
        """One ranged GET read into ``view``; the bytes read (fewer if the object is short)."""
        if not view.nbytes:
            return 0
        store = self._store
        response = store._call(f"read {self.key}", store.client.get_object, Bucket=store.bucket, Key=self.key,
                               Range=f"bytes={offset}-{offset + view.nbytes - 1}", not_found=True)
        body = response["Body"]
        direct = _plain_http_response(body)
        readinto = direct.readinto if direct is not None else body.readinto
        filled = 0
        try:
            while filled < view.nbytes:
                got = store._call(f"read {self.key}", readinto, view[filled:])
                if not got:
                    break
                filled += got
        finally:
            if direct is not None and direct.isclosed():  # read to its end: the connection is reusable
                body._raw_stream.release_conn()
            body.close()
        return filled

    def fileno(self) -> int:
        raise io.UnsupportedOperation(f"blob {self.key} is an object in bucket {self._store.bucket}, not a local file")

    def close(self) -> None:
        with self._lock:
            self._drop_ahead()


def _plain_http_response(body) -> http.client.HTTPResponse | None:
    """The ``http.client`` response under a GET's body (botocore's StreamingBody over urllib3's
    HTTPResponse) when its bytes can be read from it as they are: a known length, neither
    chunked nor encoded. Its ``readinto`` reads from the socket straight into the caller's
    buffer, where urllib3 2.x's reads into a new ``bytes`` and copies it: a 1 GiB read took
    0.50 CPU-s instead of 0.75 and 0.79 s instead of 0.98 (SeaweedFS, docs/benchmarks.md).
    None (read through the wrappers) for anything else."""
    raw = getattr(body, "_raw_stream", None)
    response = getattr(raw, "_fp", None)
    if not isinstance(response, http.client.HTTPResponse) or not hasattr(raw, "release_conn"):
        return None
    if response.chunked or response.length is None or raw.headers.get("content-encoding"):
        return None
    return response


class S3TempBlob:
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

    def __init__(self, store: "S3BlobStore", expected: str | None = None) -> None:
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
            if self._upload_id is None and self._target is not None and self._store._exists(self._target):
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
        created = store._call(f"start an upload to {key}", store.client.create_multipart_upload,
                              Bucket=store.bucket, Key=key)
        self._upload_key, self._upload_id = key, created["UploadId"]

    def _send_part(self, buffer: bytearray, reuse: bool = True) -> None:
        store = self._store
        self._raise_failed()
        number = len(self._parts) + 1
        key, upload_id = self._upload_key, self._upload_id

        def upload() -> dict:
            try:
                answer = store._call(f"upload part {number} of {key}", store.client.upload_part,
                                     Bucket=store.bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=buffer)
                return {"PartNumber": number, "ETag": answer["ETag"]}
            finally:
                if reuse:
                    self._free.put(buffer)

        self._parts.append(store._uploading.submit(upload))

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
        store._call(f"complete the upload of {self._upload_key}", store.client.complete_multipart_upload,
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
            if not store._exists(target):  # looked up again now that the caller holds its lease
                raise StorageUnavailable(
                    f"S3 {store.where()}: blob {digest} was in the bucket when this Store began to send it, and was "
                    "collected before the Store ended (its archive deleted meanwhile): run the Store again")
            return False
        try:
            if self._upload_id is None:  # every byte is held: straight to the digest key
                parts = self._held + [tail for tail in [self._tail()] if tail is not None]
                self._held = []
                if store._exists(target):
                    return False
                if len(parts) <= 1:
                    store._call(f"write {target}", store.client.put_object, Bucket=store.bucket, Key=target,
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
                if store._exists(target):
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
            stored = not store._exists(target)
            if stored:
                store._copy(self.key, target, self.size)
        except BaseException:
            self._drop_completed()
            raise
        self._drop_completed()
        return stored

    def _drop_completed(self) -> None:
        """Delete the completed temporary object (if that fails, clear_temporary does it later)."""
        try:
            self._store._delete(self.key)
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
                store._call(f"abort the upload of {key}", store.client.abort_multipart_upload,
                            Bucket=store.bucket, Key=key, UploadId=upload_id)
            except StorageUnavailable:
                pass  # clear_temporary aborts it later


class S3BlobStore:
    """Blobs in ``s3://BUCKET/PREFIX`` (see the module's docstring for the layout and the costs)."""

    #: A digest given ahead spares a large payload its temporary object and its copy.
    wants_digests = True

    def __init__(self, url: str, *, part_size: int = PART_SIZE, parts_in_flight: int = PARTS_IN_FLIGHT,
                 range_size: int = RANGE_SIZE, readahead: int = READAHEAD, readers: int = 16, uploaders: int = 16,
                 env: dict[str, str] | None = None) -> None:
        parsed = urlparse(url)
        if parsed.scheme != "s3" or not parsed.netloc:
            raise ValueError(f"not an S3 blob store URL (s3://BUCKET/PREFIX): {url!r}")
        if part_size < 5 * MiB:
            raise ValueError(f"part size {part_size} is below S3's minimum of 5 MiB")
        self.bucket = parsed.netloc
        prefix = parsed.path.strip("/")
        self.prefix = f"{prefix}/" if prefix else ""
        self.url = url
        self.part_size = part_size
        self.parts_in_flight = max(1, parts_in_flight)
        self.range_size = range_size
        self.readahead = readahead
        env = dict(os.environ if env is None else env)
        self.endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or None
        config = Config(
            retries={"mode": "standard"}, connect_timeout=5, read_timeout=60,
            max_pool_connections=readers + uploaders + 4,
            # Path-style addressing for an endpoint of one's own (SeaweedFS, MinIO: no bucket DNS
            # names). Uploads keep botocore's checksum (CRC32), which the bucket checks: a part
            # damaged on the way is refused (SeaweedFS answers BadDigest). They are not also
            # SHA-256-signed over plain HTTP ("UNSIGNED-PAYLOAD", as botocore does over HTTPS):
            # that pass cost the replica 0.9 CPU-s per GiB, and SeaweedFS does not check it.
            s3={"addressing_style": "path" if self.endpoint else "auto", "payload_signing_enabled": False},
            # Reads are checked by the block CRCs of the catalog instead.
            response_checksum_validation="when_required",
        )
        self.region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or "us-east-1"
        session = boto3.session.Session(
            aws_access_key_id=env.get("AWS_ACCESS_KEY_ID"), aws_secret_access_key=env.get("AWS_SECRET_ACCESS_KEY"),
            aws_session_token=env.get("AWS_SESSION_TOKEN"),
            region_name=self.region)
        self.client = session.client("s3", endpoint_url=self.endpoint, config=config)
        self._reading = ThreadPoolExecutor(readers, thread_name_prefix="tannery-s3-read")
        self._uploading = ThreadPoolExecutor(uploaders, thread_name_prefix="tannery-s3-upload")

    # -- keys ---------------------------------------------------------------------------------

    def key(self, digest: str) -> str:
        if not _DIGEST.fullmatch(digest):
            raise ValueError(f"not a SHA-256 hex digest: {digest!r}")
        return f"{self.prefix}blobs/{digest[:2]}/{digest[2:4]}/{digest}"

    def temp_key(self) -> str:
        return f"{self.prefix}tmp/{time.time_ns()}-{uuid.uuid4().hex}"

    def where(self) -> str:
        return f"bucket {self.bucket!r} at {self.endpoint or 'AWS S3'}"

    # -- calls ----------------------------------------------------------------------------------

    def _call(self, action: str, function: Callable[..., _T], *args, not_found: bool = False, **kwargs) -> _T:
        """``function(*args, **kwargs)`` with botocore's retries; StorageUnavailable naming the
        store and ``action`` when it still fails (FileNotFoundError for a 404 if ``not_found``)."""
        try:
            return function(*args, **kwargs)
        except (BotoCoreError, ClientError, OSError, http.client.HTTPException) as exc:
            if not_found and _is_missing(exc):
                raise FileNotFoundError(f"{action}: no such object in {self.where()}") from None
            raise StorageUnavailable(f"S3 {self.where()}: {action} failed: {_reason(exc)}") from exc

    def _exists(self, key: str) -> bool:
        try:
            self._call(f"look up {key}", self.client.head_object, Bucket=self.bucket, Key=key, not_found=True)
        except FileNotFoundError:
            return False
        return True

    def _copy(self, source: str, target: str, size: int) -> None:
        """Server-side copy: one CopyObject up to 5 GiB, UploadPartCopy parts beyond (s3transfer)."""
        if size <= _COPY_LIMIT:
            self._call(f"copy {source} to {target}", self.client.copy_object, Bucket=self.bucket, Key=target,
                       CopySource={"Bucket": self.bucket, "Key": source})
            return
        config = TransferConfig(multipart_threshold=_COPY_LIMIT, multipart_chunksize=1 << 30, max_concurrency=4)
        self._call(f"copy {source} to {target}", self.client.copy, {"Bucket": self.bucket, "Key": source},
                   self.bucket, target, Config=config)

    def _delete(self, key: str) -> None:
        self._call(f"delete {key}", self.client.delete_object, Bucket=self.bucket, Key=key)

    def _list(self, prefix: str) -> Iterator[dict]:
        paginator = self.client.get_paginator("list_objects_v2")
        pages = paginator.paginate(Bucket=self.bucket, Prefix=prefix)
        iterator = iter(pages)
        while True:
            page = self._call(f"list {prefix}", next, iterator, None)
            if page is None:
                return
            yield from page.get("Contents", [])

    # -- BlobStore ------------------------------------------------------------------------------

    def create(self, expected: str | None = None) -> S3TempBlob:
        return S3TempBlob(self, expected)

    def make_durable(self, digests: Iterable[str]) -> None:
        """Nothing to do: S3 answers a PUT, a completed upload or a copy only once the object is
        stored durably (AWS; SeaweedFS and MinIO once it is on their volumes)."""

    def open(self, digest: str, size: int | None = None) -> S3Blob:
        key = self.key(digest)
        if size is None:
            head = self._call(f"look up blob {digest}", self.client.head_object, Bucket=self.bucket, Key=key,
                              not_found=True)
            size = int(head["ContentLength"])
        return S3Blob(self, key, size)

    def remove(self, digest: str) -> int:
        key = self.key(digest)
        try:
            head = self._call(f"look up blob {digest}", self.client.head_object, Bucket=self.bucket, Key=key,
                              not_found=True)
        except FileNotFoundError:
            return 0
        self._delete(key)
        return int(head["ContentLength"])

    def digests(self) -> Iterator[str]:
        start = len(self.prefix) + len("blobs/")
        for item in self._list(f"{self.prefix}blobs/"):
            name = item["Key"][start:]
            digest = name[6:]
            if _DIGEST.fullmatch(digest) and name[:6] == f"{digest[:2]}/{digest[2:4]}/":
                yield digest

    def temporaries(self) -> list[str]:
        """The temporary objects and the unfinished multipart uploads under the prefix, by key."""
        found = [item["Key"] for item in self._list(f"{self.prefix}tmp/")]
        paginator = self.client.get_paginator("list_multipart_uploads")
        pages = iter(paginator.paginate(Bucket=self.bucket, Prefix=self.prefix))
        while (page := self._call(f"list the uploads under {self.prefix or '/'}", next, pages, None)) is not None:
            found += [f"{upload['Key']} (upload {upload['UploadId']})" for upload in page.get("Uploads", [])]
        return sorted(found)

    def clear_temporary(self, older_than_ns: int | None = None) -> int:
        """Delete temporary objects and abort multipart uploads under the prefix that have been
        idle since before ``older_than_ns`` (None: all of them). Idle, not old: an upload still
        receiving parts is a Store in progress, however long ago it began (a 100 GiB payload
        streams for many minutes), so its newest part's time counts, and a temporary object's
        own (written when its upload completed, copied right after)."""
        tmp = f"{self.prefix}tmp/"
        count = 0
        for item in list(self._list(tmp)):
            started = item["Key"][len(tmp):].split("-", 1)[0]
            if older_than_ns is not None and (not started.isdigit() or int(started) >= older_than_ns
                                              or _ns(item["LastModified"]) >= older_than_ns):
                continue
            self._delete(item["Key"])
            count += 1
        # Uploads go to tmp/ (a streamed payload) or straight to blobs/ (one held in memory, or
        # streamed with its digest given ahead).
        paginator = self.client.get_paginator("list_multipart_uploads")
        pages = iter(paginator.paginate(Bucket=self.bucket, Prefix=self.prefix))
        stale = []
        while (page := self._call(f"list the uploads under {self.prefix or '/'}", next, pages, None)) is not None:
            for upload in page.get("Uploads", []):
                if older_than_ns is None or _ns(upload["Initiated"]) < older_than_ns:
                    stale.append(upload)
        for upload in stale:
            if older_than_ns is not None and self._last_part_ns(upload) >= older_than_ns:
                continue  # still receiving parts
            try:
                self._call(f"abort the upload of {upload['Key']}", self.client.abort_multipart_upload,
                           Bucket=self.bucket, Key=upload["Key"], UploadId=upload["UploadId"], not_found=True)
            except FileNotFoundError:
                continue  # completed or aborted meanwhile
            count += 1
        return count

    def _last_part_ns(self, upload: dict) -> int:
        """When the newest part of ``upload`` was uploaded (0: none, or the upload is gone)."""
        paginator = self.client.get_paginator("list_parts")
        pages = iter(paginator.paginate(Bucket=self.bucket, Key=upload["Key"], UploadId=upload["UploadId"]))
        newest = 0
        try:
            while (page := self._call(f"list the parts of {upload['Key']}", next, pages, None,
                                      not_found=True)) is not None:
                newest = max([newest] + [_ns(part["LastModified"]) for part in page.get("Parts", [])])
        except FileNotFoundError:
            return 0
        return newest

    def check(self) -> None:
        """HeadBucket: StorageUnavailable naming the bucket and the endpoint unless it answers
        (:class:`MissingBucket`, with the remedy, when it answers that the bucket does not exist)."""
        try:
            self._call("check the bucket", self.client.head_bucket, Bucket=self.bucket, not_found=True)
        except FileNotFoundError:
            raise MissingBucket(f"S3 {self.where()}: no such bucket (create it: "
                                f"{_make_bucket(self.bucket, self.endpoint)})") from None

    def ensure_bucket(self, create: bool = False, offer_create: bool = True) -> bool:
        """At start: the bucket is there, or is created when ``create``; True when it was created.

        A missing bucket otherwise raises :class:`MissingBucket`, one line naming the bucket, the
        endpoint and the remedy (``--create-bucket`` among it when ``offer_create``); an
        unreachable one, StorageUnavailable naming it.
        """
        try:
            self.check()
            return False
        except MissingBucket:
            if not create:
                where = self.endpoint or "AWS S3"
                remedy = (f"create it ({_make_bucket(self.bucket, self.endpoint)}) or start with --create-bucket"
                          if offer_create else "check --blobs and AWS_ENDPOINT_URL_S3")
                raise MissingBucket(f"bucket {self.bucket!r} does not exist at {where}: {remedy}") from None
        self._create_bucket()
        self.check()  # created (by us, or meanwhile by another replica), and ours to use
        return True

    def _create_bucket(self) -> None:
        """CreateBucket in this store's region. Another replica creating it at the same moment is
        no failure (S3 answers "already owned by you"; SeaweedFS "already exists")."""
        where = {} if self.region == "us-east-1" else {"CreateBucketConfiguration": {"LocationConstraint": self.region}}
        try:
            self.client.create_bucket(Bucket=self.bucket, **where)
        except ClientError as exc:
            if _error_code(exc) in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                return
            raise StorageUnavailable(f"S3 {self.where()}: no such bucket, and creating it failed: "
                                     f"{_reason(exc)}") from exc
        except (BotoCoreError, OSError, http.client.HTTPException) as exc:
            raise StorageUnavailable(f"S3 {self.where()}: creating the bucket failed: {_reason(exc)}") from exc

    def close(self) -> None:
        self._reading.shutdown(wait=False)
        self._uploading.shutdown(wait=False)
