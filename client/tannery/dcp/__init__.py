"""torch.distributed.checkpoint through a tannery server: ``storage_writer=tannery.dcp.Writer(...)``
and ``storage_reader=tannery.dcp.Reader(...)`` (:mod:`.storage`), versioned saves with an alias
on the newest and retention (:mod:`.versions`)."""

from tannery.dcp.storage import METADATA_ENTRY, Reader, StoredItem, Writer, entry_name

__all__ = ["METADATA_ENTRY", "Reader", "StoredItem", "Writer", "entry_name"]
