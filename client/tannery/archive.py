"""Archives: immutable collections of named tensors, strict on read.

:class:`Archive` is the read interface, with every check and every error message. Its
kinds implement three hooks only: ``_names`` (the sorted names), ``_info`` (an entry's
dtype, shape and size, from metadata only) and ``_fetch`` (several entries at once, so
that a remote archive answers ``to_value`` in one call); ``_cast`` is optional. Here
are the in-memory kind (:meth:`Archive.of_list`, :meth:`Archive.of_value`) and the
union (:meth:`Archive.union`); ``tannery.formats.files`` has the memory-mapped one, and
``tannery.remote`` the server's. The values archives are made of and filled into (tensors,
nested structures of them, their names) are :mod:`tannery.values`.

A mismatch between an archive and what is asked of it is an :class:`ArchiveError`
that names the entry, raised before any entry is read. Messages print shapes as
Python lists and dtypes by their short names (``float32``).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tannery_protocol import mismatches
from tannery_protocol._lazy import lazy_module
from tannery_protocol.codec import FLOAT_NAMES, format_shape
from tannery_protocol.errors import ArchiveError
from tannery_protocol.names import did_you_mean, join, owned, owns
from tannery import plain, plain_trees
from tannery.values import (
    DTypeLike, TensorLike, as_tensor, dtype_name, is_tensor_leaf, leaf_dtype, named_leaves, rebuild,
)

# Imported on first use: listing or describing archives never imports torch.
torch = lazy_module("torch")
torch_codec = lazy_module("tannery.torch")

@dataclass(frozen=True)
class TensorInfo:
    """What an archive's metadata says of one entry's tensor: dtype name, shape and size in bytes.

    ``nbytes`` is the size of the elements where they are stored (booleans are
    bit-packed in .tannic files and tannic payloads, one byte each elsewhere).
    """

    dtype: str
    shape: tuple[int, ...]
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def __str__(self) -> str:
        return f"{self.dtype} {format_shape(self.shape)}"

    def __repr__(self) -> str:
        return f"TensorInfo({self.dtype} {format_shape(self.shape)}, {self.nbytes} bytes)"


def _shape(shape: Sequence[int], where: str) -> tuple[int, ...]:
    try:
        return tuple(int(d) for d in shape)
    except TypeError:
        raise TypeError(f"{where}: a shape is a sequence of ints, not {type(shape).__name__}") from None


def _check_name(name: object, where: str) -> str:
    if not isinstance(name, str):
        raise TypeError(f"{where}: an entry name is a str, not {type(name).__name__}")
    return name


class Archive(ABC):
    """An immutable collection of tensors with distinct, non-empty names.

    Build one with :meth:`of_list`, :meth:`of_value` or :meth:`union`, or load one
    from a file (``tannery.load_safetensors``, ``tannery.load_tannic``). Asking for an
    entry checks its name, shape and dtype against the archive's metadata first, and
    raises :class:`ArchiveError` naming the entry on a mismatch.

    Subclasses implement ``_names``, ``_info`` and ``_fetch`` (and may override
    ``_cast``); everything else, checks and messages included, is here.
    """

    __slots__ = ()

    # -- what a kind of archive implements -------------------------------------------

    @abstractmethod
    def _names(self) -> Sequence[str]:
        """Every entry's name, sorted and distinct (the archive is immutable: cache it)."""

    @abstractmethod
    def _info(self, name: str) -> TensorInfo | None:
        """An entry's dtype, shape and size from metadata only; None when there is none."""

    @abstractmethod
    def _fetch(self, names: Sequence[str]) -> list[torch.Tensor]:
        """The entries of ``names`` as stored, in order. Every name is known to be present."""

    def _cast(self, name: str, dtype: str) -> torch.Tensor:
        """Entry ``name`` cast to the float dtype ``dtype``, a new tensor (a remote archive
        may have its server cast)."""
        return self._fetch([name])[0].to(torch_codec.torch_dtype(dtype))

    def _plain(self) -> Mapping[str, plain_trees.Node]:
        """The plain values kept with the archive: a tree (:mod:`tannery.plain`) by the prefix
        it was given under; none by default."""
        return {}

    # -- building ------------------------------------------------------------------------

    @staticmethod
    def of_list(entries: Iterable[tuple[str, TensorLike]] | Mapping[str, TensorLike]) -> Archive:
        """An archive of ``(name, tensor)`` pairs or of a mapping; nothing is copied."""
        where = "Archive.of_list"
        pairs = entries.items() if isinstance(entries, Mapping) else entries
        tensors: dict[str, torch.Tensor] = {}
        for name, tensor in pairs:
            _check_name(name, where)
            if not name:
                raise ValueError(f"{where}: an empty name")
            if name in tensors:
                raise ValueError(f"{where}: {name!r} is named twice")
            tensors[name] = as_tensor(tensor, name, where)
        return MemoryArchive(tensors)

    @staticmethod
    def of_value(value: Any, prefix: str = "", *, skip_non_tensors: bool = False) -> Archive:
        """One entry per tensor of a structure of nested dicts, lists and tuples, and its
        plain values (None, bool, int, float, str, numpy scalars) kept beside them.

        Each tensor is named by its path under ``prefix`` (``"model.blocks.0.w"``); the plain
        values keep their types exactly (a tuple stays a tuple, an int key an int, a float its
        bits: :mod:`tannery.plain`), and :meth:`to_value` gives the whole structure back. Any
        other leaf (an object, a function) is refused with a TypeError naming its path, and so
        is a key neither str nor int. With ``skip_non_tensors``, every leaf that is not a
        tensor is left out instead (and :meth:`to_value` puts back the like's own). Nothing
        is copied.
        """
        return archive_of_value(value, prefix, skip_non_tensors, "Archive.of_value")

    @staticmethod
    def union(archives: Iterable[Archive]) -> Archive:
        """The entries of all of ``archives``, none of them read; ValueError for a name in two."""
        sources: dict[str, Archive] = {}
        trees: dict[str, plain_trees.Node] = {}
        for archive in archives:
            if not isinstance(archive, Archive):
                raise TypeError(f"Archive.union: {type(archive).__name__} is not an Archive")
            for name, source in _sources_of(archive):
                if name in sources:
                    raise ValueError(f"Archive.union: {name!r} is in two archives")
                sources[name] = source
            for at_prefix, tree in archive._plain().items():
                held = next((other for other in trees if owns(other, at_prefix) or owns(at_prefix, other)), None)
                if held is not None:
                    raise ValueError(f"Archive.union: plain values kept under {held!r} and under {at_prefix!r}: "
                                     "one would hold the other; union archives whose values lie apart")
                trees[at_prefix] = tree
        plain_trees.check_clash(trees, sources, "Archive.union")
        return UnionArchive(sources, trees)

    # -- reading -------------------------------------------------------------------------

    def names(self) -> list[str]:
        """Every entry's name, sorted."""
        return list(self._names())

    def __len__(self) -> int:
        return len(self._names())

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self._info(name) is not None

    def info(self, name: str) -> TensorInfo:
        """An entry's dtype, shape and size, from metadata only; ArchiveError when absent."""
        return self._lookup("Archive.info", name)

    def find(self, name: str) -> torch.Tensor | None:
        """The entry ``name`` as stored, or None when there is none."""
        if self._info(_check_name(name, "Archive.find")) is None:
            return None
        return self._fetch([name])[0]

    def tensor(self, name: str, shape: Sequence[int], dtype: DTypeLike) -> torch.Tensor:
        """The entry ``name`` as stored, after checking it has ``shape`` and ``dtype``."""
        where = "Archive.tensor"
        shape, dtype = _shape(shape, where), dtype_name(dtype)
        info = self._lookup(where, name, shape)
        if info.dtype != dtype:
            raise ArchiveError(mismatches.dtype_differs(where, name, info.dtype, dtype))
        return self._fetch([name])[0]

    def float(self, name: str, shape: Sequence[int], dtype: DTypeLike) -> torch.Tensor:
        """The entry ``name`` of ``shape`` at ``dtype``, one of float16, bfloat16, float32, float64.

        The entry itself when it already has that dtype, otherwise its cast: a new
        tensor on each call (and the only method that reads to answer). The entry
        must itself have one of those four dtypes.
        """
        where = "Archive.float"
        shape, dtype = _shape(shape, where), dtype_name(dtype)
        if dtype not in FLOAT_NAMES:
            raise ValueError(f"{where}: {dtype} is not {mismatches.FLOATS_TEXT}")
        info = self._lookup(where, name, shape)
        if info.dtype not in FLOAT_NAMES:
            raise ArchiveError(mismatches.not_float(where, name, info.dtype))
        if info.dtype == dtype:
            return self._fetch([name])[0]
        return self._cast(name, dtype)

    def to_value(self, like: Any = None, prefix: str = "") -> Any:
        """The value stored under ``prefix``: without ``like``, rebuilt whole; with it, ``like``
        with each tensor replaced by the archive's entry of its name.

        Without ``like``, the structure kept under ``prefix`` (dicts, lists, tuples, plain
        values and tensors where each was: :meth:`of_value`), or the part of one that
        ``prefix`` names (``"optim"`` of a whole training state), comes back as it was, its
        tensors as stored (numpy arrays where numpy arrays were given). An archive that keeps no
        structure there (tensors alone) gives a dict of each entry ``prefix`` owns by its
        name under ``prefix``, and of each structure kept under a longer prefix.

        With ``like``, ``like`` gives the structure, every dtype and shape; its tensors'
        elements are not read. Each entry is moved to the device of ``like``'s tensor (kept
        where it is when that is the meta device). The entries ``prefix`` owns must be exactly
        ``like``'s tensor leaves; others are ignored. Each other leaf of ``like`` takes the
        plain value kept at its path, and stays ``like``'s own where none is. Everything is
        checked before any entry is read.
        """
        where = "Archive.to_value"
        if like is None:
            return self._rebuilt(prefix, where)
        leaves = named_leaves(like, prefix, where)
        for name, leaf in leaves.items():
            info = self._info(name)
            if info is None:
                leaf_only = f", a leaf in the value{did_you_mean(name, self._names())}"
                raise ArchiveError(mismatches.no_entry(where, name, leaf_only))
            shape = tuple(leaf.shape)
            if info.shape != shape:
                raise ArchiveError(mismatches.shape_differs(where, name, info.shape, shape, by="in the value"))
            if info.dtype != leaf_dtype(leaf):
                raise ArchiveError(
                    mismatches.dtype_differs(where, name, info.dtype, leaf_dtype(leaf), by="in the value"))
        for name in owned(prefix, self._names()):
            if name not in leaves:
                raise ArchiveError(f"{where}: {name}: an entry in the archive, no leaf in the value")
        names = list(leaves)
        entries = dict(zip(names, self._fetch(names))) if names else {}

        def replace(path: tuple[str, ...], leaf: TensorLike) -> torch.Tensor:
            entry = entries[join(prefix, *path)]
            device = leaf.device if isinstance(leaf, torch.Tensor) else torch.device("cpu")
            return entry if device.type == "meta" else entry.to(device)

        trees = plain_trees.owned_trees(self._plain(), prefix)
        return rebuild(like, (), replace, plain_trees.filler(trees, prefix) if trees else None)

    def _rebuilt(self, prefix: str, where: str) -> Any:
        """The value kept under ``prefix``, without a like (see :meth:`to_value`)."""
        trees = plain_trees.owned_trees(self._plain(), prefix)
        referred = {name: at_prefix for at_prefix, tree in trees.items()
                    for name in plain_trees.tensor_names(tree, at_prefix)}
        for name, at_prefix in referred.items():
            if self._info(name) is None:
                raise ArchiveError(f"{where}: {name}: the structure kept under {at_prefix!r} holds this tensor, "
                                   "but the archive has no such entry (was it stored in part?)")
        loose = [name for name in owned(prefix, self._names()) if name not in referred]
        if prefix in trees and loose:
            raise ArchiveError(f"{where}: {loose[0]}: an entry in the archive, not in the structure kept under "
                               f"{prefix!r}; give a like, or a prefix that owns the structure alone")
        names = list(referred) + loose
        entries = dict(zip(names, self._fetch(names))) if names else {}
        if prefix in trees:
            return plain_trees.build(trees[prefix], prefix, entries.__getitem__)
        if loose == [prefix] and not trees:
            return entries[prefix]
        under = len(prefix) + 1 if prefix else 0
        value: dict[str, Any] = {name[under:]: entries[name] for name in loose}
        for at_prefix, tree in sorted(trees.items()):
            value[at_prefix[under:]] = plain_trees.build(tree, at_prefix, entries.__getitem__)
        return value

    def _lookup(self, where: str, name: str, shape: tuple[int, ...] | None = None) -> TensorInfo:
        """The entry's info, checked to exist (and to have ``shape`` when given)."""
        info = self._info(_check_name(name, where))
        if info is None:
            raise ArchiveError(mismatches.no_entry(where, name, did_you_mean(name, self._names())))
        if shape is not None and info.shape != shape:
            raise ArchiveError(mismatches.shape_differs(where, name, info.shape, shape))
        return info

    def __repr__(self) -> str:
        names = self._names()
        shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
        return f"<{type(self).__name__} of {len(names)} entries: {shown}>" if names else f"<empty {type(self).__name__}>"


