"""Archives in files: safetensors files and .tannic checkpoint pairs, memory-mapped.

A loaded archive is backed by a private (copy-on-write) memory map of its file: opening
reads the header only, and each tensor is a view of the map built when it is first
asked for, so ``names``, ``info``, ``tensor`` and ``to_value`` read none of the
entries' bytes; pages are read when the tensor's elements are used. Writing into a
tensor never changes the file. Two exceptions read on fetch: ``float`` when it casts,
and a boolean entry of a .tannic pair, which is bit-packed on disk and unpacked into a
new tensor.

Saving writes a temporary file and renames it into place, so a reader never sees half
of one. Malformed files raise :class:`~tannery_protocol.codec.FormatError`.

An archive's plain values (:mod:`tannery.plain`) are kept in its file too: in a safetensors
file's ``__metadata__``, one document per prefix under the key ``P.@values`` (text, as
safetensors asks); in a .tannic pair, which has no place for metadata, as a 1-D uint8 entry of
that name (the server's own way), which Tannic C++ and pytannic read as a byte buffer. Loading
lifts them out of the entries again.
"""

from __future__ import annotations

import math
import mmap
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tannery_protocol import codec
from tannery.formats import checkpoint
from tannery_protocol._lazy import lazy_module
from tannery import plain, plain_trees
from tannery.archive import Archive, IndexedArchive, TensorInfo
from tannery.records import values_entry, values_prefix
from tannery.formats.atomic import Replacement
from tannery_protocol.codec import FormatError, format_shape
from tannery_protocol.errors import ArchiveError
from tannery.formats.safetensors_format import CODES, read_layout
from tannery.values import leaf_dtype, named_leaves

# Imported on first use: reading a file's layout needs neither; a tensor view needs torch.
torch = lazy_module("torch")
tensors = lazy_module("tannery.torch")
safetensors = lazy_module("safetensors")

PathLike = str | os.PathLike[str]


@dataclass(frozen=True)
class MappedEntry:
    """Where one entry lies in a map, and how its elements are laid out there."""

    info: TensorInfo
    offset: int
    #: Booleans packed eight to a byte (.tannic) rather than one per byte (safetensors).
    packed_bools: bool = False


class MappedArchive(IndexedArchive):
    """An archive whose tensors view a private memory map of a file, built on first use."""

    __slots__ = ("path", "_map", "_tensors", "_trees")

    def __init__(self, path: PathLike, data: mmap.mmap, entries: Mapping[str, MappedEntry],
                 trees: Mapping[str, plain_trees.Node] | None = None) -> None:
        super().__init__(entries)
        self.path = Path(path)
        self._map = data
        self._tensors: dict[str, torch.Tensor] = {}
        self._trees = dict(trees or {})

    def _plain(self) -> Mapping[str, plain_trees.Node]:
        return self._trees

    def _fetch(self, names: Sequence[str]) -> list[torch.Tensor]:
        return [self._tensor(name) for name in names]

    def _tensor(self, name: str) -> torch.Tensor:
        tensor = self._tensors.get(name)
        if tensor is None:
            tensor = self._tensors.setdefault(name, self._view(self._entries[name]))
        return tensor

    def _view(self, entry: MappedEntry) -> torch.Tensor:
        info = entry.info
        dtype = codec.dtype_named(info.dtype)
        buffer = memoryview(self._map)[entry.offset : entry.offset + info.nbytes]
        if entry.packed_bools or info.numel == 0:
            return tensors.from_buffer(buffer, dtype, info.shape)
        return torch.frombuffer(buffer, dtype=tensors.torch_dtype(dtype), count=info.numel).reshape(info.shape)

    def __repr__(self) -> str:
        return f"<MappedArchive of {len(self._sorted)} entries over {str(self.path)!r}>"


