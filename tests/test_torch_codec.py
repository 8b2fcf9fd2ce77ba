"""Torch tensors as tannic payloads: round trips, pytannic's bytes, and what is (not) copied."""

from __future__ import annotations

import ctypes
import mmap
import re
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from tannery_protocol import codec, framing
from tannery.dataplane import gathering
from tannery import torch as tt
from tannery_protocol.codec import FormatError

from .conftest import peer


@pytest.fixture
def pytannic_tensors():
    """pytannic's tensor serialization, for the tests that compare with it (only they need it)."""
    return peer("pytannic.torch.tensors")


#: Every torch dtype of the format and its code (issue 2's table).
CODES = {
    torch.bool: 1,
    torch.int8: 12,
    torch.int16: 13,
    torch.int32: 14,
    torch.int64: 15,
    torch.float16: 23,
    torch.bfloat16: 231,
    torch.float32: 24,
    torch.float64: 25,
    torch.complex64: 37,
    torch.complex128: 38,
    torch.uint8: 42,
    torch.uint16: 43,
    torch.uint32: 44,
    torch.uint64: 45,
    torch.float8_e4m3fn: 22,
    torch.float8_e5m2: 221,
}
DTYPES = list(CODES)
#: The dtypes pytannic 0.1.5 serializes correctly (its float16 gets the wrong code, see below).
PYTANNIC_DTYPES = [torch.int8, torch.int16, torch.int32, torch.int64, torch.float32, torch.float64,
                   torch.complex64, torch.complex128]
SHAPES = [(), (0,), (3, 0, 2), (1,), (7,), (3, 4), (2, 3, 5), (1, 1, 1, 1, 9)]
UNSUPPORTED = [torch.complex32, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, torch.qint8, torch.quint8, torch.bits8]


def sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Random bytes as a tensor of ``dtype``: every bit pattern, NaNs and subnormals included."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    numel = int(np.prod(shape, dtype=np.int64))
    itemsize = torch.empty((), dtype=dtype).element_size()
    return torch.randint(0, 256, (numel * itemsize,), dtype=torch.uint8, generator=g).view(dtype).reshape(shape)