def archive_of_value(value: Any, prefix: str, skip_non_tensors: bool, where: str) -> Archive:
    """:meth:`Archive.of_value`, its messages prefixed by ``where`` (``Client.store`` says its own)."""
    if skip_non_tensors:
        leaves, trees = named_leaves(value, prefix, where), {}
    else:
        leaves, trees = plain.split(value, prefix, where)
    return MemoryArchive({name: as_tensor(leaf, name, where) for name, leaf in leaves.items()}, trees)


def tensor_info(tensor: torch.Tensor) -> TensorInfo:
    """The info of a tensor held in memory."""
    return TensorInfo(torch_codec.short_name(tensor.dtype), tuple(tensor.shape), tensor.numel() * tensor.element_size())


class _KeyedArchive(Archive):
    """A kind whose entries are the keys of one mapping, their names sorted once."""

    __slots__ = ("_sorted",)

    def __init__(self, names: Iterable[str]) -> None:
        self._sorted = tuple(sorted(names))

    def _names(self) -> Sequence[str]:
        return self._sorted


class MemoryArchive(_KeyedArchive):
    """An archive of tensors held in memory (the caller's own tensors: nothing is copied),
    and of the plain values kept beside them (trees by prefix, :mod:`tannery.plain`)."""

    __slots__ = ("_tensors", "_trees")

    def __init__(self, tensors: Mapping[str, torch.Tensor], trees: Mapping[str, plain_trees.Node] | None = None) -> None:
        self._tensors = dict(tensors)
        self._trees = dict(trees or {})
        super().__init__(self._tensors)

    def _plain(self) -> Mapping[str, plain_trees.Node]:
        return self._trees

    def _info(self, name: str) -> TensorInfo | None:
        tensor = self._tensors.get(name)
        return None if tensor is None else tensor_info(tensor)

    def _fetch(self, names: Sequence[str]) -> list[torch.Tensor]:
        return [self._tensors[name] for name in names]


