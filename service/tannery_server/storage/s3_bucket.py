"""An S3-compatible bucket as the blob store uses it: the client (botocore's retries, the AWS
variables for the endpoint and credentials), the keys of blobs and temporary objects, and each
call's failure raised as :class:`~.errors.StorageUnavailable` naming the bucket, the endpoint
and what failed (a missing object as FileNotFoundError, as the file store does).
"""

from __future__ import annotations

import http.client
import os
import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, TypeVar
from urllib.parse import urlparse

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

from .errors import StorageUnavailable

if TYPE_CHECKING:
    from .upload_memory import MemoryBudget

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

class S3Bucket:
    """``s3://BUCKET/PREFIX``: the client, the keys under the prefix, the calls, and the sizes the
    reads and uploads of :class:`~.s3_blobs.S3BlobStore` use (see its module for the costs)."""

    def __init__(self, url: str, *, part_size: int = PART_SIZE, parts_in_flight: int = PARTS_IN_FLIGHT,
                 range_size: int = RANGE_SIZE, readahead: int = READAHEAD, readers: int = 16, uploaders: int = 16,
                 env: dict[str, str] | None = None, memory: "MemoryBudget | None" = None,
                 spill_dir: Path | None = None) -> None:
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
        #: The replica's memory for payloads held before they go to the bucket (None: unbounded),
        #: and where a payload that finds no room in it spills (None: the system's temporary directory).
        self.memory = memory
        self.spill_dir = spill_dir
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
        self.reading = ThreadPoolExecutor(readers, thread_name_prefix="tannery-s3-read")
        self.uploading = ThreadPoolExecutor(uploaders, thread_name_prefix="tannery-s3-upload")

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

    def call(self, action: str, function: Callable[..., _T], *args, not_found: bool = False, **kwargs) -> _T:
        """``function(*args, **kwargs)`` with botocore's retries; StorageUnavailable naming the
        store and ``action`` when it still fails (FileNotFoundError for a 404 if ``not_found``)."""
        try:
            return function(*args, **kwargs)
        except (BotoCoreError, ClientError, OSError, http.client.HTTPException) as exc:
            if not_found and _is_missing(exc):
                raise FileNotFoundError(f"{action}: no such object in {self.where()}") from None
            raise StorageUnavailable(f"S3 {self.where()}: {action} failed: {_reason(exc)}") from exc

    def exists(self, key: str) -> bool:
        try:
            self.call(f"look up {key}", self.client.head_object, Bucket=self.bucket, Key=key, not_found=True)
        except FileNotFoundError:
            return False
        return True

    def copy_object(self, source: str, target: str, size: int) -> None:
        """Server-side copy: one CopyObject up to 5 GiB, UploadPartCopy parts beyond (s3transfer)."""
        if size <= _COPY_LIMIT:
            self.call(f"copy {source} to {target}", self.client.copy_object, Bucket=self.bucket, Key=target,
                       CopySource={"Bucket": self.bucket, "Key": source})
            return
        config = TransferConfig(multipart_threshold=_COPY_LIMIT, multipart_chunksize=1 << 30, max_concurrency=4)
        self.call(f"copy {source} to {target}", self.client.copy, {"Bucket": self.bucket, "Key": source},
                   self.bucket, target, Config=config)

    def delete_key(self, key: str) -> None:
        self.call(f"delete {key}", self.client.delete_object, Bucket=self.bucket, Key=key)

    def listing(self, prefix: str) -> Iterator[dict]:
        paginator = self.client.get_paginator("list_objects_v2")
        pages = paginator.paginate(Bucket=self.bucket, Prefix=prefix)
        iterator = iter(pages)
        while True:
            page = self.call(f"list {prefix}", next, iterator, None)
            if page is None:
                return
            yield from page.get("Contents", [])

    def check(self) -> None:
        """HeadBucket: StorageUnavailable naming the bucket and the endpoint unless it answers
        (:class:`MissingBucket`, with the remedy, when it answers that the bucket does not exist)."""
        try:
            self.call("check the bucket", self.client.head_bucket, Bucket=self.bucket, not_found=True)
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
        self.reading.shutdown(wait=False)
        self.uploading.shutdown(wait=False)
