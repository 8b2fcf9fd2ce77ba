"""Archives on a server, read through the :class:`~tannery.archive.Archive` interface.

A :class:`RemoteArchive` is opened with one Describe of no entry (the archive exists; its
info and metadata) and describes entries as reads need them, keeping each answer: ``find``,
``tensor``, ``float``, ``rows``, ``info``, ``entry`` and ``in`` describe the names they read,
``names``, ``description`` and ``to_value`` every entry, once. So what opening an archive and
reading an entry costs does not grow with the archive's size. (Opened with ``lazy=False``,
it is described whole at once, as a snapshot.) Every check, and every ArchiveError message,
is the local archive's, made on the description before a byte is transferred. Reading asks
the server for exactly the entries needed, in one Fetch call (``to_value`` included); each
ask carries the shape and dtype the client described, so an entry replaced since is refused
by the server rather than read. ``float`` casts on the server; :meth:`RemoteArchive.rows`
fetches a range of rows.

:class:`AsyncRemoteArchive` is the same over ``tannery.aio``: it runs the very same checks by
reading a :class:`RemoteArchive` whose describes and transfers only record what they would
ask (``_Unknown``, ``_Asked``); it makes that call asynchronously, then reads again.
"""

from __future__ import annotations

import operator
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from tannery_protocol import mismatches
from tannery.archive import DTypeLike, IndexedArchive, MemoryArchive, TensorInfo
from tannery_protocol.errors import ArchiveError
from tannery import plain, plain_trees
from tannery.records import ArchiveDescription, ArchiveInfo, EntryDescription, values_prefix
from tannery.rpc.requests import entry_ask
from tannery_protocol.v1 import archives_pb2

if TYPE_CHECKING:
    import torch

#: Fetches entries by their asks, in order (one Fetch call).
Transfer = Callable[[Sequence[archives_pb2.EntryAsk]], list["torch.Tensor"]]
#: Describes the entries of these names that the archive holds, or every entry for None (one Describe call).
Describe = Callable[[Sequence[str] | None], ArchiveDescription]


def _row_bound(value: object, what: str) -> int:
    if isinstance(value, bool):
        raise TypeError(f"Archive.rows: {what} is an int, not bool")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"Archive.rows: {what} is an int, not {type(value).__name__}") from None


def _is_whole(description: ArchiveDescription) -> bool:
    """Whether a Describe's answer holds every entry of the archive (else it holds those asked);
    the files and plain values kept with it are entries too (:mod:`tannery.calls.archive_files`,
    :mod:`tannery.calls.archive_values`)."""
    described = len(description.entries) + len(description.values) + len(description.files)
    # A server counts the kept files apart (info.files), one from before counted them as entries.
    return described == description.info.entries + description.info.files


def _names_asked(names: Iterable[str] | None, where: str) -> list[str] | None:
    if names is None:
        return None
    if isinstance(names, str):
        raise TypeError(f"{where}: names is a list of entry names, not one str")
    return list(dict.fromkeys(names))


