"""Connections that have not yet presented a valid ticket, on one data-path listener: bounded
in number (per listener and per peer) and in time, and counted when they are ended.

An unauthenticated connection costs a thread and a descriptor, nothing more (its frames are
capped at :data:`~tannery_protocol.datalink.MAX_HANDSHAKE_FRAME`). A :class:`Gate` never makes
the accepting thread wait: when a peer (a remote address on the data port, a uid on the
socket) already has :data:`PER_PEER` connections in their handshake, or the listener has
:data:`PER_LISTENER`, the oldest of them is ended to make room. A real client presents its
ticket within milliseconds of its welcome, so it is never the oldest for long; slow peers
only push out each other. A :class:`Reaper` ends every handshake still running at its deadline.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

log = logging.getLogger("tannery_server.data_paths")

#: Handshakes in progress at once on one listener (the socket's and the data port's are separate).
PER_LISTENER = 512
#: Handshakes in progress at once from one peer: a remote address, or a uid on the socket.
PER_PEER = 128
#: Why a handshake ended without handing its connection to a call (the ``reason`` label).
REASONS = ("timeout", "oversized", "peer_limit", "listener_limit", "bad_ticket", "malformed", "closed")
#: The listeners (the ``listener`` label): the same-host socket and the data port.
LISTENERS = ("local", "tcp")
#: Seconds between the reaper's looks at the deadlines.
REAP_EVERY = 0.1
_UCRED = struct.Struct("3i")  # pid, uid, gid


class HandshakeCounts:
    """Handshakes refused or timed out, by listener and reason (read by the metrics)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = {(listener, reason): 0 for listener in LISTENERS for reason in REASONS}

    def count(self, listener: str, reason: str) -> None:
        with self._lock:
            self._counts[(listener, reason)] = self._counts.get((listener, reason), 0) + 1

    def snapshot(self) -> dict[tuple[str, str], int]:
        with self._lock:
            return dict(self._counts)


@dataclass(eq=False)
class Pending:
    """One connection in its handshake: whose, until when, and why the gate ended it (if it did)."""

    fd: int
    peer: str
    deadline: float
    ended: str | None = field(default=None)
    finished: bool = False


class Gate:
    """The handshakes in progress on one listener (``listener``: "local" or "tcp")."""

    def __init__(self, listener: str, counts: HandshakeCounts, per_listener: int = PER_LISTENER,
                 per_peer: int = PER_PEER) -> None:
        self.listener = listener
        self.counts = counts
        self.per_listener = per_listener
        self.per_peer = per_peer
        self._lock = threading.Lock()
        self._pending: OrderedDict[int, Pending] = OrderedDict()  # oldest first, by id()
        self._by_peer: dict[str, int] = {}

    def admit(self, sock: socket.socket, peer: str, seconds: float) -> Pending:
        """Register a new connection from ``peer`` with ``seconds`` to present its ticket, ending the
        oldest of its peer's (or of the listener's) handshakes first when either is full."""
        with self._lock:
            if self._by_peer.get(peer, 0) >= self.per_peer:
                self._end(self._oldest(peer), "peer_limit")
            elif len(self._pending) >= self.per_listener:
                self._end(next(iter(self._pending.values())), "listener_limit")
            pending = Pending(sock.fileno(), peer, time.monotonic() + seconds)
            self._pending[id(pending)] = pending
            self._by_peer[peer] = self._by_peer.get(peer, 0) + 1
        return pending

    def finish(self, pending: Pending) -> bool:
        """Take ``pending`` off the gate before its socket is closed or handed on. True the first time
        only, and only when the gate has not ended it meanwhile (then it must not be handed on)."""
        with self._lock:
            if pending.ended is not None or pending.finished:
                return False
            pending.finished = True
            del self._pending[id(pending)]
            self._forget(pending.peer)
        return True

    def refused(self, reason: str) -> None:
        """Count a handshake that ended for ``reason`` on its own thread."""
        self.counts.count(self.listener, reason)

    def reap(self, now: float) -> None:
        """End every handshake past its deadline."""
        with self._lock:
            for pending in [p for p in self._pending.values() if p.deadline <= now]:
                self._end(pending, "timeout")

    def in_progress(self) -> int:
        with self._lock:
            return len(self._pending)

    def _oldest(self, peer: str) -> Pending:
        return next(p for p in self._pending.values() if p.peer == peer)

    def _end(self, pending: Pending, reason: str) -> None:
        """Break ``pending``'s connection (its handshake thread then closes it) and count why."""
        del self._pending[id(pending)]
        self._forget(pending.peer)
        pending.ended = reason
        self.counts.count(self.listener, reason)
        log.debug("data connection from %s ended in its handshake (%s) on the %s listener",
                  pending.peer, reason, self.listener)
        _shut_down(pending.fd)

    def _forget(self, peer: str) -> None:
        left = self._by_peer[peer] - 1
        if left:
            self._by_peer[peer] = left
        else:
            del self._by_peer[peer]


class Reaper:
    """One thread that ends the handshakes of some gates at their deadlines."""

    def __init__(self, gates: list[Gate]) -> None:
        self.gates = gates
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tannery-data-reaper", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(REAP_EVERY):
            now = time.monotonic()
            for gate in self.gates:
                gate.reap(now)


def peer_of(sock: socket.socket, address: object, local: bool) -> str:
    """Who connected, as the gate counts peers: ``uid N`` on the socket (SO_PEERCRED), the remote
    address (without its port) on the data port."""
    if local:
        try:
            _, uid, _ = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
        except OSError:
            return "uid ?"
        return f"uid {uid}"
    return str(address[0]) if isinstance(address, tuple) else str(address)


def _shut_down(fd: int) -> None:
    """Shut down the connection on ``fd`` (a blocked receive in its thread returns); the thread closes it.
    The descriptor stays open until the thread has taken it off the gate, so it is never another's."""
    try:
        duplicate = socket.socket(fileno=os.dup(fd))
    except OSError:
        return
    try:
        duplicate.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        duplicate.close()


__all__ = ["Gate", "HandshakeCounts", "LISTENERS", "PER_LISTENER", "PER_PEER", "Pending", "REASONS", "Reaper",
           "peer_of"]
