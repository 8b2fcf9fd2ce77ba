"""What a weight follower waits on (:mod:`tannery.weights`), the same for both followers: the
newest version either source has brought and not applied yet, and the pauses between two
attempts to read a source that is away.
"""

from __future__ import annotations

from tannery_protocol.errors import Cancelled, ResourceExhausted, Unavailable
from tannery.weights.stream import StreamedVersion
from tannery.weights.versions import version_of

#: How long a follower waits before it looks again for weights not pushed yet.
FIRST_VERSION_POLL_SECONDS = 0.2
#: How long a follower waits for the channel to go on bringing a version the alias has moved
#: onto, before it fetches that version from the store instead.
STREAM_GRACE_SECONDS = 2.0


class Newest:
    """The newest version a follower has not applied yet, from either source: the archive the
    alias moved to, and the newest version that came whole on the channel. Older ones are
    dropped as newer arrive, so a slow follower skips to the newest.

    A version the channel is bringing right now is not fetched from the store as well when the
    alias moves onto it (that would send it twice): the follower waits for the channel while
    its payloads keep coming, and goes to the store after :data:`STREAM_GRACE_SECONDS` without one.
    """

    def __init__(self) -> None:
        self.moved: str | None = None
        self.streamed: StreamedVersion | None = None
        self.failure: BaseException | None = None
        #: The version the channel is bringing now (None: none), and when its last payload came.
        self.streaming: int | None = None
        self.progress = 0.0

    def wait(self, now: float) -> float | None:
        """How long to wait before :meth:`take` (0: take now; None: until something arrives)."""
        if self.failure is not None or self.streamed is not None:
            return 0.0
        if self.moved is None:
            return None
        moved = version_of(self.moved)
        if self.streaming is None or moved is None or moved > self.streaming:
            return 0.0
        return max(0.0, self.progress + STREAM_GRACE_SECONDS - now)  # the channel brings it (or newer)

    def restore(self, archive: str | None, streamed: StreamedVersion | None) -> None:
        """Offer again what :meth:`take` gave, unless something newer came meanwhile (its apply
        failed, or was cancelled: the version is not lost)."""
        if archive is not None and self.moved is None:
            self.moved = archive
        if streamed is not None and self.streamed is None:
            self.streamed = streamed

    def take(self) -> tuple[str | None, StreamedVersion | None]:
        """The newest candidate: (archive to fetch, None) or (archive or None, version streamed):
        a streamed version comes with the archive the alias moved to, to fetch instead when it
        is a delta the follower cannot apply. The failure of a source that gave up is raised."""
        moved, streamed, failure = self.moved, self.streamed, self.failure
        self.moved = self.streamed = self.failure = None
        if failure is not None:
            raise failure
        number = None if moved is None else version_of(moved)
        if streamed is not None and (number is None or streamed.version >= number):
            return moved, streamed
        return moved, None


#: Errors after which a follower reads its source again, after a pause (the other source,
#: or the store, covers the gap); any other error of the alias's Watch ends the follower.
AGAIN = (ResourceExhausted, Unavailable, Cancelled)
#: The longest pause between two attempts to read a source.
MAX_PAUSE_SECONDS = 5.0

class Pauses:
    """Pauses between attempts that double up to :data:`MAX_PAUSE_SECONDS` (no retry storm from a
    fleet against a server that is down), back to the first after a success."""

    def __init__(self) -> None:
        self.next = FIRST_VERSION_POLL_SECONDS

    def take(self) -> float:
        pause, self.next = self.next, min(self.next * 2, MAX_PAUSE_SECONDS)
        return pause

    def reset(self) -> None:
        self.next = FIRST_VERSION_POLL_SECONDS


__all__ = ["AGAIN", "FIRST_VERSION_POLL_SECONDS", "MAX_PAUSE_SECONDS", "Newest", "Pauses", "STREAM_GRACE_SECONDS"]
