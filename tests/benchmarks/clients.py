"""The client side of each competitor: one tensor up to a server, and back, as its users would.

Each class has ``upload(tensor)`` and ``download() -> tensor`` (the tensor it uploaded)
and ``clear()`` (drop what the server kept, untimed). Tannery is driven two ways:
``TanneryClient`` through ``tannery.Client`` (what users run: a tensor in, a tensor
out) and ``TanneryMessages`` with pre-built request bytes and raw response bytes (the
server's share alone, comparable with the raw grpcio ceiling, whose client does no work).
"""

from __future__ import annotations

import io
import os
import socket
import struct
import warnings
from pathlib import Path
from typing import Iterator

import grpc
import numpy as np
import torch

from tannery_protocol import codec
from tannery_server.config import Config
from tannery_protocol.v1 import archives_pb2

from . import peers
from .harness import MiB

CHUNK = MiB  # bytes of tensor data per gRPC message, for every gRPC competitor
#: What tannery's server sends per message (Fetch): its default chunk size. (Its client sends
#: 1 MiB chunks, as everyone here.)
TANNERY_SERVER_CHUNK = Config().chunk_size


def _identity(data: bytes) -> bytes:
    return data


def payload_chunks(payload: bytes | memoryview, chunk: int = CHUNK) -> list[bytes]:
    view = memoryview(payload).cast("B")
    return [bytes(view[i : i + chunk]) for i in range(0, view.nbytes, chunk)]


def store_messages(archive: str, entries: dict[str, bytes | memoryview], chunk: int = CHUNK) -> list[bytes]:
    """Serialized ``StoreRequest``s of an archive (replacing any of the same name)."""
    messages = [archives_pb2.StoreRequest(begin=archives_pb2.StoreBegin(archive=archive, replace=True))
                .SerializeToString()]
    for name, payload in entries.items():
        for index, piece in enumerate(payload_chunks(payload, chunk)):
            message = archives_pb2.StoreRequest(chunk=piece)
            if index == 0:
                message.entry = name
            messages.append(message.SerializeToString())
    messages.append(commit_message(len(entries), sum(memoryview(p).nbytes for p in entries.values())))
    return messages


def commit_message(entries: int, payload_bytes: int) -> bytes:
    """The serialized last ``StoreRequest`` of a Store: the client's word that it sent everything."""
    commit = archives_pb2.StoreCommit(entries=entries, payload_bytes=payload_bytes)
    return archives_pb2.StoreRequest(commit=commit).SerializeToString()


# -- gRPC: the raw ceiling ----------------------------------------------------------------


class RawCeiling:
    """Bytes messages through bare handlers: no serialization on either side, nothing kept."""

    def __init__(self, channel: grpc.Channel, payload: bytes, durable_dir: Path | None = None,
                 chunk: int = CHUNK) -> None:
        self.chunk = chunk
        self.chunks = payload_chunks(payload, chunk)
        self.size = len(payload)
        self.durable_dir = durable_dir
        method = "SinkDurable" if durable_dir else "Sink"
        self._sink = channel.stream_unary(f"/{peers.SERVICE}/{method}", _identity, _identity)
        self._source = channel.unary_stream(f"/{peers.SERVICE}/{'SourceFile' if durable_dir else 'Source'}",
                                            _identity, _identity)
        self.file = None
        if durable_dir is not None:  # what SourceFile serves: the payload in a file (in the page cache)
            self.file = durable_dir / "source.bin"
            self.file.write_bytes(payload)

    def upload(self, tensor: torch.Tensor) -> None:
        metadata = (("directory", str(self.durable_dir)),) if self.durable_dir else None
        got = struct.unpack("<Q", self._sink(iter(self.chunks), metadata=metadata))[0]
        assert got == self.size, (got, self.size)

    def download(self) -> int:
        if self.file is not None:
            request = struct.pack("<Q", self.chunk) + str(self.file).encode()
        else:
            request = struct.pack("<QQ", len(self.chunks), self.chunk)
        return sum(len(m) for m in self._source(request))

    def clear(self) -> None:
        pass

    def close(self) -> None:
        if self.file is not None:
            self.file.unlink(missing_ok=True)


# -- tannery ------------------------------------------------------------------------------


class TanneryMessages:
    """Store with pre-built request bytes, Fetch read as raw bytes: the server's work alone."""

    def __init__(self, channel: grpc.Channel, payload: bytes, archive: str = "bench-raw",
                 chunk: int = CHUNK) -> None:
        self.archive = archive
        self.messages = store_messages(archive, {"t": payload}, chunk)
        self.size = len(payload)
        self._store = channel.stream_unary("/tannery.v1.Archives/Store", _identity,
                                           archives_pb2.ArchiveInfo.FromString)
        self._fetch = channel.unary_stream("/tannery.v1.Archives/Fetch",
                                           archives_pb2.FetchRequest.SerializeToString, _identity)
        self._delete = channel.unary_unary("/tannery.v1.Archives/Delete",
                                           archives_pb2.DeleteRequest.SerializeToString,
                                           archives_pb2.DeleteResponse.FromString)

    def upload(self, tensor: torch.Tensor) -> None:
        info = self._store(iter(self.messages))
        assert info.payload_bytes == self.size

    def download(self) -> int:
        return sum(len(m) for m in self._fetch(archives_pb2.FetchRequest(archive=self.archive)))

    def clear(self) -> None:
        """Delete the archive, so that the next Store writes (and fsyncs) its blob again."""
        try:
            self._delete(archives_pb2.DeleteRequest(archive=self.archive))
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.NOT_FOUND:
                raise

    def close(self) -> None:
        pass


