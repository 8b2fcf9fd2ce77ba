"""atheris target: the Deframer and Reframer fed a stream of payloads in random chunkings.

An input is a mode byte, then either (mode even) raw stream bytes after 4 bytes seeding the
chunking, or (mode odd) a description of valid payloads and chunk sizes. Only FormatError
may be raised, and only when the stream is not whole payloads (``reference_split`` says
so); otherwise the fragments reassemble into exactly the payloads that went in, with their
first/last flags and infos right, and the Reframer gives the same payloads.
"""

from __future__ import annotations

import math
import random
import sys
from pathlib import Path

import atheris

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DTYPE_NAMES, codec, framing, main, reference_split  # noqa: E402
from tannery.dataplane.gathering import Reframer  # noqa: E402


def valid_stream(fdp: atheris.FuzzedDataProvider) -> tuple[bytes, list[int]]:
    """Valid payloads (any dtype, rank 0 to 3, small dims) and chunk sizes, from ``fdp``."""
    payloads = []
    for _ in range(fdp.ConsumeIntInRange(0, 4)):
        dtype = codec.DTYPES[DTYPE_NAMES[fdp.ConsumeIntInRange(0, len(DTYPE_NAMES) - 1)]]
        shape = [fdp.ConsumeIntInRange(0, 6) for _ in range(fdp.ConsumeIntInRange(0, 3))]
        nbytes = dtype.buffer_nbytes(math.prod(shape))
        buffer = fdp.ConsumeBytes(nbytes)
        payloads.append(codec.encode_prefix(dtype, shape) + buffer + bytes(nbytes - len(buffer)))
    sizes = [fdp.ConsumeIntInRange(0, 80) for _ in range(fdp.ConsumeIntInRange(0, 64))]
    return b"".join(payloads), sizes


def raw_stream(data: bytes) -> tuple[bytes, list[int]]:
    """The bytes after a 4-byte seed, and chunk sizes drawn from that seed."""
    rng = random.Random(int.from_bytes(data[:4].ljust(4, b"\0"), "little"))
    stream = data[4:]
    return stream, [rng.choice([0, 1, 2, 3, 7, 15, 16, 33, 64, 1000]) for _ in range(rng.randint(0, 40))]


def chunks_of(stream: bytes, sizes: list[int]) -> list[bytes]:
    """``stream`` cut at ``sizes`` (0: an empty chunk), the rest in one last chunk."""
    out, pos = [], 0
    for size in sizes:
        out.append(stream[pos : pos + size])
        pos += size
        if pos >= len(stream):
            break
    return out + [stream[pos:]] if pos < len(stream) else out


def deframe(chunks: list[bytes]) -> list[bytes]:
    """Payloads a Deframer makes of ``chunks``, its fragments' flags and infos checked."""
    deframer = framing.Deframer()
    payloads: list[bytearray] = []
    open_info = None
    for chunk in chunks:
        for fragment in deframer.feed(chunk):
            if fragment.first:
                assert open_info is None, "a new payload began inside another"
                payloads.append(bytearray())
                open_info = fragment.info
            assert fragment.info == open_info, (fragment.info, open_info)
            payloads[-1] += fragment.data
            if fragment.last:
                assert len(payloads[-1]) == open_info.size, (len(payloads[-1]), open_info.size)
                open_info = None
    deframer.close()
    assert deframer.payloads == len(payloads)
    return [bytes(p) for p in payloads]


def reframe(chunks: list[bytes]) -> list[bytes]:
    reframer = Reframer()
    payloads = [bytes(p) for chunk in chunks for p in reframer.feed(chunk)]
    reframer.close()
    return payloads


def test_one_input(data: bytes) -> None:
    if not data:
        return
    if data[0] % 2:
        stream, sizes = valid_stream(atheris.FuzzedDataProvider(data[1:]))
    else:
        stream, sizes = raw_stream(data[1:])
    chunks = chunks_of(stream, sizes)
    assert b"".join(chunks) == stream
    try:
        expected = reference_split(stream)
    except codec.FormatError:
        expected = None
    try:
        got = deframe(chunks)
    except codec.FormatError:
        assert expected is None, "the Deframer refused a stream of whole payloads"
        got = None
    if expected is not None:
        assert got == expected, "the Deframer's payloads differ from those that went in"
        assert reframe(chunks) == expected, "the Reframer's payloads differ from those that went in"
        for payload in got:
            codec.parse(payload)
    else:
        assert got is None, "the Deframer accepted a stream that is not whole payloads"
        try:
            reframe(chunks)
        except codec.FormatError:
            pass
        else:
            raise AssertionError("the Reframer accepted a stream that is not whole payloads")
    if data[0] % 2:
        assert expected is not None, "a stream of valid payloads was refused by the reference"


if __name__ == "__main__":
    main(test_one_input)
