"""The safetensors file layout, read and checked strictly, without torch.

A safetensors file is an 8-byte little-endian header length N, N bytes of UTF-8 JSON
(an object: ``"__metadata__"``, an object of strings, and per tensor ``{"dtype",
"shape", "data_offsets": [begin, end]}``, offsets relative to the data region), then
the data region: the tensors' bytes in C order, one byte per boolean. As the
``safetensors`` package requires, the entries tile the data region exactly: no gap,
no overlap, nothing after the last.

:func:`read_layout` reads only the header, so a caller can map the file and view the
tensors in place. Anything malformed raises :class:`~tannery_protocol.codec.FormatError`.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from typing import Any

from tannery_protocol.codec import DTYPES, Buffer, DType, FormatError, format_shape

LENGTH = struct.Struct("<Q")
#: The largest header the safetensors package accepts.
MAX_HEADER = 100_000_000

#: The most elements along all dimensions of a shape (zeros counted as ones) torch can index.
MAX_ELEMENTS = 2**63 - 1

#: Every safetensors dtype tannery reads and writes, by its safetensors code.
#: safetensors has no complex128 (tannery does) and tannery has no F8_E8M0, F4, F6 or
#: FNUZ float8 formats (safetensors does): files with those are refused.
SAFETENSORS_DTYPES: dict[str, DType] = {
    "BOOL": DTYPES["bool"],
    "U8": DTYPES["uint8"],
    "I8": DTYPES["int8"],
    "U16": DTYPES["uint16"],
    "I16": DTYPES["int16"],
    "U32": DTYPES["uint32"],
    "I32": DTYPES["int32"],
    "U64": DTYPES["uint64"],
    "I64": DTYPES["int64"],
    "F16": DTYPES["float16"],
    "BF16": DTYPES["bfloat16"],
    "F32": DTYPES["float32"],
    "F64": DTYPES["float64"],
    "F8_E4M3": DTYPES["float8_e4m3fn"],
    "F8_E5M2": DTYPES["float8_e5m2"],
    "C64": DTYPES["complex64"],
}
#: The safetensors code of each tannery dtype name it has.
CODES: dict[str, str] = {dtype.name: code for code, dtype in SAFETENSORS_DTYPES.items()}

_ENTRY_KEYS = {"dtype", "shape", "data_offsets"}


@dataclass(frozen=True)
class SafetensorsEntry:
    """One tensor of a safetensors file; ``begin`` and ``end`` are offsets into the data region."""

    name: str
    dtype: DType
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class SafetensorsLayout:
    """A file's entries (in header order), its text metadata, and where its data region starts."""

    entries: list[SafetensorsEntry]
    metadata: dict[str, str]
    data_start: int


def read_layout(data: Buffer, what: str = "safetensors") -> SafetensorsLayout:
    """Parse and check the header of the safetensors file whose bytes are ``data``.

    Only the header's bytes are read, so ``data`` may be a memory map of a large file.
    ``what`` (the file's path) starts every error message.
    """
    view = memoryview(data)
    size = view.nbytes
    if size == 0:
        raise FormatError(f"{what}: the file is empty (0 bytes); a safetensors file starts with an 8-byte header length")
    if size < LENGTH.size:
        raise FormatError(f"{what}: {size} bytes, too short for the {LENGTH.size}-byte header length")
    (length,) = LENGTH.unpack_from(view)
    if length > MAX_HEADER:
        raise FormatError(f"{what}: header length {length} is over the limit of {MAX_HEADER} bytes")
    data_start = LENGTH.size + length
    if data_start > size:
        raise FormatError(f"{what}: truncated: a header of {length} bytes, {size - LENGTH.size} bytes after its length")
    text = bytes(view[LENGTH.size : data_start])
    if not text:
        raise FormatError(f"{what}: the header is empty (its length is 0); a safetensors header is a JSON object")
    if not text.startswith(b"{"):
        raise FormatError(f"{what}: the header does not start with '{{' (it starts with {text[:8]!r})")
    header = _parse_json(text, what)
    metadata = _metadata(header.pop("__metadata__", {}), what)
    entries = [_entry(name, fields, what) for name, fields in header.items()]
    _check_tiling(entries, size - data_start, what)
    return SafetensorsLayout(entries, metadata, data_start)


