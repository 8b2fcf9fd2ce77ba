"""What is read from a tree of plain values (:mod:`tannery.plain`): the value it stands for
(:func:`build`), the tensors it refers to, its parts by path or by prefix, the names of its plain
leaves, and a like's leaves filled from it. Nodes are JSON-able and already checked; nothing here
reads or writes a document.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from tannery_protocol._lazy import lazy_module
from tannery_protocol.names import join, owns

np = lazy_module("numpy")
torch = lazy_module("torch")

#: A JSON-able node of a tree (see :mod:`tannery.plain`).
Node = Any


def path_name(path: tuple[str, ...]) -> str:
    return join("", *path) or "the value"


def children(node: Node, path: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...] | None, Node]]:
    """Each child of a container node with its path; a leaf node as ``(None, node)``."""
    if isinstance(node, list):
        yield from ((path + (str(i),), item) for i, item in enumerate(node))
    elif isinstance(node, dict) and "tuple" in node:
        yield from ((path + (str(i),), item) for i, item in enumerate(node["tuple"]))
    elif isinstance(node, dict) and "dict" in node:
        yield from ((path + (str(key),), item) for key, item in node["dict"])
    else:
        yield None, node


def tensor_names(tree: Node, prefix: str) -> list[str]:
    """The entry names of the tensors ``tree`` (kept under ``prefix``) refers to, in order."""
    names: list[str] = []

    def walk(node: Node) -> None:
        if isinstance(node, dict) and "tensor" in node:
            names.append(join(prefix, node["tensor"]) if node["tensor"] else prefix)
            return
        if isinstance(node, dict) and "numpy" in node:
            return
        for sub, child in children(node, ()):
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


def leaf_names(tree: Node, prefix: str) -> Iterator[str]:
    """The entry-like name of each plain leaf of ``tree`` kept under ``prefix``."""
    if isinstance(tree, dict) and "tensor" in tree:
        return
    items = list(children(tree, ()))
    if isinstance(tree, dict) and "numpy" in tree or items == [(None, tree)]:
        yield prefix
        return
    for sub, child in items:
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
                return build(node, "", no_tensor)
        return leaf

    return fill


def no_tensor(name: str) -> Any:
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
            stack.extend((sub, child) for sub, child in children(node, path) if sub is not None)
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


__all__ = ["Node", "at", "build", "check_clash", "children", "filler", "leaf_names", "no_tensor", "owned_trees",
           "path_name", "tensor_names"]
