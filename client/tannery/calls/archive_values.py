"""Plain values on their way to a server: each tree of an archive's plain values
(:mod:`tannery.plain`) becomes an entry ``P.@values`` of the Store, a 1-D uint8 tensor of its
document. So they travel the entries' own path on every transport: committed in the same
Store as the tensors (whole or not at all), deleted with the archive, carried by a Union,
checked block by block on every read. A description lists them apart (``values``), a Fetch of
every entry leaves them out, and a remote archive reads them back (:mod:`tannery.remote`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from tannery_protocol import errors

from tannery import plain
from tannery.records import VALUES, values_entry, values_prefix

if TYPE_CHECKING:
    from tannery.archive import Archive


def refuse_values_names(archive: Archive, where: str) -> None:
    """ArchiveError for a tensor named like kept plain values (``@values``): the name is reserved."""
    for name in archive.names():
        if values_prefix(name) is not None:
            raise errors.ArchiveError(
                f"{where}: entry {name!r}: the name {VALUES!r} (alone, or after a dot) is reserved for the plain "
                "values kept with an archive; rename the tensor")


def with_values(archive: Archive, where: str) -> Archive:
    """``archive`` and an entry for each tree of its plain values (none added when it has none)."""
    from tannery.archive import Archive, MemoryArchive

    trees = archive._plain()
    if not trees:
        return archive
    entries = {values_entry(prefix): plain.as_tensor(tree, where, prefix) for prefix, tree in trees.items()}
    return Archive.union([archive, MemoryArchive(entries)])


def fetched_archive(pairs: Iterable[tuple[str, Any]], where: str) -> Archive:
    """The in-memory archive of fetched ``(name, tensor)`` pairs, the plain values lifted out of their entries."""
    from tannery.archive import MemoryArchive

    tensors, trees = {}, {}
    for name, tensor in pairs:
        prefix = values_prefix(name)
        if prefix is None:
            tensors[name] = tensor
        else:
            trees[prefix] = plain.of_tensor(tensor, f"{where}: entry {name!r}")
    return MemoryArchive(tensors, trees)


__all__ = ["fetched_archive", "refuse_values_names", "with_values"]
