"""Plain values kept beside an archive's tensors: a training state's step, learning rate,
scheduler state and RNG states, typed exactly and never pickled.

A value given to :meth:`Archive.of_value` is split in two: its tensors (entries, named by
their paths) and a *tree*, the whole structure as JSON-able nodes in which each tensor is a
reference to its entry. The tree is kept only when the value holds something the entry names
alone cannot say (a plain leaf, or an empty container beside tensors), and is written as a
small JSON document (:func:`encode`), read back by :func:`decode`, which checks every node:
reading a document never runs code and never builds anything but the types below.

Nodes: ``null``, ``true``/``false``, JSON ints, strings, finite floats as JSON numbers (Python
writes the shortest text that reads back to the same bits); and objects of exactly one tag:
``{"float": "<16 hex digits>"}`` (inf and nan, by their bits), ``{"tuple": [...]}``,
``{"dict": [[key, node], ...]}`` (keys str or int, in order), ``{"tensor": name}`` (a torch
tensor's entry, by its name under the tree's prefix; ``"numpy": true`` for a numpy array), and
``{"numpy": dtype, "value": node}`` (a numpy scalar). Lists are JSON arrays.

Reading a document imports neither torch nor (but for its numpy scalars) numpy: ``tannery
show`` stays torch-free.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterator, Mapping
from typing import Any

from tannery_protocol import codec
from tannery_protocol._lazy import lazy_module
from tannery_protocol.errors import ArchiveError, FormatError
from tannery_protocol.names import join
from tannery.plain_trees import Node, build, children, no_tensor, path_name
from tannery.values import leaf_name

np = lazy_module("numpy")
torch = lazy_module("torch")

#: The format and version a document carries; a newer version is refused, not guessed at.
FORMAT, VERSION = "tannery.values", 1
#: The most bytes one document of plain values takes (16 MiB): larger is data, meant for tensors.
MAX_BYTES = 16 << 20
#: The deepest nesting kept (a training state nests 5 levels; deeper is refused, never a RecursionError).
MAX_DEPTH = 100
#: The largest int kept (in bits): Python reads ints of at most 4300 digits from text.
MAX_INT_BITS = 14_000

_SCALARS = (type(None), bool, int, float, str)
_TAGS = {"float": {"float"}, "tuple": {"tuple"}, "dict": {"dict"}, "tensor": {"tensor", "numpy"},
         "numpy": {"numpy", "value"}}
_KEPT = ("None, bool, int, float, str, numpy scalars, and dicts (str or int keys), lists and tuples of them; "
         "tensors and numpy arrays become entries")


class _Splitter:
    """One walk of a value: its tensors by name, its tree, and the names of its plain leaves."""

    def __init__(self, prefix: str, where: str) -> None:
        self.prefix, self.where = prefix, where
        self.tensors: dict[str, Any] = {}
        self.plain_names: set[str] = set()
        self.empties = False  # whether an empty container is met (kept with tensors or plain values only)

    def node(self, value: Any, path: tuple[str, ...], depth: int) -> Node:
        if depth > MAX_DEPTH:
            raise ValueError(f"{self.where}: {self._at(path[:8])}...: nested deeper than {MAX_DEPTH} levels; "
                             "keep plain values shallower (or store deep data as a tensor)")
        if isinstance(value, (torch.Tensor, np.ndarray)):
            return self._tensor(value, path)
        if isinstance(value, np.generic):
            return self._numpy_scalar(value, path)
        if isinstance(value, Mapping):
            items = [[self._key(key, path), self.node(item, path + (str(key),), depth + 1)]
                     for key, item in value.items()]
            self.empties |= not items
            return {"dict": items}
        if isinstance(value, (list, tuple)):
            items = [self.node(item, path + (str(i),), depth + 1) for i, item in enumerate(value)]
            self.empties |= not items
            return items if isinstance(value, list) else {"tuple": items}
        return self._scalar(value, path)

    def _at(self, path: tuple[str, ...]) -> str:
        return join(self.prefix, *path) or "the value"

    def _leaf_name(self, path: tuple[str, ...]) -> str:
        return leaf_name(self.prefix, path, self.where)

    def _tensor(self, value: Any, path: tuple[str, ...]) -> Node:
        name = self._leaf_name(path)
        if isinstance(value, np.ndarray) and not _has_entry_dtype(value):
            raise TypeError(f"{self.where}: {name} is a numpy array of dtype {value.dtype}, which no entry holds; "
                            "convert it (array.tolist() keeps it as plain values), or give skip_non_tensors=True "
                            "to store the tensors alone")
        if name in self.tensors:
            raise ValueError(f"{self.where}: {name}: two leaves have this name")
        self.tensors[name] = value
        node = {"tensor": join("", *path)}
        if isinstance(value, np.ndarray):
            node["numpy"] = True
        return node

    def _numpy_scalar(self, value: Any, path: tuple[str, ...]) -> Node:
        if value.dtype.name not in _numpy_names():  # float128 would lose bits through a Python float
            raise TypeError(f"{self.where}: {self._at(path)} is a numpy {value.dtype} scalar, which is not kept "
                            f"(kept: {_KEPT}); convert it, or give skip_non_tensors=True to leave it out")
        self._note_plain(path)
        return {"numpy": value.dtype.name, "value": _float_node(value.item())}

    def _scalar(self, value: Any, path: tuple[str, ...]) -> Node:
        if type(value) not in _SCALARS:
            kind = type(value).__name__
            sub = next((t.__name__ for t in _SCALARS if isinstance(value, t)), None)
            article = "an" if kind[:1].lower() in "aeiou" else "a"
            what = f"{article} {kind} (a subclass of {sub}, whose own code is not kept)" if sub else f"{article} {kind}"
            remedy = f"convert it to a plain {sub}" if sub else "convert it to plain values"
            raise TypeError(f"{self.where}: {self._at(path)} is {what}, neither a tensor nor a plain value (kept: "
                            f"{_KEPT}); {remedy}, or give skip_non_tensors=True to store the tensors alone")
        self._note_plain(path)
        if type(value) is int:
            self._int(value, path)
        return _float_node(value) if type(value) is float else value

    def _int(self, value: int, path: tuple[str, ...]) -> None:
        if value.bit_length() > MAX_INT_BITS:
            raise ValueError(f"{self.where}: {self._at(path)}: an int of {value.bit_length()} bits, over the bound of "
                             f"{MAX_INT_BITS} bits for a plain value (JSON's text of it would be thousands of "
                             "digits); store it as a tensor of its bytes, or leave it out")

    def _note_plain(self, path: tuple[str, ...]) -> None:
        self.plain_names.add(self._leaf_name(path))

    def _key(self, key: Any, path: tuple[str, ...]) -> str | int:
        if type(key) is int:
            self._int(key, path)
        if type(key) is str or type(key) is int:
            return key
        raise TypeError(f"{self.where}: {self._at(path)}: a key {key!r} of type {type(key).__name__}; the keys of "
                        "kept dicts are str or int, so that they come back as they were: convert it")


def _has_entry_dtype(array: Any) -> bool:
    try:
        codec.dtype_of_numpy(array.dtype)
    except TypeError:
        return False
    return True


def split(value: Any, prefix: str, where: str) -> tuple[dict[str, Any], dict[str, Node]]:
    """The tensor leaves of ``value`` by name (under ``prefix``), and its tree by its prefix
    when it holds plain values (none when the entry names say all). TypeError naming the path for a leaf
    neither kept nor a tensor, or a key neither str nor int; ValueError for nesting deeper than
    :data:`MAX_DEPTH` or a plain value named like a tensor; ArchiveError over :data:`MAX_BYTES`."""
    splitter = _Splitter(prefix, where)
    tree = splitter.node(value, (), 0)
    clash = sorted(splitter.plain_names & splitter.tensors.keys())
    if clash:
        raise ValueError(f"{where}: {clash[0]}: a tensor and a plain value have this name (a dict with both the "
                         "int key and the str key?); rename one")
    if not splitter.plain_names and not (splitter.empties and splitter.tensors):
        return splitter.tensors, {}  # the entry names say all (or there is nothing at all)
    encode(tree, where, prefix)  # refused here, before anything is sent, when over the bound
    return splitter.tensors, {prefix: tree}


def _float_node(value: Any) -> Node:
    if type(value) is float and not math.isfinite(value):
        return {"float": struct.pack(">d", value).hex()}
    return value


def encode(tree: Node, where: str = "plain values", prefix: str = "") -> bytes:
    """The document of ``tree`` (kept under ``prefix``): UTF-8 JSON of plain ASCII, at most
    :data:`MAX_BYTES` bytes (ArchiveError naming the largest leaf otherwise)."""
    data = json.dumps({"format": FORMAT, "version": VERSION, "value": tree}, ensure_ascii=True,
                      separators=(",", ":"), allow_nan=False).encode("ascii")
    if len(data) > MAX_BYTES:
        size, name = max(_leaf_sizes(tree, (prefix,) if prefix else ()), default=(0, "?"))
        raise ArchiveError(f"{where}: the plain values come to {len(data)} bytes encoded, over the bound of "
                           f"{MAX_BYTES} bytes; the largest leaf is {name} ({size} bytes): store large data as "
                           "a tensor (a numpy array), or leave it out")
    return data


def _leaf_sizes(node: Node, path: tuple[str, ...]) -> Iterator[tuple[int, str]]:
    for sub, child in children(node, path):
        if sub is None:
            yield len(json.dumps(child)), path_name(path)
        else:
            yield from _leaf_sizes(child, sub)


def decode(data: bytes | bytearray | memoryview | str, where: str) -> Node:
    """The tree of a document, every node checked (FormatError naming what is wrong)."""
    try:
        document = json.loads(bytes(data) if not isinstance(data, str) else data)
    except (ValueError, RecursionError) as e:
        raise FormatError(f"{where}: the plain values are not a readable document ({type(e).__name__}: "
                          f"{str(e)[:200]}); the archive is damaged: store it again") from None
    if not isinstance(document, dict) or document.get("format") != FORMAT or "value" not in document:
        raise FormatError(f"{where}: not a document of plain values (no format {FORMAT!r})")
    version = document.get("version")
    if type(version) is not int or version < 1:
        raise FormatError(f"{where}: the plain values have no valid version ({version!r})")
    if version > VERSION:
        raise FormatError(f"{where}: the plain values were written by format version {version}, newer than this "
                          f"tannery reads (up to {VERSION}): read them with a newer release")
    _check(document["value"], (), 0, where)
    return document["value"]


def _check(node: Node, path: tuple[str, ...], depth: int, where: str) -> None:
    if depth > MAX_DEPTH:
        raise FormatError(f"{where}: plain values nested deeper than {MAX_DEPTH} levels")
    if node is None or type(node) in (bool, int, float, str):
        return
    if isinstance(node, list):
        for i, item in enumerate(node):
            _check(item, path + (str(i),), depth + 1, where)
        return
    tag = next(iter(node), None) if isinstance(node, dict) else None
    if tag not in _TAGS or not set(node) <= _TAGS[tag] or not _valid(tag, node):
        raise FormatError(f"{where}: {path_name(path)}: {json.dumps(node)[:80]} is not a node of plain values")
    if tag == "tuple":
        _check(node["tuple"], path, depth, where)
    elif tag == "dict":
        for key, item in node["dict"]:
            _check(item, path + (str(key),), depth + 1, where)
    elif tag == "numpy":
        _check(node["value"], path, depth + 1, where)


def _valid(tag: str, node: dict) -> bool:
    body = node[tag]
    if tag == "float":
        return isinstance(body, str) and len(body) == 16 and all(c in "0123456789abcdef" for c in body)
    if tag == "tuple":
        return isinstance(body, list)
    if tag == "dict":
        return isinstance(body, list) and all(
            isinstance(pair, list) and len(pair) == 2 and type(pair[0]) in (str, int) for pair in body)
    if tag == "tensor":
        return isinstance(body, str) and node.get("numpy", True) is True
    value = node.get("value")
    if isinstance(value, dict) and set(value) == {"float"} and _valid("float", value):
        value = build(value, "", no_tensor)
    if not (isinstance(body, str) and body in _numpy_names() and type(value) in (bool, int, float)):
        return False
    try:
        np.dtype(body).type(value)  # an int out of the type's range, say
    except (OverflowError, ValueError, TypeError):
        return False
    return True


def _numpy_names() -> set[str]:
    """The numpy scalar types kept: bool, the ints and the floats up to float64 (a Python float)."""
    return {np.dtype(code).name for code in "?bhilqBHILQefd"}


def as_tensor(tree: Node, where: str, prefix: str = "") -> Any:
    """The entry that keeps ``tree`` on a server: a 1-D uint8 tensor of its document."""
    return torch.frombuffer(bytearray(encode(tree, where, prefix)), dtype=torch.uint8)


def of_tensor(tensor: Any, where: str) -> Node:
    """The tree an entry keeps (:func:`as_tensor`), checked; FormatError for anything else."""
    if tensor.dtype != torch.uint8 or tensor.dim() != 1:
        raise FormatError(f"{where}: {tensor.dtype} {list(tensor.shape)} is not a document of plain values "
                          "(a 1-D uint8 tensor)")
    if tensor.numel() > MAX_BYTES:
        raise FormatError(f"{where}: {tensor.numel()} bytes of plain values, over the bound of {MAX_BYTES}")
    return decode(tensor.cpu().numpy().tobytes(), where)


__all__ = ["FORMAT", "MAX_BYTES", "MAX_DEPTH", "MAX_INT_BITS", "VERSION", "as_tensor", "decode", "encode", "of_tensor",
           "split"]
