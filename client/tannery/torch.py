"""Torch tensors as tannic payloads and .tannic checkpoint pairs.

Mirrors pytannic's modules (``dcodeof``, ``dtypeof``, ``serialize``, ``deserialize``,
``write``, ``read``) so its users feel at home, with three differences: float16 is
written with code 23 (pytannic 0.1.5 writes 231, the code of bfloat16, a bug in its
``dcodeof``), every dtype of :data:`tannery_protocol.codec.DTYPES` is supported, and no tensor
data is copied that can be viewed. The writers take ``codes="cpp"`` for a Tannic C++
reader: complex64 and complex128 under its codes 35 and 36 instead of pytannic's 37
and 38 (``"seed"``, the default); every other dtype's bytes are the same.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Sequence

import numpy as np
import torch

from tannery_protocol import codec
from tannery.formats import checkpoint
from tannery_protocol.codec import Buffer, DType, FormatError, PayloadInfo

_NAMES: dict[torch.dtype, str] = {
    torch.bool: "bool",
    torch.int8: "int8",
    torch.int16: "int16",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.float8_e4m3fn: "float8_e4m3fn",
    torch.float8_e5m2: "float8_e5m2",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float32: "float32",
    torch.float64: "float64",
    torch.complex64: "complex64",
    torch.complex128: "complex128",
    torch.uint8: "uint8",
    torch.uint16: "uint16",
    torch.uint32: "uint32",
    torch.uint64: "uint64",
}
_TORCH: dict[str, torch.dtype] = {name: dtype for dtype, name in _NAMES.items()}


def dcodeof(dtype: torch.dtype) -> int:
    """The wire code of a torch dtype, 0 for one the format cannot carry (as pytannic does)."""
    name = _NAMES.get(dtype)
    return codec.DTYPES[name].code if name else 0


def dtypeof(code: int) -> torch.dtype:
    """The torch dtype of a wire code; ValueError (a FormatError) for an unknown code."""
    return _TORCH[codec.dtype_of_code(code).name]


def codec_dtype(dtype: torch.dtype) -> DType:
    """The format's dtype for a torch dtype; TypeError naming one it cannot carry."""
    try:
        return codec.DTYPES[_NAMES[dtype]]
    except KeyError:
        raise TypeError(f"{dtype} has no tannic dcode; supported: {', '.join(codec.DTYPES)}") from None


def torch_dtype(dtype: DType | str) -> torch.dtype:
    """The torch dtype of a format dtype or its name."""
    return _TORCH[dtype if isinstance(dtype, str) else dtype.name]


def short_name(dtype: torch.dtype) -> str:
    """A torch dtype's short name, ``float32``, as messages print dtypes."""
    return _NAMES.get(dtype) or str(dtype).removeprefix("torch.")


def cpu_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor itself when it is a contiguous CPU tensor, otherwise one copy that is."""
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    return tensor.resolve_conj().resolve_neg().contiguous()


def buffer_of(tensor: torch.Tensor) -> memoryview:
    """A tensor's buffer bytes as the format lays them out.

    For a contiguous CPU tensor this views its memory; otherwise it is the one copy
    that makes the tensor contiguous (and on the CPU). Booleans are bit-packed, a new
    buffer.
    """
    dtype = codec_dtype(tensor.dtype)
    if tensor.numel() == 0:
        # An empty tensor may have stride 0 (torch.from_numpy of an empty array), which .view refuses.
        return memoryview(b"")
    tensor = cpu_contiguous(tensor)
    if dtype.is_bool:
        return memoryview(np.packbits(tensor.numpy().reshape(-1), bitorder="little"))
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def serialize_parts(tensor: torch.Tensor, *, codes: str = "seed") -> list[Buffer]:
    """A payload as pieces whose concatenation is ``serialize(tensor, codes=codes)``.

    The second piece shares the tensor's memory when it is a contiguous CPU tensor,
    so a sender can write it without a copy. ``codes`` is ``"seed"`` or ``"cpp"``
    (:func:`tannery_protocol.codec.wire_code`).
    """
    prefix = codec.encode_prefix(codec_dtype(tensor.dtype), tensor.shape, codes)
    return [prefix, buffer_of(tensor)]


def serialize(tensor: torch.Tensor, *, codes: str = "seed") -> bytes:
    """A tensor as one payload: any device, any strides, every dtype of the format.
    ``codes="cpp"`` writes complex64/complex128 under Tannic C++'s codes 35/36."""
    return b"".join(serialize_parts(tensor, codes=codes))


