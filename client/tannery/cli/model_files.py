"""The other files of a model folder: ``config.json``, ``generation_config.json``, the
tokenizer's files, a README: everything beside the weights that ``from_pretrained`` reads.

``tannery push DIR`` keeps them with the archive (:func:`read_files`, bounded: see
:mod:`tannery.calls.archive_files`), ``tannery pull NAME -o DIR/`` writes them back
(:func:`write_files`), and ``tannery show`` lists them (:func:`files_rows`, :func:`files_json`).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tannery.calls.archive_files import MAX_FILE_BYTES, MAX_FILES_BYTES
from tannery.formats.atomic import Replacement
from .errors import CommandError
from .output import human_size

#: What a refusal says to do.
_REMEDY = "leave it out with --exclude {name} (repeat for others), or push the weights alone with --no-files"


def read_files(directory: Path, weights: Iterable[Path], exclude: Sequence[str] = (),
               max_file: int = MAX_FILE_BYTES, max_total: int = MAX_FILES_BYTES) -> tuple[dict[str, bytes], list[str]]:
    """The folder's own files but the ``weights`` push already reads and those matching an
    ``exclude`` pattern (as the shell matches, ``*.bin``), by name; and the directories left
    out (only the folder's top-level files are kept). CommandError naming a file over
    ``max_file`` bytes, or the file at which they pass ``max_total`` in all, its size and the
    bound, before anything is read."""
    read = {Path(path).name for path in weights}
    chosen: list[tuple[str, Path, int]] = []
    skipped_dirs: list[str] = []
    total = 0
    for path in sorted(directory.iterdir()):
        name = path.name
        if name in read or any(fnmatch.fnmatchcase(name, pattern) for pattern in exclude):
            continue
        if path.is_dir():
            skipped_dirs.append(name)
            continue
        if not path.is_file():
            continue
        size = path.stat().st_size
        if size > max_file:
            raise CommandError(f"{path}: {human_size(size)} ({size} bytes), over the bound of {human_size(max_file)} "
                               "for one file kept with the weights (a model folder's small files: config, tokenizer)",
                               hint=_REMEDY.format(name=name))
        total += size
        if total > max_total:
            raise CommandError(f"{directory}: the files beside the weights pass {human_size(max_total)} in all at "
                               f"{name} ({human_size(size)}), the bound of the files kept with one archive",
                               hint=_REMEDY.format(name="'<large files>'"))
        chosen.append((name, path, size))
    return {name: path.read_bytes() for name, path, _ in chosen}, skipped_dirs


def file_outputs(directory: Path, names: Iterable[str], weights: Iterable[Path]) -> list[Path]:
    """Where a pull writes the kept files; CommandError for one a weight file of the pull would overwrite."""
    taken = {Path(path).name for path in weights}
    clash = sorted(set(names) & taken)
    if clash:
        raise CommandError(f"{directory}: the archive keeps a file named {clash[0]!r}, which the pull writes as "
                           "weights", hint="pull with --no-files, or with another --max-shard-size")
    return [directory / name for name in sorted(names)]


def write_files(directory: Path, files: Mapping[str, bytes]) -> list[Path]:
    """Each file written whole into ``directory`` (under a temporary name, then renamed)."""
    paths = []
    for name, data in sorted(files.items()):
        with Replacement(directory / name) as tmp:
            tmp.write_bytes(data)
        paths.append(directory / name)
    return paths


def kept_files(description: Any, prefix: str = "") -> list[Any]:
    """The files kept with a described archive under ``prefix`` (records of ``tannery.records.FileDescription``)."""
    return [file for file in getattr(description, "files", ()) if file.prefix == prefix]


def files_rows(description: Any) -> list[tuple[str, str]]:
    """``show``'s rows of the kept files: the name (under its prefix, ``P/NAME``) and the size."""
    return [(f"{file.prefix}/{file.name}" if file.prefix else file.name, human_size(file.size))
            for file in getattr(description, "files", ())]


def files_json(description: Any) -> list[dict[str, Any]]:
    """The kept files as ``show --json`` and ``push --json`` print them."""
    return [{"name": file.name, "prefix": file.prefix, "size": int(file.size), "digest": file.digest}
            for file in getattr(description, "files", ())]


def count(n: int) -> str:
    return f"{n} file{'' if n == 1 else 's'}"


__all__ = ["count", "file_outputs", "files_json", "files_rows", "kept_files", "read_files", "write_files"]