class IndexedArchive(_KeyedArchive):
    """An archive that knows its entries from an index of records carrying an ``info``
    (a file's layout, a server's description): names and infos come from the index."""

    __slots__ = ("_entries",)

    def __init__(self, entries: Mapping[str, Any]) -> None:
        self._entries = dict(entries)
        super().__init__(self._entries)

    def _info(self, name: str) -> TensorInfo | None:
        entry = self._entries.get(name)
        return None if entry is None else entry.info


class UnionArchive(_KeyedArchive):
    """The entries of several archives, each still held (and read) by its own archive, and
    their plain values."""

    __slots__ = ("_sources", "_trees")

    def __init__(self, sources: Mapping[str, Archive], trees: Mapping[str, plain_trees.Node] | None = None) -> None:
        self._sources = dict(sources)
        self._trees = dict(trees or {})
        super().__init__(self._sources)

    def _plain(self) -> Mapping[str, plain_trees.Node]:
        return self._trees

    def _info(self, name: str) -> TensorInfo | None:
        source = self._sources.get(name)
        return None if source is None else source._info(name)

    def _fetch(self, names: Sequence[str]) -> list[torch.Tensor]:
        # One fetch per source archive, so a remote one answers in one call.
        groups: dict[int, tuple[Archive, list[int]]] = {}
        for index, name in enumerate(names):
            source = self._sources[name]
            groups.setdefault(id(source), (source, []))[1].append(index)
        tensors: list[torch.Tensor | None] = [None] * len(names)
        for source, indices in groups.values():
            for index, tensor in zip(indices, source._fetch([names[i] for i in indices])):
                tensors[index] = tensor
        return tensors  # type: ignore[return-value]

    def _cast(self, name: str, dtype: str) -> torch.Tensor:
        return self._sources[name]._cast(name, dtype)


def _sources_of(archive: Archive) -> Iterable[tuple[str, Archive]]:
    """Each entry name of ``archive`` with the archive that holds it (a union's sources, flattened)."""
    if isinstance(archive, UnionArchive):
        return archive._sources.items()
    return ((name, archive) for name in archive._names())


__all__ = [
    "Archive",
    "ArchiveError",
    "DTypeLike",
    "IndexedArchive",
    "MemoryArchive",
    "TensorInfo",
    "TensorLike",
    "UnionArchive",
    "as_tensor",
    "dtype_name",
    "is_tensor_leaf",
    "join",
    "leaf_dtype",
    "named_leaves",
    "owned",
    "owns",
    "tensor_info",
]
