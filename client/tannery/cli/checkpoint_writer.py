"""Checkpoint files written entry by entry while ``tannery pull`` receives them.

Both formats can be laid out from one Describe (every entry's name, dtype and shape)
before the first tensor byte arrives: a safetensors file's header and offsets, a .tannic
pair's metadata and offsets. :class:`CheckpointWriter` writes that layout first, then
each piece of tensor bytes at its place as it arrives (``Client.fetch_pieces``: views of
the received messages), so a pull holds about one message in memory, whatever the size
of the archive or of its entries. Everything goes to temporary files beside the outputs,
renamed into place once every entry is in and removed if anything fails: a reader never
sees half a checkpoint, and an existing file is replaced only by a whole one.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tannery_protocol import codec
from tannery.dataplane.readers import TensorPiece
from tannery.formats.atomic import Replacement
from tannery.formats.checkpoint import PairEntry, encode_metadata, file_header, pair_paths
from tannery_protocol.codec import format_shape
from tannery.formats.safetensors_format import CODES, encode_header
from .errors import CommandError
from .tensorfiles import checkpoint_kind

#: Why an arriving entry can differ from the description taken before the fetch.
_REPLACED = "was the archive replaced during the pull?"
#: The order in which the safetensors package lays out dtypes (largest elements first, so
#: that every tensor is aligned); entries of one dtype follow by name.
SAFETENSORS_ORDER = ("U64", "I64", "F64", "C64", "F32", "U32", "I32", "BF16", "F16", "U16", "I16", "F8_E4M3",
                     "F8_E5M2", "I8", "U8", "BOOL")


@dataclass(frozen=True)
class _Slot:
    """Where one entry goes: its description, its offset in the data file, its bytes there."""

    entry: Any  # an EntryDescription: name, dtype, shape
    offset: int
    nbytes: int


class _TempFile(Replacement):
    """A file written at offsets under a temporary name beside ``path``, renamed into place by
    :meth:`commit`."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)

    def write_at(self, data: Any, offset: int) -> None:
        view = memoryview(data).cast("B")
        while view.nbytes:
            written = os.pwrite(self.fd, view, offset)
            view, offset = view[written:], offset + written

    def _close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def commit(self) -> None:
        self._close()
        super().commit()

    def discard(self) -> None:
        self._close()
        super().discard()