def _parse_json(text: bytes, what: str) -> dict[str, Any]:
    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        result: dict[str, Any] = {}
        for key, value in pairs:
            if key in result:
                raise FormatError(f"{what}: {key!r} appears twice in the header")
            result[key] = value
        return result

    def no_constant(name: str) -> Any:
        raise FormatError(f"{what}: the header holds {name}, which is not JSON")

    try:
        header = json.loads(text.decode("utf-8"), object_pairs_hook=unique, parse_constant=no_constant)
    except UnicodeDecodeError as e:
        raise FormatError(f"{what}: the header is not UTF-8 ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise FormatError(f"{what}: the header is not JSON ({e.msg} at byte {e.pos})") from None
    except RecursionError:
        raise FormatError(f"{what}: the header is nested too deeply") from None
    if not isinstance(header, dict):
        raise FormatError(f"{what}: the header is a JSON {type(header).__name__}, not an object")
    return header


def _metadata(value: Any, what: str) -> dict[str, str]:
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise FormatError(f"{what}: __metadata__ is not an object of strings")
    return value


def _is_count(value: Any) -> bool:
    return type(value) is int and value >= 0


def _entry(name: str, fields: Any, what: str) -> SafetensorsEntry:
    if not name:
        raise FormatError(f"{what}: an entry has an empty name")
    if not isinstance(fields, dict) or set(fields) != _ENTRY_KEYS:
        got = sorted(fields) if isinstance(fields, dict) else type(fields).__name__
        raise FormatError(f"{what}: {name}: an entry is an object of dtype, shape and data_offsets, got {got}")
    code, shape, offsets = fields["dtype"], fields["shape"], fields["data_offsets"]
    dtype = SAFETENSORS_DTYPES.get(code) if isinstance(code, str) else None
    if dtype is None:
        raise FormatError(f"{what}: {name}: dtype {code!r} is not one tannery reads ({', '.join(SAFETENSORS_DTYPES)})")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise FormatError(f"{what}: {name}: shape {shape!r} is not a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)):
        raise FormatError(f"{what}: {name}: data_offsets {offsets!r} is not two non-negative integers")
    if math.prod(max(d, 1) for d in shape) > MAX_ELEMENTS:
        raise FormatError(f"{what}: {name}: shape {format_shape(shape)} is too large for a tensor")
    begin, end = offsets
    if end < begin:
        raise FormatError(f"{what}: {name}: data_offsets [{begin}, {end}] end before they begin")
    expected = math.prod(shape) * dtype.itemsize
    if end - begin != expected:
        raise FormatError(
            f"{what}: {name}: data_offsets [{begin}, {end}] hold {end - begin} bytes, "
            f"shape {format_shape(shape)} of {dtype} takes {expected}"
        )
    return SafetensorsEntry(name, dtype, tuple(shape), begin, end)


def _check_tiling(entries: list[SafetensorsEntry], data_nbytes: int, what: str) -> None:
    """Check the entries cover the data region exactly, in offset order, with no gap or overlap."""
    for entry in entries:
        if entry.end > data_nbytes:
            raise FormatError(
                f"{what}: {entry.name}: bytes [{entry.begin}, {entry.end}) are outside the data ({data_nbytes} bytes)"
            )
    cursor, last = 0, None
    for entry in sorted(entries, key=lambda e: (e.begin, e.end)):
        if entry.begin < cursor:
            assert last is not None
            raise FormatError(
                f"{what}: {entry.name} at [{entry.begin}, {entry.end}) overlaps {last.name} at [{last.begin}, {last.end})"
            )
        if entry.begin > cursor:
            raise FormatError(f"{what}: bytes [{cursor}, {entry.begin}) of the data belong to no entry")
        cursor, last = entry.end, entry
    if cursor != data_nbytes:
        raise FormatError(f"{what}: trailing bytes: the entries end at {cursor}, the data has {data_nbytes} bytes")


def encode_header(entries: list[tuple[str, str, tuple[int, ...], int]], metadata: dict[str, str] | None = None) -> bytes:
    """Length and header (padded with spaces to a multiple of 8) for ``(name, code, shape, nbytes)``
    entries laid out in that order. For tests and tools; ``tannery.formats.files`` writes with the
    safetensors package."""
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, code, shape, nbytes in entries:
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-(LENGTH.size + len(text)) % 8)
    return LENGTH.pack(len(text)) + text


__all__ = [
    "CODES",
    "MAX_HEADER",
    "SAFETENSORS_DTYPES",
    "SafetensorsEntry",
    "SafetensorsLayout",
    "encode_header",
    "read_layout",
]
