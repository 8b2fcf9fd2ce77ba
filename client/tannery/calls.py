"""What each call sends and how its answer becomes Python values, shared by both clients.

``tannery.Client`` and ``tannery.aio.Client`` differ only in how they wait; everything
else is here: the records calls return (:class:`ArchiveInfo`, :class:`ArchiveDescription`,
...), the messages of a Store or a Publish (each tensor's bytes copied once, into its
message, from :func:`~tannery.torch.serialize_parts`), and the readers that turn Fetch and
Subscribe chunks back into tensors (gathered once into an aligned buffer that the tensor
then shares, by :class:`~tannery.codec.Reframer` and :func:`~tannery.torch.deserialize`).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Callable, Optional

from . import errors, wire
from ._lazy import lazy_module
from .archive import Archive, EntryInfo, as_tensor
from .codec import Deframer, FormatError, PayloadInfo, Reframer, byte_buffer, format_shape
from .errors import ArchiveError
from .names import join, owned
from .v1 import archives_pb2, channels_pb2

# Imported where a tensor is made or sent: List, Describe, Delete and Union never import torch.
np = lazy_module("numpy")
torch = lazy_module("torch")
torch_codec = lazy_module("tannery.torch")

#: Called with the number of tensor bytes (payload bytes) just sent or received.
Progress = Optional[Callable[[int], Any]]


# -- methods ---------------------------------------------------------------------------------


def _encoded(message: bytes) -> bytes:
    return message


class Methods:
    """The calls of both services on a channel, sync or aio (the same factory methods).

    Store and Publish send messages encoded by :mod:`tannery.wire`; Fetch and Subscribe
    answers are decoded as views of the received bytes.
    """

    def __init__(self, channel: Any) -> None:
        archives, channels = "/tannery.v1.Archives/", "/tannery.v1.Channels/"
        self.store = channel.stream_unary(
            archives + "Store", request_serializer=_encoded,
            response_deserializer=archives_pb2.ArchiveInfo.FromString)
        self.fetch = channel.unary_stream(
            archives + "Fetch", request_serializer=archives_pb2.FetchRequest.SerializeToString,
            response_deserializer=wire.parse_fetch_response)
        self.union = self._unary(channel, archives + "Union", archives_pb2.UnionRequest, archives_pb2.ArchiveInfo)
        self.describe = self._unary(channel, archives + "Describe", archives_pb2.DescribeRequest,
                                    archives_pb2.ArchiveDescription)
        self.list = self._unary(channel, archives + "List", archives_pb2.ListRequest, archives_pb2.ListResponse)
        self.delete = self._unary(channel, archives + "Delete", archives_pb2.DeleteRequest, archives_pb2.DeleteResponse)
        self.publish = channel.stream_unary(
            channels + "Publish", request_serializer=_encoded,
            response_deserializer=channels_pb2.PublishResponse.FromString)
        self.subscribe = channel.unary_stream(
            channels + "Subscribe", request_serializer=channels_pb2.SubscribeRequest.SerializeToString,
            response_deserializer=wire.parse_subscribe_response)

    @staticmethod
    def _unary(channel: Any, method: str, request: Any, response: Any) -> Any:
        return channel.unary_unary(method, request_serializer=request.SerializeToString,
                                   response_deserializer=response.FromString)


# -- records ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ArchiveInfo:
    """An archive as the catalog knows it: entries, tensor bytes, payload bytes (as stored and
    sent), and when it was created (UTC)."""

    name: str
    entries: int
    nbytes: int
    payload_bytes: int
    created: dt.datetime

    @staticmethod
    def of(message: archives_pb2.ArchiveInfo) -> "ArchiveInfo":
        created = dt.datetime.fromtimestamp(message.created.ToNanoseconds() / 1e9, dt.timezone.utc)
        return ArchiveInfo(message.name, message.entries, message.nbytes, message.payload_bytes, created)


@dataclass(frozen=True)
class EntryDescription:
    """One stored entry: dtype, shape, tensor bytes, payload bytes and the payload's SHA-256."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    payload_bytes: int
    digest: str

    @property
    def info(self) -> EntryInfo:
        return EntryInfo(self.dtype, self.shape, self.nbytes)

    def __str__(self) -> str:
        return f"{self.name}: {self.dtype} {format_shape(self.shape)}"


