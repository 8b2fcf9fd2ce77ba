"""Fetch by name: one small and one large entry out of archives of growing size.

Each archive holds a 4 KiB entry (``small``, 1024 float32), a 64 MiB entry (``big``,
when the archive is at least 128 MiB) and as many distinct 1 MiB entries as fill it
(a 2 GiB archive has ~2000 entries). The same tensors are written to a safetensors file
on the same disk. Competitors, alternating: ``tannery.Client.fetch(archive, [name])``
(one Fetch call, a tensor back), the same Fetch with a raw stub (bytes back), and
``safetensors.safe_open(path).get_tensor(name)`` on the local file (the floor a remote
store can approach: no network, no server). Both the blobs and the file are in the page
cache (just written), so the figures are about software, not the disk.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Iterator

import grpc
import numpy as np
import safetensors
import torch

from tannery_protocol import codec
from tannery.formats.safetensors_format import encode_header
from tannery_protocol.v1 import archives_pb2

from . import clients, peers
from .harness import (GiB, KiB, MiB, CaseResult, Options, Subprocess, Table, alternate, fmt_ratio, fmt_size, fmt_time,
                      free_memory, repeat_timed, scratch, tannery_server)

SMALL = 4 * KiB
BIG = 64 * MiB
FILLER = MiB
SAFETENSORS = "safetensors safe_open + get_tensor (local file)"
SAFETENSORS_READ = "safetensors safe_open + get_tensor + clone (local file)"
CEILING = "raw grpcio call (the same bytes)"


def layout(total: int) -> list[tuple[str, int]]:
    """Entry names and tensor byte sizes of an archive of about ``total`` bytes."""
    entries = [("small", SMALL)]
    if total >= 2 * BIG:
        entries.append(("big", BIG))
    left = total - sum(n for _, n in entries)
    entries += [(f"layer{i:05d}", FILLER) for i in range(left // FILLER)]
    return entries


def tensor_bytes(name: str, nbytes: int) -> np.ndarray:
    """Distinct float32 values per entry (equal entries would be stored once)."""
    seed = int.from_bytes(name.encode()[-8:].rjust(8, b"\0"), "little") % (2**32)
    return np.random.default_rng(seed).standard_normal(nbytes // 4, dtype=np.float32)


def store_stream(archive: str, entries: list[tuple[str, int]]) -> Iterator[bytes]:
    yield archives_pb2.StoreRequest(begin=archives_pb2.StoreBegin(archive=archive, replace=True)).SerializeToString()
    sent = 0
    for name, nbytes in entries:
        payload = codec.encode_numpy(tensor_bytes(name, nbytes))
        sent += len(payload)
        for index, piece in enumerate(clients.payload_chunks(payload)):
            message = archives_pb2.StoreRequest(chunk=piece)
            if index == 0:
                message.entry = name
            yield message.SerializeToString()
    yield clients.commit_message(len(entries), sent)


def write_safetensors(path: Path, entries: list[tuple[str, int]]) -> None:
    """The same tensors as a safetensors file, written one tensor at a time."""
    with open(path, "wb") as f:
        f.write(encode_header([(name, "F32", (nbytes // 4,), nbytes) for name, nbytes in entries]))
        for name, nbytes in entries:
            f.write(tensor_bytes(name, nbytes).data)


def run(options: Options) -> CaseResult:
    totals = options.pick_sizes([SMALL, 16 * MiB, 256 * MiB, 2 * GiB], [SMALL, 256 * MiB])
    result = CaseResult("fetch", "Fetch by name: one entry out of archives of growing size",
                        __doc__.split("\n\n", 1)[1].strip())
    columns = ["archive", "entries", "competitor", "median per fetch", "spread", "vs safetensors + read",
               "vs grpcio call"]
    small_table = Table(f"The {fmt_size(SMALL)} entry", columns + ["vs the smallest archive"])
    big_table = Table(f"The {fmt_size(BIG)} entry", columns)
    medians: dict[tuple[int, str, str], float] = {}
    series: dict[str, dict[str, list]] = {"small": {}, "big": {}}
    with scratch(options, "fetch") as tmp, tannery_server(tmp / "data") as server, \
            grpc.insecure_channel(server.target) as channel, \
            Subprocess("-m", "tests.benchmarks.peers", "grpc") as raw, grpc.insecure_channel(raw.target) as raw_channel:
        source = raw_channel.unary_stream(f"/{peers.SERVICE}/Source", clients._identity, clients._identity)
        tannery = clients.TanneryClient(server.target)
        store = channel.stream_unary("/tannery.v1.Archives/Store", clients._identity,
                                     archives_pb2.ArchiveInfo.FromString)
        fetch = channel.unary_stream("/tannery.v1.Archives/Fetch", archives_pb2.FetchRequest.SerializeToString,
                                     clients._identity)
        for total in totals:
            entries = layout(total)
            archive = f"archive-{total}"
            store(store_stream(archive, entries))
            path = tmp / f"{archive}.safetensors"
            write_safetensors(path, entries)
            asked = [(name, nbytes) for name, nbytes in entries if name in ("small", "big")]
            for name, nbytes in asked:
                expected = torch.from_numpy(tensor_bytes(name, nbytes))
                assert torch.equal(tannery.client.fetch(archive, [name]).find(name), expected)
                with safetensors.safe_open(path, "pt") as f:
                    assert torch.equal(f.get_tensor(name), expected)
            for name, nbytes in asked:
                kind = name

                def by_client(name=name) -> torch.Tensor:
                    return tannery.client.fetch(archive, [name]).find(name)

                def by_stub(name=name) -> int:
                    request = archives_pb2.FetchRequest(archive=archive, entries=[archives_pb2.EntryAsk(name=name)])
                    return sum(len(m) for m in fetch(request))

                def by_safetensors(name=name) -> torch.Tensor:
                    with safetensors.safe_open(path, "pt") as f:
                        return f.get_tensor(name)

                def by_safetensors_read(name=name) -> torch.Tensor:
                    with safetensors.safe_open(path, "pt") as f:
                        return f.get_tensor(name).clone()

                def by_ceiling(nbytes=nbytes) -> int:
                    chunks = max(1, nbytes // clients.CHUNK)
                    return sum(len(m) for m in source(struct.pack("<QQ", chunks, min(nbytes, clients.CHUNK))))

                rounds = {
                    SAFETENSORS: lambda fn=by_safetensors: repeat_timed(fn),
                    SAFETENSORS_READ: lambda fn=by_safetensors_read: repeat_timed(fn),
                    CEILING: lambda fn=by_ceiling: repeat_timed(fn),
                    "tannery.Client.fetch": lambda fn=by_client: repeat_timed(fn),
                    "tannery Fetch, raw stub": lambda fn=by_stub: repeat_timed(fn),
                }
                reps = options.repetitions() * (2 if kind == "small" else 1)
                timings = {n: q["time"] for n, q in alternate(rounds, reps).items()}
                base = timings[SAFETENSORS_READ].median
                ceiling = timings[CEILING].median
                for competitor, samples in timings.items():
                    medians[total, kind, competitor] = samples.median
                    series[kind].setdefault(competitor, []).append(
                        [total, samples.median, samples.low, samples.high])
                    row = [fmt_size(total), len(entries), competitor, fmt_time(samples.median), samples.spread(),
                           fmt_ratio(samples.median / base), fmt_ratio(samples.median / ceiling)]
                    if kind == "small":
                        first = medians.get((totals[0], kind, competitor), samples.median)
                        small_table.add(*row, fmt_ratio(samples.median / first))
                    else:
                        big_table.add(*row)
            tannery.client.delete(archive)
            os.unlink(path)
            free_memory()
        tannery.close()
    small_table.note = (
        "Times per call (fast calls repeated to last ~20 ms per sample). Ratios are times over the baseline's time "
        "in the same run (lower is better): safetensors + read is `get_tensor(name).clone()` (safetensors maps the "
        "file, so `get_tensor` alone hands out a tensor whose pages have not been read yet); the grpcio call is a "
        "bare unary-stream call of the raw grpcio server returning the same number of bytes (the floor of any "
        "gRPC store on this machine).")
    big_table.note = small_table.note
    result.tables += [small_table, big_table]
    largest, smallest = totals[-1], totals[0]
    for competitor in ("tannery.Client.fetch", "tannery Fetch, raw stub"):
        result.target(f"{competitor}: the {fmt_size(SMALL)} entry from a {fmt_size(largest)} archive over from a "
                      f"{fmt_size(smallest)} one", medians[largest, "small", competitor]
                      / medians[smallest, "small", competitor], 1.5, higher_is_better=False)
    result.data = {"series": series, "totals": totals}
    return result
