"""How the answers of Fetch and Subscribe become Python values, shared by both clients.

The readers turn the chunks of a stream back into tensors, each payload gathered once
into an aligned buffer that the tensor then shares (:class:`~tannery.dataplane.gathering.Reframer`
and :func:`~tannery.torch.deserialize`), or into pieces (:class:`TensorPiece`) that view the
received messages (:class:`PieceReader`, what ``tannery pull`` writes to files). Small
entries that came whole, several to a message (``FetchResponse.entries``), are read as
they are: one payload each, no gathering.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from tannery_protocol import wire
from tannery_protocol._lazy import lazy_module
from tannery_protocol.codec import FormatError, byte_buffer, parse
from tannery.dataplane.receive_memory import ReceivePool
from tannery_protocol.framing import Deframer
from tannery.dataplane.gathering import Reframer
from tannery.dataplane.received import Arrived, TensorPiece
from tannery.rpc.requests import Progress

if TYPE_CHECKING:
    import torch

# Imported where a tensor is made: PieceReader never imports torch.
torch_codec = lazy_module("tannery.torch")


class _EntryStream:
    """The entries of a Fetch stream: each message that names an entry starts it, and each
    entry carries exactly one payload. Subclasses read the payloads (:meth:`_read`)."""

    def __init__(self, progress: Progress = None) -> None:
        self._progress = progress
        self._name: str | None = None
        self._has_payload = False
        #: The current entry came whole (``FetchResponse.entries``): nothing of it is in progress.
        self._came_whole = False
        #: The maps of this stream's tensors, once dropped, for its next payloads.
        self.pool = ReceivePool()

    def feed(self, message: wire.FetchMessage) -> list:
        """What ``message`` completes (tensors or pieces, by the subclass): its ``entry`` and
        ``chunk``, then each of its whole ``entries``."""
        out = self._chunk(message) if message.entry or message.chunk.nbytes or not message.entries else []
        for whole in message.entries:
            out += self._whole_entry(whole)
        return out

    def _chunk(self, message: wire.FetchMessage) -> list:
        if message.entry:
            self._end_entry()
            self._name, self._has_payload, self._came_whole = message.entry, False, False
            self._start_entry()
        if self._name is None:
            raise FormatError("Fetch: payload bytes before any entry name")
        chunk = message.chunk
        if self._came_whole:  # nothing of it is in progress: no bytes may follow
            if chunk.nbytes:
                raise FormatError(f"Fetch: entry {self._name!r}: {chunk.nbytes} more bytes after it came whole")
            return []
        if self._progress is not None and chunk.nbytes:
            self._progress(chunk.nbytes)
        try:
            return self._read(self._name, chunk)
        except FormatError as e:
            raise FormatError(f"Fetch: entry {self._name!r}: {e}") from None

    def _whole_entry(self, whole: wire.WholeEntry) -> list:
        """An entry that came whole beside others: its one payload, read at once."""
        self._end_entry()
        if not whole.name:
            raise FormatError("Fetch: a whole entry without a name")
        self._name, self._has_payload, self._came_whole = whole.name, True, True
        if self._progress is not None and whole.payload.nbytes:
            self._progress(whole.payload.nbytes)
        try:
            return self._read_whole(whole.name, whole.payload)
        except FormatError as e:
            raise FormatError(f"Fetch: entry {whole.name!r}: {e}") from None

    def _payload(self) -> None:
        """Count the entry's payload: FormatError for a second one."""
        if self._has_payload:
            raise FormatError("a second payload")
        self._has_payload = True

    def _end_entry(self) -> None:
        if self._name is None or self._came_whole:
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

    def restart(self) -> None:
        """Forget the entry in progress: its call broke, and a new one sends it again whole."""
        self._name, self._has_payload, self._came_whole = None, False, False

    def whole(self, item: object) -> str | None:
        """The name of the entry ``item`` completes (what a resumed Fetch need not ask again), else None."""
        raise NotImplementedError

    def _start_entry(self) -> None:
        raise NotImplementedError

    def _read(self, name: str, chunk: memoryview) -> list:
        raise NotImplementedError

    def _read_whole(self, name: str, payload: memoryview) -> list:
        """What one whole payload makes; FormatError unless it is exactly one payload."""
        raise NotImplementedError

    def _close_entry(self) -> None:
        raise NotImplementedError


