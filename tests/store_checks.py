"""Checks of a data directory and of what a server lists, shared by the fuzz, kill and load tests.

A store is *consistent* with a model (archive name -> entry name -> payload bytes) when it
lists exactly the model's archives, each with exactly its entries, each fetching byte-exact;
when its blob files are exactly the SHA-256 digests of the model's payloads (nothing
unreferenced is left behind); and when ``tmp/`` is empty once calls settle.
"""

from __future__ import annotations

import hashlib
import math
import random
import sqlite3
from pathlib import Path
from typing import Mapping

from tannery_protocol.codec import DTYPES, encode_prefix
from tannery_protocol.v1 import archives_pb2 as pb

from .server_harness import collect_fetch

Model = Mapping[str, Mapping[str, bytes]]
DTYPE_NAMES = sorted(DTYPES)


def random_payload(rng: random.Random, max_bytes: int = 4096, dtype: str | None = None) -> bytes:
    """A valid tannic payload of a random dtype and shape (rank 0 to 4, empty dimensions
    included) whose buffer is about ``max_bytes`` at most, filled with random bytes."""
    kind = DTYPES[dtype or rng.choice(DTYPE_NAMES)]
    rank = rng.randint(0, 4)
    budget = max(1, max_bytes // kind.itemsize)
    shape: list[int] = []
    for _ in range(rank):
        room = max(1, budget // max(1, math.prod(shape) or 1))
        shape.append(0 if rng.random() < 0.05 else rng.randint(1, max(1, min(room, 64 if rank > 1 else room))))
    nbytes = kind.buffer_nbytes(math.prod(shape))
    return encode_prefix(kind, shape) + rng.randbytes(nbytes)


def sized_payload(rng: random.Random, nbytes: int) -> bytes:
    """A float32 vector payload of about ``nbytes`` bytes of random data (distinct per call)."""
    count = max(1, nbytes // 4)
    return encode_prefix(DTYPES["float32"], [count]) + rng.randbytes(4 * count)


def digest(payload: bytes) -> str:
    return hashlib.sha256(payload).hexdigest()


def blob_files(data_dir: Path) -> set[str]:
    """Names of the blob files under ``data_dir/blobs`` (each is a SHA-256 hex digest)."""
    return {p.name for p in (Path(data_dir) / "blobs").rglob("*") if p.is_file()}


def temporary_files(data_dir: Path) -> list[Path]:
    """What is left in ``data_dir/tmp`` (temporary blobs of Stores in flight)."""
    tmp = Path(data_dir) / "tmp"
    return list(tmp.iterdir()) if tmp.is_dir() else []


def list_all(stub, prefix: str = "", page_size: int = 0) -> list[pb.ArchiveInfo]:
    """Every archive the server lists under ``prefix``, following the pages."""
    archives: list[pb.ArchiveInfo] = []
    token = ""
    while True:
        page = stub.List(pb.ListRequest(prefix=prefix, page_size=page_size, page_token=token), timeout=60)
        archives += page.archives
        token = page.next_page_token
        if not token:
            return archives


def referenced_blobs(data_dir: Path) -> set[str]:
    """The blobs the catalog's entries reference, read from its file: each entry's own payload's,
    or the pack that holds it (docs/packs.md). The blob files must be exactly these; that each
    entry holds the model's bytes is checked through the server (:func:`archive_problems`)."""
    conn = sqlite3.connect(f"file:{Path(data_dir) / 'catalog.sqlite3'}?mode=ro", uri=True, timeout=30)
    try:
        return {row[0] for row in conn.execute("SELECT DISTINCT blob FROM entries")}
    finally:
        conn.close()


def store_problems(stub, data_dir: Path, model: Model) -> list[str]:
    """Every way the server's store differs from ``model`` (empty when consistent)."""
    problems = []
    listed = {a.name: a for a in list_all(stub)}
    if set(listed) != set(model):
        problems.append(f"listed {sorted(set(listed) - set(model))} not in the model; "
                        f"missing {sorted(set(model) - set(listed))}")
    for name in sorted(set(listed) & set(model)):
        problems += archive_problems(stub, name, model[name], listed[name])
    blobs, wanted = blob_files(data_dir), referenced_blobs(data_dir)
    if blobs != wanted:
        problems.append(f"{len(blobs - wanted)} blob files nothing references, {len(wanted - blobs)} missing")
    left = temporary_files(data_dir)
    if left:
        problems.append(f"{len(left)} temporary files left: {[p.name for p in left[:5]]}")
    return problems


def archive_problems(stub, name: str, entries: Mapping[str, bytes], info: pb.ArchiveInfo | None = None) -> list[str]:
    """How archive ``name`` differs from ``entries``: its count, its entry names and digests, its bytes."""
    problems = []
    if info is not None and info.entries != len(entries):
        problems.append(f"{name!r}: listed with {info.entries} entries, {len(entries)} stored")
    described = stub.Describe(pb.DescribeRequest(archive=name), timeout=60)
    got = {e.name: e.digest for e in described.entries}
    if got != {n: digest(p) for n, p in entries.items()}:
        problems.append(f"{name!r}: described entries {sorted(got)} differ from {sorted(entries)}")
    fetched = collect_fetch(stub.Fetch(pb.FetchRequest(archive=name), timeout=60))
    if fetched != dict(entries):
        differing = sorted(n for n in set(fetched) | set(entries) if fetched.get(n) != entries.get(n))
        problems.append(f"{name!r}: fetched entries differ from what was stored: {differing[:5]}")
    return problems


def scrub(data_dir: Path) -> list[str]:
    """The digests ``Storage.scrub`` finds bad, on a data directory no server holds."""
    from tannery_server.storage import Storage

    storage = Storage.open_local(Path(data_dir))
    try:
        return storage.scrub()
    finally:
        storage.close()


def stored_blobs(server) -> set[str]:
    """The digests of the blobs a running server's blob store holds (files or objects)."""
    return set(server.storage.blobs.digests())


def leftovers(server) -> list[str]:
    """Temporary blobs a running server's blob store holds (Stores in flight, or not cleaned up)."""
    return list(server.storage.blobs.temporaries())