class RemoteArchive(IndexedArchive):
    """An archive stored on a tannery server (``Client.archive(name)``).

    ``len`` answers from the archive's info; ``info``, ``entry``, ``in``, ``find``, ``tensor``,
    ``float`` and ``rows`` describe the entry they name once (one Describe call), ``names``,
    ``description`` and ``to_value`` the whole archive once; :meth:`describe` describes
    several entries in one call. The reads transfer the entries they return and nothing else.
    """

    __slots__ = ("_opened", "_whole", "_absent", "_describe", "_transfer", "_trees")

    def __init__(self, description: ArchiveDescription, transfer: Transfer, describe: Describe | None = None) -> None:
        if describe is None and not _is_whole(description):
            raise ValueError(f"RemoteArchive: {description.info.name!r}: a description of some entries "
                             "needs a describe call for the others")
        super().__init__({entry.name: entry for entry in description.entries})
        self._opened = description
        self._whole = description if _is_whole(description) else None
        self._absent: set[str] = set()
        self._describe = describe
        self._transfer = transfer
        self._trees: dict[str, plain_trees.Node] | None = None

    @property
    def name(self) -> str:
        """The archive's name on the server."""
        return self._opened.info.name

    @property
    def archive_info(self) -> ArchiveInfo:
        """The archive's info, as it was when opened."""
        return self._opened.info

    @property
    def metadata(self) -> dict[str, str]:
        """The archive's string-to-string metadata (safetensors' ``__metadata__``)."""
        return self._opened.metadata

    @property
    def description(self) -> ArchiveDescription:
        """The archive's info and every entry (described whole on first use)."""
        return self.describe()

    def describe(self, names: Iterable[str] | None = None) -> ArchiveDescription:
        """The description of every entry (``names`` None) or of the entries of ``names`` the
        archive holds, sorted by name: the names not described yet in one Describe call."""
        asked = _names_asked(names, "RemoteArchive.describe")
        if asked is None:
            if self._whole is None:
                self._learn(None)
            return self._whole  # type: ignore[return-value]
        unknown = [] if self._whole is not None else [n for n in asked if n not in self._entries and n not in self._absent]
        if unknown:
            self._learn(unknown)
        entries = tuple(self._entries[n] for n in sorted(asked) if n in self._entries)
        return ArchiveDescription(self._opened.info, entries, self._opened.metadata)

    def _learn(self, names: Sequence[str] | None) -> None:
        assert self._describe is not None  # a whole description asks for nothing more
        self._keep(self._describe(names), names)

    def _keep(self, described: ArchiveDescription, names: Sequence[str] | None) -> None:
        """Keep what a Describe of ``names`` (every entry for None) answered."""
        if names is None or _is_whole(described):  # (a server from before DescribeRequest.names answers whole)
            self._entries = {entry.name: entry for entry in described.entries}
            self._sorted = tuple(sorted(self._entries))
            self._whole = described
            return
        self._entries.update((entry.name, entry) for entry in described.entries)
        self._absent.update(name for name in names if name not in self._entries)

    def _names(self) -> Sequence[str]:
        if self._whole is None:
            self._learn(None)
        return self._sorted

    def _info(self, name: str) -> TensorInfo | None:
        entry = self._entries.get(name)
        if entry is None and self._whole is None and name not in self._absent:
            self._learn([name])
            entry = self._entries.get(name)
        return None if entry is None else entry.info

    def __len__(self) -> int:
        if self._whole is not None:  # the tensors, without the files and plain values kept with the archive
            return len(self._whole.entries)
        return self._opened.info.entries  # the info's count: the tensors, and the plain values' entries

    def entry(self, name: str) -> EntryDescription:
        """The stored entry's description (payload size and digest included); ArchiveError when absent."""
        self._lookup("RemoteArchive.entry", name)
        return self._entries[name]

    def to_value(self, like: Any = None, prefix: str = "") -> Any:
        """As :meth:`Archive.to_value`. Its check of the entries ``prefix`` owns needs every
        name: the whole archive is described first, in one call rather than one per leaf; its
        plain values, when it keeps any, are read in a call of their own before the tensors."""
        self._names()
        return super().to_value(like, prefix)

    def _fetch(self, names: Sequence[str]) -> list[torch.Tensor]:
        return self._transfer([entry_ask(self._entries[name]) for name in names])

    def _plain(self) -> dict[str, plain_trees.Node]:
        """The plain values kept with the archive: their entries read once (one Fetch), when it has any."""
        if self._trees is None:
            self._names()  # the whole description: the entries of the plain values among it
            kept = self.description.values
            if not kept:
                self._trees = {}
            else:
                asks = [archives_pb2.EntryAsk(name=v.entry, dtype="uint8", shape=archives_pb2.Shape(dims=[v.size]))
                        for v in kept]
                self._keep_plain([v.entry for v in kept], self._transfer(asks))
        return self._trees  # type: ignore[return-value]

    def _keep_plain(self, names: Sequence[str], tensors: Sequence[torch.Tensor]) -> None:
        """Keep the plain values of entries ``names`` read as ``tensors``."""
        trees = {}
        for name, tensor in zip(names, tensors):
            prefix = values_prefix(name)
            trees[prefix] = plain.of_tensor(tensor, f"archive {self.name!r}: entry {name!r}")
        self._trees = trees

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
        return f"<RemoteArchive {self.name!r} of {len(self)} entries>"


class _Asked(Exception):
    """Raised by a planning archive where it would transfer: the asks, all checks passed."""

    def __init__(self, asks: Sequence[archives_pb2.EntryAsk]) -> None:
        super().__init__("planned")
        self.asks = list(asks)


class _Unknown(Exception):
    """Raised by a planning archive where it would describe: the names (None: every entry)."""

    def __init__(self, names: Sequence[str] | None) -> None:
        super().__init__("not described")
        self.names = names


def _plan_only(asks: Sequence[archives_pb2.EntryAsk]) -> list[torch.Tensor]:
    raise _Asked(asks)


