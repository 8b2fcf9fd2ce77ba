"""A shared catalog knows its bucket: the blob store it was first started with, and an identity
object written there (issue #43).

Without it, a replica started on a catalog with another bucket or prefix served: it listed the
archives, failed every Fetch, and its sweeper would have collected rows whose objects it could
not see. Now the first replica on a catalog records, under the schema's lock, the blob store's
URL (``s3://BUCKET/PREFIX``, or the ``file:`` directory) and a random identity, which it first
writes into that store (``PREFIX/tannery-identity``). Every later start compares: another
URL, or a store whose identity object is missing or another's (the same bucket name at
another endpoint, a bucket emptied or replaced), stops the start with :class:`WrongBlobStore`,
naming both and the remedy. A bucket that holds another catalog's identity is refused the
same way when a new catalog starts on it; so is, for a catalog from before this record (one
with archives), a store that does not hold the blob of one of its entries.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import TYPE_CHECKING, Any

from .base import BlobStore
from .errors import WrongBlobStore
from .file_blobs import FileBlobStore
from .postgres_pool import Cursor, PostgresPool
from .private import replace_private

if TYPE_CHECKING:
    from .s3_bucket import S3Bucket

#: The identity object's name under the blob store's prefix (beside ``blobs/`` and ``tmp/``).
IDENTITY = "tannery-identity"
#: The advisory lock of schema changes (postgres_schema): replicas starting at once record one identity.
_LOCK = (0x7A77, 1)
_TABLE = """CREATE TABLE IF NOT EXISTS blob_store (
    id integer PRIMARY KEY CHECK (id = 1),
    url text NOT NULL,
    identity text NOT NULL,
    created_ns bigint NOT NULL
)"""


def check_blob_store(catalog_url: str, catalog_name: str, blobs_url: str, blobs: BlobStore) -> str:
    """Record this blob store as the catalog's at its first start, else check it is the one
    recorded; the identity. WrongBlobStore when it is not; StorageUnavailable when either does
    not answer."""
    db = PostgresPool(catalog_url, min_size=1, max_size=1)
    try:
        return db.write("checking the catalog's blob store",
                        lambda cur: _check(cur, catalog_name, _canonical(blobs_url), _IdentityObject(blobs)))
    finally:
        db.close()


def _check(cur: Cursor, catalog: str, url: str, store: "_IdentityObject") -> str:
    cur.execute("SELECT pg_advisory_xact_lock(%s, %s)", _LOCK)
    cur.execute(_TABLE)
    row = cur.execute("SELECT url, identity FROM blob_store WHERE id = 1").fetchone()
    found = store.read()
    if row is None:
        if found is not None:
            raise WrongBlobStore(
                f"{store.where(url)} belongs to another catalog (its {IDENTITY} object names catalog "
                f"{found.get('catalog', '?')}, identity {found.get('identity', '?')}); catalog {catalog} has none yet: "
                "give this catalog a bucket or prefix of its own (--blobs), or start with the catalog that bucket "
                "belongs to")
        has_entries = cur.execute("SELECT to_regclass('entries') IS NOT NULL").fetchone()[0]
        sample = cur.execute("SELECT blob FROM entries LIMIT 1").fetchone() if has_entries else None
        if sample is not None and not store.holds(sample[0]):
            # A catalog from before the record (it has archives): recorded only if its bytes are here.
            raise WrongBlobStore(
                f"catalog {catalog} holds archives whose blob {sample[0]} is not in {store.where(url)}: start with "
                "the --blobs its archives were stored to (it is recorded then)")
        identity = uuid.uuid4().hex
        store.write({"identity": identity, "catalog": catalog, "url": url})
        cur.execute("INSERT INTO blob_store (id, url, identity, created_ns) VALUES (1, %s, %s, %s)",
                    (url, identity, time.time_ns()))
        return identity
    recorded, identity = row
    if recorded != url:
        raise WrongBlobStore(
            f"catalog {catalog} belongs to blobs {recorded} (recorded at its first start), not {url}: start with "
            f"--blobs {recorded}; to move the archives to another bucket or prefix, copy them with tannery "
            "migrate into a catalog of its own there")
    if found is None or found.get("identity") != identity:
        what = "has no" if found is None else f"has another ({found.get('identity')}, of catalog {found.get('catalog')})"
        raise WrongBlobStore(
            f"catalog {catalog} belongs to blobs {recorded} with identity {identity}, but {store.where(url)} {what} "
            f"{IDENTITY} object: it is not the catalog's bucket (another endpoint, or a bucket emptied or replaced). "
            f"Point AWS_ENDPOINT_URL_S3 at the catalog's bucket; if it is that bucket, restore {IDENTITY} "
            f'({{"identity": "{identity}"}})')
    return identity


def _canonical(url: str) -> str:
    """``url`` as recorded: ``s3://BUCKET/PREFIX`` without extra slashes (a ``file:`` URL as given:
    the factory makes its directory absolute)."""
    if not url.startswith("s3://"):
        return url
    bucket, _, prefix = url[len("s3://"):].partition("/")
    prefix = prefix.strip("/")
    return f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"


class _IdentityObject:
    """The identity object of a blob store: a JSON object under its prefix (a bucket) or in its
    directory, beside ``blobs/``."""

    def __init__(self, blobs: BlobStore) -> None:
        self.blobs: Any = getattr(blobs, "inner", blobs)  # behind a read cache: the store itself

    def where(self, url: str) -> str:
        endpoint = getattr(self.blobs, "endpoint", None)
        return f"{url} at {endpoint or 'AWS S3'}" if url.startswith("s3://") else url

    def holds(self, digest: str) -> bool:
        """Whether blob ``digest`` is in the store."""
        try:
            self.blobs.open(digest).close()  # no size given: a bucket is asked whether it is there
        except FileNotFoundError:
            return False
        return True

    def read(self) -> dict | None:
        bucket = self._bucket()
        if bucket is None:
            try:
                data = (self.blobs.root / IDENTITY).read_bytes()
            except FileNotFoundError:
                return None
        else:
            try:
                answer = bucket.call(f"read {bucket.prefix}{IDENTITY}", bucket.client.get_object, Bucket=bucket.bucket,
                                     Key=f"{bucket.prefix}{IDENTITY}", not_found=True)
            except FileNotFoundError:
                return None
            data = answer["Body"].read()
        try:
            found = json.loads(data)
        except ValueError:
            return {"identity": "(unreadable)"}
        return found if isinstance(found, dict) else {"identity": "(unreadable)"}

    def write(self, content: dict) -> None:
        data = json.dumps(content, sort_keys=True).encode() + b"\n"
        bucket = self._bucket()
        if bucket is None:
            replace_private(self.blobs.root / IDENTITY, data)
            return
        bucket.call(f"write {bucket.prefix}{IDENTITY}", bucket.client.put_object, Bucket=bucket.bucket,
                    Key=f"{bucket.prefix}{IDENTITY}", Body=data)

    def _bucket(self) -> "S3Bucket | None":
        return None if isinstance(self.blobs, FileBlobStore) else self.blobs  # type: ignore[return-value]


__all__ = ["IDENTITY", "WrongBlobStore", "check_blob_store"]
