"""What every transfer on a data connection shares: how a broken connection fails its call,
how the peer is told why a transfer stops, and the sealed memory files of the same host."""

from __future__ import annotations

import fcntl
import mmap
import os
import ssl

from tannery_protocol.datalink import Link, LinkClosed, LinkError, frame
from tannery_protocol.v1.data_pb2 import DataFailure

from ..failures import Failure, Malformed, Unavailable

#: A sealed memory file of a local Store must not change, shrink or grow under the server.
_SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)

#: What a data connection raises when it breaks (or its peer breaks the protocol): errors of
#: the connection, not of the storage, whatever OSError they derive from.
LINK_ERRORS = (ConnectionError, ssl.SSLError, TimeoutError)


def link_failure(transport: str, exc: BaseException) -> Failure:
    """The call's failure for a data connection that broke (one of :data:`LINK_ERRORS`): the
    peer leaving is Unavailable, a peer breaking the protocol Malformed."""
    if isinstance(exc, LinkError) and not isinstance(exc, LinkClosed):
        return Malformed(f"the {transport} {exc}")
    return Unavailable(f"the {transport} data connection broke: {exc}")


def fail(link: Link, failure: BaseException) -> None:
    """Tell the peer why the transfer stops, then break the connection. Best effort and never
    blocking (the call's status says it too): a peer whose buffer is full misses the frame.

    In the middle of an entry's raw bytes (TCP Fetch) the connection is only broken: the
    client would read a failure frame as tensor bytes (or as the payload's header)."""
    if isinstance(failure, Failure) and not link.in_payload:
        try:
            link.sock.settimeout(0.0)
            link.send(frame(failure=DataFailure(code=failure.code.name, message=str(failure))))
        except OSError:
            pass
    link.abort()


def sealed_map(fd: int, size: int, name: str) -> mmap.mmap:
    """A read-only map of a memory file the client can no longer change; Malformed otherwise."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        seals = 0
    if seals & _SEALS != _SEALS:
        raise Malformed(f"entry {name!r}: a piece's memory file is not sealed against writes and resizing "
                        "(F_SEAL_WRITE, F_SEAL_SHRINK, F_SEAL_GROW)")
    actual = os.fstat(fd).st_size
    if actual != size or size == 0:
        raise Malformed(f"entry {name!r}: a piece of {size} bytes in a memory file of {actual}")
    # Mapped in one call (the pages are the client's, already there), not one fault per 4 KiB.
    return mmap.mmap(fd, size, prot=mmap.PROT_READ, flags=mmap.MAP_SHARED | _MAP_POPULATE)


def close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)
