"""``tannery.Client``: the synchronous client of a tannery server.

::

    with tannery.Client("localhost:50051") as client:
        client.store("resnet", model)                    # an nn.Module, a dict of tensors, an Archive
        weights = client.archive("resnet")               # no entry described yet; reads fetch only what is asked
        w = weights.tensor("fc.weight", [10, 512], torch.float32)
        client.load_state_dict(model, "resnet")

Every failure raises a tannery exception with the server's message (``NotFound``,
``ArchiveError``, ``FormatError``, ``Unavailable``, ...; see :mod:`tannery_protocol.errors`); no
``grpc.RpcError`` escapes. The asyncio twin is :mod:`tannery.aio`. Both are the call core
(:mod:`tannery.calls.core`, which calls the chosen :mod:`tannery.dataplane.transports`); this module
runs its steps by blocking (:func:`tannery.calls.running.run`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from tannery_protocol._lazy import lazy_module
from tannery.calls.core import CallCore
from tannery.rpc.connection import Connection
from tannery.records import Alias, ArchiveDescription, ArchiveInfo, Deleted, Pruned, Published, Tagged, Untagged
from tannery.rpc.requests import Progress, fetch_request, list_limit
from tannery.rpc.waits import END
from tannery.calls.running import iterate as _iterate, run as _run

if TYPE_CHECKING:  # torch is imported where a tensor is made (tannery.dataplane.readers, tannery.rpc.requests)
    import torch

    from tannery.archive import Archive
    from tannery.calls.diff import ArchiveDiff
    from tannery.calls.history import AliasMove
    from tannery.dataplane.received import TensorPiece
    from tannery.remote import RemoteArchive
    from tannery.dataplane.transports import Feed

# Imported on first use: catalog calls (tannery ls, show, rm) need none of these.
_readers = lazy_module("tannery.dataplane.readers")
_remote = lazy_module("tannery.remote")


class Client(CallCore):
    """A connection to a tannery server (a context manager; :meth:`close` when done).

    ``target`` is ``host:port`` (``TANNERY_TARGET``, else ``localhost:50051``); ``token``
    is sent as ``authorization: Bearer <token>`` on every call (``TANNERY_TOKEN``); ``tls``
    is None (insecure unless ``TANNERY_TLS_*`` say otherwise), False (insecure), True
    (the system's roots) or a :class:`tannery.TLS`. ``chunk_size`` is the bytes of tensor
    data per message sent (1 MiB); ``timeout`` the seconds any one call may take (no limit
    by default; subscriptions are never limited). ``transport`` is how Store, Fetch, Publish
    and Subscribe move their bytes (``TANNERY_TRANSPORT``, else ``"auto"``): ``"local"`` (the
    server's Unix socket: stored files mapped, no copy through a socket), ``"tcp"`` (its data port),
    ``"grpc"`` (the gRPC streams), or ``"auto"``, the first of these that reaches the server
    (see :mod:`tannery.dataplane.transports`); it is settled at the first Store or Fetch, and again
    after a retry. ``retries`` is how many times a call that ended UNAVAILABLE (the server
    unreachable or restarting, a connection lost mid-call) is tried again
    (``TANNERY_RETRIES``, else 5; 0 for none; see :mod:`tannery.rpc.retries`): reads, Union,
    Delete and Store (sent again from its start), Fetch (resumed after the entries received).
    ``timeout`` applies to each attempt.
    """

    def _open(self, connection: Connection) -> Any:
        return connection.channel()

    def _new_lock(self) -> threading.Lock:
        return threading.Lock()

    def _wants_digests(self) -> bool:
        return _run(self._digests_wanted())

    def close(self) -> None:
        """Close the channel; calls in flight are cancelled."""
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def transport(self) -> str:
        """The transport Store and Fetch take: "local", "tcp" or "grpc" (settled now if it was not)."""
        return _run(self._transport_kind())

    # -- archives ------------------------------------------------------------------------

    def store(self, name: str, value: Any, *, prefix: str = "", replace: bool = False,
              progress: Progress = None, metadata: Mapping[str, str] | None = None,
              skip_non_tensors: bool = False, allow_empty: bool = False,
              files: Mapping[str, bytes] | None = None) -> ArchiveInfo:
        """Store ``value`` as archive ``name``: an Archive, a mapping of names to tensors, an
        ``nn.Module`` (its state_dict) or a structure ``Archive.of_value`` takes, each entry
        named under ``prefix``.

        Entries stream one at a time, each tensor's bytes copied once, into its messages.
        The archive appears whole or not at all. Without ``replace``, a name that already holds
        exactly this content (entries, bytes and metadata) is no error: the server stores
        nothing and the info returned says ``already_stored`` (so a store whose answer was lost
        may be sent again); other content under that name raises AlreadyExists naming the
        first entry (or metadata key) that differs.
        ``progress`` is called with the tensor bytes (payload bytes) of each message sent.
        ``metadata``, a small mapping of str to str (safetensors' ``__metadata__``), is kept
        with the archive and returned by :meth:`describe`.

        Plain values (a step count, a learning rate, None, RNG states: :mod:`tannery.plain`)
        are kept beside the tensors, typed exactly and never pickled, committed in the same
        Store as an entry ``P.@values`` (so a tensor named so is refused), and given back by
        ``archive(name).to_value()``. Nothing vanishes silently: any other leaf (an object, a
        function) is a TypeError naming its path unless ``skip_non_tensors`` (then every leaf
        that is not a tensor is left out), and an archive of no entries is an ArchiveError
        unless ``allow_empty``.

        ``files`` (file name to bytes: a model folder's ``config.json``, its tokenizer's files)
        are kept with the archive, committed in the same Store and read back with
        :meth:`files`; at most 32 MiB each and 64 MiB in all (ArchiveError naming the file
        otherwise). They are entries on the server, never listed among the tensors (see
        :mod:`tannery.calls.archive_files`), so a tensor named ``@file:...`` is refused.
        """
        return _run(self._store(name, value, prefix, replace, progress, metadata, skip_non_tensors, allow_empty,
                                files))

    def files(self, name: str, prefix: str = "", *, progress: Progress = None) -> dict[str, bytes]:
        """The files kept with archive ``name`` (``store(files=...)``; those stored under
        ``prefix``), by name, in one Fetch, each checked against the SHA-256 recorded when it
        was stored (DataLoss otherwise); ``describe(name).files`` lists them without their bytes."""
        return _run(self._files(name, prefix, progress))

    def archive(self, name: str, *, progress: Progress = None, lazy: bool = True) -> RemoteArchive:
        """The archive ``name`` as a :class:`RemoteArchive` (NotFound when there is none).

        Opening describes no entry: reads describe the entries they name when they first need
        them, ``names()`` and ``to_value`` the whole archive, once; so opening an archive and
        reading one entry cost the same whatever its size. ``lazy=False`` describes every
        entry at once, a snapshot every read is checked against. Reads fetch only what they
        return; ``progress`` is called with the payload bytes of each message received.
        ``name`` may be an alias: it is resolved once, at open, and every later read asks for
        the archive it named then (``.description.name``), so a move never mixes two versions."""
        description = self.describe(name, () if lazy else None)
        archive = description.name or name
        return _remote.RemoteArchive(description, lambda asks: _run(self._transferred(archive, asks, progress)),
                                     lambda names: self.describe(archive, names))

    def fetch(self, name: str, names: Iterable[str] | None = None, prefix: str | None = None, *,
              progress: Progress = None) -> Archive:
        """Entries of archive ``name`` in memory: those named (NotFound for one it lacks), or
        those ``prefix`` owns, or all of them, with the plain values kept under what they
        cover; in one call."""
        return _run(self._fetched_archive(fetch_request(name, names, prefix), progress))

    def fetch_iter(self, name: str, names: Iterable[str] | None = None, prefix: str | None = None, *,
                   progress: Progress = None) -> Iterator[tuple[str, torch.Tensor]]:
        """The entries :meth:`fetch` would return, as ``(name, tensor)`` pairs while they arrive,
        in the order the server sends them (``names``' order, else by name), in one call.

        Each tensor is yielded once its last byte is in, so only the entry being received is
        held: to write a checkpoint larger than memory, or to start on the first entries
        early. Stopping early (``break``, ``close()``) cancels the call; a failure midway
        raises where it happens, after the entries that came whole.
        """
        return _iterate(self._entries(fetch_request(name, names, prefix), _readers.EntryReader(progress)))

    def fetch_pieces(self, name: str, names: Iterable[str] | None = None, prefix: str | None = None, *,
                     progress: Progress = None) -> Iterator[TensorPiece]:
        """The entries :meth:`fetch_iter` would yield, as the pieces of their tensor bytes that
        each message brings (:class:`~tannery.dataplane.readers.TensorPiece`: name, dtype and shape,
        offset, bytes), viewing the received messages: nothing is gathered or copied, so
        an entry of any size can be written to a file while only one message is held.
        """
        return _iterate(self._entries(fetch_request(name, names, prefix), _readers.PieceReader(progress)))

    def union(self, target: str, sources: Mapping[str, str] | Sequence[str], *, replace: bool = False,
              metadata: Mapping[str, str] | None = None) -> ArchiveInfo:
        """A new archive ``target`` of the entries of ``sources``: a mapping of prefix to archive
        name, or a list of names. No tensor bytes are copied (on the server either). Without
        ``replace``, a ``target`` that already holds exactly what the union gives is returned
        with ``already_stored``; other content there raises AlreadyExists naming the entry."""
        return _run(self._union(target, sources, replace, metadata))

    def derive(self, archive: str, base: str, changes: Iterable[Any], *, replace: bool = False,
               metadata: Mapping[str, str] | None = None) -> ArchiveInfo:
        """A new archive ``archive`` built on the server from archive (or alias) ``base`` and
        ``changes``, each ``(name, kind, crc32c, tensors)``: kind ``"same"`` (no tensor: the base's
        entry, its bytes reused), ``"delta"`` (flat int32/int64 indices and the new bits of those
        elements, as the integer dtype of the element's width) or ``"whole"`` (the tensor);
        ``crc32c`` is the CRC-32C of the entry's new bytes, checked on a delta. Every entry of
        the new archive is named once. Only the changes travel (on gRPC); the server stores the
        result as a Store would (``replace``, AlreadyExists, ``already_stored`` alike), or
        nothing: InvalidArgument for a bad delta or CRC, NotFound for a missing base or entry."""
        return _run(self._derive(archive, base, changes, metadata, replace))

    def describe(self, name: str, names: Iterable[str] | None = None) -> ArchiveDescription:
        """The archive's info and metadata, and every entry's name, dtype, shape, sizes and
        digest; with ``names``, only the entries of those names it holds (none for an empty
        list), so a few entries of a large archive are described at the cost of a few."""
        return _run(self._describe(name, names))

    def diff(self, a: str, b: str, *, names: Iterable[str] | None = None, prefix: str | None = None,
             same: bool = False) -> ArchiveDiff:
        """How archive ``b`` differs from archive ``a`` (each an archive or an alias, resolved once),
        entry by entry: the same by digest (no byte read), added, removed, another dtype or shape,
        or other values, with the fraction that differ, max |b - a|, ||b - a|| / ||a|| and NaN or
        Inf appearing, computed on the server (no tensor byte travels); and the metadata keys that
        differ. ``names`` or ``prefix`` narrow it; ``same`` lists the entries that are the same too."""
        return _run(self._diff(a, b, names, prefix, same))

    def list(self, prefix: str = "", *, limit: int | None = None) -> list[ArchiveInfo]:
        """Every archive whose name starts with ``prefix``, sorted by name (all pages, each the
        server's largest); ``limit``: the first ``limit`` only."""
        return _run(self._list(prefix, list_limit(limit)))

    def delete(self, name: str, *, force: bool = False) -> Deleted:
        """Remove archive ``name`` (NotFound if there is none) and the blobs only it used.

        An archive an alias points at is refused (AliasError naming the aliases) unless
        ``force``, which removes those aliases with it (``aliases_removed``).
        When an attempt's answer was lost (UNAVAILABLE) after it reached the server and the
        retry finds the archive gone, the lost attempt deleted it: the result says so
        (``already_gone``), with no counts. An attempt never seen to reach the server deleted
        nothing: the retry's NotFound is raised."""
        return _run(self._delete(name, force))

    def tag(self, alias: str, archive: str, *, expect: str | None = None) -> Tagged:
        """Point ``alias`` at archive ``archive``, creating or moving it atomically: every read that
        names the alias afterwards (``archive``, ``fetch``, ``load_state_dict``, a union's source)
        reads the new archive whole; one that resolved it before, the old one whole.

        ``expect`` makes it a compare-and-set: the move happens only when the alias points at
        ``expect`` now (``""``: only when there is no such alias yet), else AliasError naming
        where it points. A tag to where the alias already points succeeds with ``changed``
        False (so a retry after a lost answer does not fail). AliasError too when ``alias`` is
        an archive's name or ``archive`` an alias; NotFound when ``archive`` does not exist."""
        return _run(self._tag(alias, archive, expect))

    def tag_back(self, alias: str) -> Tagged:
        """Move ``alias`` back to where it pointed before its last move (a rollback), compare-and-set
        against where it points now: AliasError when another writer moved it meanwhile, or when its
        history has no previous target; NotFound when that archive is gone."""
        return _run(self._tag_back(alias))

    def history(self, alias: str, limit: int | None = None) -> list[AliasMove]:
        """The moves of ``alias``, newest first (the last ``limit``; all the server keeps by
        default): each Tag that created or moved it, each Untag or forced Delete that removed it,
        with when and by which token. NotFound when the name was never an alias."""
        return _run(self._history(alias, limit))

    def untag(self, alias: str) -> Untagged:
        """Remove ``alias`` (NotFound if there is none); the archive stays."""
        return _run(self._untag(alias))

    def resolve(self, name: str) -> str:
        """The archive ``name`` denotes now: an alias's target, or ``name`` itself for an archive
        (NotFound when it is neither)."""
        return _run(self._resolve(name))

    def aliases(self, prefix: str = "", *, archive: str | None = None,
                archive_prefix: str | None = None) -> list[Alias]:
        """Every alias whose name starts with ``prefix`` (pointing at ``archive``, and at archives
        whose names start with ``archive_prefix``, if given; all pages), by name (by archive, then
        name, with ``archive`` or ``archive_prefix``)."""
        return _run(self._aliases(prefix, archive, archive_prefix))

    def watch(self, alias: str) -> "Watch":
        """Follow ``alias``: an iterator of :class:`~tannery.records.Alias` records (the archive it
        points at, when it moved there), its current target first, then one per move, made on
        any replica, until :meth:`Watch.close` (or the ``with`` block ends, or the iterator is
        dropped after a ``break``). A caller that reads slowly gets the latest target, not
        every move in between. NotFound naming the alias when there is none, or when it is
        removed while watched; a server that restarts is watched again (``retries``), its
        target yielded again only if it changed meanwhile."""
        return Watch(self, alias)

    def prune(self, prefix: str, *, keep_last: int, dry_run: bool = False) -> Pruned:
        """Delete all but the newest ``keep_last`` archives whose names start with ``prefix``
        (newest by creation time), never one an alias points at; ``dry_run`` deletes nothing and
        says what would go. ValueError for ``keep_last`` under 1 or an empty prefix."""
        return _run(self._prune(prefix, keep_last, dry_run))

    def load_state_dict(self, module: torch.nn.Module, name: str, prefix: str = "", strict: bool = True,
                        *, progress: Progress = None) -> Any:
        """Fill ``module`` from archive ``name`` (its entries under ``prefix``), as torch's
        ``load_state_dict`` does, fetching only the entries the module has keys for, in one
        call. Everything is checked first (ArchiveError naming the entries); returns torch's
        ``(missing_keys, unexpected_keys)``."""
        return _run(self._load_state_dict(module, name, prefix, strict, progress))

    # -- channels ------------------------------------------------------------------------

    def publish(self, channel: str, tensors: Iterable[Any], *, progress: Progress = None) -> Published:
        """Publish ``tensors`` (torch tensors or numpy arrays, any iterable, read as sent) on
        ``channel``, in one stream; returns what was published."""
        return _run(self._publish(channel, tensors, progress))

    def subscribe(self, channel: str, *, progress: Progress = None) -> "Subscription":
        """Subscribe to ``channel``: an iterator of the tensors published from now on.

        Returns once the server has registered the subscription, so everything published
        afterwards arrives. ``close()`` it (or leave its ``with`` block) to end it.
        """
        feed = _run(self._subscribe(channel, progress))
        return LinkSubscription(feed) if feed.link is not None else Subscription(feed)


class Subscription:
    """The tensors published on a channel, in order (an iterator and a context manager)."""

    def __init__(self, feed: Feed) -> None:
        self._feed = feed

    def __iter__(self) -> "Subscription":
        return self

    def __next__(self) -> torch.Tensor:
        tensor = _run(self._feed.next_tensor())
        if tensor is END:
            raise StopIteration
        return tensor

    def close(self) -> None:
        """End the subscription (the server forgets it); iterating stops."""
        self._feed.close()

    def __enter__(self) -> "Subscription":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class LinkSubscription(Subscription):
    """A subscription whose payloads come on a data path: on the same host, each one published
    there is a memory file mapped here (the tensor shares it, nothing is copied between
    processes); over TCP, bytes received straight into the tensors' buffers."""

    def close(self) -> None:
        """End the subscription (the server forgets it); iterating stops."""
        super().close()
        self._feed.link.close()


class Watch:
    """The targets of a watched alias (an iterator and a context manager); the call is read on
    a thread of its own, which keeps only the newest target not yet taken."""

    def __init__(self, client: Client, alias: str) -> None:
        self._ready = ready = threading.Condition()

        def wake() -> None:  # holds no reference to this Watch: dropping it closes the call
            with ready:
                ready.notify_all()

        self._wake = wake
        self._watched = client._watched(alias, wake)
        self._thread = threading.Thread(target=_run, args=(self._watched.pump(),), daemon=True,
                                        name=f"tannery-watch-{alias}")
        self._thread.start()

    def __iter__(self) -> "Watch":
        return self

    def __next__(self) -> Alias:
        with self._ready:
            while (item := self._watched.take()) is None:
                self._ready.wait()
        if item is END:
            raise StopIteration
        return item

    def close(self) -> None:
        """End the watch: the call is cancelled, iterating stops."""
        self._watched.close()
        self._wake()

    def __enter__(self) -> "Watch":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()


__all__ = ["Client", "LinkSubscription", "Subscription", "Watch"]
