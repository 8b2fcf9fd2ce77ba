"""Where archives live: a catalog (SQLite) and content-addressed blobs (files), behind
the small :class:`Catalog` and :class:`BlobStore` protocols of :mod:`.base`.

``PostgresCatalog`` (the catalog replicas share) is imported on first use, so the embedded
server never needs psycopg."""

from .base import (ArchiveRecord, BlobFile, BlobInfo, BlobStore, Catalog, CatalogTotals, EntryRecord, ArchiveLimits,
                   SharedCatalog, TempBlob)
from .reserve import SpaceReserve
from .catalog_and_blobs import Collected, Storage
from .errors import StorageFull, StorageUnavailable
from .lock import DataDirectoryInUse, DataDirectoryLock
from .payload_writer import PayloadWriter
from .sqlite_catalog import CatalogTooNew

__all__ = [
    "ArchiveRecord",
    "BlobFile",
    "BlobInfo",
    "BlobStore",
    "Catalog",
    "CatalogTooNew",
    "CatalogTotals",
    "Collected",
    "DataDirectoryInUse",
    "DataDirectoryLock",
    "EntryRecord",
    "ArchiveLimits",
    "PayloadWriter",
    "PostgresCatalog",
    "SpaceReserve",
    "SharedCatalog",
    "Storage",
    "StorageFull",
    "StorageUnavailable",
    "TempBlob",
]


def __getattr__(name: str):
    if name == "PostgresCatalog":
        from .postgres_catalog import PostgresCatalog

        return PostgresCatalog
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