@dataclass(frozen=True)
class ArchiveDescription:
    """An archive's info and every entry, sorted by name (iterating gives the entries)."""

    info: ArchiveInfo
    entries: tuple[EntryDescription, ...]

    @staticmethod
    def of(message: archives_pb2.ArchiveDescription) -> "ArchiveDescription":
        entries = tuple(
            EntryDescription(e.name, e.dtype, tuple(e.shape), e.nbytes, e.payload_bytes, e.digest)
            for e in message.entries
        )
        return ArchiveDescription(ArchiveInfo.of(message.info), entries)

    @property
    def name(self) -> str:
        return self.info.name

    def __iter__(self) -> Iterator[EntryDescription]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)


@dataclass(frozen=True)
class Deleted:
    """What a delete removed: the archive, and the blobs no other archive used (and their bytes)."""

    archive: ArchiveInfo
    blobs_removed: int
    bytes_freed: int

    @staticmethod
    def of(message: archives_pb2.DeleteResponse) -> "Deleted":
        return Deleted(ArchiveInfo.of(message.deleted), message.blobs_removed, message.bytes_freed)


@dataclass(frozen=True)
class Published:
    """What one publish call sent: payloads, their bytes, and subscribers dropped for falling behind."""

    payloads: int
    nbytes: int
    dropped_subscribers: int

    @staticmethod
    def of(message: channels_pb2.PublishResponse) -> "Published":
        return Published(message.payloads, message.bytes, message.dropped_subscribers)


# -- requests --------------------------------------------------------------------------------


def archive_to_store(name: str, value: Any, prefix: str = "") -> tuple[Archive, str]:
    """The archive a ``store`` value stands for, and the prefix still to add to its names.

    An Archive as it is; an ``nn.Module`` by its state_dict; a mapping, list or tuple by
    :meth:`Archive.of_value` (which names each tensor by its path). Nothing is read yet.
    The archive's name is checked to be a non-empty str first (an empty one would leave the
    call without its first message, and the server's answer would not say why).
    """
    if not isinstance(name, str) or not name:
        raise errors.InvalidArgument(f"Client.store: the archive's name is a non-empty str, not {name!r}")
    if not isinstance(prefix, str):
        raise TypeError(f"Client.store: prefix is a str, not {type(prefix).__name__}")
    if isinstance(value, Archive):
        return value, prefix
    if isinstance(value, torch.nn.Module):
        value = value.state_dict()
    if not isinstance(value, (Mapping, list, tuple, torch.Tensor, np.ndarray)):
        raise TypeError(
            f"Client.store: a {type(value).__name__} is not something to store; give an Archive, a mapping of "
            "names to tensors, an nn.Module or nested dicts, lists and tuples of tensors"
        )
    return Archive.of_value(value, prefix), ""


def store_messages(
    name: str, archive: Archive, prefix: str, replace: bool, chunk_size: int, progress: Progress = None
) -> Iterator[bytes]:
    """The serialized ``StoreRequest``s of an archive: begin, then each entry in name order,
    its name in the first of its messages, then commit with the counts sent (the server
    stores nothing without it). Entries are read one at a time, as sent."""
    begin = archives_pb2.StoreBegin(archive=name, replace=replace).SerializeToString()
    yield wire.encode_store_request(begin=begin)
    entries = sent = 0
    for entry in archive.names():
        tensor = archive.find(entry)
        first = True
        for chunk in wire.split_parts(torch_codec.serialize_parts(tensor), chunk_size):
            yield wire.encode_store_request(entry=join(prefix, entry) if first else None, parts=chunk)
            first = False
            size = sum(piece.nbytes for piece in chunk)
            sent += size
            if progress is not None:
                progress(size)
        entries += 1
    yield wire.encode_store_commit(entries, sent)