class TanneryClient:
    """``tannery.Client``: store a tensor, fetch it back as a tensor, on the data path
    ``transport`` ("grpc", "local" or "tcp"; refused at once when the server does not offer it).

    A tensor fetched over "local" is a view of the blob file in the page cache (mapped
    privately and populated), every block of it read by the client's CRC check before the
    tensor is handed out: the download reads every byte, as the others' do.
    """

    def __init__(self, target: str, archive: str = "bench", transport: str = "grpc") -> None:
        from tannery import Client

        self.client = Client(target, transport=transport)
        assert self.client.transport == transport, (self.client.transport, transport)
        self.archive = archive

    def upload(self, tensor: torch.Tensor) -> None:
        self.client.store(self.archive, {"t": tensor}, replace=True)

    def download(self) -> torch.Tensor:
        return self.client.fetch(self.archive, ["t"]).find("t")

    def clear(self) -> None:
        self.client.delete(self.archive)

    def close(self) -> None:
        self.client.close()


# -- the other competitors ----------------------------------------------------------------


class PytannicTcp:
    """pytannic's ``serialize``/``deserialize`` and its framing over a TCP socket.

    Upload sends ``pytannic.serialize(tensor)`` with pytannic's ``Client.send``. Download
    reads the reply into one buffer with ``recv_into`` (``shipped_receive``: with
    pytannic's own ``Client.receive``, which grows a ``bytes`` by concatenation and so
    copies the message once per ``recv``) and ``pytannic.deserialize``s it.
    """

    def __init__(self, target: str, shipped_receive: bool = False) -> None:
        from pytannic.client import Client

        host, port = target.rsplit(":", 1)
        self.client = Client(host, int(port))
        self.client.begin()
        self.client.socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.shipped_receive = shipped_receive

    def upload(self, tensor: torch.Tensor) -> None:
        from pytannic.torch import tensors

        self.client.send(tensors.serialize(tensor))
        ack = peers.recv_tannic(self.client.socket)
        assert len(ack) == peers.TANNIC_HEADER.size

    def download(self) -> torch.Tensor:
        from pytannic.torch import tensors

        self.client.send(peers.tannic_message())
        data = self.client.receive() if self.shipped_receive else peers.recv_tannic(self.client.socket)
        return tensors.deserialize(data)

    def clear(self) -> None:
        self.client.send(peers.tannic_message(b"\0"))  # a one-byte message replaces the kept one
        peers.recv_tannic(self.client.socket)

    def close(self) -> None:
        self.client.close()


class TorchSaveGrpc:
    """``torch.save`` to bytes, sent in chunk-sized gRPC messages; ``torch.load`` on the way back."""

    def __init__(self, channel: grpc.Channel) -> None:
        self._put = channel.stream_unary(f"/{peers.SERVICE}/Put", _identity, _identity)
        self._get = channel.unary_stream(f"/{peers.SERVICE}/Get", _identity, _identity)
        self._clear = channel.unary_unary(f"/{peers.SERVICE}/Clear", _identity, _identity)

    def upload(self, tensor: torch.Tensor) -> None:
        buffer = io.BytesIO()
        torch.save(tensor, buffer)
        view = buffer.getbuffer()

        def chunks() -> Iterator[bytes]:
            for start in range(0, view.nbytes, CHUNK):
                yield bytes(view[start : start + CHUNK])

        self._put(chunks())
        del view

    def download(self) -> torch.Tensor:
        data = b"".join(self._get(struct.pack("<Q", CHUNK)))
        return torch.load(io.BytesIO(data))

    def clear(self) -> None:
        self._clear(b"")

    def close(self) -> None:
        pass


class ArrowFlight:
    """Apache Arrow Flight ``DoPut``/``DoGet`` of a one-column float table, record batches of
    the same size as the gRPC chunks; the column back as one contiguous tensor."""

    def __init__(self, target: str) -> None:
        import pyarrow.flight as flight

        self.flight = flight
        self.client = flight.FlightClient(f"grpc://{target}")

    def upload(self, tensor: torch.Tensor) -> None:
        import pyarrow as pa

        array = tensor.numpy()
        table = pa.table({"t": pa.array(array)})  # a view of the tensor's memory
        writer, _ = self.client.do_put(self.flight.FlightDescriptor.for_path(b"t"), table.schema)
        writer.write_table(table, max_chunksize=CHUNK // array.itemsize)
        writer.close()

    def download(self) -> torch.Tensor:
        table = self.client.do_get(self.flight.Ticket(b"t")).read_all()
        column = table.column(0)
        array = column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
        with warnings.catch_warnings():  # Arrow's memory is read-only: torch warns, and shares it all the same
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(array.to_numpy(zero_copy_only=False))

    def clear(self) -> None:
        list(self.client.do_action(self.flight.Action("clear", b"")))

    def close(self) -> None:
        self.client.close()


def random_tensor(nbytes: int, seed: int = 0) -> torch.Tensor:
    """A float32 tensor of ``nbytes`` bytes of random values (incompressible, all distinct)."""
    rng = np.random.default_rng(seed)
    return torch.from_numpy(rng.standard_normal(nbytes // 4, dtype=np.float32))


def tannic_payload(tensor: torch.Tensor) -> bytes:
    return codec.encode_numpy(tensor.numpy())


def remove_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
