"""Writes the kept seed corpora of the atheris targets: ``python tests/fuzz/make_corpus.py``.

``corpus/codec/``: a few small valid payloads (float32 matrix, bool vector, int64 scalar, an
empty bfloat16 tensor, complex64 under Tannic C++'s alias code 35) and interesting invalid
ones (bad magic, truncated, trailing bytes, rank 255 of 2**64-1, nbytes disagreeing with the
shape). ``corpus/deframer/``: the same streams in both input modes of ``fuzz_deframer``.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

import sys

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "client"))
from tannery_protocol import codec  # noqa: E402

HERE = Path(__file__).resolve().parent


def payloads() -> dict[str, bytes]:
    valid = {
        "float32-2x2": codec.encode_numpy(np.arange(4, dtype=np.float32).reshape(2, 2)),
        "bool-5": codec.encode_numpy(np.array([1, 0, 1, 1, 0], dtype=bool)),
        "int64-scalar": codec.encode_numpy(np.array(7, dtype=np.int64)),
        "bfloat16-empty-0x3": codec.encode_prefix(codec.DTYPES["bfloat16"], [0, 3]),
    }
    alias = bytearray(codec.encode_numpy(np.array([1 + 2j], dtype=np.complex64)))
    alias[codec.HEADER.size] = 35
    valid["complex64-alias-35"] = bytes(alias)
    good = valid["float32-2x2"]
    rank = 255
    after = codec.METADATA.size + codec.DIM.size * rank
    hostile = (codec.HEADER.pack(codec.MAGIC, codec.VERSION, 0, after) + codec.METADATA.pack(24, 0, 0, rank)
               + struct.pack(f"<{rank}Q", *[2**64 - 1] * rank))
    wrong_nbytes = bytearray(good)
    struct.pack_into("<Q", wrong_nbytes, codec.HEADER.size + 9, 15)
    invalid = {
        "bad-magic": b"XXXX" + good[4:],
        "truncated": good[:-3],
        "trailing": good + b"\0",
        "rank-255-of-2-64": hostile,
        "nbytes-disagrees": bytes(wrong_nbytes),
        "header-only": good[: codec.HEADER.size],
    }
    return {**valid, **{f"invalid-{k}": v for k, v in invalid.items()}}


def main() -> None:
    items = payloads()
    (HERE / "corpus" / "codec").mkdir(parents=True, exist_ok=True)
    (HERE / "corpus" / "deframer").mkdir(parents=True, exist_ok=True)
    for name, data in items.items():
        (HERE / "corpus" / "codec" / name).write_bytes(data)
        # Mode 0: a 4-byte chunking seed, then the stream (each payload twice, to cross a boundary).
        (HERE / "corpus" / "deframer" / f"raw-{name}").write_bytes(b"\0" + bytes([7, 0, 0, 0]) + data + data)
    # Mode 1: structured valid payloads; a few byte strings the provider reads as such.
    for index, seed in enumerate([b"\x02\x05\x02\x03\x04abcdefgh", b"\x04" + bytes(range(40)), b"\x01\x00\x00"]):
        (HERE / "corpus" / "deframer" / f"valid-{index}").write_bytes(b"\x01" + seed)


if __name__ == "__main__":
    main()