class EntryReader(_EntryStream):
    """Turns a Fetch stream into ``(name, tensor)`` pairs, each payload gathered once."""

    #: A data path sends it whole entries (the tensor shares the mapped or received memory).
    pieces = False

    def arrived(self, item: Arrived) -> list[tuple[str, torch.Tensor]]:
        """The tensor of an entry that came on a data path, sharing its memory."""
        if self._progress is not None:
            self._progress(item.info.size)
        return [(item.name, torch_codec.from_buffer(item.data, item.info.dtype, item.info.shape))]

    def whole(self, item: tuple[str, torch.Tensor]) -> str:
        return item[0]

    def _start_entry(self) -> None:
        self._reframer = Reframer(pool=self.pool)

    def _read(self, name: str, chunk: memoryview) -> list[tuple[str, torch.Tensor]]:
        out = []
        for payload in self._reframer.feed(chunk):
            self._payload()
            out.append((name, torch_codec.deserialize(payload)))
        return out

    def _read_whole(self, name: str, payload: memoryview) -> list[tuple[str, torch.Tensor]]:
        return [(name, torch_codec.deserialize(payload))]  # as a payload in one chunk: a view of the message

    def _close_entry(self) -> None:
        self._reframer.close()


class PieceReader(_EntryStream):
    """Turns a Fetch stream into tensor pieces (:class:`TensorPiece`), views of the received messages."""

    #: A TCP data path sends it pieces, so that only one is held.
    pieces = True

    def arrived(self, item: Arrived | TensorPiece) -> list[TensorPiece]:
        """An entry (a mapped one is one piece) or a piece that came on a data path."""
        if isinstance(item, TensorPiece):
            if self._progress is not None:  # payload bytes, as everywhere: the header with the first piece
                self._progress(item.data.nbytes + (item.info.data_offset if item.first else 0))
            return [item]
        if self._progress is not None:
            self._progress(item.info.size)
        return [TensorPiece(item.name, item.info, 0, item.data, True, True)]

    def whole(self, item: TensorPiece) -> str | None:
        return item.name if item.last else None

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

    def _read_whole(self, name: str, payload: memoryview) -> list[TensorPiece]:
        info = parse(payload)
        return [TensorPiece(name, info, 0, byte_buffer(payload)[info.data_offset:], True, True)]

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
        #: The maps of this subscription's tensors, once dropped, for its next payloads.
        self.pool = ReceivePool()
        self._reframer = Reframer(pool=self.pool)

    def feed(self, chunk: memoryview) -> list[torch.Tensor]:
        if self._progress is not None and chunk.nbytes:
            self._progress(chunk.nbytes)
        return [torch_codec.deserialize(payload) for payload in self._reframer.feed(chunk)]

    def receive(self, size: int, read_into: Callable[[memoryview], None]) -> list[torch.Tensor]:
        """The tensors completed by the next ``size`` bytes of the stream, which ``read_into``
        writes (a data connection's bytes, received straight into the payload's buffer)."""
        tensors = [torch_codec.deserialize(payload) for payload in self._reframer.receive(size, read_into)]
        if self._progress is not None and size:
            self._progress(size)
        return tensors

    def arrived(self, item: Arrived) -> torch.Tensor:
        """The tensor of a payload passed whole on the same-host path, sharing its mapping."""
        if self._progress is not None:
            self._progress(item.info.size)
        return torch_codec.from_buffer(item.data, item.info.dtype, item.info.shape)

    def discard(self) -> None:
        """Forget the payload in progress (its publisher abandoned it): the next chunk starts a payload."""
        self._reframer = Reframer(pool=self.pool)


__all__ = ["EntryReader", "PayloadReader", "PieceReader", "TensorPiece", "check_fetched"]
