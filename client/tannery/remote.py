"""Archives on a server, read through the :class:`~tannery.archive.Archive` interface.

A :class:`RemoteArchive` is built from one Describe: names and infos come from it, so
every check (and every ArchiveError message) is the local archive's, made before a byte
is transferred. Reading asks the server for exactly the entries needed, in one Fetch
call (``to_value`` included); each ask carries the shape and dtype the client saw, so an
archive replaced in between is refused by the server rather than read. ``float`` casts on
the server; :meth:`RemoteArchive.rows` fetches a range of rows.

:class:`AsyncRemoteArchive` is the same over ``tannery.aio``: it runs the very same
checks by reading a :class:`RemoteArchive` whose transfers only record what they would
ask (``_Asked``), then makes that one Fetch call asynchronously.
"""

from __future__ import annotations

import operator
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from tannery_protocol import mismatches
from .archive import DTypeLike, IndexedArchive, MemoryArchive, TensorInfo
from tannery_protocol.errors import ArchiveError
from .records import ArchiveDescription, ArchiveInfo, EntryDescription
from .requests import entry_ask
from tannery_protocol.v1 import archives_pb2

if TYPE_CHECKING:
    import torch

#: Fetches entries by their asks, in order (one Fetch call).
Transfer = Callable[[Sequence[archives_pb2.EntryAsk]], list["torch.Tensor"]]


def _row_bound(value: object, what: str) -> int:
    if isinstance(value, bool):
        raise TypeError(f"Archive.rows: {what} is an int, not bool")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"Archive.rows: {what} is an int, not {type(value).__name__}") from None


class RemoteArchive(IndexedArchive):
    """An archive stored on a tannery server (``Client.archive(name)``).

    ``names``, ``info``, ``len`` and ``in`` answer from the description fetched when it
    was opened; ``find``, ``tensor``, ``float``, ``to_value`` and ``rows`` transfer the
    entries they return and nothing else.
    """

    __slots__ = ("description", "_transfer")

    def __init__(self, description: ArchiveDescription, transfer: Transfer) -> None:
        super().__init__({entry.name: entry for entry in description.entries})
        self.description = description
        self._transfer = transfer

    @property
    def name(self) -> str:
        """The archive's name on the server."""
        return self.description.info.name

    @property
    def archive_info(self) -> ArchiveInfo:
        return self.description.info

    def entry(self, name: str) -> EntryDescription:
        """The stored entry's description (payload size and digest included); ArchiveError when absent."""
        self._lookup("RemoteArchive.entry", name)
        return self._entries[name]

    def _fetch(self, names: Sequence[str]) -> list[torch.Tensor]:
        return self._transfer([entry_ask(self._entries[name]) for name in names])

    def _cast(self, name: str, dtype: str) -> torch.Tensor:
        return self._transfer([entry_ask(self._entries[name], cast=dtype)])[0]

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` of entry ``name`` along its first dimension, as stored.

        Only those rows travel. ArchiveError for a missing entry, a scalar, or rows past the
        end; ValueError for a range that starts after it stops.
        """
        where = "Archive.rows"
        start, stop = _row_bound(start, "start"), _row_bound(stop, "stop")
        info = self._lookup(where, name)
        if start < 0 or stop < start:
            raise ValueError(f"{where}: {name}: rows [{start}, {stop}) is not a range of rows (0 <= start <= stop)")
        if not info.shape:
            raise ArchiveError(mismatches.rows_of_scalar(where, name, start, stop))
        if stop > info.shape[0]:
            raise ArchiveError(mismatches.rows_past_end(where, name, start, stop, info.shape))
        return self._transfer([entry_ask(self._entries[name], rows=(start, stop))])[0]

    def __repr__(self) -> str:
        return f"<RemoteArchive {self.name!r} of {len(self._sorted)} entries>"


class _Asked(Exception):
    """Raised by a planning archive where it would transfer: the asks, all checks passed."""

    def __init__(self, asks: Sequence[archives_pb2.EntryAsk]) -> None:
        super().__init__("planned")
        self.asks = list(asks)


def _plan_only(asks: Sequence[archives_pb2.EntryAsk]) -> list[torch.Tensor]:
    raise _Asked(asks)


class AsyncRemoteArchive:
    """An archive on a server, for ``tannery.aio`` (``await client.archive(name)``).

    The methods of :class:`RemoteArchive`, with the same checks and messages; those that
    transfer are coroutines (``await archive.tensor(...)``), the others answer at once.
    """

    __slots__ = ("_planner", "_transfer")

    def __init__(self, description: ArchiveDescription,
                 transfer: Callable[[Sequence[archives_pb2.EntryAsk]], Awaitable[list[torch.Tensor]]]) -> None:
        self._planner = RemoteArchive(description, _plan_only)
        self._transfer = transfer

    @property
    def name(self) -> str:
        return self._planner.name

    @property
    def description(self) -> ArchiveDescription:
        return self._planner.description

    @property
    def archive_info(self) -> ArchiveInfo:
        return self._planner.archive_info

    def names(self) -> list[str]:
        return self._planner.names()

    def info(self, name: str) -> TensorInfo:
        return self._planner.info(name)

    def entry(self, name: str) -> EntryDescription:
        return self._planner.entry(name)

    def __len__(self) -> int:
        return len(self._planner)

    def __contains__(self, name: object) -> bool:
        return name in self._planner

    async def _answer(self, read: Callable[[RemoteArchive], Any],
                      finish: Callable[[list[str], list[torch.Tensor]], Any] | None = None) -> Any:
        """``read`` on the planning archive: its answer, or (where it would transfer) the
        transfer's tensors passed through ``finish`` (default: the one tensor)."""
        try:
            return read(self._planner)
        except _Asked as asked:
            tensors = await self._transfer(asked.asks)
            if finish is None:
                return tensors[0]
            return finish([ask.name for ask in asked.asks], tensors)

    async def find(self, name: str) -> torch.Tensor | None:
        return await self._answer(lambda archive: archive.find(name))

    async def tensor(self, name: str, shape: Sequence[int], dtype: DTypeLike) -> torch.Tensor:
        return await self._answer(lambda archive: archive.tensor(name, shape, dtype))

    async def float(self, name: str, shape: Sequence[int], dtype: DTypeLike) -> torch.Tensor:
        return await self._answer(lambda archive: archive.float(name, shape, dtype))

    async def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        return await self._answer(lambda archive: archive.rows(name, start, stop))

    async def to_value(self, like: Any, prefix: str = "") -> Any:
        def finish(names: list[str], tensors: list[torch.Tensor]) -> Any:
            # The fetched entries are exactly like's leaves: the checks pass again, and the
            # value is rebuilt (devices included) by the same code as everywhere else.
            return MemoryArchive(dict(zip(names, tensors))).to_value(like, prefix)

        return await self._answer(lambda archive: archive.to_value(like, prefix), finish)

    def __repr__(self) -> str:
        return f"<AsyncRemoteArchive {self.name!r} of {len(self)} entries>"


__all__ = ["AsyncRemoteArchive", "RemoteArchive", "Transfer"]