def _describe_later(names: Sequence[str] | None) -> ArchiveDescription:
    raise _Unknown(names)


class AsyncRemoteArchive:
    """An archive on a server, for ``tannery.aio`` (``await client.archive(name)``).

    The methods of :class:`RemoteArchive`, with the same checks and messages; those that
    describe or transfer are coroutines (``await archive.tensor(...)``), the others
    (``names``, ``info``, ``entry``, ``in``, ``len``, ``description``) answer at once: from
    the whole description taken when it was opened, or, opened with ``lazy=True``, from what
    its reads and :meth:`describe` have described (RuntimeError for the rest).
    """

    __slots__ = ("_planner", "_describe", "_transfer")

    def __init__(self, description: ArchiveDescription,
                 transfer: Callable[[Sequence[archives_pb2.EntryAsk]], Awaitable[list[torch.Tensor]]],
                 describe: Callable[[Sequence[str] | None], Awaitable[ArchiveDescription]] | None = None) -> None:
        if describe is None and not _is_whole(description):
            raise ValueError(f"AsyncRemoteArchive: {description.info.name!r}: a description of some entries "
                             "needs a describe call for the others")
        self._planner = RemoteArchive(description, _plan_only, _describe_later)
        self._describe = describe
        self._transfer = transfer

    @property
    def name(self) -> str:
        return self._planner.name

    @property
    def archive_info(self) -> ArchiveInfo:
        return self._planner.archive_info

    @property
    def metadata(self) -> dict[str, str]:
        return self._planner.metadata

    @property
    def description(self) -> ArchiveDescription:
        return self._now("description", lambda archive: archive.description)

    def names(self) -> list[str]:
        return self._now("names()", lambda archive: archive.names())

    def info(self, name: str) -> TensorInfo:
        return self._now(f"info({name!r})", lambda archive: archive.info(name))

    def entry(self, name: str) -> EntryDescription:
        return self._now(f"entry({name!r})", lambda archive: archive.entry(name))

    def __len__(self) -> int:
        return len(self._planner)

    def __contains__(self, name: object) -> bool:
        return self._now(f"in ({name!r} in archive)", lambda archive: name in archive)

    def _now(self, what: str, read: Callable[[RemoteArchive], Any]) -> Any:
        """``read`` on the planning archive, answered from what is described."""
        try:
            return read(self._planner)
        except _Unknown as unknown:
            names = "" if unknown.names is None else repr(list(unknown.names))
            needs = "its entries are" if unknown.names is None else f"{names} is"
            raise RuntimeError(
                f"AsyncRemoteArchive.{what}: {self.name!r} was opened with lazy=True and {needs} not described "
                f"yet: await archive.describe({names}) first, or open it with lazy=False") from None

    async def describe(self, names: Iterable[str] | None = None) -> ArchiveDescription:
        """As :meth:`RemoteArchive.describe`: what is described is then known at once."""
        return await self._answer(lambda archive: archive.describe(names))

    async def _answer(self, read: Callable[[RemoteArchive], Any],
                      finish: Callable[[list[str], list[torch.Tensor]], Any] | None = None) -> Any:
        """``read`` on the planning archive: its answer, or (where it would transfer) the
        transfer's tensors passed through ``finish`` (default: the one tensor). Where it would
        describe, the Describe is made and kept, and ``read`` runs again."""
        while True:
            try:
                return read(self._planner)
            except _Unknown as unknown:
                assert self._describe is not None  # a whole description asks for nothing more
                self._planner._keep(await self._describe(unknown.names), unknown.names)
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

    async def to_value(self, like: Any = None, prefix: str = "") -> Any:
        planner = self._planner
        if planner._trees is None:  # the plain values first: which tensors a rebuild needs may depend on them
            await self._answer(lambda archive: archive._plain(), planner._keep_plain)

        def finish(names: list[str], tensors: list[torch.Tensor]) -> Any:
            # The fetched entries are exactly those read: the checks pass again, and the
            # value is rebuilt (devices included) by the same code as everywhere else.
            return MemoryArchive(dict(zip(names, tensors)), planner._trees).to_value(like, prefix)

        return await self._answer(lambda archive: archive.to_value(like, prefix), finish)

    def __repr__(self) -> str:
        return f"<AsyncRemoteArchive {self.name!r} of {len(self)} entries>"


__all__ = ["AsyncRemoteArchive", "Describe", "RemoteArchive", "Transfer"]
