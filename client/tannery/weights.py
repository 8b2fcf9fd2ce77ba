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
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from tannery_protocol.errors import ArchiveError, NotFound
from .follow_sources import AGAIN, FIRST_VERSION_POLL_SECONDS, Newest, Pauses
from .weight_stream import Assembler
from .weight_versions import FROM_STORE, Applied, Following, Pushed, Pushing, apply_steps, apply_streamed, push_steps

if TYPE_CHECKING:
    from .aio import Client as AsyncClient
    from .client import Client
    from .state_dict import Rows

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
    version whole from the store. Versions only go up. One publisher per name: a push that
    finds the alias moved by another raises AliasError naming where it points.
    """

    def __init__(self, client: Client, name: str, *, keep: bool | int = True, stream: bool = True,
                 delta: bool = True) -> None:
        self.client = client
        self._pushing = Pushing(name, keep, stream, delta)

    @property
    def version(self) -> int | None:
        """The latest version pushed (by this publisher, or before it started), None before any."""
        from .client import _run

        _run(self._pushing.learn(self.client))
        return self._pushing.version

    def push(self, state: Any, version: int) -> Pushed:
        """Push ``state`` (an ``nn.Module`` or a state dict) as version ``version``: returns once
        it is stored whole and the alias points at it."""
        from .client import _run

        return _run(push_steps(self.client, self._pushing, state, version))


class AsyncPublisher:
    """:class:`Publisher` for ``tannery.aio.Client``: ``await publisher.push(state, version)``."""

    def __init__(self, client: AsyncClient, name: str, *, keep: bool | int = True, stream: bool = True,
                 delta: bool = True) -> None:
        self.client = client
        self._pushing = Pushing(name, keep, stream, delta)

    async def push(self, state: Any, version: int) -> Pushed:
        from .aio import _run

        return await _run(push_steps(self.client, self._pushing, state, version))


class Follower:
    """Applies each version of weights ``name`` to ``target`` (the worker's side): an iterator
    of :class:`~tannery.weight_versions.Applied`, one per version once it is in the target.

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
    """

    def __init__(self, client: Client, name: str, target: Any, *, prefix: str = "", strict: bool = True,
                 rows: Rows | None = None, stream: bool = True) -> None:
        self.client = client
        self.following = Following(name, target, prefix, strict, rows)
        self.following.check()
        self.closed = False
        self._newest = Newest()
        self._ready = threading.Condition()
        self._sources: list[Any] = []  # the watch and the subscription open now
        self._subscribed = threading.Event()
        self._stop = threading.Event()  # its pauses end at close()
        self._threads = [threading.Thread(target=self._watching, daemon=True, name=f"tannery-follow-{name}")]
        if stream:
            self._threads.append(threading.Thread(target=self._streaming, daemon=True, name=f"tannery-stream-{name}"))
        else:
            self._subscribed.set()
        for thread in self._threads:
            thread.start()
        self._subscribed.wait(10)  # versions pushed from now on come on the channel too

    @property
    def version(self) -> int | None:
        """The version the target holds (None before the first)."""
        return self.following.version

    def __iter__(self) -> Follower:
        return self

    def __next__(self) -> Applied:
        from .client import _run

        while True:
            with self._ready:
                while not self.closed and (pause := self._newest.wait(time.monotonic())) != 0.0:
                    self._ready.wait(pause)
                if self.closed:
                    raise StopIteration
                archive, streamed = self._newest.take()
            try:
                applied = apply_streamed(self.following, streamed) if streamed is not None else FROM_STORE
                if applied is FROM_STORE:  # not streamed, or a delta this follower cannot apply
                    applied = _run(apply_steps(self.client, self.following, archive)) if archive else None
            except NotFound:
                continue  # deleted (kept versions pruned) while fetched: a newer one is coming
            except ArchiveError:
                raise  # refused: not tried again
            except BaseException:
                with self._ready:
                    self._newest.restore(archive, streamed)  # not lost: the next call tries it again
                raise
            if applied is not None:
                return applied

    def _offer(self, **found: Any) -> None:
        with self._ready:
            for key, value in found.items():
                setattr(self._newest, key, value)
            self._ready.notify_all()

    def _opened(self, source: Any) -> bool:
        """Keep ``source`` to close it; False (and closed) when the follower closed meanwhile."""
        with self._ready:
            if not self.closed:
                self._sources.append(source)
                return True
        source.close()
        return False

    def _done(self, source: Any) -> None:
        with self._ready:
            if source in self._sources:
                self._sources.remove(source)
        source.close()

    def _watching(self) -> None:
        pauses = Pauses()
        while not self.closed:
            try:
                watch = self.client.watch(self.following.name)
                if not self._opened(watch):
                    return
                try:
                    for alias in watch:
                        pauses.reset()
                        self._offer(moved=alias.archive)
                finally:
                    self._done(watch)
            except NotFound:  # nothing pushed yet (or the alias removed): look again soon
                self._stop.wait(FIRST_VERSION_POLL_SECONDS)
            except AGAIN:  # the server is away (longer than the client's retries): wait for it
                self._stop.wait(pauses.take())
            except Exception as error:  # no wait mends it (a token refused): next() raises it
                if not self.closed:
                    self._offer(failure=error)
                return

    def _streaming(self) -> None:
        pauses = Pauses()
        while not self.closed:
            assembler = Assembler(self.following.name)
            try:
                subscription = self.client.subscribe(self.following.name)
                if not self._opened(subscription):
                    return
                self._subscribed.set()
                pauses.reset()
                try:
                    for tensor in subscription:
                        streamed = assembler.add(tensor)
                        self._offer(streaming=assembler.pending, progress=time.monotonic(),
                                    **({"streamed": streamed} if streamed is not None else {}))
                finally:
                    self._done(subscription)
            except AGAIN:  # dropped for falling behind, or the server went: the store covers the gap
                self._offer(streaming=None)
                self._subscribed.set()
                self._stop.wait(pauses.take())
            except Exception as error:  # no channels here (or not allowed): versions come from the store
                log.warning("%s: versions come from the store alone, not the channel: %s", self.following.where, error)
                self._offer(streaming=None)
                self._subscribed.set()
                return

    def close(self) -> None:
        """Stop following: iterating ends, the watch and the subscription are closed."""
        self._stop.set()
        with self._ready:
            self.closed = True
            sources, self._sources = self._sources, []
            self._ready.notify_all()
        for source in sources:
            source.close()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(5)

    def __enter__(self) -> Follower:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class AsyncFollower:
    """:class:`Follower` for ``tannery.aio.Client``: ``async for applied in follower`` (the alias
    and the channel are read by two tasks, started at the first step; a version is copied in on
    a worker thread, so the event loop goes on meanwhile)."""

    def __init__(self, client: AsyncClient, name: str, target: Any, *, prefix: str = "", strict: bool = True,
                 rows: Rows | None = None, stream: bool = True) -> None:
        self.client = client
        self.following = Following(name, target, prefix, strict, rows)
        self.following.check()
        self.closed = False
        self._stream = stream
        self._newest = Newest()
        self._ready = asyncio.Event()
        self._sources: list[Any] = []
        self._tasks: list[asyncio.Task] = []

    @property
    def version(self) -> int | None:
        return self.following.version

    def __aiter__(self) -> AsyncFollower:
        return self

    async def start(self) -> None:
        """Start reading the alias and the channel (the first step does it): returns once the
        subscription is registered (or 10 s have passed), so versions pushed from then on come
        on the channel too."""
        if self._tasks:
            return
        subscribed = asyncio.Event()
        self._tasks.append(asyncio.create_task(self._watching()))
        if self._stream:
            self._tasks.append(asyncio.create_task(self._streaming(subscribed)))
            try:
                await asyncio.wait_for(subscribed.wait(), 10)
            except asyncio.TimeoutError:
                pass

    async def __anext__(self) -> Applied:
        from .aio import _run

        await self.start()
        while True:
            while not self.closed and (pause := self._newest.wait(time.monotonic())) != 0.0:
                self._ready.clear()
                try:
                    await asyncio.wait_for(self._ready.wait(), pause)
                except asyncio.TimeoutError:
                    pass
            if self.closed:
                raise StopAsyncIteration
            archive, streamed = self._newest.take()
            try:
                applied = (await asyncio.to_thread(apply_streamed, self.following, streamed)
                           if streamed is not None else FROM_STORE)
                if applied is FROM_STORE:  # not streamed, or a delta this follower cannot apply
                    applied = await _run(apply_steps(self.client, self.following, archive)) if archive else None
            except NotFound:
                continue
            except ArchiveError:
                raise
            except BaseException:  # cancelled too: the version is not lost
                self._newest.restore(archive, streamed)
                raise
            if applied is not None:
                return applied

    def _offer(self, **found: Any) -> None:
        for key, value in found.items():
            setattr(self._newest, key, value)
        self._ready.set()

    async def _watching(self) -> None:
        pauses = Pauses()
        while not self.closed:
            watch = self.client.watch(self.following.name)
            self._sources.append(watch)
            try:
                async for alias in watch:
                    pauses.reset()
                    self._offer(moved=alias.archive)
            except NotFound:
                await asyncio.sleep(FIRST_VERSION_POLL_SECONDS)
            except AGAIN:
                await asyncio.sleep(pauses.take())
            except Exception as error:
                if not self.closed:
                    self._offer(failure=error)
                return
            finally:
                self._sources.remove(watch)
                await watch.aclose()

    async def _streaming(self, subscribed: asyncio.Event) -> None:
        pauses = Pauses()
        while not self.closed:
            assembler = Assembler(self.following.name)
            subscription = None
            try:
                subscription = self.client.subscribe(self.following.name)
                async with subscription:
                    self._sources.append(subscription)
                    subscribed.set()
                    pauses.reset()
                    async for tensor in subscription:
                        streamed = assembler.add(tensor)
                        self._offer(streaming=assembler.pending, progress=time.monotonic(),
                                    **({"streamed": streamed} if streamed is not None else {}))
            except AGAIN:
                self._offer(streaming=None)
                subscribed.set()
                await asyncio.sleep(pauses.take())
            except Exception as error:
                log.warning("%s: versions come from the store alone, not the channel: %s", self.following.where, error)
                self._offer(streaming=None)
                subscribed.set()
                return
            finally:
                if subscription in self._sources:
                    self._sources.remove(subscription)

    async def aclose(self) -> None:
        """Stop following: iterating ends."""
        self.closed = True
        for source in list(self._sources):
            source.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._ready.set()

    async def __aenter__(self) -> AsyncFollower:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()


__all__ = ["Applied", "AsyncFollower", "AsyncPublisher", "Follower", "Publisher", "Pushed"]
