"""The competitors' servers, each run as a subprocess: ``python -m tests.benchmarks.peers KIND``.

- ``grpc``: bare grpc.aio generic handlers of bytes messages (no protobuf, no codec):
  the raw grpcio ceiling (``Sink``, ``Source``), the ceiling plus what a store must do
  with the bytes (``SinkDurable``: write them to a file and fsync it; ``SourceFile``:
  read them from a file with ``pread``), and ``torch.save`` bytes stored and served in
  chunk-sized messages (``Put``, ``Get``, ``Clear``).
- ``tcp``: pytannic's framing over raw TCP: a tannic message (15-byte header, then
  ``nbytes`` bytes) is read into memory and kept, and answered by an empty message; an
  empty message asks for the kept one back.
- ``flight``: Apache Arrow Flight: ``DoPut`` keeps the table under its path, ``DoGet``
  streams it back, the ``clear`` action forgets everything.

Each prints ``serving on 127.0.0.1:PORT`` once it listens, and stops on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import struct
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

HOST = "127.0.0.1"
SERVICE = "bench.Raw"
TANNIC_HEADER = struct.Struct("<IBHQ")  # magic, version, checksum, nbytes
TANNIC_MAGIC = 0x43495245


def _identity(data: bytes) -> bytes:
    return data


# -- gRPC ---------------------------------------------------------------------------------


class RawGrpc:
    """Bytes in, bytes out; what is kept between calls lives in :attr:`kept`."""

    def __init__(self) -> None:
        self.kept = b""
        self.io = ThreadPoolExecutor(2, thread_name_prefix="raw-io")

    async def sink(self, requests, context) -> bytes:
        total = 0
        async for message in requests:
            total += len(message)
        return struct.pack("<Q", total)

    async def sink_durable(self, requests, context) -> bytes:
        """Each message written to a new file in the directory the metadata names (by a
        worker thread while the next message is received, as tannery's Store does), then
        fsynced; the file is removed afterwards."""
        directory = dict(context.invocation_metadata())["directory"]
        loop = asyncio.get_running_loop()
        fd = os.open(os.path.join(directory, f"sink-{os.getpid()}-{id(requests)}"),
                     os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        total = 0
        pending = None
        try:
            async for message in requests:
                if pending is not None:
                    await pending
                pending = loop.run_in_executor(self.io, _write_all, fd, message)
                total += len(message)
            if pending is not None:
                await pending
            await loop.run_in_executor(self.io, os.fsync, fd)
        finally:
            os.close(fd)
            os.unlink(os.path.join(directory, f"sink-{os.getpid()}-{id(requests)}"))
        return struct.pack("<Q", total)

    async def source(self, request: bytes, context):
        count, size = struct.unpack("<QQ", request)
        chunk = bytes(size)
        for _ in range(count):
            yield chunk

    async def source_file(self, request: bytes, context):
        """The file named in the request, in ``size``-byte messages read with ``pread`` by a
        worker thread, one message read ahead (as tannery's Fetch reads blobs)."""
        size = struct.unpack_from("<Q", request)[0]
        fd = os.open(request[8:].decode(), os.O_RDONLY)
        loop = asyncio.get_running_loop()
        try:
            length = os.fstat(fd).st_size
            offsets = iter(range(0, length, size))
            ahead = loop.run_in_executor(self.io, _pread_next, fd, size, offsets)
            while True:
                chunk = await ahead
                if not chunk:
                    break
                ahead = loop.run_in_executor(self.io, _pread_next, fd, size, offsets)
                yield chunk
        finally:
            os.close(fd)

    async def put(self, requests, context) -> bytes:
        """Chunks gathered into one buffer and kept (what a store of pickled bytes does)."""
        gathered = bytearray()
        async for message in requests:
            gathered += message
        self.kept = gathered
        return struct.pack("<Q", len(gathered))

    async def get(self, request: bytes, context):
        size = struct.unpack("<Q", request)[0]
        view = memoryview(self.kept)
        for start in range(0, len(view), size):
            yield bytes(view[start : start + size])

    async def clear(self, request: bytes, context) -> bytes:
        self.kept = b""
        return b""


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view.nbytes:
        view = view[os.write(fd, view):]


def _pread_next(fd: int, size: int, offsets) -> bytes:
    offset = next(offsets, None)
    return b"" if offset is None else os.pread(fd, size, offset)


async def serve_grpc(port: int) -> None:
    import grpc

    raw = RawGrpc()
    server = grpc.aio.server()
    handlers = {
        "Sink": grpc.stream_unary_rpc_method_handler(raw.sink, _identity, _identity),
        "SinkDurable": grpc.stream_unary_rpc_method_handler(raw.sink_durable, _identity, _identity),
        "Source": grpc.unary_stream_rpc_method_handler(raw.source, _identity, _identity),
        "SourceFile": grpc.unary_stream_rpc_method_handler(raw.source_file, _identity, _identity),
        "Put": grpc.stream_unary_rpc_method_handler(raw.put, _identity, _identity),
        "Get": grpc.unary_stream_rpc_method_handler(raw.get, _identity, _identity),
        "Clear": grpc.unary_unary_rpc_method_handler(raw.clear, _identity, _identity),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    port = server.add_insecure_port(f"{HOST}:{port}")
    await server.start()
    print(f"serving on {HOST}:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(1)


# -- pytannic's framing over TCP ----------------------------------------------------------


def tannic_message(payload: bytes | memoryview = b"") -> bytes:
    """A tannic message header for ``payload`` (an empty message is the header alone)."""
    return TANNIC_HEADER.pack(TANNIC_MAGIC, 1, 0xABCD, len(payload)) + bytes(payload)


def recv_exactly(sock: socket.socket, size: int) -> bytearray:
    """``size`` bytes read into one preallocated buffer (no growing, no joins)."""
    buffer = bytearray(size)
    view = memoryview(buffer)
    while view.nbytes:
        got = sock.recv_into(view)
        if not got:
            raise ConnectionError(f"connection closed with {view.nbytes} of {size} bytes to go")
        view = view[got:]
    return buffer


def recv_tannic(sock: socket.socket) -> bytearray:
    """One whole tannic message, header included, read the way the header says."""
    header = recv_exactly(sock, TANNIC_HEADER.size)
    magic, _version, _checksum, nbytes = TANNIC_HEADER.unpack(header)
    if magic != TANNIC_MAGIC:
        raise ValueError(f"bad magic {magic:#x}")
    message = bytearray(TANNIC_HEADER.size + nbytes)
    message[: TANNIC_HEADER.size] = header
    view = memoryview(message)[TANNIC_HEADER.size :]
    while view.nbytes:
        got = sock.recv_into(view)
        if not got:
            raise ConnectionError("connection closed mid-message")
        view = view[got:]
    return message


def serve_tcp(port: int) -> None:
    listener = socket.create_server((HOST, port))
    print(f"serving on {HOST}:{listener.getsockname()[1]}", flush=True)
    kept: list[bytearray] = [bytearray()]

    def connection(sock: socket.socket) -> None:
        with sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while True:
                try:
                    message = recv_tannic(sock)
                except (ConnectionError, OSError):
                    return
                if len(message) == TANNIC_HEADER.size:  # an empty message: send the kept one back
                    sock.sendall(kept[0])
                else:
                    kept[0] = message
                    sock.sendall(tannic_message())

    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    while True:
        sock, _ = listener.accept()
        threading.Thread(target=connection, args=(sock,), daemon=True).start()


# -- Arrow Flight -------------------------------------------------------------------------


def serve_flight(port: int) -> None:
    import pyarrow.flight as flight

    class Server(flight.FlightServerBase):
        def __init__(self) -> None:
            super().__init__(f"grpc://{HOST}:{port}")
            self.tables: dict[bytes, object] = {}

        def do_put(self, context, descriptor, reader, writer) -> None:
            self.tables[descriptor.path[0]] = reader.read_all()

        def do_get(self, context, ticket):
            return flight.RecordBatchStream(self.tables[ticket.ticket])

        def do_action(self, context, action):
            if action.type == "clear":
                self.tables.clear()
            return iter(())

    server = Server()
    print(f"serving on {HOST}:{server.port}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    server.serve()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=("grpc", "tcp", "flight"))
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    if args.kind == "grpc":
        asyncio.run(serve_grpc(args.port))
    elif args.kind == "tcp":
        serve_tcp(args.port)
    else:
        serve_flight(args.port)


if __name__ == "__main__":
    sys.exit(main())
