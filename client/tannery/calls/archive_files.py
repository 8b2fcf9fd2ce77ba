"""Files kept with an archive: the small files of a model folder (``config.json``, the
tokenizer's files, a README) stored beside its tensors, so that a folder pulled loads as it
was pushed.

Each file is an entry of the archive: a 1-D uint8 tensor of its bytes, named ``@file:`` and
the file's name (under the Store's prefix, as every entry: ``enc.@file:config.json``). So
they travel the entries' own path: committed in the same Store (whole or not at all),
deleted with the archive, carried by a Union, checked block by block on every read, and
here again against the payload's SHA-256 (:func:`file_bytes`). The client keeps them apart
from the tensors: a description lists them as ``files``, never as entries, and a Fetch of
every entry leaves them out; a Store refuses a tensor named like one. See
``docs/model-folders.md``.

Torch-free at import (the naming of a kept file's entry is the records'); torch is read where a tensor is made.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from tannery_protocol import errors
from tannery_protocol._lazy import lazy_module

from tannery.records import MARK, entry_name, is_file_entry, split_entry  # noqa: F401 (this module's face)

if TYPE_CHECKING:
    import torch as _torch

    from tannery.archive import Archive
    from tannery.records import FileDescription  # noqa: F401 (annotations only)

torch = lazy_module("torch")

#: The largest file kept with an archive (32 MiB): larger ones are weights or data, not a folder's small files.
MAX_FILE_BYTES = 32 << 20
#: The most bytes of files one archive keeps (64 MiB in all).
MAX_FILES_BYTES = 64 << 20


def check_file_name(file: object, where: str) -> str:
    """A kept file's name: a plain file name of the folder (no directory, no control character)."""
    if not isinstance(file, str) or not file:
        raise TypeError(f"{where}: a file's name is a non-empty str, not {file!r}")
    if "/" in file or "\\" in file or file in (".", "..") or any(ord(c) < 32 or ord(c) == 127 for c in file):
        raise errors.ArchiveError(f"{where}: file {file!r}: not a plain file name (no directories, no control "
                                  "characters): only the folder's own files are kept")
    return file


def check_files(files: Mapping[str, Any], where: str, max_file: int = MAX_FILE_BYTES,
                max_total: int = MAX_FILES_BYTES) -> dict[str, bytes]:
    """``files`` (name to bytes) checked: plain names, bytes-like contents, each at most
    ``max_file`` bytes and all at most ``max_total``; ArchiveError naming the file, its size
    and the bound otherwise."""
    if not isinstance(files, Mapping):
        raise TypeError(f"{where}: files is a mapping of file names to bytes, not {type(files).__name__}")
    checked: dict[str, bytes] = {}
    total = 0
    for file in sorted(files):
        check_file_name(file, where)
        data = files[file]
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"{where}: file {file!r}: its contents are bytes, not {type(data).__name__}")
        data = bytes(data)
        if len(data) > max_file:
            raise errors.ArchiveError(
                f"{where}: file {file!r} is {len(data)} bytes, over the bound of {max_file} bytes for one file "
                "kept with an archive; leave it out (it is not one of a model folder's small files), or store "
                "it as an archive of its own")
        total += len(data)
        if total > max_total:
            raise errors.ArchiveError(
                f"{where}: the files come to more than {max_total} bytes in all (at {file!r}, {len(data)} bytes), "
                "over the bound of the files kept with one archive; leave the largest out")
        checked[file] = data
    return checked


def refuse_file_names(archive: Archive, where: str) -> None:
    """ArchiveError for a tensor named like a kept file (``@file:...``): the name is reserved."""
    for name in archive.names():
        if is_file_entry(name):
            raise errors.ArchiveError(
                f"{where}: entry {name!r}: names with {MARK!r} (at the start, or after a dot) are reserved for the "
                "files kept with an archive; rename the tensor, or give the file with files=")


def with_files(archive: Archive, rest: str, prefix: str, files: Mapping[str, bytes]) -> Archive:
    """``archive`` (whose names still take ``rest``, as ``requests.archive_to_store`` gives it)
    and the entries of ``files``, each named under ``prefix``."""
    from tannery.archive import Archive, MemoryArchive

    under = "" if rest else prefix  # the names of archive already carry the prefix when rest is empty
    tensors = {entry_name(file, under): _tensor_of(data) for file, data in files.items()}
    return Archive.union([archive, MemoryArchive(tensors)]) if tensors else archive


def _tensor_of(data: bytes) -> _torch.Tensor:
    if not data:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def file_bytes(file: FileDescription, tensor: _torch.Tensor) -> bytes:
    """The bytes of a kept file from its entry's tensor, checked: a 1-D uint8 tensor of the
    size described, whose payload has the SHA-256 described (DataLoss otherwise)."""
    from tannery.torch import serialize_parts

    if tensor.dtype != torch.uint8 or tensor.dim() != 1 or tensor.numel() != file.size:
        raise errors.ArchiveError(f"entry {file.entry!r}: {tensor.dtype} {tuple(tensor.shape)} is not a kept file "
                                  f"of {file.size} bytes (a 1-D uint8 tensor)")
    digest = hashlib.sha256()
    for part in serialize_parts(tensor.contiguous()):
        digest.update(memoryview(part).cast("B"))
    if file.digest and digest.hexdigest() != file.digest:
        raise errors.DataLoss(f"file {file.name!r} (entry {file.entry!r}): its bytes do not have the SHA-256 the "
                              "archive recorded; pull it again, and run tannery scrub on the server")
    return tensor.numpy().tobytes()


__all__ = ["MARK", "MAX_FILES_BYTES", "MAX_FILE_BYTES", "check_file_name", "check_files", "entry_name",
           "file_bytes", "is_file_entry", "refuse_file_names", "split_entry", "with_files"]
