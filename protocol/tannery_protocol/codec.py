"""The tannic payload format, without torch: what the server and every peer agree on.

A payload is ``[Header][Metadata][shape][buffer]``, little-endian and packed:

- Header ``<I B H Q`` (15 bytes): magic 0x43495245 ("ERIC"), version 1, checksum,
  and nbytes, the number of bytes after the header. The checksum is written as
  0xABCD, as Tannic and pytannic do, and never verified.
- Metadata ``<B Q Q B`` (18 bytes): dcode, offset, buffer nbytes and rank, then
  rank x ``<Q`` dimensions. The offset is written as 0 and ignored on read: the
  buffer starts right after the shape.
- Buffer: the elements in C order. Booleans are bit-packed, least significant bit
  first, in ``(n + 7) // 8`` bytes, as Tannic C++ stores them.

Everything here works on bytes-like objects and numpy arrays and copies no tensor
data it can view. Malformed input raises :class:`FormatError` naming the problem
and its numbers, and nothing is allocated on the word of a header before the bytes
it describes have arrived. Cutting a stream of chunks into payloads is :mod:`tannery_protocol.framing`.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from functools import cache, cached_property
from typing import Sequence, Union

from ._lazy import lazy_module
from .errors import FormatError

# Imported on first use, so that naming dtypes and formatting shapes (what the command's
# ls and show do) costs no numpy import; every function that handles arrays imports it.
np = lazy_module("numpy")
ml_dtypes = lazy_module("ml_dtypes")

MAGIC = 0x43495245
VERSION = 1
CHECKSUM = 0xABCD
HEADER = struct.Struct("<IBHQ")
METADATA = struct.Struct("<BQQB")
DIM = struct.Struct("<Q")
#: Bytes before the shape: header and tensor metadata.
FIXED_PREFIX = HEADER.size + METADATA.size
#: The most bytes numpy and torch can index (their sizes and strides are signed 64-bit).
MAX_ARRAY_BYTES = 2**63 - 1
#: Alignment of the tensor data in buffers this module allocates.
ALIGNMENT = 64

Buffer = Union[bytes, bytearray, memoryview]


class OverLimit(FormatError):
    """A header whose rank or size is over the reader's :class:`Limits` (checked before the
    shape or anything else is read from it)."""


@dataclass(frozen=True)
class DType:
    """One element type of the format: its name, wire code and numpy type."""

    name: str
    code: int
    itemsize: int

    @cached_property
    def numpy(self) -> np.dtype:
        """numpy's dtype of the elements (ml_dtypes' for bfloat16 and float8), numpy imported now."""
        module = ml_dtypes if self.name in _ML_DTYPES else np
        return np.dtype(getattr(module, "bool_" if self.name == "bool" else self.name))

    @property
    def is_bool(self) -> bool:
        return self.code == 1

    @property
    def is_float(self) -> bool:
        """One of float16, bfloat16, float32 and float64, the dtypes a float cast may target."""
        return self.name in FLOAT_NAMES

    def buffer_nbytes(self, numel: int) -> int:
        """Bytes that ``numel`` elements take in a buffer (booleans are bit-packed)."""
        return (numel + 7) // 8 if self.is_bool else numel * self.itemsize

    def __str__(self) -> str:
        return self.name


#: Dtypes numpy lacks, whose numpy types come from ml_dtypes.
_ML_DTYPES = frozenset({"float8_e4m3fn", "float8_e5m2", "bfloat16"})

#: Every dtype of the format, by name, with its wire code and element size in bytes (numpy's
#: itemsize; a test checks they agree). Codes 1 to 38 are Tannic's; 42 to 45, 22 and 221 are
#: tannery extensions.
DTYPES: dict[str, DType] = {
    d.name: d
    for d in (
        DType("bool", 1, 1),
        DType("int8", 12, 1),
        DType("int16", 13, 2),
        DType("int32", 14, 4),
        DType("int64", 15, 8),
        DType("float8_e4m3fn", 22, 1),
        DType("float8_e5m2", 221, 1),
        DType("float16", 23, 2),
        DType("bfloat16", 231, 2),
        DType("float32", 24, 4),
        DType("float64", 25, 8),
        DType("complex64", 37, 8),
        DType("complex128", 38, 16),
        DType("uint8", 42, 1),
        DType("uint16", 43, 2),
        DType("uint32", 44, 4),
        DType("uint64", 45, 8),
    )
}
FLOAT_NAMES = ("float16", "bfloat16", "float32", "float64")
#: The code sets a writer can use (``codes=``): ``"seed"``, the codes of :data:`DTYPES`
#: (pytannic's: complex64 and complex128 as 37 and 38), and ``"cpp"``, Tannic C++'s (35 and
#: 36). They differ only there; readers accept both.
WRITER_CODES = ("seed", "cpp")
_CPP_CODES = {"complex64": 35, "complex128": 36}
_CODE_ALIASES = {code: DTYPES[name] for name, code in _CPP_CODES.items()}
_BY_CODE: dict[int, DType] = {d.code: d for d in DTYPES.values()} | _CODE_ALIASES


def check_codes(codes: str) -> str:
    """``codes`` itself if it is one of :data:`WRITER_CODES`; ValueError naming them otherwise."""
    if not isinstance(codes, str) or codes not in WRITER_CODES:
        raise ValueError(f"codes={codes!r}: use one of {', '.join(map(repr, WRITER_CODES))}")
    return codes


def wire_code(dtype: DType, codes: str = "seed") -> int:
    """The code a writer puts on ``dtype``'s payloads and pair entries under ``codes``
    (:data:`WRITER_CODES`): every writer of the format asks here."""
    if check_codes(codes) == "cpp":
        return _CPP_CODES.get(dtype.name, dtype.code)
    return dtype.code


@cache
def _by_numpy() -> dict[np.dtype, DType]:
    """Every dtype by its numpy dtype (built on first use: it imports numpy)."""
    return {d.numpy: d for d in DTYPES.values()}


def dtype_of_code(code: int) -> DType:
    """The dtype a wire code stands for; FormatError for an unknown code."""
    try:
        return _BY_CODE[code]
    except KeyError:
        raise FormatError(f"unknown dcode {code}") from None


def dtype_named(name: str) -> DType:
    """The dtype of a name such as ``"float32"``; ValueError for an unknown name."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; known: {', '.join(DTYPES)}") from None


