"""The one place where a catalog URL and a blobs URL become a :class:`Storage`.

* nothing, ``sqlite:`` and ``file:`` with the data directory: the embedded store (one
  server per data directory, :meth:`Storage.open_local`);
* ``postgresql://USER@HOST:PORT/DB``: a catalog that replicas share, with blobs in
  ``s3://BUCKET/PREFIX`` (or a ``file:`` directory every replica mounts): a
  :class:`SharedStorage`, whose collection is lease-based and delayed;
* a SQLite catalog with blobs in a bucket: one server, the embedded rules, remote bytes.

``cache_dir`` puts a local LRU of whole blobs in front of a bucket. The drivers of a
remote store (psycopg, the S3 client) are imported only when one is asked for.
"""

from __future__ import annotations

import logging
from pathlib import Path
from urllib.parse import urlsplit

from ..config import Config
from .base import BlobStore
from .catalog_and_blobs import Storage
from .file_blobs import FileBlobStore
from .private import check_private

log = logging.getLogger("tannery_server.storage")


def open_storage(config: Config, collecting: bool = True, offer_create: bool = True) -> Storage:
    """The storage ``config`` names, opened and recovered (ready to serve). ``collecting=False``
    for a tool beside running servers: a shared store then collects nothing itself, and a data
    directory is not recovered (what recovery would remove, ``tannery scrub`` reports).
    ``offer_create=False`` for a tool without ``--create-bucket`` (see :func:`open_blobs`)."""
    catalog_scheme = _scheme(config.catalog, "sqlite")
    blobs_scheme = _scheme(config.blobs, "file")
    if catalog_scheme == "sqlite":
        _check_same_directory(config)
        check_private(config.data_dir, config.fix_permissions)
        if blobs_scheme == "file":
            return Storage.open_local(config.data_dir, config.reserve_bytes, recovering=collecting)
        blobs = open_blobs(config, offer_create)
        try:
            return Storage.open_local(config.data_dir, config.reserve_bytes, blobs=blobs, recovering=collecting)
        except BaseException:
            blobs.close()  # a bucket's threads, a cache's files: the storage never took them
            raise
    from .postgres_catalog import PostgresCatalog
    from .shared_storage import SharedStorage

    blobs = open_blobs(config, offer_create)
    try:
        catalog = PostgresCatalog(config.catalog)
    except BaseException:
        blobs.close()  # a bucket's threads; a directory has none
        raise
    try:
        from .deployment import check_blob_store

        where = config.blobs if blobs_scheme == "s3" else f"file:{(_file_path(config.blobs) or config.data_dir).resolve()}"
        check_blob_store(config.catalog, catalog.name, where, blobs)
    except BaseException:
        catalog.close()
        blobs.close()
        raise
    storage = SharedStorage(catalog, blobs, grace_seconds=config.gc_grace_seconds,
                            lease_seconds=config.lease_seconds, collecting=collecting)
    try:
        storage.recover()
    except BaseException:
        storage.close()
        raise
    return storage


def describe(config: Config) -> str:
    """Where the data lives, for the start-up line (no password)."""
    from ..config import without_password

    if _scheme(config.catalog, "sqlite") == "sqlite" and _scheme(config.blobs, "file") == "file":
        return f"data directory {config.data_dir.resolve()}"
    cache = f", cache {config.cache_dir} ({config.cache_size} bytes)" if config.cache_dir and config.cache_size else ""
    catalog = without_password(config.catalog) if config.catalog else f"{config.data_dir}/catalog.sqlite3"
    return f"catalog {catalog}, blobs {config.blobs or config.data_dir}{cache}"


def open_blobs(config: Config, offer_create: bool = True) -> BlobStore:
    """The blob store of ``config.blobs``, behind the read cache when ``cache_dir`` is set.

    A bucket is checked first: one that does not exist is created with ``config.create_bucket``,
    else the start fails with :class:`~.s3_blobs.MissingBucket` naming the bucket, the endpoint
    and the remedy (``--create-bucket`` among them when ``offer_create``); an unreachable one
    fails it with StorageUnavailable naming it.
    """
    scheme = _scheme(config.blobs, "file")
    if scheme == "file":
        return FileBlobStore(_file_path(config.blobs) or config.data_dir)
    from .s3_blobs import S3BlobStore
    from .upload_memory import MemoryBudget

    bucket = S3BlobStore(config.blobs, memory=MemoryBudget(config.upload_memory), spill_dir=config.data_dir)
    try:
        # Only a tool that offers --create-bucket creates one (scrub never does, whatever the environment says).
        if bucket.ensure_bucket(create=config.create_bucket and offer_create, offer_create=offer_create):
            log.info("created the bucket %r at %s", bucket.bucket, bucket.endpoint or "AWS S3")
    except BaseException:
        bucket.close()
        raise
    store: BlobStore = bucket
    if config.cache_dir is not None and config.cache_size > 0:
        from .blob_cache import CachedBlobStore

        store = CachedBlobStore(store, Path(config.cache_dir), config.cache_size)
    return store


def _scheme(url: str, default: str) -> str:
    scheme = url.split(":", 1)[0] if url else default
    return "postgresql" if scheme == "postgres" else scheme


def _file_path(url: str) -> Path | None:
    """The directory of a ``file:`` URL (``file:///srv/tannery`` or ``file:relative``), None when empty."""
    if not url:
        return None
    parts = urlsplit(url)
    path = parts.path if parts.scheme == "file" else url
    return Path(path) if path else None


def _check_same_directory(config: Config) -> None:
    """An embedded store keeps catalog and blobs in the data directory: a ``sqlite:`` or ``file:``
    URL elsewhere is refused (rather than quietly ignored)."""
    for url, expected in ((config.catalog, config.data_dir / "catalog.sqlite3"), (config.blobs, config.data_dir)):
        path = _file_path(url)
        if path is not None and url.split(":", 1)[0] in ("sqlite", "file") and path.resolve() != expected.resolve():
            raise ValueError(f"{url!r}: the embedded store keeps its catalog and blobs in the data directory "
                             f"({config.data_dir}); set --data-dir instead (or use postgresql:// and s3://)")
