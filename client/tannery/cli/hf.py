"""Hugging Face checkpoint folders: ``model.safetensors.index.json`` and its shards
(``model-00001-of-00004.safetensors``, ...), or a single ``model.safetensors``.

:func:`read_folder` checks a folder's index against its shards and gives one archive of
every tensor, each shard memory-mapped (a tensor's bytes are read as it is sent: pushing a
checkpoint does not load it in memory). :func:`plan_shards` splits an archive's entries
into shards under a maximum size, as ``transformers`` does (whole entries, in name order,
a shard over the maximum only when one entry is), and :class:`ShardedWriter` writes them
with their index while the entries arrive.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tannery_protocol import codec
from tannery.archive import Archive
from tannery.formats.atomic import Replacement
from tannery.formats.files import load_safetensors
from tannery.dataplane.readers import TensorPiece
from tannery.formats.safetensors_format import CODES, read_layout
from .checkpoint_writer import CheckpointWriter
from .errors import CommandError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
#: What ``transformers`` names the shards of an N-shard checkpoint.
SHARD = "model-{:05d}-of-{:05d}.safetensors"
#: ``save_pretrained``'s default maximum shard size.
DEFAULT_MAX_SHARD = "5GB"

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}


def parse_size(text: str) -> int:
    """``5GB`` (10**9 bytes, as transformers counts), ``500MiB`` (2**20), ``1000`` (bytes)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = match and match.group(2).upper()
    if not match or unit not in _UNITS:
        raise CommandError(f"--max-shard-size {text!r}: not a size",
                           hint="give bytes with a unit, for example 5GB, 500MB or 2GiB")
    size = int(float(match.group(1)) * _UNITS[unit])
    if size <= 0:
        raise CommandError(f"--max-shard-size {text!r}: must be more than 0 bytes", hint="for example 5GB")
    return size


@dataclass
class Folder:
    """A checked checkpoint folder: its archive, the metadata of its shards, its shards."""

    archive: Archive
    metadata: dict[str, str]
    shards: list[Path]


def read_folder(directory: str | os.PathLike[str]) -> Folder:
    """The archive of every tensor of a Hugging Face checkpoint folder, after checking its index
    against its shards: every tensor the index names is in the shard it names, every tensor of
    a shard is in the index, and every shard it names is there. CommandError naming the
    tensor or the shard otherwise. The metadata is the first shard's ``__metadata__``."""
    directory = Path(directory)
    index_path = directory / INDEX
    if not index_path.is_file():
        if (directory / SINGLE).is_file():
            archive, metadata = read_shard(directory / SINGLE)
            return Folder(archive, metadata, [directory / SINGLE])
        raise CommandError(f"{directory}: no {INDEX} and no {SINGLE} in the folder",
                           hint="push a Hugging Face checkpoint folder (as save_pretrained writes it) or one file")
    weight_map = _weight_map(index_path)
    shards = sorted(set(weight_map.values()))
    for shard in shards:
        if not (directory / shard).is_file():
            tensors = sorted(name for name, where in weight_map.items() if where == shard)
            raise CommandError(
                f"{index_path}: the index names shard {shard!r} ({_some(tensors)}), which is not in {directory}",
                hint="download every shard the index names into the folder, or fix its weight_map")
    archives: list[Archive] = []
    metadata: dict[str, str] | None = None
    where: dict[str, str] = {}
    for shard in shards:
        archive, shard_metadata = read_shard(directory / shard)
        metadata = shard_metadata if metadata is None else metadata
        for name in archive.names():
            where[name] = shard
            named = weight_map.get(name)
            if named is None:
                raise CommandError(f"{directory / shard}: holds tensor {name!r}, which the index does not list",
                                   hint=f"add it to the weight_map of {INDEX} (or regenerate the index)")
        archives.append(archive)
    for name, shard in sorted(weight_map.items()):
        found = where.get(name)
        if found is None:
            raise CommandError(f"{index_path}: the index puts tensor {name!r} in {shard!r}, which does not hold it "
                               "(nor does any other shard)",
                               hint=f"remove it from the weight_map of {INDEX}, or download the right shard")
        if found != shard:
            raise CommandError(f"{index_path}: the index puts tensor {name!r} in {shard!r}, but it is in {found!r}",
                               hint=f"fix the weight_map of {INDEX} (or regenerate the index)")
    return Folder(Archive.union(archives), metadata or {}, [directory / shard for shard in shards])


def read_shard(path: Path) -> tuple[Archive, dict[str, str]]:
    """A safetensors file memory-mapped, and its ``__metadata__`` but the plain values kept there
    (``P.@values``), which the archive carries itself (``tannery.plain``)."""
    from tannery.records import values_prefix

    archive = load_safetensors(path)
    metadata = read_layout(archive._map, str(path)).metadata
    return archive, {key: text for key, text in metadata.items() if values_prefix(key) is None}


