"""Property-based round trips of archives: values of nested dicts, lists and tuples with
tensors of every dtype (no-element ones included), in memory, through safetensors and
through .tannic pairs."""

from __future__ import annotations

import math
import string
import struct
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tannery_protocol.codec
import tannery
import tannery.torch
from tannery import Archive, ArchiveError, load_safetensors, load_tannic, save_safetensors, save_tannic
from tannery.values import is_tensor_leaf, named_leaves
from tannery_protocol.codec import DTYPES

ALL_DTYPES = list(DTYPES)
SAFETENSORS_DTYPES = [name for name in ALL_DTYPES if name != "complex128"]
SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def tensors(draw, dtypes: list[str]) -> torch.Tensor | np.ndarray:
    """A tensor (or, sometimes, a numpy array) of a drawn dtype and shape, with drawn bits."""
    name = draw(st.sampled_from(dtypes))
    dtype = DTYPES[name]
    shape = tuple(draw(st.lists(st.integers(0, 3), max_size=3)))
    numel = math.prod(shape)
    if dtype.is_bool:
        array = np.array(draw(st.lists(st.booleans(), min_size=numel, max_size=numel)), dtype=np.bool_)
    else:
        raw = draw(st.binary(min_size=numel * dtype.itemsize, max_size=numel * dtype.itemsize))
        array = np.frombuffer(raw, dtype=dtype.numpy).copy()
    array = array.reshape(shape)
    if draw(st.booleans()):
        return array
    flat = torch.from_numpy(array.reshape(-1).view(np.uint8))
    return flat.view(tannery.torch.torch_dtype(dtype)).reshape(shape)


KEYS = st.text(alphabet=string.ascii_letters + string.digits + "_", min_size=1, max_size=5)
OTHER_LEAVES = st.one_of(st.none(), st.integers(-5, 5), st.text(max_size=3), st.floats(allow_nan=False))


def values(dtypes: list[str]) -> st.SearchStrategy[Any]:
    leaves = st.one_of(tensors(dtypes), tensors(dtypes), tensors(dtypes), OTHER_LEAVES)  # mostly tensors
    return st.recursive(
        leaves,
        lambda children: st.one_of(
            st.lists(children, max_size=4),
            st.lists(children, max_size=3).map(tuple),
            st.dictionaries(KEYS, children, max_size=4),
        ),
        max_leaves=12,
    )


PREFIXES = st.sampled_from(["", "model", "run.0"])


def fix_prefix(value: Any, prefix: str) -> str:
    """A leaf at the root needs a prefix to be named."""
    return prefix or ("root" if not isinstance(value, (dict, list, tuple)) else "")


def torch_dtype_of(leaf: Any) -> torch.dtype:
    if isinstance(leaf, np.ndarray):
        return tannery.torch.torch_dtype(tannery_protocol.codec.dtype_of_numpy(leaf.dtype))
    return leaf.dtype


def like_of(value: Any, device: str = "cpu") -> Any:
    """``value`` with each tensor replaced by a zero one of its dtype and shape, and each other
    leaf by a different object, so results can tell where their leaves came from."""
    if is_tensor_leaf(value):
        return torch.zeros(tuple(value.shape), dtype=torch_dtype_of(value), device=device)
    if isinstance(value, dict):
        return {k: like_of(v, device) for k, v in value.items()}
    if isinstance(value, list):
        return [like_of(v, device) for v in value]
    if isinstance(value, tuple):
        return tuple(like_of(v, device) for v in value)
    return LikeLeaf(value)


class LikeLeaf:
    """A non-tensor leaf of a like, an object of its own (not a container to rebuild)."""

    def __init__(self, value: Any) -> None:
        self.value = value


def bytes_of(leaf: Any) -> bytes:
    tensor = tannery.archive.as_tensor(leaf, "leaf", "test")
    return bytes(tannery.torch.buffer_of(tensor))


def assert_value(got: Any, value: Any, like: Any) -> None:
    """``got`` has ``like``'s structure and other leaves, and ``value``'s tensors (dtype, shape, bits)."""
    if is_tensor_leaf(value):
        assert isinstance(got, torch.Tensor) and got.device.type == "cpu"
        assert got.dtype == torch_dtype_of(value) and tuple(got.shape) == tuple(value.shape)
        assert bytes_of(got) == bytes_of(value)
    elif isinstance(value, (dict, list, tuple)):
        assert type(got) is type(value) and len(got) == len(value)
        keys = value.keys() if isinstance(value, dict) else range(len(value))
        for key in keys:
            assert_value(got[key], value[key], like[key])
    else:
        assert got is like


@SETTINGS
@given(values(ALL_DTYPES), PREFIXES, st.booleans())
def test_in_memory_round_trip(value, prefix, meta):
    prefix = fix_prefix(value, prefix)
    archive = Archive.of_value(value, prefix, skip_non_tensors=True)
    leaves = named_leaves(value, prefix)
    assert archive.names() == sorted(leaves)
    for name, leaf in leaves.items():
        info = archive.info(name)
        assert info.shape == tuple(leaf.shape) and info.dtype == tannery.archive.leaf_dtype(leaf)
        tensor = archive.tensor(name, leaf.shape, torch_dtype_of(leaf))
        if isinstance(leaf, torch.Tensor):
            assert tensor is leaf  # nothing copied
        elif leaf.size:
            assert tensor.data_ptr() == leaf.ctypes.data  # a numpy array's memory, shared
    like = like_of(value, "meta" if meta else "cpu")
    assert_value(archive.to_value(like, prefix), value, like)


