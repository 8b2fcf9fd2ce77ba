"""Weight sync: a trainer pushes versions of its weights; a fleet of workers applies each one,
whole and in place, while they run.

    # the trainer                                   # each worker
    pub = tannery.weights.Publisher(client, "policy")   for applied in tannery.weights.Follower(client, "policy", model):
    pub.push(model, version=step)                        print("now on version", applied.version)

A version travels through the store: :meth:`Publisher.push` stores it as archive
``policy/v{N}`` (whole or not at all) and then moves the alias ``policy`` onto it; a
:class:`Follower` watches the alias (it hears of a move at once, on any replica) and applies
the version it points at. That gives every guarantee a fleet needs from one mechanism:

- **whole versions**: a follower fetches every entry it needs of one immutable archive,
  checks them all against its target, and only then copies them in (``copy_`` into the
  target's own tensors: no new allocation, casting between float dtypes); a mismatch
  (a missing or extra entry, a shape, a dtype that cannot be cast) refuses the version,
  naming the entry, with nothing applied;
- **late joiners and slow workers**: the alias always names the newest whole version, so a
  follower starts from it at once, and one that falls behind skips to the newest;
- **failures**: a trainer killed mid-push leaves no version and the alias where it was; a
  server that restarts is watched again and the followers go on from the stored latest;
- **fan-out**: the server sends each follower its entries from the one stored file of each
  (mapped on the same host, ``sendfile`` over the TCP data path), never a copy per follower;
  a follower holding a row shard (``rows``) receives only its rows.

Tied parameters (``lm_head.weight`` and the embeddings) are applied once. See
``docs/weight-sync.md`` for how this scales past one server.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from tannery_protocol.errors import NotFound
from .weight_versions import (Applied, Following, Pushed, apply_steps, check_version, keep_last, push_steps,
                              version_of)

if TYPE_CHECKING:
    from .aio import Client as AsyncClient
    from .client import Client
    from .state_dict import Rows

#: How long a follower waits before it looks again for weights not pushed yet.
FIRST_VERSION_POLL_SECONDS = 0.2


class _Pushing:
    """What both publishers hold: the weights' name, what to keep, the latest version."""

    def __init__(self, name: str, keep: bool | int) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"Publisher: the weights' name is a non-empty str, not {name!r}")
        self.name = name
        self.where = f"Publisher of {name!r}"
        self.keep = keep_last(keep, self.where)
        #: The archive the alias points at (None: not known yet; "": no version pushed).
        self.current: str | None = None
        self.version: int | None = None

    def found(self, archive: str) -> None:
        self.current = archive
        self.version = version_of(archive) if archive else None

    def pushed(self, result: Pushed) -> Pushed:
        self.current, self.version = result.archive, result.version
        return result


class Publisher:
    """Pushes versions of weights ``name`` (the trainer's side).

    ``keep``: True keeps every version as an archive (``name/vN``); a number keeps the newest
    that many; False keeps only the newest (a late joiner still starts from it). Versions
    only go up. Only one publisher may move the alias: a push that finds it moved by another
    raises AliasError naming where it points, and stores nothing more.
    """

    def __init__(self, client: Client, name: str, *, keep: bool | int = True) -> None:
        self.client = client
        self._state = _Pushing(name, keep)

    @property
    def version(self) -> int | None:
        """The latest version pushed (by any publisher, as of the last push), None before any."""
        self._know()
        return self._state.version

    def _know(self) -> None:
        if self._state.current is None:
            try:
                self._state.found(self.client.resolve(self._state.name))
            except NotFound:
                self._state.found("")

    def push(self, state: Any, version: int) -> Pushed:
        """Push ``state`` (an ``nn.Module`` or a state dict) as version ``version``: returns once
        it is stored whole and every follower can apply it."""
        from .client import _run

        self._know()
        version = check_version(version, self._state.version, self._state.where)
        steps = push_steps(self.client, self._state.name, state, version, self._state.current, self._state.keep)
        return self._state.pushed(_run(steps))


