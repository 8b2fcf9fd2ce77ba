"""One server per data directory: an exclusive lock file naming the pid that holds it."""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

from .private import open_private


class DataDirectoryInUse(RuntimeError):
    """Another server holds the data directory's lock."""


class DataDirectoryLock:
    """An exclusive ``flock`` on ``<data_dir>/lock``, held while the server runs."""

    def __init__(self, data_dir: Path) -> None:
        self.path = Path(data_dir) / "lock"
        self._fd = open_private(self.path, os.O_RDWR)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.pread(self._fd, 64, 0).decode(errors="replace").strip() or "?"
            os.close(self._fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise DataDirectoryInUse(
                    f"data directory {data_dir} is in use by another tannery server (pid {holder})"
                ) from None
            raise
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        if self._fd >= 0:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = -1
