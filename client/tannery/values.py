"""Tensors and structures of tensors as callers give them: dtypes, leaves and their names.

A value is a torch tensor, a numpy array (which becomes a torch tensor sharing its memory),
or nested dicts, lists and tuples of them, each tensor named by its path
(``"model.blocks.0.w"``). What an archive is built from (:meth:`Archive.of_value`) and
filled into (:meth:`Archive.to_value`), and what ``save_safetensors`` writes.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any, Callable, Iterator, Union

from tannery_protocol import codec
from tannery_protocol._lazy import lazy_module
from tannery_protocol.names import join

# Imported on first use: naming dtypes by their strings never imports torch.
np = lazy_module("numpy")
torch = lazy_module("torch")
torch_codec = lazy_module("tannery.torch")

#: A dtype as callers may give it: ``torch.float32``, ``"float32"`` or a codec DType.
DTypeLike = Union["torch.dtype", str, codec.DType]
#: A tensor as callers may give it; numpy arrays become torch tensors sharing their memory.
TensorLike = Union["torch.Tensor", "np.ndarray"]

#: Dtypes whose numpy arrays (ml_dtypes) torch.from_numpy cannot take directly.
_VIA_BITS = frozenset({"bfloat16", "float8_e4m3fn", "float8_e5m2"})


def is_tensor_leaf(value: object) -> bool:
    """Whether a leaf of a value is a tensor (torch tensor or numpy array), hence an entry."""
    return isinstance(value, (torch.Tensor, np.ndarray))


def dtype_name(dtype: DTypeLike) -> str:
    """The short name of a dtype given as a torch dtype, a name or a codec DType.

    ValueError for an unknown name, TypeError for anything else.
    """
    if isinstance(dtype, torch.dtype):
        return torch_codec.short_name(dtype)
    if isinstance(dtype, codec.DType):
        return dtype.name
    if isinstance(dtype, str):
        return codec.dtype_named(dtype).name
    raise TypeError(f"a dtype is a torch.dtype or a name such as 'float32', not {type(dtype).__name__}")


def leaf_dtype(leaf: TensorLike) -> str:
    """The short dtype name of a tensor leaf (a numpy array's included)."""
    if isinstance(leaf, np.ndarray):
        try:
            return codec.dtype_of_numpy(leaf.dtype).name
        except TypeError:
            return str(leaf.dtype)
    return torch_codec.short_name(leaf.dtype)


def named_leaves(value: Any, prefix: str = "", where: str = "named_leaves") -> dict[str, TensorLike]:
    """The tensor leaves of a structure of dicts, lists and tuples, by name, in order.

    Each is named by its path, keys and indices joined with dots, under ``prefix``
    (:func:`tannery_protocol.names.join`); other leaves are skipped. ValueError, prefixed by
    ``where``, for a leaf left without a name or two leaves of one name.
    """
    leaves: dict[str, TensorLike] = {}
    for path, leaf in _walk(value, ()):
        name = leaf_name(prefix, path, where)
        if name in leaves:
            raise ValueError(f"{where}: {name}: two leaves have this name")
        leaves[name] = leaf
    return leaves


def leaf_name(prefix: str, path: tuple[str, ...], where: str) -> str:
    """The name of the leaf at ``path`` under ``prefix``; ValueError, prefixed by ``where``, when it is empty."""
    name = join(prefix, *path)
    if not name:
        if not path:
            raise ValueError(f"{where}: a leaf at the root has no name; give a prefix")
        raise ValueError(f"{where}: a leaf at {list(path)} has an empty name; give a prefix")
    return name


def non_tensor_leaves(value: Any, prefix: str = "") -> Iterator[tuple[str, object]]:
    """The name (path under ``prefix``) and the leaf of each leaf of ``value`` that is not a
    tensor, depth first, in order. Empty containers are no leaves."""
    for path, leaf in _walk(value, (), tensors_only=False):
        if not is_tensor_leaf(leaf):
            yield join(prefix, *path), leaf


def first_non_tensor(value: Any, prefix: str = "") -> tuple[str, object] | None:
    """The first of :func:`non_tensor_leaves`, or None when every leaf is a tensor."""
    return next(non_tensor_leaves(value, prefix), None)


def not_a_tensor(name: str, leaf: object) -> str:
    """How a message names a non-tensor leaf: ``optimizer.state.0.step is an int, not a tensor``."""
    kind = type(leaf).__name__
    article = "an" if kind[:1].lower() in "aeiou" else "a"
    what = "None" if leaf is None else f"{article} {kind}"
    return f"{name or 'the value'} is {what}, not a tensor"


def _walk(value: Any, path: tuple[str, ...], tensors_only: bool = True):
    """(path, leaf) for each tensor leaf of ``value`` (each leaf, with ``tensors_only`` False),
    depth first, in order."""
    if is_tensor_leaf(value):
        yield path, value
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from _walk(item, path + (str(key),), tensors_only)
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from _walk(item, path + (str(index),), tensors_only)
    elif not tensors_only:
        yield path, value


def rebuild(value: Any, path: tuple[str, ...], replace: Callable[[tuple[str, ...], Any], Any],
            other: Callable[[tuple[str, ...], tuple[Any, ...], Any], Any] | None = None,
            keys: tuple[Any, ...] = ()) -> Any:
    """``value`` with each tensor leaf replaced by ``replace(path, leaf)`` and, given ``other``,
    each other leaf by ``other(path, keys, leaf)`` (``keys``: the dict keys and indices on the
    way, as they are); containers keep their types."""
    if is_tensor_leaf(value):
        return replace(path, value)
    if isinstance(value, Mapping):
        items = {key: rebuild(item, path + (str(key),), replace, other, keys + (key,)) for key, item in value.items()}
        if not isinstance(value, dict):
            return items
        # A shallow copy keeps the dict's class and attributes (a state_dict's _metadata).
        new = copy.copy(value)
        new.update(items)
        return new
    if isinstance(value, (list, tuple)):
        items = [rebuild(item, path + (str(i),), replace, other, keys + (i,)) for i, item in enumerate(value)]
        if type(value) is list:
            return items
        if isinstance(value, list):
            new = copy.copy(value)
            new[:] = items
            return new
        if type(value) is tuple:
            return tuple(items)
        if hasattr(type(value), "_fields"):  # a namedtuple
            return type(value)(*items)
        return type(value)(items)
    return value if other is None else other(path, keys, value)


def as_tensor(value: TensorLike, name: str, where: str) -> torch.Tensor:
    """A tensor leaf as a torch tensor an archive may hold, sharing a numpy array's memory.

    TypeError naming the entry for anything else, a dtype the format cannot carry, or a
    layout other than strided. A numpy array with negative strides, which torch cannot
    view, is copied.
    """
    if isinstance(value, np.ndarray):
        try:
            dtype = codec.dtype_of_numpy(value.dtype)
        except TypeError as e:
            raise TypeError(f"{where}: {name}: {e}") from None
        if any(stride < 0 for stride in value.strides):
            value = np.ascontiguousarray(value)
        if dtype.name in _VIA_BITS:
            # ml_dtypes' types, which torch.from_numpy does not know: view their bits.
            bits = np.dtype(f"uint{8 * dtype.itemsize}")
            return torch.from_numpy(value.view(bits)).view(torch_codec.torch_dtype(dtype))
        return torch.from_numpy(value)
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{where}: {name}: {type(value).__name__} is not a tensor")
    try:
        torch_codec.codec_dtype(value.dtype)
    except TypeError as e:
        raise TypeError(f"{where}: {name}: {e}") from None
    if value.layout != torch.strided:
        raise TypeError(f"{where}: {name}: a {value.layout} tensor; archives hold strided (dense) tensors")
    return value


__all__ = [
    "DTypeLike", "TensorLike", "as_tensor", "dtype_name", "first_non_tensor", "is_tensor_leaf", "leaf_dtype",
    "leaf_name", "named_leaves", "non_tensor_leaves", "not_a_tensor", "rebuild",
]
