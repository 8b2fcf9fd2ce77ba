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
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from tannery_protocol import codec
from tannery_protocol._lazy import lazy_module
from tannery_protocol.errors import ArchiveError, FormatError
from tannery_protocol.names import join, owns
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
#: A JSON-able node of a tree (see the module's docstring).
Node = Any

_SCALARS = (type(None), bool, int, float, str)
_TAGS = {"float": {"float"}, "tuple": {"tuple"}, "dict": {"dict"}, "tensor": {"tensor", "numpy"},
         "numpy": {"numpy", "value"}}
_KEPT = ("None, bool, int, float, str, numpy scalars, and dicts (str or int keys), lists and tuples of them; "
         "tensors and numpy arrays become entries")


def _name(path: tuple[str, ...]) -> str:
    return join("", *path) or "the value"


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
    for sub, child in _children(node, path):
        if sub is None:
            yield len(json.dumps(child)), _name(path)
        else:
            yield from _leaf_sizes(child, sub)


def _children(node: Node, path: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...] | None, Node]]:
    """Each child of a container node with its path; a leaf node as ``(None, node)``."""
    if isinstance(node, list):
        yield from ((path + (str(i),), item) for i, item in enumerate(node))
    elif isinstance(node, dict) and "tuple" in node:
        yield from ((path + (str(i),), item) for i, item in enumerate(node["tuple"]))
    elif isinstance(node, dict) and "dict" in node:
        yield from ((path + (str(key),), item) for key, item in node["dict"])
    else:
        yield None, node


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
                          f"tannery reads (up to {VERSION}): upgrade tannery to read them")
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
        raise FormatError(f"{where}: {_name(path)}: {json.dumps(node)[:80]} is not a node of plain values")
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
        value = build(value, "", _no_tensor)
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


def tensor_names(tree: Node, prefix: str) -> list[str]:
    """The entry names of the tensors ``tree`` (kept under ``prefix``) refers to, in order."""
    names: list[str] = []

    def walk(node: Node) -> None:
        if isinstance(node, dict) and "tensor" in node:
            names.append(join(prefix, node["tensor"]) if node["tensor"] else prefix)
            return
        if isinstance(node, dict) and "numpy" in node:
            return
        for sub, child in _children(node, ()):
            if sub is not None:
                walk(child)

    walk(tree)
    return names


def build(tree: Node, prefix: str, tensor_of: Callable[[str], Any]) -> Any:
    """The value ``tree`` stands for: plain values as they were, each tensor from
    ``tensor_of(entry name)`` (a numpy array again where one was given)."""
    if tree is None or type(tree) in (bool, int, float, str):
        return tree
    if isinstance(tree, list):
        return [build(item, prefix, tensor_of) for item in tree]
    if "float" in tree:
        return struct.unpack(">d", bytes.fromhex(tree["float"]))[0]
    if "tuple" in tree:
        return tuple(build(item, prefix, tensor_of) for item in tree["tuple"])
    if "dict" in tree:
        return {key: build(item, prefix, tensor_of) for key, item in tree["dict"]}
    if "tensor" in tree:
        tensor = tensor_of(join(prefix, tree["tensor"]) if tree["tensor"] else prefix)
        return _as_numpy(tensor) if tree.get("numpy") else tensor
    return np.dtype(tree["numpy"]).type(build(tree["value"], prefix, tensor_of))


def _as_numpy(tensor: Any) -> Any:
    """A tensor as the numpy array it was given as (ml_dtypes' types through their bits)."""
    from tannery.torch import codec_dtype

    dtype = codec_dtype(tensor.dtype)
    tensor = tensor.cpu()
    if dtype.name in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        bits = {1: torch.uint8, 2: torch.int16}[dtype.itemsize]
        return tensor.view(bits).numpy().view(dtype.numpy)
    return tensor.numpy()


def at(tree: Node, keys: tuple[Any, ...]) -> tuple[bool, Node]:
    """``(True, node)`` at the path of typed ``keys`` (dict keys, list and tuple indices) in
    ``tree``, ``(False, None)`` where the tree holds nothing there."""
    node = tree
    for key in keys:
        if isinstance(node, dict) and "tuple" in node:
            node = node["tuple"]
        if isinstance(node, list):
            if type(key) is not int or not 0 <= key < len(node):
                return False, None
            node = node[key]
        elif isinstance(node, dict) and "dict" in node:
            found = [item for k, item in node["dict"] if k == key and type(k) is type(key)]
            if not found:
                return False, None
            node = found[0]
        else:
            return False, None
    return True, node


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