def dtype_of_numpy(np_dtype: np.dtype) -> DType:
    """The dtype of a numpy dtype; TypeError for one the format cannot carry."""
    try:
        return _by_numpy()[np.dtype(np_dtype)]
    except KeyError:
        raise TypeError(f"numpy dtype {np.dtype(np_dtype)} has no tannic dcode") from None


#: Dimensions a message prints of a shape; a longer one shows its first few and its rank.
SHAPE_SHOWN = 8


def format_shape(shape: Sequence[int]) -> str:
    """A shape as a Python list, ``[2, 2]``, ``[]`` for a scalar: how messages print shapes.
    A hostile header's shape stays short: ``[1, 2, ... (rank 255)]`` past SHAPE_SHOWN dims."""
    dims = [int(d) for d in shape[: SHAPE_SHOWN + 1]]
    if len(shape) <= SHAPE_SHOWN:
        return str(dims)
    return f"[{', '.join(map(str, dims[:SHAPE_SHOWN - 2]))}, ... (rank {len(shape)})]"


def _span_over(dims: Sequence[int], itemsize: int, bound: int) -> bool:
    """Whether the non-zero ``dims`` of elements of ``itemsize`` bytes span more than ``bound`` bytes,
    found without building the (unbounded) product."""
    span = itemsize
    for d in dims:
        if d:
            span *= d
            if span > bound:
                return True
    return False