def _weight_map(path: Path) -> dict[str, str]:
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise CommandError(f"{path}: not a JSON index ({exc})", hint="regenerate the index") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise CommandError(f"{path}: no weight_map object of tensor names to shard files",
                           hint='an index is {"metadata": {...}, "weight_map": {"tensor": "shard file"}}')
    for shard in set(weight_map.values()):
        if not shard or Path(shard).name != shard or shard in (".", ".."):
            raise CommandError(f"{path}: shard {shard!r} is not a file name in the folder",
                               hint="the weight_map names shard files beside the index")
    return weight_map


def _some(names: Sequence[str]) -> str:
    shown = ", ".join(map(repr, names[:3]))
    return shown + (f", ... ({len(names)} tensors)" if len(names) > 3 else "")


# -- writing --------------------------------------------------------------------------------


def entry_nbytes(entry: Any) -> int:
    """Bytes of an entry in a safetensors file (a bool is a byte)."""
    return math.prod(entry.shape) * codec.dtype_named(entry.dtype).itemsize


def plan_shards(entries: Sequence[Any], max_size: int) -> list[list[Any]]:
    """Entries in name order, grouped into shards of at most ``max_size`` tensor bytes; an
    entry larger than that has a shard of its own."""
    shards: list[list[Any]] = []
    size = 0
    for entry in sorted(entries, key=lambda e: e.name):
        nbytes = entry_nbytes(entry)
        if not shards or (shards[-1] and size + nbytes > max_size):
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes
    return shards


def shard_names(count: int) -> list[str]:
    """The files of ``count`` shards: ``model.safetensors`` alone, as transformers saves one."""
    return [SINGLE] if count == 1 else [SHARD.format(i + 1, count) for i in range(count)]


def folder_outputs(directory: Path, count: int) -> list[Path]:
    """The files a pull of ``count`` shards writes into ``directory``."""
    return [directory / name for name in shard_names(count)] + ([directory / INDEX] if count > 1 else [])


class ShardedWriter:
    """The shards of ``plan`` (:func:`plan_shards`) and their index, in ``directory``, written
    piece by piece as the entries arrive (:meth:`write`), renamed into place by :meth:`finish`
    (the index last); leaving without :meth:`finish` removes every temporary file."""

    def __init__(self, directory: Path, plan: Sequence[Sequence[Any]], metadata: Mapping[str, str]) -> None:
        self.directory = directory
        names = shard_names(len(plan))
        self._writers: list[CheckpointWriter] = []
        self._of: dict[str, CheckpointWriter] = {}
        self._weight_map: dict[str, str] = {}
        try:
            for name, entries in zip(names, plan):
                writer = CheckpointWriter(directory / name, entries, metadata=metadata)
                self._writers.append(writer)
                for entry in entries:
                    self._of[entry.name] = writer
                    self._weight_map[entry.name] = name
        except BaseException:
            self.abort()
            raise
        self._total = sum(entry_nbytes(e) for entries in plan for e in entries)
        self._index = len(plan) > 1

    def write(self, piece: TensorPiece) -> None:
        writer = self._of.get(piece.name)
        if writer is None:
            raise CommandError(f"{piece.name}: received an entry the archive's description did not have "
                               "(was the archive replaced during the pull?)")
        writer.write(piece)

    def finish(self) -> list[Path]:
        paths: list[Path] = []
        for writer in self._writers:  # every shard whole (finish checks) before any is renamed
            writer.check_complete()
        for writer in self._writers:
            paths += writer.finish()
        if self._index:
            index = {"metadata": {"total_size": self._total},
                     "weight_map": dict(sorted(self._weight_map.items()))}
            with Replacement(self.directory / INDEX) as tmp:
                tmp.write_text(json.dumps(index, indent=2, sort_keys=False) + "\n", encoding="utf-8")
            paths.append(self.directory / INDEX)
        return paths

    def abort(self) -> None:
        for writer in self._writers:
            writer.abort()

    def __enter__(self) -> "ShardedWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.abort()


def check_dtypes(directory: Path, dtypes: Sequence[str]) -> None:
    for dtype in dtypes:
        if dtype not in CODES:
            raise CommandError(f"{directory}: safetensors has no {dtype} dtype",
                               hint="pull into a .tannic pair instead (-o NAME.tannic)")


__all__ = ["DEFAULT_MAX_SHARD", "INDEX", "Folder", "ShardedWriter", "folder_outputs", "parse_size", "plan_shards",
           "read_folder", "shard_names"]