class AsyncPublisher:
    """:class:`Publisher` for ``tannery.aio.Client``: ``await publisher.push(state, version)``."""

    def __init__(self, client: AsyncClient, name: str, *, keep: bool | int = True) -> None:
        self.client = client
        self._state = _Pushing(name, keep)

    async def _know(self) -> None:
        if self._state.current is None:
            try:
                self._state.found(await self.client.resolve(self._state.name))
            except NotFound:
                self._state.found("")

    async def push(self, state: Any, version: int) -> Pushed:
        from .aio import _run

        await self._know()
        version = check_version(version, self._state.version, self._state.where)
        steps = push_steps(self.client, self._state.name, state, version, self._state.current, self._state.keep)
        return self._state.pushed(await _run(steps))


class Follower:
    """Applies each version of weights ``name`` to ``target`` (the worker's side): an iterator
    of :class:`~tannery.weight_versions.Applied`, one per version once it is in the target.

    ``target`` is an ``nn.Module`` or a state dict; its tensors are written in place.
    The first version is the newest stored (waited for if none is pushed yet); then each
    newer one, skipping to the newest when this worker is behind. ``prefix`` reads the
    entries under it; ``strict=False`` applies a version that lacks some keys or has extra
    entries; ``rows`` maps a key to the (start, stop) rows of the stored parameter this
    target holds (a tensor-parallel shard: only those rows travel).

    A version that does not fit the target raises ArchiveError from ``next()`` naming the
    entry, with nothing applied; iterating again goes on with the next version. ``close()``
    (or the ``with`` block) ends it.
    """

    def __init__(self, client: Client, name: str, target: Any, *, prefix: str = "", strict: bool = True,
                 rows: Rows | None = None) -> None:
        self.client = client
        self.following = Following(name, target, prefix, strict, rows)
        self.following.check()
        self._watch: Any = None
        self.closed = False

    @property
    def version(self) -> int | None:
        """The version the target holds (None before the first)."""
        return self.following.version

    def __iter__(self) -> Follower:
        return self

    def __next__(self) -> Applied:
        from .client import _run

        while True:
            archive = self._next_target()
            try:
                applied = _run(apply_steps(self.client, self.following, archive))
            except NotFound:
                continue  # deleted (kept versions pruned) while fetched: a newer one is coming
            if applied is not None:
                return applied

    def _next_target(self) -> str:
        while not self.closed:
            if self._watch is None:
                self._watch = self.client.watch(self.following.name)
            try:
                return next(self._watch).archive
            except (NotFound, StopIteration):
                if self.closed:
                    break
                self._watch.close()  # no version pushed yet (or the alias removed): look again soon
                self._watch = None
                time.sleep(FIRST_VERSION_POLL_SECONDS)
        raise StopIteration

    def close(self) -> None:
        """Stop following: iterating ends."""
        self.closed = True
        if self._watch is not None:
            self._watch.close()

    def __enter__(self) -> Follower:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class AsyncFollower:
    """:class:`Follower` for ``tannery.aio.Client``: ``async for applied in follower``."""

    def __init__(self, client: AsyncClient, name: str, target: Any, *, prefix: str = "", strict: bool = True,
                 rows: Rows | None = None) -> None:
        self.client = client
        self.following = Following(name, target, prefix, strict, rows)
        self.following.check()
        self._watch: Any = None
        self.closed = False

    @property
    def version(self) -> int | None:
        return self.following.version

    def __aiter__(self) -> AsyncFollower:
        return self

    async def __anext__(self) -> Applied:
        from .aio import _run

        while True:
            archive = await self._next_target()
            try:
                applied = await _run(apply_steps(self.client, self.following, archive))
            except NotFound:
                continue
            if applied is not None:
                return applied

    async def _next_target(self) -> str:
        while not self.closed:
            if self._watch is None:
                self._watch = self.client.watch(self.following.name)
            try:
                return (await self._watch.__anext__()).archive
            except (NotFound, StopAsyncIteration):
                if self.closed:
                    break
                await self._watch.aclose()
                self._watch = None
                await asyncio.sleep(FIRST_VERSION_POLL_SECONDS)
        raise StopAsyncIteration

    async def aclose(self) -> None:
        """Stop following: iterating ends."""
        self.closed = True
        if self._watch is not None:
            await self._watch.aclose()

    async def __aenter__(self) -> AsyncFollower:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()


__all__ = ["Applied", "AsyncFollower", "AsyncPublisher", "Follower", "Publisher", "Pushed"]
