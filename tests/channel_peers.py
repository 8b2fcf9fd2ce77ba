"""Channel peers for tests/test_channel_tcp.py: raw data connections, and processes of their own.

:class:`RawPublisher` and :class:`RawSubscriber` speak the TCP data path by hand (a gRPC call
with ``tannery-transport: tcp``, its ticket, the frames of protos/tannery/v1/data.proto), so a
test can send a payload of any size from one reused block, stop in the middle of one, or
count a subscriber's bytes without gathering them.

``python -m tests.channel_peers subscribe TARGET TRANSPORT CHANNEL COUNT``: a ``tannery.Client``
subscriber that prints ``ready``, then one JSON line per tensor (dtype, shape, SHA-256 of its
bytes). ``python -m tests.channel_peers publish-half TARGET CHANNEL SIZE``: a raw TCP publisher
that announces a payload of SIZE bytes, sends half of it, prints ``half`` and waits to be killed.
"""

from __future__ import annotations

import hashlib
import json
import sys
import threading
import time
from typing import Any, Iterator

import grpc

from tannery.dataplane.links import Route
from tannery_protocol import codec
from tannery_protocol.datalink import TICKET_KEY, TRANSPORT_KEY, Link, expect, frame
from tannery_protocol.v1 import archives_pb2, archives_pb2_grpc, channels_pb2, channels_pb2_grpc
from tannery_protocol.v1.data_pb2 import DataEnd, EntryBytes

MiB = 1 << 20
TCP = ((TRANSPORT_KEY, "tcp"),)


def data_route(channel: grpc.Channel) -> Route:
    """The TCP data path of the server behind ``channel`` (its DataPaths answer)."""
    offered = archives_pb2_grpc.ArchivesStub(channel).DataPaths(archives_pb2.DataPathsRequest(), timeout=10)
    assert offered.data_port, "the server offers no data port"
    return Route("tcp", offered.server_id, host="127.0.0.1", port=offered.data_port)


def ticket_of(call: Any) -> str:
    ticket = dict(call.initial_metadata()).get(TICKET_KEY)
    assert ticket, f"no ticket in the initial metadata (status {call.code() if call.done() else 'pending'})"
    return ticket


class RawPublisher:
    """A Publish on the TCP data path, frame by frame: ``send_payload``, then ``finish``."""

    def __init__(self, target: str, channel: str) -> None:
        self.grpc = grpc.insecure_channel(target)
        self._done = threading.Event()

        def requests() -> Iterator[channels_pb2.PublishRequest]:
            yield channels_pb2.PublishRequest(channel=channel)
            self._done.wait(600)

        self.call = channels_pb2_grpc.ChannelsStub(self.grpc).Publish.future(requests(), metadata=TCP, timeout=600)
        self.ticket = ticket_of(self.call)
        self.link: Link = data_route(self.grpc).connect(self.ticket)
        self.payloads = self.bytes = 0

    def send_payload(self, size: int, block: bytes = b"", stop_after: int | None = None) -> None:
        """Announce a uint8 payload of ``size`` bytes in all and send it (its data ``block`` over
        and over; zeros by default), or only its first ``stop_after`` bytes."""
        header = len(codec.encode_prefix(codec.dtype_named("uint8"), [0]))  # the same for any length
        prefix = codec.encode_prefix(codec.dtype_named("uint8"), [size - header])
        block = block or bytes(MiB)
        self.link.send(frame(entry=EntryBytes(payload_bytes=size)))
        self.link.send_bytes(prefix)
        left = size - len(prefix) if stop_after is None else stop_after - len(prefix)
        view = memoryview(block)
        while left > 0:
            piece = view[: min(left, len(view))]
            self.link.send_bytes(piece)
            left -= len(piece)
        if stop_after is None:
            self.payloads += 1
            self.bytes += size

    def finish(self) -> channels_pb2.PublishResponse:
        """Send ``end``, read the server's, end the call; its answer."""
        self.link.send(frame(end=DataEnd(entries=self.payloads, payload_bytes=self.bytes)))
        expect(self.link.receive()[0], "end")
        self._done.set()
        try:
            return self.call.result(timeout=60)
        finally:
            self.close()

    def close(self) -> None:
        self._done.set()
        self.link.close()
        self.grpc.close()


class RawSubscriber:
    """A Subscribe on the TCP data path whose frames are read by hand: counted, not gathered."""

    def __init__(self, target: str, channel: str) -> None:
        self.grpc = grpc.insecure_channel(target)
        self.call = channels_pb2_grpc.ChannelsStub(self.grpc).Subscribe(
            channels_pb2.SubscribeRequest(channel=channel), metadata=TCP)
        self.link: Link = data_route(self.grpc).connect(ticket_of(self.call))
        self._buffer = memoryview(bytearray(4 * MiB))
        #: Payload bytes received, and the kinds of frames in order ("entry" or "abandoned").
        self.bytes = 0
        self.frames: list[str] = []

    def read_bytes(self, total: int) -> None:
        """Read frames until ``total`` payload bytes in all have come."""
        while self.bytes < total:
            self.read_frame()

    def read_frame(self) -> str:
        """Read the next frame (and the bytes that follow an ``entry``); its kind."""
        received, _ = self.link.receive()
        kind = expect(received, "entry", "abandoned")
        self.frames.append(kind)
        left = received.entry.payload_bytes if kind == "entry" else 0
        while left:
            piece = self._buffer[: min(left, self._buffer.nbytes)]
            self.link.receive_into(piece)
            left -= piece.nbytes
            self.bytes += piece.nbytes
        return kind

    def close(self) -> None:
        self.call.cancel()
        self.link.close()
        self.grpc.close()


def digest(tensor: Any) -> dict[str, Any]:
    """What a subscriber process prints of a tensor: enough to compare it bit for bit."""
    import torch

    data = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return {"dtype": str(tensor.dtype), "shape": list(tensor.shape), "sha256": hashlib.sha256(data).hexdigest()}


def subscribe_main(target: str, transport: str, channel: str, count: int) -> None:
    import tannery

    with tannery.Client(target, transport=transport) as client, client.subscribe(channel) as subscription:
        print(json.dumps({"ready": client.transport}), flush=True)
        for _, tensor in zip(range(count), subscription):
            print(json.dumps(digest(tensor)), flush=True)


def publish_half_main(target: str, channel: str, size: int) -> None:
    publisher = RawPublisher(target, channel)
    publisher.send_payload(size, stop_after=size // 2)
    print("half", flush=True)
    time.sleep(600)  # killed here, in the middle of the payload


if __name__ == "__main__":
    command, args = sys.argv[1], sys.argv[2:]
    if command == "subscribe":
        subscribe_main(args[0], args[1], args[2], int(args[3]))
    elif command == "publish-half":
        publish_half_main(args[0], args[1], int(args[2]))
    else:
        sys.exit(f"unknown command {command!r}: subscribe or publish-half")
