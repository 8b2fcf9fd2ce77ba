"""Where archives live: a catalog (SQLite) and content-addressed blobs (files), behind
the small :class:`Catalog` and :class:`BlobStore` protocols of :mod:`.base`."""

from .base import (ArchiveRecord, BlobFile, BlobInfo, BlobStore, Catalog, CatalogTotals, EntryRecord, ArchiveLimits,
                   TempBlob)
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
    "SpaceReserve",
    "Storage",
    "StorageFull",
    "StorageUnavailable",
    "TempBlob",
]