def leaf_names(tree: Node, prefix: str) -> Iterator[str]:
    """The entry-like name of each plain leaf of ``tree`` kept under ``prefix``."""
    if isinstance(tree, dict) and "tensor" in tree:
        return
    children = list(_children(tree, ()))
    if isinstance(tree, dict) and "numpy" in tree or children == [(None, tree)]:
        yield prefix
        return
    for sub, child in children:
        yield from leaf_names(child, join(prefix, *sub[-1:]))


def check_clash(trees: Mapping[str, Node], tensors: Iterable[str], where: str) -> None:
    """ValueError when a plain value of ``trees`` is named like a tensor of ``tensors``."""
    names = set(tensors)
    for at_prefix, tree in trees.items():
        clash = next((name for name in leaf_names(tree, at_prefix) if name in names), None)
        if clash is not None:
            raise ValueError(f"{where}: {clash}: a tensor and a plain value have this name; rename one")


def filler(trees: Mapping[str, Node], prefix: str) -> Callable[[tuple[str, ...], tuple[Any, ...], Any], Any]:
    """For :func:`tannery.values.rebuild`: a like's leaf at ``(path, keys)`` under ``prefix``
    replaced by the plain value ``trees`` keep there (one free of tensors), or left as it is."""
    def fill(path: tuple[str, ...], keys: tuple[Any, ...], leaf: Any) -> Any:
        for depth in range(len(path) + 1):
            at_prefix = join(prefix, *path[:depth])
            if at_prefix not in trees:
                continue
            found, node = at(trees[at_prefix], keys[depth:])
            if found and not tensor_names(node, ""):
                return build(node, "", _no_tensor)
        return leaf

    return fill


def _no_tensor(name: str) -> Any:
    raise AssertionError(f"{name}: no tensor is read here")


def owned_trees(trees: Mapping[str, Node], prefix: str) -> dict[str, Node]:
    """The trees kept under ``prefix`` or a prefix it owns, and the part under ``prefix`` of a
    tree kept under a shorter one (``optim`` of a whole training state), by their prefixes."""
    owned = {at_prefix: tree for at_prefix, tree in trees.items() if owns(prefix, at_prefix)}
    for at_prefix, tree in trees.items():
        if at_prefix != prefix and owns(at_prefix, prefix):
            found = _part(tree, at_prefix, prefix)
            if found is not None:
                owned[prefix] = found
    return owned


def _part(tree: Node, at_prefix: str, prefix: str) -> Node | None:
    """The node of ``tree`` (kept under ``at_prefix``) whose name is ``prefix``, its tensors
    named again under ``prefix``; None when the tree has no container or leaf of that name."""
    stack = [((), tree)]
    while stack:
        path, node = stack.pop()
        name = join(at_prefix, *path)
        if name == prefix:
            return _renamed(node, len(join("", *path)) + 1 if path else 0)
        if owns(name, prefix):
            stack.extend((sub, child) for sub, child in _children(node, path) if sub is not None)
    return None


def _renamed(node: Node, cut: int) -> Node:
    """``node`` with each tensor's name cut by its first ``cut`` characters (the path above it)."""
    if isinstance(node, dict) and "tensor" in node:
        return {**node, "tensor": node["tensor"][cut:]}
    if isinstance(node, list):
        return [_renamed(item, cut) for item in node]
    if isinstance(node, dict) and "tuple" in node:
        return {"tuple": [_renamed(item, cut) for item in node["tuple"]]}
    if isinstance(node, dict) and "dict" in node:
        return {"dict": [[key, _renamed(item, cut)] for key, item in node["dict"]]}
    return node


__all__ = [
    "FORMAT", "MAX_BYTES", "MAX_DEPTH", "MAX_INT_BITS", "VERSION", "Node", "as_tensor", "at", "build", "check_clash",
    "decode", "encode", "filler", "leaf_names", "of_tensor", "owned_trees", "split", "tensor_names",
]
