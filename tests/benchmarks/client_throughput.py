"""Store and Fetch of one archive through ``tannery.Client``, against raw stubs, with the client's memory.

One server (a subprocess) serves every variant; each variant runs in a fresh client
process, so its peak RSS (``VmHWM``) is its own. Variants, side by side in the same run:

- ``raw bytes``: the server benchmark's client (``archives_throughput.py``): pre-built
  ``StoreRequest`` bytes sent as they are (built before the clock starts, so the messages,
  not tensors, are what the process holds), ``Fetch`` read as raw bytes and dropped;
- ``raw protobuf``: what a hand-written client does with the generated stubs: tensors in
  memory, a ``StoreRequest(chunk=bytes(...))`` per chunk; ``FetchResponse``s joined into
  one ``bytearray`` per entry, then ``deserialize``;
- ``tannery.Client`` and ``tannery.aio.Client``: tensors in memory to ``store``; ``fetch``
  to tensors.

    python -m tests.benchmarks.client_throughput --size 1GiB
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MiB = 1 << 20
VARIANTS = [
    ("store", "raw bytes"), ("store", "raw protobuf"), ("store", "tannery.Client"), ("store", "tannery.aio.Client"),
    ("fetch", "raw bytes"), ("fetch", "raw protobuf"), ("fetch", "tannery.Client"), ("fetch", "tannery.aio.Client"),
]


def memory() -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process, in bytes."""
    values = {}
    with open("/proc/self/status") as status:
        for line in status:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                values[key] = int(rest.split()[0]) * 1024
    return values["VmRSS"], values["VmHWM"]


def reset_peak() -> None:
    """Reset VmHWM to the current RSS (Linux: write 5 to clear_refs)."""
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")


def tensors(size: int, entries: int):
    import torch

    generator = torch.Generator().manual_seed(0)
    per_entry = size // entries // 4
    return {f"layer{i:03d}.weight": torch.randn(per_entry, generator=generator) for i in range(entries)}


def measure(operation: str, variant: str, target: str, size: int, entries: int, chunk: int) -> dict:
    """Run one variant in this process; what it took and the memory it used."""
    import asyncio

    import grpc
    import torch

    import tannery
    import tannery.aio
    from tannery.torch import deserialize, serialize_parts
    from tannery_protocol.v1 import archives_pb2

    identity = lambda data: data  # noqa: E731
    channel = grpc.insecure_channel(target, options=[("grpc.max_receive_message_length", 8 << 20)])
    nbytes = 0
    if operation == "store":
        if variant == "raw bytes":
            from .archives_throughput import archive_messages

            held = archive_messages("bench", size, entries, chunk)
            store = channel.stream_unary("/tannery.v1.Archives/Store", request_serializer=identity,
                                         response_deserializer=archives_pb2.ArchiveInfo.FromString)
            nbytes = sum(map(len, held))
            run = lambda: store(iter(held))  # noqa: E731
        else:
            state = tensors(size, entries)
            nbytes = sum(t.numel() * 4 for t in state.values())
            if variant == "raw protobuf":
                store = archives_pb2_grpc_stub(channel).Store

                def requests():
                    yield archives_pb2.StoreRequest(begin=archives_pb2.StoreBegin(archive="bench", replace=True))
                    sent = 0
                    for name, tensor in state.items():
                        payload = b"".join(bytes(p) for p in serialize_parts(tensor))
                        sent += len(payload)
                        for start in range(0, len(payload), chunk):
                            request = archives_pb2.StoreRequest(chunk=payload[start : start + chunk])
                            if start == 0:
                                request.entry = name
                            yield request
                    commit = archives_pb2.StoreCommit(entries=len(state), payload_bytes=sent)
                    yield archives_pb2.StoreRequest(commit=commit)

                run = lambda: store(requests())  # noqa: E731
            elif variant == "tannery.Client":
                client = tannery.Client(target, chunk_size=chunk)
                run = lambda: client.store("bench", state, replace=True)  # noqa: E731
            else:
                async def store_async():
                    async with tannery.aio.Client(target, chunk_size=chunk) as client:
                        await client.store("bench", state, replace=True)

                run = lambda: asyncio.run(store_async())  # noqa: E731
    else:
        request = archives_pb2.FetchRequest(archive="bench")
        if variant == "raw bytes":
            fetch = channel.unary_stream("/tannery.v1.Archives/Fetch",
                                         request_serializer=archives_pb2.FetchRequest.SerializeToString,
                                         response_deserializer=identity)
            run = lambda: sum(len(m) for m in fetch(request))  # noqa: E731
        elif variant == "raw protobuf":
            fetch = archives_pb2_grpc_stub(channel).Fetch

            def collect():
                payloads: dict[str, bytearray] = {}
                current = None
                for response in fetch(request):
                    if response.entry:
                        current = payloads.setdefault(response.entry, bytearray())
                    current += response.chunk
                return {name: deserialize(data) for name, data in payloads.items()}

            run = collect
        elif variant == "tannery.Client":
            client = tannery.Client(target)
            run = lambda: client.fetch("bench")  # noqa: E731
        else:
            async def fetch_async():
                async with tannery.aio.Client(target) as client:
                    return await client.fetch("bench")

            run = lambda: asyncio.run(fetch_async())  # noqa: E731
    before, _ = memory()
    reset_peak()
    start = time.perf_counter()
    result = run()
    seconds = time.perf_counter() - start
    after, peak = memory()
    if operation == "fetch":
        nbytes = size
        if isinstance(result, tannery.Archive):
            assert len(result) == entries
    del result
    return {"seconds": seconds, "nbytes": nbytes, "rss_before": before, "peak": peak}


