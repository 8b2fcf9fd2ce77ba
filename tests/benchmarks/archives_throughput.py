"""Superseded by the suite's transport, memory and scale cases (``python -m tests.benchmarks``).

Kept for :func:`archive_messages`, which ``client_throughput.py`` imports.
"""

from __future__ import annotations

import numpy as np

from tannery_protocol.codec import DTYPES, encode_prefix
from tannery_protocol.v1 import archives_pb2


def archive_messages(name: str, size: int, entries: int, chunk: int) -> list[bytes]:
    """Serialized StoreRequests of an archive of ``entries`` random float32 tensors totalling ``size`` bytes."""
    rng = np.random.default_rng(0)
    per_entry = size // entries // 4
    messages = [archives_pb2.StoreRequest(begin=archives_pb2.StoreBegin(archive=name, replace=True)).SerializeToString()]
    sent = 0
    for index in range(entries):
        data = rng.integers(0, 2**32, per_entry, dtype=np.uint32).view(np.float32)
        payload = encode_prefix(DTYPES["float32"], (per_entry,)) + data.tobytes()
        for start in range(0, len(payload), chunk):
            message = archives_pb2.StoreRequest(chunk=payload[start : start + chunk])
            if start == 0:
                message.entry = f"layer{index:03d}.weight"
            messages.append(message.SerializeToString())
        sent += len(payload)
    commit = archives_pb2.StoreCommit(entries=entries, payload_bytes=sent)
    messages.append(archives_pb2.StoreRequest(commit=commit).SerializeToString())
    return messages