@dataclass(frozen=True)
class Limits:
    """Bounds a reader enforces before it trusts a header."""

    max_payload: int = 1 << 40
    max_rank: int = 64


DEFAULT_LIMITS = Limits()


@dataclass(frozen=True)
class PayloadInfo:
    """What a payload's header, metadata and shape say, read without touching its buffer."""

    dtype: DType
    shape: tuple[int, ...]
    nbytes: int
    data_offset: int

    @property
    def size(self) -> int:
        """Bytes of the whole payload, header to the end of the buffer."""
        return self.data_offset + self.nbytes

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def rank(self) -> int:
        return len(self.shape)

    def describe(self) -> str:
        return f"{self.dtype} {format_shape(self.shape)}"


def byte_buffer(data: Buffer) -> memoryview:
    """Any C-contiguous bytes-like object as a flat view of its bytes (``len`` counts bytes).

    A memoryview of another format or of several dimensions (``cast("I")``, a 2-D numpy
    array) is a payload too; without this its ``len`` and slices count items, not bytes.
    """
    view = memoryview(data)
    return view if view.ndim == 1 and view.format == "B" else view.cast("B")


def read_info(data: Buffer, limits: Limits = DEFAULT_LIMITS) -> PayloadInfo | None:
    """Parse the header, metadata and shape at the start of ``data``.

    Returns None while ``data`` is too short to hold them (a stream that has not
    delivered them yet); the buffer need not be there. Raises FormatError as soon
    as what is there is wrong.
    """
    view = byte_buffer(data)
    if len(view) < HEADER.size:
        return None
    magic, version, _checksum, after_header = HEADER.unpack_from(view)
    if magic != MAGIC:
        raise FormatError(f"bad magic 0x{magic:08X}, expected 0x{MAGIC:08X} ('ERIC')")
    if version != VERSION:
        raise FormatError(f"unsupported version {version}, this reader knows version {VERSION}")
    if HEADER.size + after_header > limits.max_payload:
        raise OverLimit(
            f"payload of {HEADER.size + after_header} bytes is over the limit of {limits.max_payload} bytes"
        )
    if after_header < METADATA.size:
        raise FormatError(
            f"header nbytes {after_header} is too small for the tensor metadata ({METADATA.size} bytes)"
        )
    if len(view) < FIXED_PREFIX:
        return None
    code, _offset, nbytes, rank = METADATA.unpack_from(view, HEADER.size)
    dtype = dtype_of_code(code)
    if rank > limits.max_rank:
        raise OverLimit(f"rank {rank} is over the limit of {limits.max_rank}")
    data_offset = FIXED_PREFIX + DIM.size * rank
    if HEADER.size + after_header < data_offset:
        raise FormatError(
            f"header nbytes {after_header} is too small for the metadata and shape of rank {rank} "
            f"({data_offset - HEADER.size} bytes)"
        )
    if len(view) < data_offset:
        return None
    shape = struct.unpack_from(f"<{rank}Q", view, FIXED_PREFIX)
    if _span_over(shape, dtype.itemsize, MAX_ARRAY_BYTES):
        # [0, 2**62, 4] has no elements, yet numpy and torch cannot even describe it. The
        # span itself is not printed: with 255 dims of 2**64-1 it has thousands of digits.
        raise FormatError(
            f"shape {format_shape(shape)} of {dtype} is too large for an array: its non-zero dimensions "
            f"span more than {MAX_ARRAY_BYTES} bytes"
        )
    expected = dtype.buffer_nbytes(math.prod(shape))
    if nbytes != expected:
        raise FormatError(
            f"buffer nbytes {nbytes} does not match shape {format_shape(shape)} of {dtype} ({expected} bytes)"
        )
    if after_header != data_offset - HEADER.size + nbytes:
        raise FormatError(
            f"header nbytes {after_header} is inconsistent with the metadata: "
            f"{data_offset - HEADER.size} bytes of metadata and shape + {nbytes} of buffer "
            f"= {data_offset - HEADER.size + nbytes}"
        )
    return PayloadInfo(dtype, shape, nbytes, data_offset)


