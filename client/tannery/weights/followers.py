"""Weight sync: a trainer pushes versions of its weights; a fleet of workers applies each one,
whole and in place, while they run.

    # the trainer                                   # each worker
    pub = tannery.weights.Publisher(client, "policy")   for applied in tannery.weights.Follower(client, "policy", model):
    pub.push(model, version=step)                        print("now on version", applied.version)

A version travels two ways at once. :meth:`Publisher.push` streams it on the channel
``policy`` to the followers running now, then stores it as the archive ``policy/v{N}`` (whole
or not at all) and moves the alias ``policy`` onto it. A :class:`Follower` reads the channel
and watches the alias (a move is heard at once, on any replica), and applies the newest
version either brings:

- **whole versions**: a follower applies a version only once every entry it needs is here
  and checked against its target, then copies them in (``copy_`` into the target's own
  tensors: no new allocation, casting between float dtypes); a mismatch (a missing or extra
  entry, a shape, a dtype that cannot be cast) refuses the version, naming the entry, with
  nothing applied;
- **late joiners and slow workers**: the alias always names the newest stored version, so a
  follower starts from it at once, and one that falls behind (or missed a version on the
  channel) skips to the newest;
- **failures**: a trainer killed while it streams leaves the followers and the store on the
  previous version (killed between its stream and its store, the running followers keep the
  version they got, and the trainer's next push, of the same number, brings everyone level:
  docs/weight-sync.md); a server that restarts is read again and the followers go on from the
  stored latest;
- **fan-out**: the server hands every follower the same payloads (one sealed memory file
  each on the same host; messages made once over gRPC), and serves the store from one file
  per entry; a follower holding a row shard (``rows``) keeps only its rows.

Tied parameters (``lm_head.weight`` and the embeddings) are applied once. See
``docs/weight-sync.md`` for how this scales past one server.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Awaitable

from tannery_protocol.errors import ArchiveError, NotFound
from tannery.dataplane.memory_files import DEFAULT_BUDGET
from tannery.weights.sources import AGAIN, FIRST_VERSION_POLL_SECONDS, Newest, Pauses
from tannery.calls.running import run as run_blocking, run_async
from tannery.rpc.waits import END, Blocking, Rpc, Steps
from tannery.weights.relays import Relaying, ThreadedSource, relays_possible, sync_twin
from tannery.weights.stream import Assembler, StreamedVersion
from tannery.weights.versions import FROM_STORE, Applied, Following, Pushed, Pushing, apply_steps, apply_streamed, push_steps

if TYPE_CHECKING:
    from tannery.aio import Client as AsyncClient
    from tannery.client import Client
    from tannery.calls.state_dict import Rows

log = logging.getLogger("tannery.weights")


class Publisher:
    """Pushes versions of weights ``name`` (the trainer's side).

    ``keep``: True keeps every version as an archive (``name/vN``); a number keeps the newest
    that many; False keeps only the newest (a late joiner still starts from it). ``stream``
    (the default) sends each version to the followers running now on the channel ``name``
    before storing it; ``stream=False`` only stores it (followers take it from the store,
    after the commit: see docs/weight-sync.md). ``delta`` (the default) streams a version as
    its changes from the version streamed before, when they are less than half of it (a copy
    of that version is kept to diff against: as much memory as the weights); followers that
    hold that version apply the changes and check every tensor's digest, the others take the
    version whole from the store. ``ready_bytes``: on the same host, how many bytes of memory
    files a publisher makes ready between pushes for the next version's payloads, so that
    writing them does not wait for the kernel to allocate their pages (0: none). Versions only
    go up. One publisher per name: a push that finds the alias moved by another raises
    AliasError naming where it points.
    """

    def __init__(self, client: Client, name: str, *, keep: bool | int = True, stream: bool = True,
                 delta: bool = True, ready_bytes: int = DEFAULT_BUDGET) -> None:
        self.client = client
        self._pushing = Pushing(name, keep, stream, delta, ready_bytes)

    @property
    def version(self) -> int | None:
        """The latest version pushed (by this publisher, or before it started), None before any."""
        run_blocking(self._pushing.learn(self.client))
        return self._pushing.version

    def push(self, state: Any, version: int) -> Pushed:
        """Push ``state`` (an ``nn.Module`` or a state dict) as version ``version``: returns once
        it is stored whole and the alias points at it."""
        return run_blocking(push_steps(self.client, self._pushing, state, version))


class AsyncPublisher:
    """:class:`Publisher` for ``tannery.aio.Client``: ``await publisher.push(state, version)``."""

    def __init__(self, client: AsyncClient, name: str, *, keep: bool | int = True, stream: bool = True,
                 delta: bool = True, ready_bytes: int = DEFAULT_BUDGET) -> None:
        self.client = client
        self._pushing = Pushing(name, keep, stream, delta, ready_bytes)

    async def push(self, state: Any, version: int) -> Pushed:
        return await run_async(push_steps(self.client, self._pushing, state, version))


class _Follower:
    """What both followers are: the loops that read the alias and the channel, and the one that
    applies the newest version either brought, written once as steps (:mod:`tannery.rpc.waits`).
    :class:`Follower` runs them on threads, blocking; :class:`AsyncFollower` as tasks, awaiting:
    each says only how it waits (``_newest_ready``, ``_pause``, ``_next_of``, ``_subscribe``,
    ``_close_source``), as the two clients do over one call core."""

    def __init__(self, client: Any, name: str, target: Any, prefix: str, strict: bool, rows: Rows | None,
                 stream: bool) -> None:
        self.client = client
        self.following = Following(name, target, prefix, strict, rows)
        self.following.check()
        self.closed = False
        self._stream = stream
        self._newest = Newest()
        self._sources: list[Any] = []  # the watch and the subscription open now

    @property
    def version(self) -> int | None:
        """The version the target holds (None before the first)."""
        return self.following.version

    def _next(self) -> Steps[Applied | None]:
        """The next version applied; None once closed."""
        while True:
            newest = yield Rpc(self._newest_ready)
            if newest is None:
                return None
            archive, streamed = newest
            try:
                applied = (yield Blocking(apply_streamed, self.following, streamed)) if streamed is not None else FROM_STORE
                if applied is FROM_STORE:  # not streamed, or a delta this follower cannot apply
                    applied = (yield from apply_steps(self.client, self.following, archive)) if archive else None
            except NotFound:
                continue  # deleted (kept versions pruned) while fetched: a newer one is coming
            except ArchiveError:
                raise  # refused: not tried again
            except BaseException:  # cancelled too: the version is not lost, the next step tries it again
                with self._lock:
                    self._newest.restore(archive, streamed)
                raise
            if applied is not None and streamed is not None and streamed.base is not None and \
                    streamed.base == (self.following.version, self.following.push):
                with self._lock:  # an older version from the store was the base this delta lacked
                    self._newest.restore(None, streamed)
            if applied is not None:
                return applied

    def _offer(self, **found: Any) -> None:
        with self._lock:
            for key, value in found.items():
                setattr(self._newest, key, value)
            self._wake()

    def _opened(self, source: Any) -> bool:
        """Keep ``source`` to close it; False (and closed) when the follower closed meanwhile."""
        with self._lock:
            if not self.closed:
                self._sources.append(source)
                return True
        source.close()
        return False

    def _watching(self) -> Steps[None]:
        pauses = Pauses()
        while not self.closed:
            try:
                watch = self.client.watch(self.following.name)
                if not self._opened(watch):
                    return
                try:
                    while (alias := (yield Rpc(self._next_of, watch))) is not END:
                        pauses.reset()
                        self._offer(moved=alias.archive)
                finally:
                    yield Rpc(self._close_source, watch)
            except NotFound:  # nothing pushed yet (or the alias removed): look again soon
                yield Rpc(self._pause, FIRST_VERSION_POLL_SECONDS)
            except AGAIN:  # the server is away (longer than the client's retries): wait for it
                yield Rpc(self._pause, pauses.take())
            except Exception as error:  # no wait mends it (a token refused): the next step raises it
                if not self.closed:
                    self._offer(failure=error)
                return

    def _streaming(self) -> Steps[None]:
        pauses = Pauses()
        while not self.closed:
            assembler = Assembler(self.following.name)
            try:
                subscription = yield Rpc(self._subscribe)
                if not self._opened(subscription):
                    return
                self._subscribed.set()
                pauses.reset()
                try:
                    while (tensor := (yield Rpc(self._next_of, subscription))) is not END:
                        streamed = assembler.add(tensor)
                        self._offer(streaming=assembler.pending, progress=time.monotonic(),
                                    **({"streamed": streamed} if streamed is not None else {}))
                finally:
                    yield Rpc(self._close_source, subscription)
            except AGAIN:  # dropped for falling behind, or the server went: the store covers the gap
                self._offer(streaming=None)
                self._subscribed.set()
                yield Rpc(self._pause, pauses.take())
            except Exception as error:  # no channels here (or not allowed): versions come from the store
                log.warning("%s: versions come from the store alone, not the channel: %s", self.following.where, error)
                if (relaying := getattr(self, "_relaying", None)) is not None:
                    relaying.close()  # it leaves the plan: no follower is routed through it any more
                self._offer(streaming=None)
                self._subscribed.set()
                return


class Follower(_Follower):
    """Applies each version of weights ``name`` to ``target`` (the worker's side): an iterator
    of :class:`~tannery.weights.versions.Applied`, one per version once it is in the target.

    ``target`` is an ``nn.Module`` or a state dict; its tensors are written in place.
    The first version is the newest stored (waited for if none is pushed yet); then each
    newer one, as it comes on the channel (``stream``, the default) or, when this follower
    missed it there, from the store; a follower that is behind skips to the newest.
    ``prefix`` reads the entries under it; ``strict=False`` applies a version that lacks some
    keys or has extra entries; ``rows`` maps a key to the (start, stop) rows of the stored
    parameter this target holds (a tensor-parallel shard: from the store only those rows
    travel).

    A version that does not fit the target raises ArchiveError from ``next()`` naming the
    entry, with nothing applied; iterating again goes on with the next version. A server
    away for a while is waited for (the alias and the channel are read again, with growing
    pauses); an error no wait can mend (PermissionDenied, say) is raised from ``next()``.
    ``close()`` (or the ``with`` block) ends it. The follower reads the alias and the
    channel on two threads of its own; the versions are applied on the thread that iterates.

    ``relay`` (by default on, unless this client takes the same-host path): the follower passes
    every version it receives on to the followers the server routes through it, piece by piece
    on threads of its own, so the server sends each version about once (docs/weight-sync.md,
    "Relays"). It listens on ``relay_port`` (0: any free port) of ``relay_host`` (None: the
    address this host reaches the server from; other followers must reach it there).
    """

    def __init__(self, client: Client, name: str, target: Any, *, prefix: str = "", strict: bool = True,
                 rows: Rows | None = None, stream: bool = True, relay: bool | None = None,
                 relay_host: str | None = None, relay_port: int = 0) -> None:
        super().__init__(client, name, target, prefix, strict, rows, stream)
        #: Whether to relay (None: decided at the first subscription, by the transport it takes), and
        #: the relay once made.
        self._relay, self._relay_at = (relay if stream else False), (relay_host, relay_port)
        self._relaying: Relaying | None = None
        self._ready = self._lock = threading.Condition()
        self._wake = self._ready.notify_all
        self._subscribed = threading.Event()
        self._stop = threading.Event()  # its pauses end at close()
        self._pause = self._stop.wait
        loops = [self._watching] + ([self._streaming] if stream else [])
        self._threads = [threading.Thread(target=run_blocking, args=(loop(),), daemon=True, name=f"tannery-{kind}-{name}")
                         for loop, kind in zip(loops, ("follow", "stream"))]
        if not stream:
            self._subscribed.set()
        for thread in self._threads:
            thread.start()
        self._subscribed.wait(10)  # versions pushed from now on come on the channel too

    def __iter__(self) -> Follower:
        return self

    def __next__(self) -> Applied:
        applied = run_blocking(self._next())
        if applied is None:
            raise StopIteration
        return applied

    def _newest_ready(self) -> tuple[str | None, StreamedVersion | None] | None:
        with self._ready:
            while not self.closed and (pause := self._newest.wait(time.monotonic())) != 0.0:
                self._ready.wait(pause)
            return None if self.closed else self._newest.take()

    @staticmethod
    def _next_of(source: Any) -> Any:
        return next(source, END)

    def _subscribe(self) -> Any:
        if self._relay is not False and self._relaying is None and not relays_possible(self.client):
            if self._relay:
                log.warning("%s: relay=True, but this client takes the same-host path: every follower here maps "
                            "the server's memory files, nothing to pass on; this follower does not relay",
                            self.following.where)
            self._relay = False
        if self._relay is not False and self._relaying is None:
            with self._ready:
                if self.closed:
                    return self.client.subscribe(self.following.name)  # closed at once by the caller
                self._relaying = Relaying(self.client, self.following.name, *self._relay_at)
        if self._relaying is not None:
            return self._relaying.open_source()
        return self.client.subscribe(self.following.name)

    def _close_source(self, source: Any) -> None:
        with self._ready:
            if source in self._sources:
                self._sources.remove(source)
        source.close()

    def close(self) -> None:
        """Stop following: iterating ends, the watch and the subscription are closed."""
        self._stop.set()
        with self._ready:
            self.closed = True
            sources, self._sources = self._sources, []
            self._ready.notify_all()
        for source in sources:
            source.close()
        with self._ready:
            relaying = self._relaying
        if relaying is not None:
            relaying.close()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(5)

    def __enter__(self) -> Follower:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class AsyncFollower(_Follower):
    """:class:`Follower` for ``tannery.aio.Client``: ``async for applied in follower`` (the alias
    and the channel are read by two tasks, started at the first step; a version is copied in on
    a worker thread, so the event loop goes on meanwhile)."""

    def __init__(self, client: AsyncClient, name: str, target: Any, *, prefix: str = "", strict: bool = True,
                 rows: Rows | None = None, stream: bool = True, relay: bool | None = None,
                 relay_host: str | None = None, relay_port: int = 0) -> None:
        super().__init__(client, name, target, prefix, strict, rows, stream)
        #: As :class:`Follower`'s; the relay runs on threads of its own over a blocking twin of the client.
        self._relay, self._relay_at = (relay if stream else False), (relay_host, relay_port)
        self._relaying: Relaying | None = None
        self._ready = asyncio.Event()
        self._lock = contextlib.nullcontext()  # one event loop: nothing to lock
        self._wake = self._ready.set
        self._subscribed = asyncio.Event()
        self._pause = asyncio.sleep
        self._tasks: list[asyncio.Task] = []

    def __aiter__(self) -> AsyncFollower:
        return self

    async def start(self) -> None:
        """Start reading the alias and the channel (the first step does it): returns once the
        subscription is registered (or 10 s have passed), so versions pushed from then on come
        on the channel too."""
        if self._tasks:
            return
        self._tasks.append(asyncio.create_task(run_async(self._watching())))
        if self._stream:
            self._tasks.append(asyncio.create_task(run_async(self._streaming())))
            try:
                await asyncio.wait_for(self._subscribed.wait(), 10)
            except asyncio.TimeoutError:
                pass

    async def __anext__(self) -> Applied:
        await self.start()
        applied = await run_async(self._next())
        if applied is None:
            raise StopAsyncIteration
        return applied

    async def _newest_ready(self) -> tuple[str | None, StreamedVersion | None] | None:
        while not self.closed and (pause := self._newest.wait(time.monotonic())) != 0.0:
            self._ready.clear()
            try:
                await asyncio.wait_for(self._ready.wait(), pause)
            except asyncio.TimeoutError:
                pass
        return None if self.closed else self._newest.take()

    @staticmethod
    def _next_of(source: Any) -> Awaitable[Any]:
        return anext(source, END)

    async def _subscribe(self) -> Any:
        if self._relay is not False and self._relaying is None:
            twin = sync_twin(self.client)
            if await asyncio.to_thread(relays_possible, twin):
                self._relaying = Relaying(twin, self.following.name, *self._relay_at)
            else:
                twin.close()
                self._relay = False
        if self._relaying is not None:
            return ThreadedSource(await asyncio.to_thread(self._relaying.open_source))
        return await self.client.subscribe(self.following.name)

    async def _close_source(self, source: Any) -> None:
        if source in self._sources:
            self._sources.remove(source)
        if hasattr(source, "aclose"):  # a watch: wait until its call is over
            await source.aclose()
        else:
            source.close()

    async def aclose(self) -> None:
        """Stop following: iterating ends."""
        self.closed = True
        for source in list(self._sources):
            source.close()
        if self._relaying is not None:
            await asyncio.to_thread(self._relaying.close)
            self._relaying.client.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._ready.set()

    async def __aenter__(self) -> AsyncFollower:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()


__all__ = ["Applied", "AsyncFollower", "AsyncPublisher", "Follower", "Publisher", "Pushed"]
