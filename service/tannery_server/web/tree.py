"""An archive's entries as a tree by their dotted names, and its parameter counts.

``model.layers.0.attn.q.weight`` sits under ``model`` > ``layers`` > ``0`` > ``attn`` > ``q``.
The tree is laid out flat (:func:`rows`): one row per node opened, per entry, and per node
closed, so the page renders it in one loop, without recursion, for archives of any depth.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Iterator

from ..storage import EntryRecord


def numel(entry: EntryRecord) -> int:
    """How many elements (parameters) an entry holds."""
    return math.prod(entry.shape)


@dataclass
class Node:
    """A name prefix: its children by the next part of the name, its entries, and their totals."""

    name: str
    path: str
    children: dict[str, "Node"] = field(default_factory=dict)
    entries: list[EntryRecord] = field(default_factory=list)
    entry_count: int = 0
    params: int = 0
    nbytes: int = 0


@dataclass(frozen=True)
class Row:
    """One row of the flat tree: ``kind`` is ``open`` (a node: ``node``), ``leaf`` (an entry:
    ``entry``, shown by ``label``, its name past the node's) or ``close``."""

    kind: str
    depth: int
    node: Node | None = None
    entry: EntryRecord | None = None
    label: str = ""
    params: int = 0
    #: An ``open`` row whose content is not in the page: it is fetched when the node is opened.
    lazy: bool = False


def build(entries: Iterable[EntryRecord]) -> Node:
    """The tree of ``entries``: a node for each dotted prefix shared by at least one entry."""
    root = Node("", "")
    for entry in entries:
        parts = entry.name.split(".")
        count = numel(entry)
        node = root
        node.entry_count += 1
        node.params += count
        node.nbytes += entry.nbytes
        for part in parts[:-1]:
            child = node.children.get(part)
            if child is None:
                child = node.children[part] = Node(part, f"{node.path}.{part}" if node.path else part)
            node = child
            node.entry_count += 1
            node.params += count
            node.nbytes += entry.nbytes
        node.entries.append(entry)
    return root


def rows(root: Node, lazy_from: int | None = None) -> Iterator[Row]:
    """The rows of the tree under ``root`` in name order, nodes before entries at each level;
    a node whose only content is one node is merged with it (``a.b`` rather than ``a`` > ``b``).
    ``lazy_from``: nodes this deep or deeper come without their content (``lazy`` rows, closed
    at once), which the page fetches when one is opened (None: every node with its content)."""
    stack: list[Iterator[Row]] = [_level(root, 0)]
    while stack:
        row = next(stack[-1], None)
        if row is None:
            stack.pop()
            if stack:
                yield Row("close", len(stack) - 1)
            continue
        if row.kind == "open" and lazy_from is not None and row.depth >= lazy_from:
            yield Row("open", row.depth, row.node, label=row.label, params=row.params, lazy=True)
            yield Row("close", row.depth)
            continue
        yield row
        if row.kind == "open":
            assert row.node is not None
            stack.append(_level(row.node, row.depth + 1))


def _level(node: Node, depth: int) -> Iterator[Row]:
    """The rows of one level: its nodes (each opened, merged down single-node chains), then its
    entries, with those of nodes that hold one entry and nothing else (``3.weight``, not ``3`` > ``weight``)."""
    leaves = list(node.entries)
    for child in sorted(node.children.values(), key=lambda n: _order(n.name)):
        label = child.name
        while len(child.children) == 1 and not child.entries:
            child = next(iter(child.children.values()))
            label += "." + child.name
        if not child.children and len(child.entries) == 1:
            leaves.append(child.entries[0])
            continue
        yield Row("open", depth, child, label=label, params=child.params)
    for entry in sorted(leaves, key=lambda e: _order(e.name)):
        label = entry.name[len(node.path) + 1:] if node.path else entry.name
        yield Row("leaf", depth, entry=entry, label=label, params=numel(entry))


def find(root: Node, path: str) -> Node | None:
    """The node of dotted ``path`` in the tree (None when no entry is under it)."""
    node: Node | None = root
    for part in path.split("."):
        node = node.children.get(part) if node is not None else None
    return node


def _order(name: str) -> tuple:
    """Sort key of a name part: numbers by value (``layers.2`` before ``layers.10``), then text."""
    parts = name.split(".")
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in parts)


def params_by_dtype(entries: Iterable[EntryRecord]) -> dict[str, tuple[int, int]]:
    """Parameters and tensor bytes per dtype, largest first: ``{dtype: (params, nbytes)}``."""
    totals: dict[str, list[int]] = {}
    for entry in entries:
        total = totals.setdefault(entry.dtype, [0, 0])
        total[0] += numel(entry)
        total[1] += entry.nbytes
    return {d: (p, b) for d, (p, b) in sorted(totals.items(), key=lambda kv: (-kv[1][0], kv[0]))}
