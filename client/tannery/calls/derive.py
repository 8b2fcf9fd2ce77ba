"""The messages of a Derive (``archives.proto``): an archive the server builds from a base archive
and per-entry changes, so that only the changes travel (weight sync stores its versions so).

A change is ``(name, kind, crc32c, tensors)``: ``kind`` ``"same"`` (no tensor: the base's entry
as it is), ``"delta"`` (two tensors: flat int32 or int64 indices, then the new bits of those
elements as the integer dtype of the element's width) or ``"whole"`` (one tensor: the entry);
``crc32c`` the CRC-32C of the entry's new bytes in C order, which the server checks on a delta.
Tensors are serialized with the client's codec, as Store serializes them. gRPC only: the
changes are small, and travel in the call's own messages whatever transport the client chose.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from tannery_protocol._lazy import lazy_module
from tannery_protocol.v1 import archives_pb2
from tannery_protocol.wire import split_parts

_codec = lazy_module("tannery.torch")

#: How many tensors each kind of change carries, and its value in the proto.
KINDS = {"same": (0, archives_pb2.DeriveEntry.SAME), "delta": (2, archives_pb2.DeriveEntry.DELTA),
         "whole": (1, archives_pb2.DeriveEntry.WHOLE)}

Change = tuple[str, str, int, Sequence[Any]]


def check_changes(changes: Iterable[Any], where: str) -> list[Change]:
    """The changes as a list (a retry sends them again), each checked: a name, a known kind with
    its number of tensors, a 32-bit CRC (ValueError or TypeError naming the entry otherwise)."""
    checked = []
    for change in changes:
        name, kind, crc, tensors = change
        if not isinstance(name, str) or not name:
            raise TypeError(f"{where}: an entry name is a non-empty str, not {name!r}")
        if kind not in KINDS:
            raise ValueError(f"{where}: entry {name!r}: kind {kind!r} is not one of {', '.join(KINDS)}")
        tensors = list(tensors or ())
        if len(tensors) != KINDS[kind][0]:
            raise ValueError(f"{where}: entry {name!r}: a {kind!r} change carries {KINDS[kind][0]} tensors, "
                             f"not {len(tensors)}")
        if isinstance(crc, bool) or not isinstance(crc, int) or not 0 <= crc < 2**32:
            raise ValueError(f"{where}: entry {name!r}: crc32c {crc!r} is not a 32-bit unsigned int")
        checked.append((name, kind, crc, tensors))
    return checked


def derive_messages(archive: str, base: str, changes: Sequence[Change], replace: bool,
                    metadata: Mapping[str, str] | None, chunk_size: int) -> Iterator[archives_pb2.DeriveRequest]:
    """Begin, then each entry and its payloads in chunks of ``chunk_size`` bytes, then commit."""
    yield archives_pb2.DeriveRequest(begin=archives_pb2.DeriveBegin(
        archive=archive, base=base, replace=replace, metadata=dict(metadata or {})))
    for name, kind, crc, tensors in changes:
        payloads = [_codec.serialize_parts(_codec.cpu_contiguous(tensor)) for tensor in tensors]
        sizes = [sum(memoryview(part).nbytes for part in parts) for parts in payloads]
        entry = archives_pb2.DeriveEntry(name=name, change=KINDS[kind][1], crc32c=crc, payload_bytes=sizes)
        chunks = split_parts((part for parts in payloads for part in parts), chunk_size)
        first = next(chunks, None)
        yield archives_pb2.DeriveRequest(entry=entry, chunk=b"".join(first or ()))
        for chunk in chunks:
            yield archives_pb2.DeriveRequest(chunk=b"".join(chunk))
    yield archives_pb2.DeriveRequest(commit=archives_pb2.DeriveCommit(entries=len(changes)))


__all__ = ["KINDS", "check_changes", "derive_messages"]
