"""``tannery.aio.Client``: the asyncio client, with the methods of ``tannery.Client``, awaitable.

::

    async with tannery.aio.Client("localhost:50051") as client:
        await client.store("resnet", model)
        weights = await client.archive("resnet")
        w = await weights.tensor("fc.weight", [10, 512], torch.float32)
        async with client.subscribe("frames") as frames:
            async for tensor in frames:
                ...

Create it inside the event loop that uses it. Every call is the call core's
(:mod:`tannery.calls.core`), as for the synchronous client; this module only waits for what the
core asks (:mod:`tannery.rpc.waits`), by awaiting (:func:`tannery.calls.running.run_async`):
gRPC's asyncio API, and worker threads (``asyncio.to_thread``) for what blocks (a data connection's
bytes). The workarounds that grpc.aio needs (grpc/grpc#36066's overwritten status among them) are in
:mod:`tannery.dataplane.grpc_streams`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import grpc

from tannery.archive import Archive
from tannery.calls.core import CallCore
from tannery.rpc.connection import Connection
from tannery.dataplane.readers import EntryReader, PieceReader
from tannery.dataplane.received import TensorPiece
from tannery.records import Alias, ArchiveDescription, ArchiveInfo, Deleted, Pruned, Published, Tagged, Untagged
from tannery.remote import AsyncRemoteArchive
from tannery.rpc.requests import Progress, fetch_request, list_limit
from tannery.calls.watches import Watched
from tannery.rpc.waits import END, Driven, Steps
from tannery.calls.running import drive_async as _drive, run_async as _run

if TYPE_CHECKING:  # torch is imported where a tensor is made (tannery.dataplane.readers, tannery.rpc.requests)
    import torch

    from tannery.calls.diff import ArchiveDiff
    from tannery.calls.history import AliasMove
    from tannery.dataplane.transports import Feed


class Client(CallCore):
    """An asyncio connection to a tannery server: ``tannery.Client``'s methods, awaitable.

    Arguments as for :class:`tannery.Client`. Use ``async with`` or ``await close()``. On a
    data path (``transport``), the bytes move on worker threads (``asyncio.to_thread``), and
    a Store's ``progress`` is called from them.
    """

    _NAME = "tannery.aio.Client"

    def _open(self, connection: Connection) -> grpc.aio.Channel:
        return connection.aio_channel()

    def _new_lock(self) -> asyncio.Lock:
        return asyncio.Lock()

    async def _wants_digests(self) -> bool:
        return await _run(self._digests_wanted())

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "Client":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def transport(self) -> str:
        """The transport Store and Fetch take: "local", "tcp" or "grpc" (settled now if it was not)."""
        return await _run(self._transport_kind())

    # -- archives ------------------------------------------------------------------------

    async def store(self, name: str, value: Any, *, prefix: str = "", replace: bool = False,
                    progress: Progress = None, metadata: Mapping[str, str] | None = None,
                    skip_non_tensors: bool = False, allow_empty: bool = False,
                    files: Mapping[str, bytes] | None = None) -> ArchiveInfo:
        """As :meth:`tannery.Client.store`."""
        return await _run(self._store(name, value, prefix, replace, progress, metadata, skip_non_tensors,
                                      allow_empty, files))

    async def files(self, name: str, prefix: str = "", *, progress: Progress = None) -> dict[str, bytes]:
        """As :meth:`tannery.Client.files`."""
        return await _run(self._files(name, prefix, progress))

    async def archive(self, name: str, *, progress: Progress = None, lazy: bool = False) -> AsyncRemoteArchive:
        """As :meth:`tannery.Client.archive`; the reads of the archive are coroutines. Its
        ``names``, ``info``, ``entry`` and ``in`` answer at once (they cannot await a Describe),
        so it is described whole when opened, unless ``lazy=True``: then opening describes no
        entry, reads describe what they need, and those answer for what has been described.
        An alias is resolved once, at open: later reads ask for the archive it named then."""
        description = await self.describe(name, () if lazy else None)
        archive = description.name or name

        async def transfer(asks: Sequence[Any]) -> list[torch.Tensor]:
            return await _run(self._transferred(archive, asks, progress))

        async def describe(names: Sequence[str] | None) -> ArchiveDescription:
            return await self.describe(archive, names)

        return AsyncRemoteArchive(description, transfer, describe)

    async def fetch(self, name: str, names: Iterable[str] | None = None, prefix: str | None = None, *,
                    progress: Progress = None) -> Archive:
        """As :meth:`tannery.Client.fetch`."""
        return await _run(self._fetched_archive(fetch_request(name, names, prefix), progress))

    def fetch_iter(self, name: str, names: Iterable[str] | None = None, prefix: str | None = None, *,
                   progress: Progress = None) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """As :meth:`tannery.Client.fetch_iter`, an async iterator: ``async for name, tensor in
        client.fetch_iter(...)``. Leaving the loop early (or ``aclose()``) cancels the call."""
        return _drive(Driven(self._entries(fetch_request(name, names, prefix), EntryReader(progress))))

    def fetch_pieces(self, name: str, names: Iterable[str] | None = None, prefix: str | None = None, *,
                     progress: Progress = None) -> AsyncIterator[TensorPiece]:
        """As :meth:`tannery.Client.fetch_pieces`, an async iterator."""
        return _drive(Driven(self._entries(fetch_request(name, names, prefix), PieceReader(progress))))

    async def union(self, target: str, sources: Mapping[str, str] | Sequence[str], *,
                    replace: bool = False, metadata: Mapping[str, str] | None = None) -> ArchiveInfo:
        """As :meth:`tannery.Client.union`."""
        return await _run(self._union(target, sources, replace, metadata))

    async def derive(self, archive: str, base: str, changes: Iterable[Any], *, replace: bool = False,
                     metadata: Mapping[str, str] | None = None) -> ArchiveInfo:
        """As :meth:`tannery.Client.derive`."""
        return await _run(self._derive(archive, base, changes, metadata, replace))

    async def describe(self, name: str, names: Iterable[str] | None = None) -> ArchiveDescription:
        """As :meth:`tannery.Client.describe`."""
        return await _run(self._describe(name, names))

    async def diff(self, a: str, b: str, *, names: Iterable[str] | None = None, prefix: str | None = None,
                   same: bool = False) -> ArchiveDiff:
        """As :meth:`tannery.Client.diff`."""
        return await _run(self._diff(a, b, names, prefix, same))

    async def list(self, prefix: str = "", *, limit: int | None = None) -> list[ArchiveInfo]:
        """As :meth:`tannery.Client.list`."""
        return await _run(self._list(prefix, list_limit(limit)))

    async def delete(self, name: str, *, force: bool = False) -> Deleted:
        """As :meth:`tannery.Client.delete`."""
        return await _run(self._delete(name, force))

    async def tag(self, alias: str, archive: str, *, expect: str | None = None) -> Tagged:
        """As :meth:`tannery.Client.tag`."""
        return await _run(self._tag(alias, archive, expect))

    async def untag(self, alias: str) -> Untagged:
        """As :meth:`tannery.Client.untag`."""
        return await _run(self._untag(alias))

    async def tag_back(self, alias: str) -> Tagged:
        """As :meth:`tannery.Client.tag_back`."""
        return await _run(self._tag_back(alias))

    async def history(self, alias: str, limit: int | None = None) -> list[AliasMove]:
        """As :meth:`tannery.Client.history`."""
        return await _run(self._history(alias, limit))

    async def resolve(self, name: str) -> str:
        """As :meth:`tannery.Client.resolve`."""
        return await _run(self._resolve(name))

    async def aliases(self, prefix: str = "", *, archive: str | None = None,
                      archive_prefix: str | None = None) -> list[Alias]:
        """As :meth:`tannery.Client.aliases`."""
        return await _run(self._aliases(prefix, archive, archive_prefix))

    async def prune(self, prefix: str, *, keep_last: int, dry_run: bool = False) -> Pruned:
        """As :meth:`tannery.Client.prune`."""
        return await _run(self._prune(prefix, keep_last, dry_run))

    def watch(self, alias: str) -> "AsyncWatch":
        """As :meth:`tannery.Client.watch`: ``async for moved in client.watch("prod")``; ``async
        with`` it, or :meth:`AsyncWatch.close` it, to end it."""
        return AsyncWatch(self, alias)

    async def load_state_dict(self, module: torch.nn.Module, name: str, prefix: str = "", strict: bool = True,
                              *, progress: Progress = None) -> Any:
        """As :meth:`tannery.Client.load_state_dict`."""
        return await _run(self._load_state_dict(module, name, prefix, strict, progress))

    # -- channels ------------------------------------------------------------------------

    async def publish(self, channel: str, tensors: Iterable[Any] | AsyncIterable[Any], *,
                      progress: Progress = None) -> Published:
        """As :meth:`tannery.Client.publish`; ``tensors`` may also be an async iterable."""
        return await _run(self._publish(channel, tensors, progress))

    def subscribe(self, channel: str, *, progress: Progress = None) -> "AsyncSubscription":
        """Subscribe to ``channel``: ``await`` it (or ``async with`` it) to register the
        subscription on the server, then ``async for`` the tensors published from then on."""
        return AsyncSubscription(lambda: self._subscribe(channel, progress))


class AsyncSubscription:
    """The tensors published on a channel, in order: ``await`` it or ``async with`` it to
    register, then ``async for``; :meth:`close` (or leaving the block) ends it."""

    def __init__(self, subscribe: Callable[[], Steps[Feed]]) -> None:
        self._subscribe = subscribe
        self._feed: Feed | None = None
        self._closed = False

    async def _start(self) -> "AsyncSubscription":
        if self._feed is None:
            self._feed = await _run(self._subscribe())
            if self._closed:
                self._feed.close()
        return self

    def __await__(self):
        return self._start().__await__()

    async def __aenter__(self) -> "AsyncSubscription":
        return await self._start()

    async def __aexit__(self, *exc: Any) -> None:
        self.close()

    def __aiter__(self) -> "AsyncSubscription":
        return self

    async def __anext__(self) -> torch.Tensor:
        await self._start()
        try:
            tensor = await _run(self._feed.next_tensor())
        except asyncio.CancelledError:
            if self._feed.closed:
                raise StopAsyncIteration from None
            raise
        if tensor is END:
            raise StopAsyncIteration
        return tensor

    def close(self) -> None:
        """End the subscription (the server forgets it); iterating stops."""
        self._closed = True
        if self._feed is not None:
            self._feed.close()


class AsyncWatch:
    """The targets of a watched alias, an async iterator (and ``async with``): the call is read
    by a task started at the first ``async for`` step, which keeps only the newest target."""

    def __init__(self, client: Client, alias: str) -> None:
        self._ready = asyncio.Event()
        self._watched = client._watched(alias, self._ready.set)
        self._task: asyncio.Task | None = None


    def __aiter__(self) -> "AsyncWatch":
        return self

    async def __anext__(self) -> Alias:
        if self._task is None and not self._watched.closed:
            self._task = asyncio.create_task(_pump(self._watched))
        while True:
            self._ready.clear()
            item = self._watched.take()
            if item is not None:
                break
            await self._ready.wait()
        if item is END:
            raise StopAsyncIteration
        return item

    def close(self) -> None:
        """End the watch: the call is cancelled, iterating stops."""
        self._watched.close()
        self._ready.set()

    async def aclose(self) -> None:
        """:meth:`close`, and wait until the call is over."""
        self.close()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)

    async def __aenter__(self) -> "AsyncWatch":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    def __del__(self) -> None:
        self.close()


async def _pump(watched: Watched) -> None:
    """Read a watch's call (a task that holds no reference to its AsyncWatch)."""
    try:
        await _run(watched.pump())
    except asyncio.CancelledError:
        if not watched.closed:
            raise


__all__ = ["AsyncRemoteArchive", "AsyncSubscription", "AsyncWatch", "Client"]