class CheckpointWriter:
    """A .safetensors file or a .tannic pair (by ``path``'s extension) of ``entries``
    (``EntryDescription``s), written piece by piece: :meth:`write` each piece of tensor
    bytes as it arrives (entries in any order), then :meth:`finish`. A context manager:
    leaving it without :meth:`finish` (an error, Ctrl-C) removes the temporary files.

    Safetensors files come out as the safetensors package writes them (same layout, same
    bytes), with ``metadata`` as their ``__metadata__`` (a pair has none); a pair's entries
    are laid out in the order given, their dtype codes by ``codes``
    (:func:`tannery_protocol.codec.wire_code`; a safetensors file has no codes).
    """

    def __init__(self, path: str | os.PathLike[str], entries: Sequence[Any], codes: str = "seed",
                 metadata: Mapping[str, str] | None = None) -> None:
        self._codes = codec.check_codes(codes)
        self._files: list[_TempFile] = []
        self._slots: dict[str, _Slot] = {}
        self._written: set[str] = set()
        self._receiving: set[str] = set()
        self._names = [entry.name for entry in entries]
        self._torch_file: Path | None = None  # a torch checkpoint: written whole at finish
        try:
            kind = checkpoint_kind(path, writing=True)
            if kind == "safetensors":
                self._lay_out_safetensors(Path(path), entries, metadata)
            elif kind == "tannic":
                self._lay_out_pair(Path(path), entries)
            else:
                self._lay_out_torch(Path(path), entries)
        except BaseException:
            self.abort()
            raise

    def _lay_out_safetensors(self, path: Path, entries: Sequence[Any], metadata: Mapping[str, str] | None) -> None:
        self._packed_bools = False
        rank = {code: index for index, code in enumerate(SAFETENSORS_ORDER)}
        order = sorted(entries, key=lambda e: (rank[CODES[e.dtype]], e.name))
        sizes = [math.prod(e.shape) * codec.dtype_named(e.dtype).itemsize for e in order]  # a bool is a byte
        header = encode_header([(e.name, CODES[e.dtype], tuple(e.shape), n) for e, n in zip(order, sizes)],
                               dict(metadata) if metadata else None)
        data = self._open(path)
        self._place(order, sizes, start=len(header))
        data.write_at(header, 0)
        os.ftruncate(data.fd, len(header) + sum(sizes))

    def _lay_out_pair(self, path: Path, entries: Sequence[Any]) -> None:
        self._packed_bools = True
        data_path, metadata_path = pair_paths(path)
        sizes = [codec.dtype_named(e.dtype).buffer_nbytes(math.prod(e.shape)) for e in entries]
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        data = self._open(data_path)
        header = file_header(sum(sizes))
        self._place(entries, sizes, start=len(header))
        data.write_at(header, 0)
        os.ftruncate(data.fd, len(header) + sum(sizes))
        metadata = encode_metadata([PairEntry(e.name, codec.dtype_named(e.dtype), offset, n)
                                    for e, offset, n in zip(entries, offsets, sizes)], self._codes)
        self._open(metadata_path).write_at(metadata, 0)

    def _lay_out_torch(self, path: Path, entries: Sequence[Any]) -> None:
        """A torch checkpoint: torch.save needs every tensor at once, so the pieces land in a
        staging file laid out as a pair's data (every dtype; booleans packed), read back whole by
        :meth:`finish`, which saves ``{name: tensor}`` (in name order, as push reads it back)."""
        self._packed_bools = True
        self._torch_file = path
        sizes = [codec.dtype_named(e.dtype).buffer_nbytes(math.prod(e.shape)) for e in entries]
        staging = self._open(path.with_name(path.name + ".staging"))  # never renamed into place
        self._place(entries, sizes, start=0)
        os.ftruncate(staging.fd, sum(sizes))

    def _save_torch(self, path: Path) -> None:
        """Read the staged entries back as tensors and torch.save them to ``path`` (whole or not at all)."""
        import torch

        from tannery.torch import from_buffer

        staging = self._files[0]
        staging._close()
        data = staging.tmp.read_bytes()
        tensors = {name: from_buffer(bytearray(data[slot.offset: slot.offset + slot.nbytes]),
                                     codec.dtype_named(slot.entry.dtype), slot.entry.shape)
                   for name, slot in sorted(self._slots.items())}
        with Replacement(path) as tmp, open(tmp, "wb") as f:
            torch.save(tensors, f)

    def _open(self, path: Path) -> _TempFile:
        file = _TempFile(path)
        self._files.append(file)
        return file

    def _place(self, entries: Sequence[Any], sizes: Sequence[int], start: int) -> None:
        offset = start
        for entry, nbytes in zip(entries, sizes):
            self._slots[entry.name] = _Slot(entry, offset, nbytes)
            offset += nbytes

    @property
    def paths(self) -> list[Path]:
        """The files this writer makes (renamed into place by :meth:`finish`)."""
        if self._torch_file is not None:
            return [self._torch_file]
        return [file.path for file in self._files]

    def write(self, piece: TensorPiece) -> None:
        """Write a piece of an entry's tensor bytes at its place (``Client.fetch_pieces``);
        CommandError if the entry is not the one described."""
        if piece.first:
            self._start(piece)
        slot = self._slots[piece.name]
        if piece.data.nbytes:
            if piece.info.dtype.is_bool and not self._packed_bools:  # a byte per boolean
                bits = np.unpackbits(np.frombuffer(piece.data, np.uint8), bitorder="little")
                first = 8 * piece.offset
                self._files[0].write_at(bits[: slot.nbytes - first], slot.offset + first)
            else:
                self._files[0].write_at(piece.data, slot.offset + piece.offset)
        if piece.last:
            self._written.add(piece.name)

    def _start(self, piece: TensorPiece) -> None:
        """Check an entry's first piece against its description."""
        name, info, slot = piece.name, piece.info, self._slots.get(piece.name)
        if slot is None:
            raise CommandError(f"{name}: received an entry the archive's description did not have ({_REPLACED})")
        if name in self._written:
            raise CommandError(f"{name}: received twice")
        # In ``_receiving`` already: a retried Fetch sends again from its start the entry its
        # broken call cut off (tannery.rpc.retries); its pieces land at the same offsets again.
        if (info.dtype.name, tuple(info.shape)) != (slot.entry.dtype, tuple(slot.entry.shape)):
            raise CommandError(
                f"{name}: received {info.dtype} {format_shape(info.shape)}, described as {slot.entry.dtype} "
                f"{format_shape(slot.entry.shape)} ({_REPLACED})"
            )
        self._receiving.add(name)

    def finish(self) -> list[Path]:
        """Check that every entry came, and rename the files into place; the paths written."""
        self.check_complete()
        if self._torch_file is not None:
            self._save_torch(self._torch_file)  # the staging file goes with abort()
            return self.paths
        for file in self._files:
            file.commit()
        return self.paths

    def check_complete(self) -> None:
        """CommandError unless every entry came whole."""
        missing = [name for name in self._names if name not in self._written]
        if missing:
            shown = ", ".join(map(repr, missing[:5])) + (f", ... ({len(missing)} in all)" if len(missing) > 5 else "")
            raise CommandError(f"the server sent no {shown} ({_REPLACED})")

    def abort(self) -> None:
        """Remove the temporary files (the outputs are left as they were)."""
        for file in self._files:
            file.discard()

    def __enter__(self) -> "CheckpointWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.abort()  # after finish there is nothing left to remove


__all__ = ["CheckpointWriter"]