def parse(data: Buffer, limits: Limits = DEFAULT_LIMITS) -> PayloadInfo:
    """Check that ``data`` is exactly one whole payload and return what its header says."""
    info = read_info(data, limits)
    size = byte_buffer(data).nbytes
    if info is None:
        raise FormatError(f"truncated payload: {size} bytes, too few for its header, metadata and shape")
    if size < info.size:
        raise FormatError(f"truncated payload: {size} of {info.size} bytes")
    if size > info.size:
        raise FormatError(f"trailing bytes: {size} bytes for a payload of {info.size}")
    return info


def encode_prefix(dtype: DType, shape: Sequence[int], codes: str = "seed") -> bytes:
    """Header, metadata and shape of a payload of ``dtype`` and ``shape``; the buffer follows.
    ``codes`` picks the dtype code (:func:`wire_code`)."""
    code = wire_code(dtype, codes)
    shape = tuple(int(d) for d in shape)
    if len(shape) > 255:
        raise ValueError(f"rank {len(shape)} is over 255, the most a payload can carry")
    nbytes = dtype.buffer_nbytes(math.prod(shape))
    after_header = METADATA.size + DIM.size * len(shape) + nbytes
    return b"".join(
        (
            HEADER.pack(MAGIC, VERSION, CHECKSUM, after_header),
            METADATA.pack(code, 0, nbytes, len(shape)),
            struct.pack(f"<{len(shape)}Q", *shape),
        )
    )


def byte_view(array: np.ndarray) -> memoryview:
    """The bytes of a C-contiguous array, viewed, not copied (any dtype, 0-d included)."""
    return memoryview(array.reshape(-1).view(np.uint8))


def numpy_parts(array: np.ndarray, codes: str = "seed") -> list[Buffer]:
    """A payload of ``array`` as pieces to write one after the other.

    The buffer piece views the array's memory when it is C-contiguous; booleans are
    bit-packed, which needs a new (eight times smaller) buffer. ``codes`` picks the dtype
    code (:func:`wire_code`: ``"cpp"`` for a Tannic C++ reader).
    """
    dtype = dtype_of_numpy(array.dtype)
    array = np.asarray(array, order="C")  # not ascontiguousarray: it turns a 0-d array into shape [1]
    if dtype.is_bool:
        buffer = memoryview(np.packbits(array.reshape(-1), bitorder="little"))
    else:
        buffer = byte_view(array)
    return [encode_prefix(dtype, array.shape, codes), buffer]


def encode_numpy(array: np.ndarray, codes: str = "seed") -> bytes:
    """A payload of ``array`` as one bytes object (``codes``: see :func:`numpy_parts`)."""
    return b"".join(numpy_parts(array, codes))


def to_numpy(data: Buffer, limits: Limits = DEFAULT_LIMITS) -> np.ndarray:
    """The tensor of a payload as a numpy array viewing ``data`` (booleans are unpacked, a copy)."""
    info = parse(data, limits)
    return buffer_to_numpy(byte_buffer(data)[info.data_offset :], info)


def buffer_to_numpy(buffer: Buffer, info: PayloadInfo) -> np.ndarray:
    """The array over a payload's buffer bytes (exactly ``info.nbytes`` of them)."""
    if info.dtype.is_bool:
        bits = np.frombuffer(buffer, dtype=np.uint8, count=info.nbytes)
        return np.unpackbits(bits, count=info.numel, bitorder="little").astype(np.bool_).reshape(info.shape)
    if info.numel == 0:
        return np.empty(info.shape, dtype=info.dtype.numpy)
    return np.frombuffer(buffer, dtype=info.dtype.numpy, count=info.numel).reshape(info.shape)
