"""The raw grpcio ceiling: bytes messages through a bare generic handler, no protobuf, no disk.

``Sink`` (client streaming) consumes messages and answers their total size; ``Source``
(server streaming) sends the number of chunk-sized messages asked for. Same process
layout as the tannery benchmarks: this server in a subprocess, the client in the
benchmark's process. Run ``python -m tests.benchmarks.raw_grpc_server --port 0``; it
prints ``serving on 127.0.0.1:PORT``.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import struct

import grpc

SERVICE = "bench.Raw"


def _identity(data: bytes) -> bytes:
    return data


async def _sink(request_iterator, context) -> bytes:
    total = 0
    async for message in request_iterator:
        total += len(message)
    return struct.pack("<Q", total)


async def _source(request: bytes, context):
    count, size = struct.unpack("<QQ", request)
    chunk = bytes(size)
    for _ in range(count):
        yield chunk


async def serve(host: str, port: int) -> None:
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
        "Sink": grpc.stream_unary_rpc_method_handler(_sink, _identity, _identity),
        "Source": grpc.unary_stream_rpc_method_handler(_source, _identity, _identity),
    }),))
    port = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    print(f"serving on {host}:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    asyncio.run(serve(args.host, args.port))


if __name__ == "__main__":
    main()