def check_tensors(tensors: Any) -> None:
    """A publish takes an iterable of tensors: one tensor (iterable over its rows) is refused."""
    if isinstance(tensors, (torch.Tensor, np.ndarray)):
        raise TypeError("Client.publish: tensors is an iterable of tensors; for one tensor t, give [t]")


def publish_messages(
    tensor: Any, channel: str | None, chunk_size: int, progress: Progress = None, index: int = 0
) -> Iterator[bytes]:
    """The serialized ``PublishRequest``s of one tensor (a torch tensor or numpy array);
    ``channel`` names the channel in the first (for the call's first tensor)."""
    tensor = as_tensor(tensor, f"tensor {index}", "Client.publish")
    for chunk in wire.split_parts(torch_codec.serialize_parts(tensor), chunk_size):
        yield wire.encode_publish_request(channel, chunk)
        channel = None
        if progress is not None:
            progress(sum(piece.nbytes for piece in chunk))


def entry_ask(entry: EntryDescription, cast: str | None = None, rows: tuple[int, int] | None = None
              ) -> archives_pb2.EntryAsk:
    """An ask for ``entry`` that the server checks against what the client saw (the archive
    may have been replaced since it was described)."""
    ask = archives_pb2.EntryAsk(name=entry.name, shape=archives_pb2.Shape(dims=entry.shape), dtype=entry.dtype)
    if cast:
        ask.cast = cast
    if rows is not None:
        ask.rows.start, ask.rows.stop = rows
    return ask


def fetch_request(archive: str, names: Iterable[str] | None = None, prefix: str | None = None
                  ) -> archives_pb2.FetchRequest:
    """Entries by name (in that order), or those a prefix owns, or all of them."""
    if names is not None and prefix is not None:
        raise ValueError("Client.fetch: give names or a prefix, not both")
    if isinstance(names, str):
        raise TypeError("Client.fetch: names is a list of entry names, not one str")
    request = archives_pb2.FetchRequest(archive=archive, prefix=prefix or "")
    if names is not None:
        names = list(names)
        if not names:
            raise ValueError("Client.fetch: an empty list of names (give None for every entry)")
        request.entries.extend(archives_pb2.EntryAsk(name=n) for n in names)
    return request


def union_request(target: str, sources: Mapping[str, str] | Sequence[str], replace: bool) -> archives_pb2.UnionRequest:
    """Sources as a mapping of prefix to archive name, or a list of archive names (no prefixes)."""
    if isinstance(sources, str):
        raise TypeError("Client.union: sources is a list of archive names or a mapping of prefix to name, not a str")
    if isinstance(sources, Mapping):
        pairs = [(archive, prefix) for prefix, archive in sources.items()]
    else:
        pairs = [(archive, "") for archive in sources]
    if not pairs:
        raise ValueError("Client.union: no sources")
    return archives_pb2.UnionRequest(
        target=target, replace=replace,
        sources=[archives_pb2.UnionSource(archive=a, prefix=p) for a, p in pairs],
    )


# -- answers ---------------------------------------------------------------------------------


