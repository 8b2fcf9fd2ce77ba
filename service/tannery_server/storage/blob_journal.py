"""The blob journal: the digests of blobs that may lie in the store with no archive referencing them,
so that start-up recovery checks those alone instead of every blob and every entry.

A blob can be left so only by a run interrupted while it was in flight: sealed by a Store that
never committed, or released by a Delete (or a replacing Store or Union) whose removal of the
file never ran. Each is noted here before the step that could leave it (the rename of a sealed
blob into place; the catalog write that releases an archive's blobs), as one appended line, and
forgotten once dealt with; the file is emptied whenever nothing noted is in flight. Recovery
reads the lines left, removes the blobs among them that nothing references, and empties it.

Lines are appended without an fsync (the page cache outlives the process, so any crash of the
server leaves them); after a power loss a line may be lost with the blob's rename kept, a leak
``tannery scrub`` finds (it looks at every blob). A data directory from before the journal has
no file yet: its first start-up checks every blob once, then makes it.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections import Counter
from pathlib import Path
from typing import Iterable

from .private import open_private, replace_private

log = logging.getLogger("tannery_server.storage")

#: The journal's file in the data directory.
NAME = "blob-journal"
#: Bytes the file may reach before it is emptied the next time nothing noted is in flight.
EMPTY_AT = 1 << 20
_DIGEST = re.compile(r"[0-9a-f]{64}")


class BlobJournal:
    """Digests noted in ``data_dir/blob-journal`` (see the module); thread-safe."""

    def __init__(self, data_dir: Path) -> None:
        self.path = Path(data_dir) / NAME
        #: Whether the file was there (a store that kept a journal); False on its first start-up.
        self.existed = self.path.exists()
        self._fd = open_private(self.path, os.O_WRONLY | os.O_APPEND)
        self._lock = threading.Lock()
        self._open: Counter[str] = Counter()
        self._size = os.fstat(self._fd).st_size

    def note(self, digests: Iterable[str]) -> list[str]:
        """Write ``digests`` down (one append) before a step that could leave them unreferenced; the
        caller gives the same list to :meth:`done` once they are committed or removed."""
        noted = list(dict.fromkeys(digests))
        if noted:
            line = "".join(f"{d}\n" for d in noted).encode()
            with self._lock:
                try:
                    os.write(self._fd, line)
                    self._size += len(line)
                except OSError as exc:  # a full disk must not stop a Delete, which frees space
                    log.warning("blob journal: could not note %d blobs (%s); if the server stops before they "
                                "are dealt with, tannery scrub --repair finds what they leave", len(noted), exc)
                self._open.update(noted)
        return noted

    def done(self, digests: Iterable[str]) -> None:
        """``digests`` noted before are dealt with (referenced, or removed). Past :data:`EMPTY_AT`
        bytes the file is emptied, or rewritten with the digests still in flight (a new file
        renamed over it: a crash meanwhile leaves the old one or the new one, whole)."""
        with self._lock:
            for digest in digests:
                if self._open[digest] > 1:
                    self._open[digest] -= 1
                else:
                    self._open.pop(digest, None)
            if self._size > EMPTY_AT:
                if self._open:
                    self._rewrite_locked()
                else:
                    self._empty_locked()

    def left(self) -> list[str]:
        """The digests the file holds (what a run interrupted left noted), each once."""
        text = self.path.read_text(encoding="ascii", errors="replace")
        return list(dict.fromkeys(line for line in text.splitlines() if _DIGEST.fullmatch(line)))

    def empty(self) -> None:
        """Forget every digest (recovery has dealt with them)."""
        with self._lock:
            self._open.clear()
            self._empty_locked()

    def _rewrite_locked(self) -> None:
        lines = "".join(f"{d}\n" for d in self._open).encode()
        replace_private(self.path, lines)
        os.close(self._fd)
        self._fd = open_private(self.path, os.O_WRONLY | os.O_APPEND)
        self._size = len(lines)

    def _empty_locked(self) -> None:
        os.ftruncate(self._fd, 0)
        os.fsync(self._fd)
        self._size = 0

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


__all__ = ["BlobJournal", "EMPTY_AT", "NAME"]
