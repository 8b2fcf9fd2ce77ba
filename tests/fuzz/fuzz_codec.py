"""atheris target: the payload parser (``read_info``, ``parse``, ``to_numpy``) on any bytes.

Only FormatError may be raised. When ``parse`` accepts the bytes, ``read_info`` agrees with
it, ``to_numpy`` gives an array of that dtype and shape, and that array encoded and parsed
again is the same array (the header's checksum and offset, which readers ignore, aside).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import codec, main  # noqa: E402


def check_payload(data: bytes) -> None:
    """The properties above, for one input; AssertionError when one fails."""
    try:
        partial = codec.read_info(data)
    except codec.FormatError:
        partial = None
    try:
        info = codec.parse(data)
    except codec.FormatError:
        return
    assert partial == info, (partial, info)
    array = codec.to_numpy(data)
    assert array.shape == info.shape and array.dtype == info.dtype.numpy, (array.shape, array.dtype, info)
    again = codec.to_numpy(codec.encode_numpy(array))
    assert again.shape == array.shape and again.dtype == array.dtype
    assert np.ascontiguousarray(again).tobytes() == np.ascontiguousarray(array).tobytes()
    if not info.dtype.is_bool:  # bool payloads may carry any padding bits; other buffers come back as sent
        assert codec.encode_numpy(array)[info.data_offset :] == data[info.data_offset :]


def test_one_input(data: bytes) -> None:
    check_payload(data)
    # The same bytes under tight limits: still only FormatError (OverLimit among them).
    try:
        codec.parse(data, codec.Limits(max_payload=4096, max_rank=4))
    except codec.FormatError:
        pass


if __name__ == "__main__":
    main(test_one_input)