class _EntryStream:
    """The entries of a Fetch stream: each message that names an entry starts it, and each
    entry carries exactly one payload. Subclasses read the payloads (:meth:`_read`)."""

    def __init__(self, progress: Progress = None) -> None:
        self._progress = progress
        self._name: str | None = None
        self._has_payload = False

    def feed(self, message: wire.FetchMessage) -> list:
        """What ``message`` completes (tensors or pieces, by the subclass)."""
        if message.entry:
            self._end_entry()
            self._name, self._has_payload = message.entry, False
            self._start_entry()
        if self._name is None:
            raise FormatError("Fetch: payload bytes before any entry name")
        chunk = message.chunk
        if self._progress is not None and chunk.nbytes:
            self._progress(chunk.nbytes)
        try:
            return self._read(self._name, chunk)
        except FormatError as e:
            raise FormatError(f"Fetch: entry {self._name!r}: {e}") from None

    def _payload(self) -> None:
        """Count the entry's payload: FormatError for a second one."""
        if self._has_payload:
            raise FormatError("a second payload")
        self._has_payload = True

    def _end_entry(self) -> None:
        if self._name is None:
            return
        try:
            self._close_entry()
        except FormatError as e:
            raise FormatError(f"Fetch: entry {self._name!r}: {e}") from None
        if not self._has_payload:
            raise FormatError(f"Fetch: entry {self._name!r} came without a payload")

    def close(self) -> None:
        """The stream ended: FormatError if it stopped inside an entry."""
        self._end_entry()

    def _start_entry(self) -> None:
        raise NotImplementedError

    def _read(self, name: str, chunk: memoryview) -> list:
        raise NotImplementedError

    def _close_entry(self) -> None:
        raise NotImplementedError


class EntryReader(_EntryStream):
    """Turns a Fetch stream into ``(name, tensor)`` pairs, each payload gathered once."""

    def _start_entry(self) -> None:
        self._reframer = Reframer()

    def _read(self, name: str, chunk: memoryview) -> list[tuple[str, torch.Tensor]]:
        out = []
        for payload in self._reframer.feed(chunk):
            self._payload()
            out.append((name, torch_codec.deserialize(payload)))
        return out

    def _close_entry(self) -> None:
        self._reframer.close()


@dataclass(frozen=True)
class TensorPiece:
    """A piece of one entry's tensor bytes (its payload's buffer), as it arrived.

    ``data`` views the received message (nothing is copied); it holds the tensor bytes
    ``[offset, offset + len(data))`` of entry ``name``, whose payload header said ``info``
    (dtype, shape, nbytes). Every entry comes as one or more pieces in order, from the
    ``first`` (at offset 0, possibly empty) to the ``last`` (ending at ``info.nbytes``).
    Booleans are bit-packed, eight to a byte, as the payload carries them.
    """

    name: str
    info: PayloadInfo
    offset: int
    data: memoryview
    first: bool
    last: bool


class PieceReader(_EntryStream):
    """Turns a Fetch stream into tensor pieces (:class:`TensorPiece`), views of the received messages."""

    def _start_entry(self) -> None:
        self._deframer = Deframer()
        self._position = 0  # payload bytes of the current payload seen so far

    def _read(self, name: str, chunk: memoryview) -> list[TensorPiece]:
        out = []
        for fragment in self._deframer.feed(chunk):
            if fragment.first:
                self._payload()
                self._position = 0
            info, data = fragment.info, byte_buffer(fragment.data)
            start, self._position = self._position, self._position + data.nbytes
            skip = max(0, info.data_offset - start)  # header bytes: what info already says
            if skip < data.nbytes or fragment.first or fragment.last:
                offset = max(0, start - info.data_offset)
                out.append(TensorPiece(name, info, offset, data[skip:], fragment.first, fragment.last))
        return out

    def _close_entry(self) -> None:
        self._deframer.close()


