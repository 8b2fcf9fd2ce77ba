"""Diff's request and records: how archive ``b`` differs from archive ``a``, as the server
computed it (the figures of changed values come from the server, which reads both; no tensor
byte travels). Shared by both clients and ``tannery diff``; nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from tannery_protocol.v1 import archives_pb2

#: What ``EntryChange.change`` says, by the wire's enum.
CHANGES = {archives_pb2.EntryDiff.SAME: "same", archives_pb2.EntryDiff.ADDED: "added",
           archives_pb2.EntryDiff.REMOVED: "removed", archives_pb2.EntryDiff.TYPE: "type",
           archives_pb2.EntryDiff.VALUE: "value"}


def diff_request(a: str, b: str, names: Iterable[str] | None, prefix: str | None, same: bool
                 ) -> archives_pb2.DiffRequest:
    """The request, refusing what the server would (names and a prefix, one str as names)."""
    if names is not None and prefix is not None:
        raise ValueError("Client.diff: give names or a prefix, not both")
    if isinstance(names, str):
        raise TypeError("Client.diff: names is a list of entry names, not one str")
    return archives_pb2.DiffRequest(a=a, b=b, names=list(names or ()), prefix=prefix or "", list_same=same)


@dataclass(frozen=True)
class ValueChange:
    """How an entry's values differ (b against a): elements whose bits differ, max |b - a| and
    ||b - a|| / ||a|| over the finite ones, and NaN or Inf in b where a had none."""

    elements: int
    differing: int
    max_abs: float
    relative_l2: float
    nan_appeared: int
    inf_appeared: int

    @property
    def fraction(self) -> float:
        """The fraction of elements that differ (0 to 1)."""
        return self.differing / self.elements if self.elements else 0.0

    @classmethod
    def of(cls, message: archives_pb2.ValueChange) -> "ValueChange":
        return cls(message.elements, message.differing, message.max_abs, message.relative_l2,
                   message.nan_appeared, message.inf_appeared)


@dataclass(frozen=True)
class EntryChange:
    """One entry of a diff: ``change`` is "same", "added", "removed", "type" (dtype or shape) or
    "value" (``values`` says how; None for a kept file, ``file`` true, which is no tensor)."""

    name: str
    change: str
    dtype_a: str
    dtype_b: str
    shape_a: tuple[int, ...]
    shape_b: tuple[int, ...]
    nbytes_a: int
    nbytes_b: int
    values: ValueChange | None
    file: bool

    @classmethod
    def of(cls, message: archives_pb2.EntryDiff) -> "EntryChange":
        values = ValueChange.of(message.values) if message.HasField("values") else None
        return cls(message.name, CHANGES.get(message.change, "value"), message.dtype_a, message.dtype_b,
                   tuple(message.shape_a), tuple(message.shape_b), message.nbytes_a, message.nbytes_b, values,
                   message.file)


@dataclass(frozen=True)
class ArchiveDiff:
    """How archive ``b`` differs from archive ``a`` (their own names: aliases resolved once each).

    ``entries`` lists every entry that differs, by name (and the same ones, when asked);
    ``metadata`` maps each key whose value differs to its ``(a, b)`` values (None where absent);
    the counts cover the tensors compared, and ``files_same``/``files_changed`` the kept files
    (added, removed or changed); ``bytes_read`` is the tensor data the server read."""

    a: str
    b: str
    entries: tuple[EntryChange, ...]
    metadata: dict[str, tuple[str | None, str | None]]
    same: int
    added: int
    removed: int
    type_changed: int
    value_changed: int
    bytes_read: int
    files_same: int = 0
    files_changed: int = 0

    @property
    def identical(self) -> bool:
        """Whether nothing differs: every entry the same, and the metadata."""
        return not (self.added or self.removed or self.type_changed or self.value_changed or self.files_changed
                    or self.metadata)

    def changed(self) -> list[EntryChange]:
        """The entries that differ (no "same" one)."""
        return [e for e in self.entries if e.change != "same"]

    @classmethod
    def of(cls, message: archives_pb2.DiffResponse) -> "ArchiveDiff":
        summary = message.summary
        metadata = {m.key: (m.a if m.HasField("a") else None, m.b if m.HasField("b") else None)
                    for m in message.metadata}
        return cls(message.a, message.b, tuple(EntryChange.of(e) for e in message.entries), metadata,
                   summary.same, summary.added, summary.removed, summary.type_changed, summary.value_changed,
                   summary.bytes_read, summary.files_same, summary.files_changed)


__all__ = ["ArchiveDiff", "EntryChange", "ValueChange", "diff_request"]