def from_buffer(buffer: Buffer, dtype: DType, shape: Sequence[int]) -> torch.Tensor:
    """The tensor over a buffer of exactly ``dtype.buffer_nbytes(numel)`` bytes.

    Shares a writable buffer's memory; copies a read-only one once, into memory torch
    allocates. Booleans are unpacked, a new buffer either way.
    """
    shape = tuple(int(d) for d in shape)
    target = torch_dtype(dtype)
    if dtype.is_bool:
        info = PayloadInfo(dtype, shape, dtype.buffer_nbytes(math.prod(shape)), 0)
        return torch.from_numpy(codec.buffer_to_numpy(buffer, info))
    numel = math.prod(shape)
    if numel == 0:
        return torch.empty(shape, dtype=target)
    view = memoryview(buffer)
    if view.readonly:
        tensor = torch.empty(shape, dtype=target)
        np.copyto(tensor.reshape(-1).view(torch.uint8).numpy(), np.frombuffer(view, np.uint8, numel * dtype.itemsize))
        return tensor
    return torch.frombuffer(view, dtype=target, count=numel).reshape(shape)


def deserialize(data: Buffer) -> torch.Tensor:
    """The tensor of one payload.

    When ``data`` is writable (bytearray, writable memoryview, mmap) the tensor shares
    its memory; otherwise one copy is made. Raises FormatError for anything that is
    not exactly one valid payload.
    """
    info = codec.parse(data)
    return from_buffer(codec.byte_buffer(data)[info.data_offset :], info.dtype, info.shape)


def write(
    module_or_state_dict: torch.nn.Module | Mapping[str, torch.Tensor],
    path: str | os.PathLike[str],
    *,
    codes: str = "seed",
) -> None:
    """Write a module's state_dict (or a state_dict) as the pair ``<path>.tannic`` and ``<path>.metadata.tannic``.

    Entries are written in state_dict order, in the directory of ``path``; a
    ``.tannic`` suffix on ``path`` is optional. ``codes="cpp"`` writes complex64/complex128
    under Tannic C++'s codes 35/36 (default ``"seed"``: pytannic's 37/38).
    """
    codec.check_codes(codes)
    state = module_or_state_dict
    if isinstance(state, torch.nn.Module):
        state = state.state_dict()
    items = []
    for name, tensor in state.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"write: {name}: {type(tensor).__name__} is not a tensor")
        items.append((name, codec_dtype(tensor.dtype), [buffer_of(tensor)]))
    checkpoint.write_pair(path, items, codes)


def read(path: str | os.PathLike[str], like: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Read a pair written by :func:`write`, pytannic or Tannic C++, memory-mapped.

    The pair stores no shapes: entries are 1-D unless ``like`` (a state_dict) gives
    theirs. Entries ``like`` lacks stay 1-D; an entry ``like`` names that the pair
    lacks, or one whose dtype or element count differs, raises ValueError naming it.
    Tensors view a private map of the data file: pages are read when used, and
    writing a tensor never changes the file.
    """
    pair = checkpoint.open_pair(path)
    found = {entry.name: entry for entry in pair.entries}
    like = dict(like or {})
    for name in like:
        if name not in found:
            raise ValueError(f"read: {name}: in like, not in the checkpoint")
    tensors = {}
    for entry in pair.entries:
        shape = _shape_of(entry, like.get(entry.name))
        tensors[entry.name] = from_buffer(pair.buffer(entry), entry.dtype, shape)
    return tensors


def _shape_of(entry: checkpoint.PairEntry, like: torch.Tensor | None) -> tuple[int, ...]:
    """The shape of a pair's entry: ``like``'s, checked against the entry's size, or 1-D."""
    if like is None:
        return entry.flat_shape
    if short_name(like.dtype) != entry.dtype.name:
        raise ValueError(f"read: {entry.name}: {entry.dtype} in the checkpoint, {short_name(like.dtype)} in like")
    expected = entry.dtype.buffer_nbytes(like.numel())
    if expected != entry.nbytes:
        raise ValueError(
            f"read: {entry.name}: {entry.nbytes} bytes in the checkpoint, shape {codec.format_shape(like.shape)} "
            f"of {entry.dtype} in like ({expected} bytes)"
        )
    return tuple(like.shape)


__all__ = [
    "FormatError",
    "buffer_of",
    "codec_dtype",
    "cpu_contiguous",
    "dcodeof",
    "deserialize",
    "dtypeof",
    "from_buffer",
    "read",
    "serialize",
    "serialize_parts",
    "short_name",
    "torch_dtype",
    "write",
]