def check_fetched(asked: Sequence[str], got: Sequence[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
    """The tensors of ``asked``, in order; FormatError if the server sent other entries."""
    names = [name for name, _ in got]
    if names != list(asked):
        raise FormatError(f"Fetch: asked for entries {list(asked)[:8]}, the server sent {names[:8]}")
    return [tensor for _, tensor in got]


class PayloadReader:
    """Turns a Subscribe stream into tensors, each payload gathered once."""

    def __init__(self, progress: Progress = None) -> None:
        self._progress = progress
        self._reframer = Reframer()

    def feed(self, chunk: memoryview) -> list[torch.Tensor]:
        if self._progress is not None and chunk.nbytes:
            self._progress(chunk.nbytes)
        return [torch_codec.deserialize(payload) for payload in self._reframer.feed(chunk)]

    def discard(self) -> None:
        """Forget the payload in progress (its publisher abandoned it): the next chunk starts a payload."""
        self._reframer = Reframer()


@dataclass
class StateDictPlan:
    """What ``load_state_dict`` fetches (archive entry names, by the module key they fill)
    and which keys are missing from the archive or unexpected in it."""

    fetch: dict[str, str]
    missing: list[str]
    unexpected: list[str]
    #: The asks of the entries to fetch, in ``fetch``'s order (checked again by the server).
    asks: list[archives_pb2.EntryAsk]

    def load(self, module: torch.nn.Module, tensors: Sequence[torch.Tensor], strict: bool) -> Any:
        """Copy the fetched tensors into ``module``; torch's (missing_keys, unexpected_keys)."""
        state = dict(zip(self.fetch.values(), tensors))
        result = module.load_state_dict(state, strict=strict)
        return result._replace(missing_keys=list(self.missing), unexpected_keys=list(self.unexpected))


def _names_text(names: Sequence[str], limit: int = 10) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return f"{shown}, ... ({len(names)} in all)" if len(names) > limit else shown


def plan_state_dict(module: torch.nn.Module, description: ArchiveDescription, prefix: str, strict: bool
                    ) -> StateDictPlan:
    """Check a module's state_dict against an archive before anything is fetched.

    As torch's ``load_state_dict``: with ``strict``, every key of the module must have an
    entry under ``prefix`` and every entry there a key; a shape that differs is an error
    either way; dtypes may differ (torch casts when it copies). ArchiveError naming the
    entries otherwise.
    """
    where = "Client.load_state_dict"
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"{where}: {type(module).__name__} is not a torch.nn.Module")
    if not isinstance(prefix, str):
        raise TypeError(f"{where}: prefix is a str, not {type(prefix).__name__}")
    entries = {entry.name: entry for entry in description}
    state = module.state_dict()
    fetch: dict[str, str] = {}
    missing: list[str] = []
    problems: list[str] = []
    for key, tensor in state.items():
        name = join(prefix, key)
        entry = entries.get(name)
        if entry is None:
            missing.append(key)
        elif entry.shape != tuple(tensor.shape):
            problems.append(
                f"{name}: shape {format_shape(entry.shape)} in the archive, {format_shape(tensor.shape)} in the module"
            )
        else:
            fetch[name] = key
    known = {join(prefix, key) for key in state}
    unexpected = [
        name[len(prefix) + 1 :] if prefix and name != prefix else name
        for name in owned(prefix, entries) if name not in known
    ]
    under = f"archive {description.name!r}" + (f" under prefix {prefix!r}" if prefix else "")
    if problems:
        raise ArchiveError(f"{where}: {under}: " + "; ".join(problems))
    if strict and (missing or unexpected):
        found = []
        if missing:
            found.append(f"no entries for the module's keys {_names_text(missing)}")
        if unexpected:
            found.append(f"entries the module has no key for: {_names_text(unexpected)}")
        raise ArchiveError(f"{where}: {under}: " + "; ".join(found) + " (strict=False to load the rest)")
    return StateDictPlan(fetch, missing, unexpected, [entry_ask(entries[name]) for name in fetch])


def list_request(prefix: str, page_token: str) -> archives_pb2.ListRequest:
    if not isinstance(prefix, str):
        raise TypeError(f"Client.list: prefix is a str, not {type(prefix).__name__}")
    return archives_pb2.ListRequest(prefix=prefix, page_token=page_token)


__all__ = [
    "Methods",
    "ArchiveDescription",
    "ArchiveInfo",
    "Deleted",
    "EntryDescription",
    "EntryReader",
    "PayloadReader",
    "PieceReader",
    "Progress",
    "Published",
    "StateDictPlan",
    "TensorPiece",
    "archive_to_store",
    "check_fetched",
    "check_tensors",
    "entry_ask",
    "fetch_request",
    "list_request",
    "plan_state_dict",
    "publish_messages",
    "store_messages",
    "union_request",
]
