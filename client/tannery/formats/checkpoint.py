"""The .tannic checkpoint pair that Tannic C++ and pytannic read and write, without torch.

- ``<stem>.tannic``: a header (see :mod:`tannery_protocol.codec`) whose nbytes is the size of
  the data that follows, then the raw buffers back to back.
- ``<stem>.metadata.tannic``: a header whose nbytes is the size of the entries that
  follow, then per entry ``<B Q Q I`` (dcode, offset into the data, nbytes, name
  length in bytes) and the UTF-8 name.

The pair stores no shapes: a reader gets flat buffers and the caller gives shapes.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from tannery.formats.atomic import Replacement
from tannery_protocol.codec import (CHECKSUM, HEADER, MAGIC, VERSION, Buffer, DType, FormatError, byte_buffer, check_codes,
                    dtype_of_code, wire_code)

ENTRY = struct.Struct("<BQQI")
DATA_SUFFIX = ".tannic"
METADATA_SUFFIX = ".metadata.tannic"


@dataclass(frozen=True)
class PairEntry:
    """One tensor of a pair: where its buffer lies in the data, after the data file's header."""

    name: str
    dtype: DType
    offset: int
    nbytes: int

    @property
    def flat_shape(self) -> tuple[int, ...]:
        """The shape to read the entry at when none is given: 1-D, every element (booleans are
        bit-packed, eight to a byte)."""
        if self.dtype.is_bool:
            return (self.nbytes * 8,)
        return (self.nbytes // self.dtype.itemsize,)


def pair_paths(path: str | os.PathLike[str]) -> tuple[Path, Path]:
    """The data and metadata files of a pair named by ``path``, with or without a suffix.

    ``ckpt/model``, ``ckpt/model.tannic`` and ``ckpt/model.metadata.tannic`` all name
    ``ckpt/model.tannic`` and ``ckpt/model.metadata.tannic``.
    """
    path = Path(path)
    stem = path.name
    for suffix in (METADATA_SUFFIX, DATA_SUFFIX):
        if stem.endswith(suffix) and len(stem) > len(suffix):
            stem = stem[: -len(suffix)]
            break
    return path.with_name(stem + DATA_SUFFIX), path.with_name(stem + METADATA_SUFFIX)


def file_header(nbytes: int) -> bytes:
    """The header of either file, for ``nbytes`` bytes after it."""
    return HEADER.pack(MAGIC, VERSION, CHECKSUM, nbytes)


def read_file_header(data: Buffer, what: str) -> int:
    """Check the header at the start of a pair file; return how many bytes it says follow."""
    data = byte_buffer(data)
    if len(data) < HEADER.size:
        raise FormatError(f"{what}: {len(data)} bytes, too short for a {HEADER.size}-byte header")
    magic, version, _checksum, nbytes = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise FormatError(f"{what}: bad magic 0x{magic:08X}, expected 0x{MAGIC:08X} ('ERIC')")
    if version != VERSION:
        raise FormatError(f"{what}: unsupported version {version}, this reader knows version {VERSION}")
    if nbytes != len(data) - HEADER.size:
        kind = "truncated" if nbytes > len(data) - HEADER.size else "trailing bytes"
        raise FormatError(
            f"{what}: {kind}: the header says {nbytes} bytes follow it, the file has {len(data) - HEADER.size}"
        )
    return nbytes


def parse_metadata(data: Buffer, data_nbytes: int, what: str = "metadata") -> list[PairEntry]:
    """The entries of a metadata file's bytes, checked against a data region of ``data_nbytes``.

    Raises FormatError for a truncated entry, an unknown dcode, a name that is not
    UTF-8 or appears twice, a buffer outside the data, overlapping buffers, or a size
    that is not a whole number of elements.
    """
    view = byte_buffer(data)
    read_file_header(view, what)
    entries: list[PairEntry] = []
    seen: set[str] = set()
    pos = HEADER.size
    while pos < len(view):
        index = len(entries)
        if len(view) - pos < ENTRY.size:
            raise FormatError(f"{what}: entry {index} is truncated: {len(view) - pos} of {ENTRY.size} bytes")
        code, offset, nbytes, namelength = ENTRY.unpack_from(view, pos)
        pos += ENTRY.size
        if namelength > len(view) - pos:
            raise FormatError(
                f"{what}: entry {index}: name of {namelength} bytes, only {len(view) - pos} bytes left"
            )
        try:
            name = bytes(view[pos : pos + namelength]).decode("utf-8")
        except UnicodeDecodeError as e:
            raise FormatError(f"{what}: entry {index}: name is not UTF-8 ({e.reason} at byte {e.start})") from None
        pos += namelength
        if not name:
            raise FormatError(f"{what}: entry {index} has an empty name")
        if name in seen:
            raise FormatError(f"{what}: {name!r} appears twice")
        seen.add(name)
        try:
            dtype = dtype_of_code(code)
        except FormatError as e:
            raise FormatError(f"{what}: {name}: {e}") from None
        if offset + nbytes > data_nbytes:
            raise FormatError(
                f"{what}: {name}: bytes [{offset}, {offset + nbytes}) are outside the data ({data_nbytes} bytes)"
            )
        if not dtype.is_bool and nbytes % dtype.itemsize:
            raise FormatError(f"{what}: {name}: {nbytes} bytes is not a whole number of {dtype} elements")
        entries.append(PairEntry(name, dtype, offset, nbytes))
    _check_no_overlap(entries, what)
    return entries


def _check_no_overlap(entries: Sequence[PairEntry], what: str) -> None:
    spans = sorted((e for e in entries if e.nbytes), key=lambda e: e.offset)
    for before, after in zip(spans, spans[1:]):
        if after.offset < before.offset + before.nbytes:
            raise FormatError(
                f"{what}: {after.name} at [{after.offset}, {after.offset + after.nbytes}) overlaps "
                f"{before.name} at [{before.offset}, {before.offset + before.nbytes})"
            )


def encode_metadata(entries: Sequence[PairEntry], codes: str = "seed") -> bytes:
    """A metadata file's bytes for ``entries``, dtype codes by ``codes`` (:func:`tannery_protocol.codec.wire_code`)."""
    check_codes(codes)
    body = bytearray()
    for entry in entries:
        name = entry.name.encode("utf-8")
        body += ENTRY.pack(wire_code(entry.dtype, codes), entry.offset, entry.nbytes, len(name))
        body += name
    return file_header(len(body)) + bytes(body)


@dataclass(frozen=True)
class OpenPair:
    """A pair opened for reading: its entries and a private memory map of its data file.

    The map is copy-on-write (``ACCESS_COPY``): tensors built over it can be written
    without touching the file, and pages are read from disk only when used.
    """

    entries: list[PairEntry]
    data: mmap.mmap
    data_start: int = HEADER.size

    def buffer(self, entry: PairEntry) -> memoryview:
        start = self.data_start + entry.offset
        return memoryview(self.data)[start : start + entry.nbytes]


def open_pair(path: str | os.PathLike[str]) -> OpenPair:
    """Open the pair named by ``path``, check both files, and map the data file."""
    data_path, metadata_path = pair_paths(path)
    with open(data_path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < HEADER.size:
            raise FormatError(f"{data_path}: {size} bytes, too short for a {HEADER.size}-byte header")
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    data_nbytes = read_file_header(memoryview(data), str(data_path))
    entries = parse_metadata(metadata_path.read_bytes(), data_nbytes, str(metadata_path))
    return OpenPair(entries, data)


def write_pair(
    path: str | os.PathLike[str], items: Iterable[tuple[str, DType, Sequence[Buffer]]], codes: str = "seed"
) -> tuple[Path, Path]:
    """Write ``(name, dtype, buffer pieces)`` items as a pair; returns the two paths.

    Each file is written under a temporary name and renamed into place, so a reader
    never sees half of one. ``codes`` picks the dtype codes (:func:`tannery_protocol.codec.wire_code`).
    """
    check_codes(codes)
    data_path, metadata_path = pair_paths(path)
    items = [(name, dtype, [memoryview(p).cast("B") for p in pieces]) for name, dtype, pieces in items]
    entries, offset, seen = [], 0, set()
    for name, dtype, pieces in items:
        if not name:
            raise ValueError("write: an empty name")
        if name in seen:
            raise ValueError(f"write: {name!r} is named twice")
        seen.add(name)
        nbytes = sum(p.nbytes for p in pieces)
        entries.append(PairEntry(name, dtype, offset, nbytes))
        offset += nbytes
    with Replacement(data_path) as tmp, open(tmp, "wb") as f:
        f.write(file_header(offset))
        for _, _, pieces in items:
            for piece in pieces:
                f.write(piece)
    with Replacement(metadata_path) as tmp, open(tmp, "wb") as f:
        f.write(encode_metadata(entries, codes))
    return data_path, metadata_path