@SETTINGS
@given(values(SAFETENSORS_DTYPES), PREFIXES)
def test_safetensors_round_trip(value, prefix):
    prefix = fix_prefix(value, prefix)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "value.safetensors"
        save_safetensors(path, Archive.of_value(value, prefix, skip_non_tensors=True))
        loaded = load_safetensors(path)
        assert loaded.names() == sorted(named_leaves(value, prefix))
        like = like_of(value)
        assert_value(loaded.to_value(like, prefix), value, like)


@SETTINGS
@given(values(ALL_DTYPES), PREFIXES)
def test_tannic_round_trip_with_like(value, prefix):
    prefix = fix_prefix(value, prefix)
    like = like_of(value)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "value"
        save_tannic(path, Archive.of_value(value, prefix, skip_non_tensors=True))
        loaded = load_tannic(path, like=like, prefix=prefix)
        assert_value(loaded.to_value(like, prefix), value, like)


@SETTINGS
@given(values(SAFETENSORS_DTYPES), values(ALL_DTYPES))
def test_two_values_share_a_file_under_distinct_prefixes(model, optim):
    both = Archive.union([Archive.of_value(model, "model", skip_non_tensors=True), Archive.of_value(optim, "optim", skip_non_tensors=True)])
    with tempfile.TemporaryDirectory() as tmp:
        save_tannic(Path(tmp) / "both", both)
        like_model, like_optim = like_of(model), like_of(optim)
        loaded = load_tannic(Path(tmp) / "both", like={"model": like_model, "optim": like_optim})
        assert_value(loaded.to_value(like_model, "model"), model, like_model)
        assert_value(loaded.to_value(like_optim, "optim"), optim, like_optim)


@SETTINGS
@given(values(ALL_DTYPES), st.data())
def test_a_like_that_differs_in_one_leaf_is_named(value, data):
    prefix = fix_prefix(value, "")
    leaves = named_leaves(value, prefix)
    if not leaves:
        return
    archive = Archive.of_value(value, prefix, skip_non_tensors=True)
    name = data.draw(st.sampled_from(sorted(leaves)))
    leaf = leaves[name]
    other = data.draw(st.sampled_from([d for d in ALL_DTYPES if d != tannery.archive.leaf_dtype(leaf)]))
    wrong = torch.zeros(tuple(leaf.shape), dtype=tannery.torch.torch_dtype(other))
    like = replace_leaf(like_of(value), prefix, name, wrong)
    with pytest.raises(ArchiveError) as e:
        archive.to_value(like, prefix)
    assert str(e.value) == (
        f"Archive.to_value: {name}: {tannery.archive.leaf_dtype(leaf)} in the archive, {other} in the value"
    )


def replace_leaf(value: Any, prefix: str, name: str, new: torch.Tensor) -> Any:
    from tannery.values import rebuild
    from tannery_protocol.names import join

    return rebuild(value, (), lambda path, leaf: new if join(prefix, *path) == name else leaf)


@SETTINGS
@given(values(ALL_DTYPES), PREFIXES)
def test_of_value_keeps_every_leaf_and_to_value_gives_the_value_back(value, prefix):
    """Plain values are kept beside the tensors: without a like, the whole value comes back,
    typed exactly (tuples, numpy arrays, a float's bits). A value of tensors alone keeps no
    structure: its entries come back by name."""
    prefix = fix_prefix(value, prefix)
    archive = Archive.of_value(value, prefix)
    assert archive.names() == sorted(named_leaves(value, prefix))
    back = archive.to_value(prefix=prefix)
    if list(tannery.values.non_tensor_leaves(value, prefix)) or (has_empty(value) and named_leaves(value, prefix)):
        assert same(back, value)
    else:  # as stored: torch tensors
        leaves = {name: as_torch(leaf) for name, leaf in named_leaves(value, prefix).items()}
        under = len(prefix) + 1 if prefix else 0
        by_name = {name[under:]: leaf for name, leaf in sorted(leaves.items())}
        assert same(back, leaves[prefix] if list(leaves) == [prefix] else by_name)


@SETTINGS
@given(values(SAFETENSORS_DTYPES), PREFIXES)
def test_plain_values_round_trip_through_safetensors(value, prefix):
    prefix = fix_prefix(value, prefix)
    if not list(tannery.values.non_tensor_leaves(value, prefix)):
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "a.safetensors"
        save_safetensors(path, Archive.of_value(value, prefix))
        assert same(load_safetensors(path).to_value(prefix=prefix), value)


def as_torch(leaf: Any) -> torch.Tensor:
    return Archive.of_value(leaf, "x").tensor("x", leaf.shape, tannery.archive.leaf_dtype(leaf))


def has_empty(value: Any) -> bool:
    if isinstance(value, dict):
        return not value or any(has_empty(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return not value or any(has_empty(item) for item in value)
    return False


def same(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` are the same value: same types all the way down, the same bits."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and tannery.torch.serialize(a) == tannery.torch.serialize(b)
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, float):
        return struct.pack(">d", a) == struct.pack(">d", b)
    return a == b


