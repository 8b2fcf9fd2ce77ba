"""What a Store and a Publish send: an archive's (or a stream of tensors') messages, each
tensor's bytes copied once, into its message, from :func:`~tannery.torch.serialize_parts`
(or, on a data connection, each entry's payload parts and their SHA-256 when the server asks
for them ahead). Imported by the first call that sends a tensor: catalog calls never are.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from tannery_protocol import errors, wire
from tannery_protocol._lazy import lazy_module
from tannery_protocol.names import join
from tannery_protocol.v1 import archives_pb2
from tannery.rpc.requests import Progress, check_metadata

if TYPE_CHECKING:
    from concurrent.futures import Future

    from tannery.archive import Archive

np = lazy_module("numpy")
torch = lazy_module("torch")
torch_codec = lazy_module("tannery.torch")


def archive_to_store(name: str, value: Any, prefix: str = "", *, skip_non_tensors: bool = False,
                     allow_empty: bool = False) -> tuple[Archive, str]:
    """The archive a ``store`` value stands for, and the prefix still to add to its names.

    An Archive as it is; an ``nn.Module`` by its state_dict; a mapping, list or tuple by
    :meth:`Archive.of_value` (which names each tensor by its path). Nothing is read yet.
    The archive's name is checked to be a non-empty str first (an empty one would leave the
    call without its first message, and the server's answer would not say why).

    Plain values (a step, a learning rate, RNG states) are kept with the tensors, as
    :meth:`Archive.of_value` keeps them; any other leaf is a TypeError naming its path,
    unless ``skip_non_tensors`` (then every leaf that is not a tensor is left out); an archive
    of no entries and no plain values is an ArchiveError, unless ``allow_empty``: nothing vanishes.
    """
    if not isinstance(name, str) or not name:
        raise errors.InvalidArgument(f"Client.store: the archive's name is a non-empty str, not {name!r}")
    if not isinstance(prefix, str):
        raise TypeError(f"Client.store: prefix is a str, not {type(prefix).__name__}")
    from tannery.archive import Archive, archive_of_value  # not at import: catalog calls need no archive module

    if isinstance(value, Archive):
        archive, rest = value, prefix
    else:
        if isinstance(value, torch.nn.Module):
            value = value.state_dict()
        if not isinstance(value, (Mapping, list, tuple, torch.Tensor, np.ndarray)):
            raise TypeError(
                f"Client.store: a {type(value).__name__} is not something to store; give an Archive, a mapping of "
                "names to tensors, an nn.Module or nested dicts, lists and tuples of tensors and plain values"
            )
        archive = archive_of_value(value, prefix, skip_non_tensors, f"Client.store({name!r})")
        rest = ""
    if not allow_empty and not len(archive) and not archive._plain():
        raise errors.ArchiveError(
            f"Client.store({name!r}): the value holds no tensors, so the archive would be empty; "
            "give allow_empty=True to store an empty archive")
    return archive, rest


def store_messages(
    name: str, archive: Archive, prefix: str, replace: bool, chunk_size: int, progress: Progress = None,
    metadata: Mapping[str, str] | None = None, digests: bool = False, batched: bool = False,
) -> Iterator[bytes]:
    """The serialized ``StoreRequest``s of an archive: begin, then each entry in name order,
    its name (and with ``digests`` its payload's SHA-256) in the first of its messages, then
    commit with the counts sent (the server stores nothing without it). Entries are read one
    at a time, as sent.

    With ``batched`` (the server said it reads ``StoreRequest.entries``), consecutive entries
    of payloads below :data:`~tannery_protocol.wire.BATCHED_BELOW` go whole, several to a
    message of up to ``chunk_size`` bytes: 10,000 small tensors are a few messages, not 10,000."""
    yield wire.encode_store_request(begin=store_begin(name, replace, metadata))
    entries = sent = 0
    batch = wire.EntryBatch(wire.STORE_ENTRIES, chunk_size)
    for entry, parts, sha256 in store_entries(archive, prefix, digests):
        entries += 1
        size = sum(memoryview(part).nbytes for part in parts)
        sent += size
        if batched and size < wire.BATCHED_BELOW:
            encoded = entry.encode("utf-8")
            cost = batch.cost(encoded, size, sha256)
            if cost <= chunk_size:
                if batch.full_for(cost):
                    yield from _batch_message(batch, progress)
                batch.add(encoded, parts, size, sha256)
                continue
        if batch.count:
            yield from _batch_message(batch, progress)
        first = True
        for chunk in wire.split_parts(parts, chunk_size):
            yield wire.encode_store_request(entry=entry if first else None, parts=chunk,
                                            sha256=sha256 if first else b"")
            first = False
            if progress is not None:
                progress(sum(piece.nbytes for piece in chunk))
    if batch.count:
        yield from _batch_message(batch, progress)
    yield wire.encode_store_commit(entries, sent)


def _batch_message(batch: wire.EntryBatch, progress: Progress) -> Iterator[bytes]:
    """The message of the whole entries in ``batch`` (emptied), then its payload bytes told to ``progress``."""
    size = batch.payload_bytes
    yield batch.take()
    if progress is not None:
        progress(size)


def store_entries(archive: Archive, prefix: str, digests: bool = False) -> Iterator[tuple[str, list, bytes]]:
    """Each entry of an archive as its name under ``prefix``, its payload's parts (a header,
    and a view of the tensor's memory) and, with ``digests``, the payload's SHA-256 (else
    empty), in name order.

    The server asks for digests when they spare it work (``wants_digests``: a bucket takes
    a payload whose digest it knows straight to its final key). Entry ``i + 1`` is hashed on
    another thread while entry ``i`` is sent (hashlib releases the GIL), so the hash pass
    delays a Store by about one entry's hash, not the whole archive's."""
    named = ((join(prefix, entry), torch_codec.serialize_parts(archive.find(entry))) for entry in archive.names())
    if not digests:
        for entry, parts in named:
            yield entry, parts, b""
        return
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1, thread_name_prefix="tannery-digest") as hashing:
        ahead: tuple[str, list, Future[bytes]] | None = None
        for entry, parts in named:
            hashed = hashing.submit(_sha256, parts)
            if ahead is not None:
                yield ahead[0], ahead[1], ahead[2].result()
            ahead = (entry, parts, hashed)
        if ahead is not None:
            yield ahead[0], ahead[1], ahead[2].result()


def _sha256(parts: Sequence[Any]) -> bytes:
    import hashlib

    digest = hashlib.sha256()
    for part in parts:
        digest.update(memoryview(part).cast("B"))
    return digest.digest()


def check_tensors(tensors: Any) -> None:
    """A publish takes an iterable of tensors: one tensor (iterable over its rows) is refused."""
    if isinstance(tensors, (torch.Tensor, np.ndarray)):
        raise TypeError("Client.publish: tensors is an iterable of tensors; for one tensor t, give [t]")


def publish_messages(
    tensor: Any, channel: str | None, chunk_size: int, progress: Progress = None, index: int = 0,
    store_as: bytes = b""
) -> Iterator[bytes]:
    """The serialized ``PublishRequest``s of one tensor (a torch tensor or numpy array);
    ``channel`` names the channel in the first (for the call's first tensor), with ``store_as``."""
    from tannery.values import as_tensor

    tensor = as_tensor(tensor, f"tensor {index}", "Client.publish")
    for chunk in wire.split_parts(torch_codec.serialize_parts(tensor), chunk_size):
        yield wire.encode_publish_request(channel, chunk, store_as if channel else b"")
        channel = None
        if progress is not None:
            progress(sum(piece.nbytes for piece in chunk))



def publish_stream(channel: str, tensors: Iterable[Any] | AsyncIterable[Any], chunk_size: int,
                   progress: Progress = None, store_as: bytes = b"") -> Iterator[bytes] | AsyncIterator[bytes]:
    """The messages of a Publish of ``tensors`` (each read as it is sent; an async iterable
    gives an async iterator), the first naming ``channel`` (alone when there is no tensor) and
    carrying ``store_as`` (a serialized ``StoreAs``, b"" for none)."""
    publishing = _Publishing(channel, chunk_size, progress, store_as)
    return publishing.each_async(tensors) if isinstance(tensors, AsyncIterable) else publishing.each(tensors)


class _Publishing:
    def __init__(self, channel: str, chunk_size: int, progress: Progress, store_as: bytes = b"") -> None:
        self.channel, self.chunk_size, self.progress, self.store_as = channel, chunk_size, progress, store_as
        self.count = 0

    def of(self, tensor: Any) -> Iterator[bytes]:
        messages = publish_messages(tensor, None if self.count else self.channel, self.chunk_size, self.progress,
                                    self.count, self.store_as)
        self.count += 1
        return messages

    def end(self) -> list[bytes]:
        return [] if self.count else [wire.encode_publish_request(self.channel, [], self.store_as)]

    def each(self, tensors: Iterable[Any]) -> Iterator[bytes]:
        for tensor in tensors:
            yield from self.of(tensor)
        yield from self.end()

    async def each_async(self, tensors: AsyncIterable[Any]) -> AsyncIterator[bytes]:
        async for tensor in tensors:
            for message in self.of(tensor):
                yield message
        for message in self.end():
            yield message


def store_begin(name: str, replace: bool, metadata: Mapping[str, str] | None) -> bytes:
    """A serialized ``StoreBegin``; TypeError for metadata that is not a mapping of str to str."""
    return archives_pb2.StoreBegin(archive=name, replace=replace,
                                   metadata=check_metadata("Client.store", metadata)).SerializeToString()


__all__ = ["archive_to_store", "check_tensors", "publish_messages", "publish_stream", "store_begin", "store_entries",
           "store_messages"]
