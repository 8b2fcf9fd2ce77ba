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
  in parallel). What all calls hold so is bounded by the replica's upload memory
  (``--upload-memory``, :mod:`.upload_memory`): a payload that finds no room spills to an
  unnamed local file, uploaded from there at seal. A larger one streams as a multipart upload (each part uploaded by a
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

from typing import Iterable, Iterator

from .base import BlobStore
from .s3_bucket import (_DIGEST, MiB, PART_SIZE, PARTS_IN_FLIGHT, RANGE_SIZE, READAHEAD, MissingBucket, S3Bucket,
                        _ns)
from .s3_reads import S3Blob
from .s3_uploads import S3TempBlob


class S3BlobStore(S3Bucket, BlobStore):
    """Blobs in ``s3://BUCKET/PREFIX`` (see the module's docstring for the layout and the costs)."""

    #: A digest given ahead spares a large payload its temporary object and its copy.
    wants_digests = True

    # -- BlobStore ------------------------------------------------------------------------------

    def create(self, expected: str | None = None) -> S3TempBlob:
        return S3TempBlob(self, expected)

    def make_durable(self, digests: Iterable[str]) -> None:
        """Nothing to do: S3 answers a PUT, a completed upload or a copy only once the object is
        stored durably (AWS; SeaweedFS and MinIO once it is on their volumes)."""

    def open(self, digest: str, size: int | None = None) -> S3Blob:
        key = self.key(digest)
        if size is None:
            head = self.call(f"look up blob {digest}", self.client.head_object, Bucket=self.bucket, Key=key,
                              not_found=True)
            size = int(head["ContentLength"])
        return S3Blob(self, key, size)

    def remove(self, digest: str) -> int:
        key = self.key(digest)
        try:
            head = self.call(f"look up blob {digest}", self.client.head_object, Bucket=self.bucket, Key=key,
                              not_found=True)
        except FileNotFoundError:
            return 0
        self.delete_key(key)
        return int(head["ContentLength"])

    def modified_ns(self, digest: str) -> int:
        head = self.call(f"look up blob {digest}", self.client.head_object, Bucket=self.bucket, Key=self.key(digest),
                         not_found=True)
        return int(head["LastModified"].timestamp() * 1e9)

    def digests(self) -> Iterator[str]:
        start = len(self.prefix) + len("blobs/")
        for item in self.listing(f"{self.prefix}blobs/"):
            name = item["Key"][start:]
            digest = name[6:]
            if _DIGEST.fullmatch(digest) and name[:6] == f"{digest[:2]}/{digest[2:4]}/":
                yield digest

    def temporaries(self) -> list[str]:
        """The temporary objects and the unfinished multipart uploads under the prefix, by key."""
        found = [item["Key"] for item in self.listing(f"{self.prefix}tmp/")]
        paginator = self.client.get_paginator("list_multipart_uploads")
        pages = iter(paginator.paginate(Bucket=self.bucket, Prefix=self.prefix))
        while (page := self.call(f"list the uploads under {self.prefix or '/'}", next, pages, None)) is not None:
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
        for item in list(self.listing(tmp)):
            started = item["Key"][len(tmp):].split("-", 1)[0]
            if older_than_ns is not None and (not started.isdigit() or int(started) >= older_than_ns
                                              or _ns(item["LastModified"]) >= older_than_ns):
                continue
            self.delete_key(item["Key"])
            count += 1
        # Uploads go to tmp/ (a streamed payload) or straight to blobs/ (one held in memory, or
        # streamed with its digest given ahead).
        paginator = self.client.get_paginator("list_multipart_uploads")
        pages = iter(paginator.paginate(Bucket=self.bucket, Prefix=self.prefix))
        stale = []
        while (page := self.call(f"list the uploads under {self.prefix or '/'}", next, pages, None)) is not None:
            for upload in page.get("Uploads", []):
                if older_than_ns is None or _ns(upload["Initiated"]) < older_than_ns:
                    stale.append(upload)
        for upload in stale:
            if older_than_ns is not None and self._last_part_ns(upload) >= older_than_ns:
                continue  # still receiving parts
            try:
                self.call(f"abort the upload of {upload['Key']}", self.client.abort_multipart_upload,
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
            while (page := self.call(f"list the parts of {upload['Key']}", next, pages, None,
                                      not_found=True)) is not None:
                newest = max([newest] + [_ns(part["LastModified"]) for part in page.get("Parts", [])])
        except FileNotFoundError:
            return 0
        return newest


__all__ = ["MiB", "MissingBucket", "PART_SIZE", "PARTS_IN_FLIGHT", "RANGE_SIZE", "READAHEAD", "S3Blob", "S3BlobStore",
           "S3TempBlob"]