def archives_pb2_grpc_stub(channel):
    from tannery_protocol.v1 import archives_pb2_grpc

    return archives_pb2_grpc.ArchivesStub(channel)


def child(args: argparse.Namespace) -> None:
    print(json.dumps(measure(args.operation, args.variant, args.target, args.size, args.entries, args.chunk)))


def main(argv: list[str] | None = None) -> None:
    from tannery_server.config import parse_size

    from ..server_harness import ServerProcess

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1GiB", type=parse_size)
    parser.add_argument("--chunk", default="1MiB", type=parse_size)
    parser.add_argument("--entries", default=16, type=int)
    parser.add_argument("--repeat", default=2, type=int)
    parser.add_argument("--child", nargs=3, metavar=("OPERATION", "VARIANT", "TARGET"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        args.operation, args.variant, args.target = args.child
        child(args)
        return
    results: dict[tuple[str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="tannery-client-bench-") as tmp:
        with ServerProcess(Path(tmp) / "data", chunk_size=args.chunk, log_format="json") as server:
            for repeat in range(args.repeat):
                for operation, variant in VARIANTS:
                    if operation == "store":  # every store writes all its blobs
                        from tannery import Client, NotFound

                        with Client(server.target) as client:
                            try:
                                client.delete("bench")
                            except NotFound:
                                pass
                    out = subprocess.run(
                        [sys.executable, "-m", "tests.benchmarks.client_throughput", "--size", str(args.size),
                         "--chunk", str(args.chunk), "--entries", str(args.entries),
                         "--child", operation, variant, server.target],
                        check=True, capture_output=True, text=True,
                    ).stdout
                    results.setdefault((operation, variant), []).append(json.loads(out.strip().splitlines()[-1]))
    print(f"archive of {args.size / MiB:.0f} MiB in {args.entries} float32 entries, {args.chunk // 1024} KiB "
          f"chunks, best of {args.repeat}; client process memory")
    print(f"{'':28} {'GB/s':>6} {'vs raw':>7} {'RSS before MiB':>15} {'peak MiB':>9} {'peak - before':>14}")
    for operation in ("store", "fetch"):
        baseline = None
        for (op, variant), runs in results.items():
            if op != operation:
                continue
            best = min(runs, key=lambda r: r["seconds"])
            gbps = best["nbytes"] / best["seconds"] / 1e9
            baseline = baseline or gbps
            print(f"{operation + ': ' + variant:28} {gbps:6.3f} {gbps / baseline:6.2f}x "
                  f"{best['rss_before'] / MiB:15.0f} {best['peak'] / MiB:9.0f} "
                  f"{(best['peak'] - best['rss_before']) / MiB:14.0f}")


if __name__ == "__main__":
    main()
