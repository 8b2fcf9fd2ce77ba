"""A private data directory: what the server creates there only its own user may read.

The tokens guard the archives over the network; the files on disk must not hand them to any
other local user. Every directory the server creates under the data directory (``blobs/``
and its subdirectories, ``tmp/``, a read cache, the socket's directory) is made 0700 and
every file (blobs, temporary files, the catalog and its WAL, the lock) 0600, by explicit
modes rather than by the process-wide umask, which a threaded server must not change.

A data directory made by an older server (0755 directories, 0644 files) is found at start:
:func:`exposed` names what others may read, :func:`fix` takes their access away
(``--fix-permissions``), and :func:`check_private` does one or the other.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

log = logging.getLogger("tannery_server.storage")

#: The mode of every directory the server creates under the data directory.
PRIVATE_DIR = 0o700
#: The mode of every file the server creates there.
PRIVATE_FILE = 0o600
#: The permission bits of the group and of others.
_OTHERS = 0o077
#: How many exposed paths a warning names before it says "and N more".
_NAMED = 8


def private_directory(path: Path) -> Path:
    """``path`` as a directory: created 0700 (its missing parents as the umask makes them)
    when missing, left as it is when it exists (:func:`check_private` looks at those)."""
    path = Path(path)
    try:
        path.mkdir(mode=PRIVATE_DIR)
    except FileExistsError:
        return path
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        return private_directory(path)
    os.chmod(path, PRIVATE_DIR)  # the umask may have taken the owner's bits too
    return path


def open_private(path: Path, flags: int) -> int:
    """A file descriptor of ``path`` opened with ``flags`` (``O_CREAT`` added): a file it
    creates is 0600 (the umask can only take bits away from that)."""
    return os.open(path, flags | os.O_CREAT, PRIVATE_FILE)


def replace_private(path: Path, data: bytes) -> None:
    """Put ``data`` at ``path`` whole or not at all: written to a 0600 file beside it, fsynced,
    then renamed over it (a crash leaves the old file or the new one, never half of one)."""
    temp = path.with_name(path.name + ".new")
    fd = open_private(temp, os.O_WRONLY | os.O_TRUNC)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(temp, path)


def private_opener(path: str, flags: int) -> int:
    """An ``opener`` for :func:`open`: the files it creates are 0600."""
    return os.open(path, flags, PRIVATE_FILE)


def create_private_file(path: Path) -> None:
    """Create ``path`` empty and 0600 when missing (the catalog before SQLite opens it: SQLite
    gives its WAL and shared-memory files the database file's mode)."""
    os.close(open_private(path, os.O_RDONLY))


def _is_exposed(path: Path) -> bool:
    """Whether the group or others have any permission on ``path`` (a symlink is not followed)."""
    mode = path.lstat().st_mode
    return not stat.S_ISLNK(mode) and bool(mode & _OTHERS)


def _top_paths(data_dir: Path) -> list[Path]:
    """The data directory, what it holds, and the subdirectories of ``blobs/``: the paths that
    decide who reaches a blob (a bounded walk, however many blobs there are)."""
    paths = [data_dir]
    for child in sorted(data_dir.iterdir()):
        paths.append(child)
        if child.name == "blobs" and child.is_dir() and not child.is_symlink():
            paths.extend(sorted(p for p in child.iterdir() if p.is_dir()))
    return paths


def exposed(data_dir: Path) -> list[Path]:
    """The paths of ``data_dir`` (itself, its entries, the subdirectories of ``blobs/``) that
    the group or others may read, write or enter."""
    return [p for p in _top_paths(Path(data_dir)) if _is_exposed(p)]


def fix(data_dir: Path) -> int:
    """Take every permission of the group and others away from ``data_dir`` and everything in
    it (symlinks are not followed); the number of paths changed."""
    changed = 0
    for root, directories, files in os.walk(data_dir):
        for path in [Path(root)] + [Path(root) / name for name in directories + files]:
            mode = path.lstat().st_mode
            if not stat.S_ISLNK(mode) and mode & _OTHERS:
                os.chmod(path, stat.S_IMODE(mode) & ~_OTHERS)
                changed += 1
    return changed


def fixing_command(data_dir: Path) -> str:
    """The shell command that makes ``data_dir`` private by hand."""
    return f"chmod -R go-rwx {Path(data_dir).resolve()}"


def _named(paths: list[Path]) -> str:
    """The first paths of ``paths`` with their modes, and how many more there are."""
    shown = ", ".join(f"{p} ({stat.S_IMODE(p.lstat().st_mode):04o})" for p in paths[:_NAMED])
    return shown + (f" and {len(paths) - _NAMED} more" if len(paths) > _NAMED else "")


def check_private(data_dir: Path, fix_permissions: bool) -> list[Path]:
    """At start: the paths of an existing ``data_dir`` that others may reach, logged as a
    warning naming them and the command that fixes them, or fixed with ``fix_permissions``
    (then logged as fixed). The exposed paths found (empty: private, or not there yet)."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        return []
    found = exposed(data_dir)
    if not found:
        return []
    if fix_permissions:
        changed = fix(data_dir)
        log.warning("data directory %s was readable by other users: --fix-permissions took the group's and "
                    "others' access away from %d paths", data_dir.resolve(), changed)
    else:
        log.warning("data directory %s is readable by other users, who may read the stored tensors and the "
                    "catalog whatever the tokens say: %s. Fix it with: %s (or start once with --fix-permissions)",
                    data_dir.resolve(), _named(found), fixing_command(data_dir))
    return found


def socket_directory(path: Path, socket_mode: int) -> Path:
    """The directory of the same-host socket, created when missing: 0700, plus the search bit
    for the group or others when ``socket_mode`` lets them connect (so that they can reach it).
    An existing directory is left as it is; a warning says when it keeps out whom the socket's
    mode lets in."""
    path = Path(path)
    reach = (0o010 if socket_mode & 0o060 else 0) | (0o001 if socket_mode & 0o006 else 0)
    if not path.exists():
        private_directory(path)
        os.chmod(path, PRIVATE_DIR | reach)
    elif reach & ~path.stat().st_mode:
        log.warning("the socket's mode %04o lets other users connect, but its directory %s (%04o) keeps them out: "
                    "put the socket in a directory they can search (--socket /run/tannery/tannery.sock, made with "
                    "install -d -m 2750 -g GROUP /run/tannery)", socket_mode, path,
                    stat.S_IMODE(path.stat().st_mode))
    return path


__all__ = ["PRIVATE_DIR", "PRIVATE_FILE", "check_private", "create_private_file", "exposed", "fix",
           "fixing_command", "open_private", "private_directory", "private_opener", "socket_directory"]
