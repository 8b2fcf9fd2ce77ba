"""The files kept with an archive (a pushed folder's config.json, tokenizer files, README) on the
web page: apart from its tensors (no parameters, no dtype, no tree, no statistics), listed with
their sizes, and a text file shown as text. Their bytes come through the one checked reader."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from tannery_protocol.kept_files import is_file_entry, split_entry

from ..dataplane.blocks import VerifiedBlob
from ..fetching import digests, resolve
from ..storage import EntryRecord, Storage
from tannery_protocol.v1 import archives_pb2

#: Bytes of a file the page shows at most (the rest is said, not shown).
SHOWN_BYTES = 1 << 20


@dataclass(frozen=True)
class KeptFile:
    """One kept file: its name, the prefix it was pushed under, its entry, and its size."""

    name: str
    prefix: str
    entry: str
    size: int


def split(entries: Iterable[EntryRecord]) -> tuple[list[EntryRecord], list[KeptFile]]:
    """The tensors of ``entries`` and the files kept with them, each in name order."""
    tensors, files = [], []
    for entry in entries:
        kept = split_entry(entry.name)
        if kept is None:
            tensors.append(entry)
        else:
            files.append(KeptFile(kept[1], kept[0], entry.name, entry.nbytes))
    return tensors, files


def tensors_only(entries: Iterable[EntryRecord]) -> list[EntryRecord]:
    return [e for e in entries if not is_file_entry(e.name)]


@dataclass(frozen=True)
class FileText:
    """What the file page shows: the text (None for a binary file), whether it was cut, the size."""

    text: str | None
    cut: bool
    size: int


def read_text(storage: Storage, archive: str, entry: EntryRecord, most: int = SHOWN_BYTES) -> FileText:
    """The first ``most`` bytes of kept file ``entry`` as UTF-8 text (None when they are not
    text: invalid UTF-8, or a NUL byte), read in checked blocks with its blob pinned. Blocking."""
    request = archives_pb2.FetchRequest(archive=archive, entries=[archives_pb2.EntryAsk(name=entry.name)])
    plans = resolve(storage, request)
    try:
        plan = plans[0]
        stop = min(plan.entry.payload_bytes, plan.entry.data_offset + most)
        with VerifiedBlob(storage, plan) as blob:
            data = b"".join(bytes(piece) for piece in blob.blocks(plan.entry.data_offset, stop))
    finally:
        storage.release(digests(plans))
    cut = entry.nbytes > len(data)
    try:
        text = data.decode("utf-8", errors="strict" if not cut else "ignore")
    except UnicodeDecodeError:
        text = None
    if text is not None and "\x00" in text:
        text = None
    return FileText(text, cut, entry.nbytes)


__all__ = ["FileText", "KeptFile", "SHOWN_BYTES", "read_text", "split", "tensors_only"]
