"""Files that appear whole or not at all: written under a temporary name, then renamed into place.

Every file tannery writes (``save_safetensors``, ``save_tannic``, ``tannery get -o``, ``tannery
pull``) goes through :class:`Replacement`, so that a reader never sees half of one and an
existing file is replaced only by a whole one. Missing parent directories are created, as
``mkdir -p`` (and as the command line does for its outputs). Nothing here imports numpy or torch.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any


class Replacement:
    """A file written at :attr:`tmp`, a hidden name beside ``path`` (one per process and thread),
    that replaces ``path`` on :meth:`commit` and is removed on :meth:`discard`.

    As a context manager it gives the temporary path and commits when the block ends
    normally, discards when it raises::

        with Replacement(path) as tmp, open(tmp, "wb") as f:
            f.write(data)
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.{threading.get_ident()}.tmp")

    def commit(self) -> None:
        """Rename the temporary file into place (removing it if that fails)."""
        try:
            os.replace(self.tmp, self.path)
        except BaseException:
            self.discard()
            raise

    def discard(self) -> None:
        """Remove the temporary file, if it is still there; ``path`` is left as it was."""
        self.tmp.unlink(missing_ok=True)

    def __enter__(self) -> Path:
        make_parents(self.path)
        return self.tmp

    def __exit__(self, kind: Any, *_: Any) -> None:
        if kind is None:
            self.commit()
        else:
            self.discard()


def make_parents(path: Path) -> None:
    """Create the missing directories above ``path`` (``mkdir -p``), so that a write into a new
    ``ckpt/`` works; one that cannot be made (a file in the way) is an OSError naming it."""
    parent = path.parent
    if parent.is_dir():
        return
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as exc:
        raise NotADirectoryError(exc.errno, "cannot make this directory: a file is in the way", str(parent)) from None


__all__ = ["Replacement", "make_parents"]
