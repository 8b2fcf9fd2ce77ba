"""Memory files made ready ahead of the same-host sends that will need them.

On the same host a payload travels as a sealed memory file (memfd): the server and every
same-host subscriber map the publisher's pages, and the seal (no write, no resize) is what
lets them trust those pages once checked. A sealed file cannot be written again, so files
are not reused; but most of what writing a fresh one costs is the kernel allocating and
clearing its pages as the bytes go in (about half of it on a 256 MiB payload on this VM,
measured in docs/weight-sync.md). A publisher that sends payloads of the same sizes version
after version (weight sync) has that done ahead, between versions:

- after a Publish, :meth:`MemoryFiles.expect` prepares one file for each payload size just
  sent (its pages allocated with ``posix_fallocate``), on a thread of low priority, up to a
  budget of bytes;
- the next Publish :meth:`~MemoryFiles.take`\\ s the smallest prepared file that holds each
  payload, cut to its exact size (the pages past it freed), writes into pages already there,
  seals it and sends it as before. Any payload that finds none gets a fresh file.

Nothing changes for the server or the subscribers: each file is still written once, sealed,
and sent once.
"""

from __future__ import annotations

import bisect
import os
import threading
import weakref
from typing import Iterable

#: Bytes of prepared files one publisher may hold between two versions, unless told otherwise.
DEFAULT_BUDGET = 4 << 30
#: Payloads smaller than this are not prepared for (their pages cost next to nothing).
MIN_PREPARED = 1 << 20
#: Nice value of the thread that prepares files (it runs while the trainer works on the next step).
PREPARE_NICENESS = 10


def new_file(name: str, size: int) -> int:
    """A fresh memory file of ``size`` bytes that may be sealed (its pages allocated as written)."""
    fd = os.memfd_create(f"tannery-{name[:40]}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        raise
    return fd


class MemoryFiles:
    """Prepared memory files, by capacity: what :meth:`take` hands out, :meth:`expect` makes."""

    def __init__(self, budget: int = DEFAULT_BUDGET) -> None:
        self.budget = budget
        self._lock = threading.Lock()
        #: Prepared files as sorted (capacity, fd) pairs (changed in place: the finalizer holds it).
        self._ready: list[tuple[int, int]] = []
        self._thread: threading.Thread | None = None
        self._closed = False
        #: Payloads sent from a prepared file, and from a fresh one (for tests and benchmarks).
        self.hits = self.misses = 0
        weakref.finalize(self, _close_files, self._ready)

    @property
    def prepared_bytes(self) -> int:
        with self._lock:
            return sum(capacity for capacity, _ in self._ready)

    def take(self, name: str, size: int) -> int:
        """A memory file of exactly ``size`` bytes, unsealed, that the caller owns (and closes):
        the smallest prepared one that holds it, cut to size, else a fresh one."""
        with self._lock:
            index = bisect.bisect_left(self._ready, (size, -1))
            found = self._ready.pop(index) if index < len(self._ready) else None
        if found is None:
            self.misses += 1
            return new_file(name, size)
        capacity, fd = found
        try:
            if capacity != size:
                os.ftruncate(fd, size)  # the pages past ``size`` go back to the kernel
        except BaseException:
            os.close(fd)
            raise
        self.hits += 1
        return fd

    def expect(self, sizes: Iterable[int]) -> None:
        """Prepare a file for each of ``sizes`` (those of the payloads just sent) in the
        background, as far as the budget goes; what was prepared and not taken is dropped first."""
        wanted = sorted((size for size in sizes if size >= MIN_PREPARED), reverse=True)
        self.drop()
        room, chosen = self.budget, []
        for size in wanted:
            if size <= room:
                chosen.append(size)
                room -= size
        if not chosen or self._closed:
            return
        thread = threading.Thread(target=_prepare, args=(weakref.ref(self), chosen), name="tannery-memory-files",
                                  daemon=True)
        self._thread = thread
        thread.start()

    def drop(self) -> None:
        """Close every prepared file not taken (their memory goes back to the kernel)."""
        with self._lock:
            _close_files(self._ready)

    def close(self) -> None:
        """Stop preparing and drop what was prepared."""
        self._closed = True
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        self.drop()


def _prepare(files: "weakref.ref[MemoryFiles]", sizes: list[int]) -> None:
    """Make a file of each size, its pages allocated, for ``files`` (a weak reference: a
    publisher dropped meanwhile is not kept alive); stops when it is closed or a newer
    :meth:`~MemoryFiles.expect` took over."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), PREPARE_NICENESS)
    except OSError:  # not allowed here: the files are made all the same
        pass
    for size in sizes:
        owner = files()
        if owner is None or owner._closed or owner._thread is not threading.current_thread():
            return
        fd = new_file("ready", size)
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError:  # no memory for it now: the send makes its file as it goes
            os.close(fd)
            return
        with owner._lock:  # asked again under the lock: a newer expect may have dropped the files meanwhile
            current = owner._thread is threading.current_thread() and not owner._closed
            if current:
                bisect.insort(owner._ready, (size, fd))
        if not current:
            os.close(fd)
            return
        del owner


def _close_files(ready: list[tuple[int, int]]) -> None:
    """Close the prepared files in ``ready`` and empty it."""
    for _, fd in ready:
        os.close(fd)
    ready.clear()


__all__ = ["DEFAULT_BUDGET", "MemoryFiles", "new_file"]