def _map_file(path: Path, min_size: int, what: str) -> mmap.mmap:
    """A private, copy-on-write map of the whole file (FormatError if it has fewer than ``min_size`` bytes)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            raise FormatError(f"{what}: the file is empty (0 bytes); a safetensors file starts with an "
                              f"{min_size}-byte header length")
        if size < min_size:
            raise FormatError(f"{what}: {size} bytes, too short for the {min_size}-byte header length")
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)


def load_safetensors(path: PathLike) -> MappedArchive:
    """The archive of a safetensors file, memory-mapped; only its header is read.

    The header is checked strictly (known dtypes, sizes that match shapes, entries
    that tile the data region with no gap, overlap or trailing byte): FormatError
    otherwise. Its ``__metadata__`` is checked; the plain values kept there (``@values``
    keys) are read, and the rest ignored.
    """
    path = Path(path)
    data = _map_file(path, 8, str(path))
    layout = read_layout(data, str(path))
    entries = {
        e.name: MappedEntry(TensorInfo(e.dtype.name, e.shape, e.nbytes), layout.data_start + e.begin)
        for e in layout.entries
    }
    trees = {prefix: plain.decode(text, f"{path}: __metadata__[{key!r}]")
             for key, text in layout.metadata.items() if (prefix := values_prefix(key)) is not None}
    return MappedArchive(path, data, entries, trees)


def values_metadata(archive: Archive, where: str) -> dict[str, str]:
    """The plain values of ``archive`` as safetensors metadata: a document per prefix, under ``P.@values``."""
    return {values_entry(prefix): plain.encode(tree, where, prefix).decode("ascii")
            for prefix, tree in archive._plain().items()}


def save_safetensors(path: PathLike, archive: Archive) -> None:
    """Write every entry of ``archive`` to a safetensors file, with the safetensors package.

    TypeError naming the entry, before anything is written, for a dtype safetensors
    lacks (complex128). Tensors are written from their own memory when they are
    contiguous and on the CPU, otherwise from one contiguous CPU copy each. The archive's
    plain values go into ``__metadata__`` (see the module's docstring).
    """
    names = archive.names()
    for name in names:
        dtype = archive.info(name).dtype
        if dtype not in CODES:
            raise TypeError(
                f"save_safetensors: {name}: {dtype} has no safetensors dtype; safetensors has {', '.join(CODES)}"
            )
    host = [tensors.cpu_contiguous(t) for t in archive._fetch(names)] if names else []
    specs = {
        name: safetensors.TensorSpec(
            dtype=tensors.short_name(t.dtype),
            shape=list(t.shape),
            data_ptr=t.data_ptr(),
            data_len=t.numel() * t.element_size(),
        )
        for name, t in zip(names, host)
    }
    # serialize_file reads each tensor's memory through its pointer: `host` keeps them alive.
    metadata = values_metadata(archive, "save_safetensors")
    with Replacement(path) as tmp:
        safetensors.serialize_file(specs, tmp, metadata=metadata or None)
    del host


def save_tannic(path: PathLike, archive: Archive, codes: str = "seed") -> None:
    """Write every entry of ``archive`` as the .tannic pair ``<path>.tannic`` and ``<path>.metadata.tannic``.

    The pair stores no shapes (see :func:`load_tannic`). Entries are written in name
    order, each from its own memory when it is contiguous and on the CPU. ``codes="cpp"``
    writes complex entries under Tannic C++'s codes (:func:`tannery_protocol.codec.wire_code`).
    The archive's plain values go in as uint8 entries ``P.@values`` (see the module's docstring).
    """
    names = archive.names()
    clash = [name for name in names if values_prefix(name) is not None]
    if clash:
        raise ArchiveError(f"save_tannic: entry {clash[0]!r}: the name '@values' is reserved for plain values; "
                           "rename the tensor")
    items = [
        (name, tensors.codec_dtype(t.dtype), [tensors.buffer_of(t)])
        for name, t in zip(names, archive._fetch(names) if names else [])
    ]
    for prefix, tree in archive._plain().items():
        document = plain.as_tensor(tree, "save_tannic", prefix)
        items.append((values_entry(prefix), tensors.codec_dtype(document.dtype), [tensors.buffer_of(document)]))
    checkpoint.write_pair(path, sorted(items, key=lambda item: item[0]), codes)


def load_tannic(path: PathLike, like: Any = None, prefix: str = "") -> MappedArchive:
    """The archive of a .tannic pair, memory-mapped; only the metadata file is read.

    The pair stores no shapes: entries are 1-D (a boolean entry has eight elements per
    byte) unless ``like``, a value as :meth:`Archive.to_value` takes, gives theirs: each
    of its tensor leaves, named by its path under ``prefix``, must be an entry of the
    same dtype and size (ArchiveError naming it otherwise). Entries ``like`` lacks stay 1-D.
    """
    pair = checkpoint.open_pair(path)
    shapes: dict[str, tuple[int, ...]] = {}
    if like is not None:
        found = {entry.name: entry for entry in pair.entries}
        for name, leaf in named_leaves(like, prefix, "load_tannic").items():
            shapes[name] = _like_shape(found.get(name), name, leaf)
    entries, trees = {}, {}
    for entry in pair.entries:
        at_prefix = values_prefix(entry.name)
        if at_prefix is not None:
            if entry.dtype.name != "uint8":
                raise FormatError(f"load_tannic: entry {entry.name!r}: {entry.dtype}, not the uint8 bytes of plain "
                                  "values; the pair was not written by tannery: rename that entry")
            start = pair.data_start + entry.offset
            trees[at_prefix] = plain.decode(pair.data[start:start + entry.nbytes], f"load_tannic: entry {entry.name!r}")
            continue
        shape = shapes[entry.name] if entry.name in shapes else entry.flat_shape
        info = TensorInfo(entry.dtype.name, shape, entry.nbytes)
        entries[entry.name] = MappedEntry(info, pair.data_start + entry.offset, packed_bools=True)
    return MappedArchive(checkpoint.pair_paths(path)[0], pair.data, entries, trees)


def _like_shape(entry: checkpoint.PairEntry | None, name: str, leaf: Any) -> tuple[int, ...]:
    """The shape ``like``'s leaf gives an entry, checked against the entry's dtype and size."""
    if entry is None:
        raise ArchiveError(f"load_tannic: {name}: no entry in the file, a leaf in like")
    dtype = leaf_dtype(leaf)
    if dtype != entry.dtype.name:
        raise ArchiveError(f"load_tannic: {name}: {entry.dtype} in the file, {dtype} in like")
    shape = tuple(int(d) for d in leaf.shape)
    expected = entry.dtype.buffer_nbytes(math.prod(shape))
    if expected != entry.nbytes:
        raise ArchiveError(
            f"load_tannic: {name}: {entry.nbytes} bytes in the file, "
            f"shape {format_shape(shape)} of {dtype} in like takes {expected}"
        )
    return shape


__all__ = ["MappedArchive", "MappedEntry", "load_safetensors", "load_tannic", "save_safetensors", "save_tannic"]