def raw_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.detach().resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Same dtype, shape and bytes (so NaN payloads compare equal, and -0.0 differs from 0.0)."""
    assert actual.dtype == expected.dtype
    assert actual.shape == expected.shape
    assert raw_bytes(actual) == raw_bytes(expected)


def address(buffer) -> int:
    return np.frombuffer(buffer, np.uint8).ctypes.data


def shares(tensor: torch.Tensor, buffer) -> bool:
    """True when the tensor's data lies inside ``buffer``'s memory."""
    start, size = address(buffer), memoryview(buffer).nbytes
    return start <= tensor.data_ptr() and tensor.data_ptr() + tensor.nbytes <= start + size


def anonymous_map(data: bytes) -> mmap.mmap:
    m = mmap.mmap(-1, len(data))
    m[:] = data
    return m


# ------------------------------------------------------------------------------ dtypes


def test_dcodeof_and_dtypeof_follow_the_table():
    for dtype, code in CODES.items():
        assert tt.dcodeof(dtype) == code
        assert tt.dtypeof(code) == dtype
    assert tt.dtypeof(35) == torch.complex64 and tt.dtypeof(36) == torch.complex128


@pytest.mark.parametrize("dtype", UNSUPPORTED)
def test_dcodeof_is_zero_for_an_unsupported_dtype(dtype):
    assert tt.dcodeof(dtype) == 0


@pytest.mark.parametrize("code", [0, 2, 16, 26, 99, 230, 255])
def test_dtypeof_raises_value_error_naming_the_code(code):
    with pytest.raises(ValueError, match=f"unknown dcode {code}"):
        tt.dtypeof(code)


@pytest.mark.filterwarnings("ignore::UserWarning")  # complex32 is experimental, quantized tensors deprecated
@pytest.mark.parametrize("dtype", [torch.complex32, torch.float8_e4m3fnuz, torch.qint8])
def test_unsupported_dtype_is_a_type_error_naming_it(dtype):
    if dtype == torch.qint8:
        tensor = torch.quantize_per_tensor(torch.zeros(2), scale=1.0, zero_point=0, dtype=dtype)
    else:
        tensor = torch.zeros(2, dtype=dtype)
    name = str(dtype).removeprefix("torch.")
    for fn in (tt.serialize, tt.serialize_parts, tt.buffer_of):
        with pytest.raises(TypeError, match=name):
            fn(tensor)


def test_dtype_helpers():
    assert tt.codec_dtype(torch.float32) is codec.DTYPES["float32"]
    assert tt.torch_dtype("bfloat16") == torch.bfloat16 == tt.torch_dtype(codec.DTYPES["bfloat16"])
    assert tt.short_name(torch.float8_e5m2) == "float8_e5m2"
    assert tt.short_name(torch.complex32) == "complex32"


# ------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip(dtype, shape):
    tensor = sample(dtype, shape)
    data = tt.serialize(tensor)
    info = codec.parse(data)
    assert info.dtype.code == CODES[dtype] and info.shape == shape
    assert b"".join(bytes(p) for p in tt.serialize_parts(tensor)) == data
    for source in (data, bytearray(data), memoryview(bytearray(data)), memoryview(data), anonymous_map(data)):
        assert_same(tt.deserialize(source), tensor)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_non_contiguous_tensors(dtype):
    base = sample(dtype, (4, 6, 5), seed=3)
    views = [
        base.transpose(0, 2),
        base[:, ::2, 1:],
        base.permute(2, 0, 1)[1:],
        base[1:3],  # contiguous with a storage offset
        base[0, 0, :1].expand(3, 4),  # stride 0
        base[..., 2],  # a column
    ]
    for view in views:
        data = tt.serialize(view)
        assert data == tt.serialize(view.contiguous())
        assert_same(tt.deserialize(bytearray(data)), view.contiguous())


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_conjugate_and_negative_bits_are_resolved(dtype):
    z = sample(dtype, (3, 4), seed=5)
    conj = z.conj()
    assert conj.is_conj()
    assert_same(tt.deserialize(tt.serialize(conj)), torch.conj_physical(z))
    negative = conj.imag
    assert negative.is_neg()
    assert_same(tt.deserialize(tt.serialize(negative)), (-z.imag).contiguous())
    assert_same(tt.deserialize(tt.serialize(conj.T)), torch.conj_physical(z).T.contiguous())


def test_tensors_that_require_grad():
    weight = torch.nn.Parameter(torch.randn(3, 4))
    data = tt.serialize(weight)
    back = tt.deserialize(bytearray(data))
    assert not back.requires_grad
    assert_same(back, weight.detach())
    (_, buffer) = tt.serialize_parts(weight)
    assert address(buffer) == weight.data_ptr()
    assert_same(tt.deserialize(tt.serialize(weight * 2)), weight.detach() * 2)


def test_bool_payload_hand_computed():
    bits = torch.tensor([True, False, False, False, False, False, False, False, True, True])
    expected = (
        struct.pack("<IBHQ", 0x43495245, 1, 0xABCD, 18 + 8 + 2)
        + struct.pack("<BQQB", 1, 0, 2, 1)
        + struct.pack("<Q", 10)
        + bytes([0b00000001, 0b00000011])
    )
    assert tt.serialize(bits) == expected
    assert torch.equal(tt.deserialize(expected), bits)
    grid = torch.tensor([[False, True, False], [True, False, False], [False, False, True]])
    # C order: 0 1 0 | 1 0 0 | 0 0 1 -> bits 1 and 3 of byte 0, bit 0 of byte 1.
    assert tt.serialize(grid)[-2:] == bytes([0b00001010, 0b00000001])
    assert torch.equal(tt.deserialize(tt.serialize(grid)), grid)


def test_bool_padding_bits_are_ignored_on_read():
    data = bytearray(tt.serialize(torch.tensor([True, False, True])))
    data[-1] |= 0b11111000
    assert tt.deserialize(data).tolist() == [True, False, True]


def test_zero_dim_tensor_keeps_rank_zero():
    data = tt.serialize(torch.tensor(2.5))
    assert codec.parse(data).shape == ()
    back = tt.deserialize(data)
    assert back.dim() == 0 and back.item() == 2.5


# ------------------------------------------------------------------- pytannic's bytes


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", PYTANNIC_DTYPES, ids=str)
def test_bytes_equal_pytannic(dtype, shape, pytannic_tensors):
    tensor = sample(dtype, shape, seed=11)
    ours = tt.serialize(tensor)
    assert ours == pytannic_tensors.serialize(tensor)
    assert_same(tt.deserialize(pytannic_tensors.serialize(tensor)), tensor)
    if tensor.numel():  # pytannic's deserialize fails on empty buffers (torch.frombuffer refuses them)
        assert_same(pytannic_tensors.deserialize(ours), tensor)


@pytest.mark.parametrize("dtype", PYTANNIC_DTYPES, ids=str)
def test_bytes_equal_pytannic_for_non_contiguous_tensors(dtype, pytannic_tensors):
    view = sample(dtype, (5, 6), seed=2).T[1:, ::2]
    assert tt.serialize(view) == pytannic_tensors.serialize(view)


@pytest.mark.parametrize("shape", [(), (5,), (2, 3)], ids=str)
def test_float16_is_written_as_23_where_pytannic_writes_231(shape, pytannic_tensors):
    tensor = sample(torch.float16, shape, seed=4)
    ours, theirs = tt.serialize(tensor), pytannic_tensors.serialize(tensor)
    dcode_at = codec.HEADER.size
    assert ours[dcode_at] == 23 and theirs[dcode_at] == 231
    assert ours[:dcode_at] + ours[dcode_at + 1 :] == theirs[:dcode_at] + theirs[dcode_at + 1 :]
    # pytannic reads our float16 right; its own float16 payloads say bfloat16, and are read so.
    assert_same(pytannic_tensors.deserialize(ours), tensor)
    assert tt.deserialize(theirs).dtype == torch.bfloat16


# ----------------------------------------------------------------- shared memory, copies


def test_serialize_parts_shares_the_tensors_memory():
    tensor = torch.arange(1000, dtype=torch.float32)
    prefix, buffer = tt.serialize_parts(tensor)
    assert address(buffer) == tensor.data_ptr() and memoryview(buffer).nbytes == tensor.nbytes
    tensor[7] = -1.0
    assert np.frombuffer(buffer, np.float32)[7] == -1.0
    assert bytes(prefix) + bytes(buffer) == tt.serialize(tensor)


def test_serialize_parts_shares_a_contiguous_view_with_an_offset():
    base = torch.arange(60, dtype=torch.int64).reshape(6, 10)
    view = base[2:4]
    _, buffer = tt.serialize_parts(view)
    assert address(buffer) == view.data_ptr() == base.data_ptr() + 20 * 8
    base[2, 0] = 99
    assert np.frombuffer(buffer, np.int64)[0] == 99


def test_serialize_parts_of_non_contiguous_tensors_is_a_copy_with_the_right_bytes():
    base = torch.arange(12, dtype=torch.int32).reshape(3, 4)
    _, buffer = tt.serialize_parts(base.T)
    assert not shares(base, buffer) and bytes(buffer) == raw_bytes(base.T)


@pytest.mark.parametrize(
    "make",
    [
        bytearray,
        lambda data: memoryview(bytearray(data)),
        anonymous_map,
        lambda data: memoryview(bytearray(b"..." + data))[3:],  # a view with an offset
    ],
    ids=["bytearray", "memoryview", "mmap", "offset-view"],
)
def test_deserialize_shares_a_writable_buffer(make):
    data = tt.serialize(torch.arange(100, dtype=torch.float64))
    buffer = make(data)
    tensor = tt.deserialize(buffer)
    assert shares(tensor, buffer)
    assert tensor.data_ptr() == address(buffer) + codec.parse(data).data_offset
    memoryview(buffer)[-8:] = struct.pack("<d", -3.5)
    assert tensor[-1].item() == -3.5
    tensor[0] = 42.0
    assert struct.unpack_from("<d", buffer, codec.parse(data).data_offset)[0] == 42.0


def test_deserialize_shares_a_file_map(tmp_path):
    data = tt.serialize(torch.arange(10, dtype=torch.int16))
    path = tmp_path / "payload"
    path.write_bytes(data)
    with open(path, "r+b") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    tensor = tt.deserialize(mapped)
    assert shares(tensor, mapped)
    tensor[0] = 7
    assert path.read_bytes() == data  # a private map: the file is untouched


@pytest.mark.parametrize("make", [bytes, lambda d: memoryview(d), lambda d: memoryview(bytearray(d)).toreadonly()],
                         ids=["bytes", "memoryview-of-bytes", "readonly-view"])
def test_deserialize_copies_a_read_only_buffer(make):
    data = tt.serialize(torch.arange(100, dtype=torch.int32))
    buffer = make(data)
    tensor = tt.deserialize(buffer)
    assert not shares(tensor, buffer)
    tensor[0] = 5  # writable, and writing it changes nothing else
    assert bytes(buffer) == data


def _peak_rss_reset() -> None:
    """Return the allocator's free pages to the kernel, then restart the peak count.

    Without the trim, memory freed by earlier tests stays resident, and a new
    allocation that reuses it raises no peak: the copy under test would not show.
    """
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    Path("/proc/self/clear_refs").write_text("5")


def _status(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's peak RSS reset")
def test_deserialize_of_bytes_copies_at_most_once():
    size = 64 << 20
    source = torch.ones(size // 4, dtype=torch.float32)  # alive, so the copy cannot reuse its pages
    data = tt.serialize(source)
    try:
        _peak_rss_reset()
    except OSError:
        pytest.skip("cannot reset the peak RSS")
    before = _status("VmRSS")
    tensor = tt.deserialize(data)
    peak = _status("VmHWM") - before
    assert size <= peak < size * 1.5, f"deserialize(bytes) of {size} bytes raised the peak RSS by {peak}"
    assert tensor.sum().item() == size // 4


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's peak RSS reset")
def test_serialize_copies_once_and_serialize_parts_never():
    size = 64 << 20
    tensor = torch.ones(size // 4, dtype=torch.float32)
    try:
        _peak_rss_reset()
    except OSError:
        pytest.skip("cannot reset the peak RSS")
    before = _status("VmRSS")
    parts = tt.serialize_parts(tensor)
    assert _status("VmHWM") - before < size * 0.1
    data = tt.serialize(tensor)
    peak = _status("VmHWM") - before
    assert size <= peak < size * 1.5, f"serialize of {size} bytes raised the peak RSS by {peak}"
    assert len(data) == size + codec.parse(data).data_offset and parts


def test_service_path_gathers_once_and_deserializes_in_place():
    tensor = sample(torch.float32, (300, 700), seed=8)
    parts = tt.serialize_parts(tensor)
    stream = b"".join(bytes(p) for p in parts)
    reframer = gathering.Reframer()
    chunks = [stream[i : i + 65536] for i in range(0, len(stream), 65536)]
    (payload,) = [p for chunk in chunks for p in reframer.feed(chunk)]
    reframer.close()
    back = tt.deserialize(payload)
    assert shares(back, payload) and back.data_ptr() % codec.ALIGNMENT == 0
    assert_same(back, tensor)


def test_from_buffer_and_buffer_of():
    tensor = sample(torch.bfloat16, (4, 5), seed=1)
    buffer = bytearray(tt.buffer_of(tensor))
    view = tt.from_buffer(buffer, codec.DTYPES["bfloat16"], (4, 5))
    assert shares(view, buffer)
    assert_same(view, tensor)
    assert tt.from_buffer(b"", codec.DTYPES["int8"], (0, 3)).shape == (0, 3)


# -------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "data,message",
    [
        (b"", "truncated payload: 0 bytes"),
        (b"ERIC", "truncated payload: 4 bytes"),
        (b"X" * 60, "bad magic"),
        (None, "trailing bytes"),
        (None, "truncated payload"),
    ],
)
def test_deserialize_bad_input_is_a_format_error(data, message):
    good = tt.serialize(torch.arange(3))
    if data is None:
        data = good + b"\0" if message == "trailing bytes" else good[:-1]
    with pytest.raises(FormatError, match=message):
        tt.deserialize(data)
    with pytest.raises(ValueError):
        tt.deserialize(data)
