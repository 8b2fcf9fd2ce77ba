"""The plain values kept with an archive, as the commands show and pull them: their documents'
bytes fetched as raw pieces (no torch: ``tannery show`` stays torch-free), their trees, their lines."""

from __future__ import annotations

from typing import Any

from tannery import plain, plain_trees
from tannery_protocol.names import join, owns


def kept_values(description: Any, prefix: str = "") -> list[Any]:
    """The plain values a described archive keeps under ``prefix`` (or a prefix it owns)."""
    return [kept for kept in getattr(description, "values", ()) if owns(prefix, kept.prefix)]


def documents(client: Any, name: str, kept: list[Any]) -> dict[str, bytes]:
    """The document of each of ``kept`` (``tannery.records.ValuesDescription``), by its prefix, in one Fetch."""
    if not kept:
        return {}
    prefixes = {value.entry: value.prefix for value in kept}
    chunks: dict[str, list[bytes]] = {entry: [] for entry in prefixes}
    for piece in client.fetch_pieces(name, names=list(prefixes)):
        chunks[piece.name].append(bytes(piece.data))
    return {prefixes[entry]: b"".join(parts) for entry, parts in chunks.items()}


def trees(client: Any, name: str, kept: list[Any]) -> dict[str, plain_trees.Node]:
    """The trees of ``kept``, each checked (FormatError for a damaged or newer document)."""
    return {prefix: plain.decode(data, f"{name}: plain values under {prefix!r}")
            for prefix, data in documents(client, name, kept).items()}


def as_metadata(client: Any, name: str, kept: list[Any]) -> dict[str, str]:
    """The documents of ``kept`` as a safetensors file's metadata: each under its key ``P.@values``,
    as ``tannery.save_safetensors`` writes them, checked first."""
    from tannery.records import values_entry

    documents_ = documents(client, name, kept)
    for prefix, data in documents_.items():
        plain.decode(data, f"{name}: plain values under {prefix!r}")
    return {values_entry(prefix): data.decode("ascii") for prefix, data in documents_.items()}


def render(node: plain_trees.Node, prefix: str = "", limit: int = 100) -> str:
    """``node`` (kept under ``prefix``) as Python would print its value, tensors as ``<tensor NAME>`` by
    their entry names, cut to about
    ``limit`` characters with ``...`` (what ``tannery show`` prints; no tensor is read)."""
    parts: list[str] = []
    size = 0

    def put(text: str) -> None:
        nonlocal size
        if size <= limit:
            parts.append(text)
        size += len(text)

    def walk(node: plain_trees.Node) -> None:
        if size > limit:
            return
        if isinstance(node, list) or isinstance(node, dict) and "tuple" in node:
            items = node if isinstance(node, list) else node["tuple"]
            put("[" if isinstance(node, list) else "(")
            for i, item in enumerate(items):
                put(", " if i else "")
                walk(item)
            put("]" if isinstance(node, list) else ("," if len(items) == 1 else "") + ")")
        elif isinstance(node, dict) and "dict" in node:
            put("{")
            for i, (key, item) in enumerate(node["dict"]):
                put((", " if i else "") + repr(key) + ": ")
                walk(item)
            put("}")
        elif isinstance(node, dict) and "tensor" in node:
            put(f"<{'numpy array' if node.get('numpy') else 'tensor'} {join(prefix, node['tensor'])}>")
        elif isinstance(node, dict) and "numpy" in node:
            put(f"np.{node['numpy']}({plain_trees.build(node['value'], '', plain_trees.no_tensor)!r})")
        else:
            put(repr(plain_trees.build(node, "", plain_trees.no_tensor)))

    walk(node)
    text = "".join(parts)
    return text if size <= limit else text[:limit] + "..."


def lines(kept: dict[str, plain_trees.Node]) -> list[str]:
    """``show``'s lines: under each prefix, each top-level item of the value, cut short."""
    out: list[str] = []
    for prefix, tree in sorted(kept.items()):
        items = tree["dict"] if isinstance(tree, dict) and "dict" in tree else [[None, tree]]
        out.append(f"plain values{f' under {prefix!r}' if prefix else ''}:")
        out.extend(f"  {'' if key is None else f'{key!r}: '}{render(item, prefix)}" for key, item in items)
    return out


__all__ = ["as_metadata", "documents", "kept_values", "lines", "render", "trees"]
