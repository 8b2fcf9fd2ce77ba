"""An alias's history and the rollback it allows: the records of History's moves, and which
archive ``tag --back`` moves an alias to. Shared by both clients and ``tannery log``; no torch."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass

from tannery_protocol import errors
from tannery_protocol.v1 import archives_pb2


@dataclass(frozen=True)
class AliasMove:
    """One move of an alias: from ``previous`` ("" when it created the alias) to ``archive`` (""
    when it removed it), when (UTC), and by which token (``by``: its role and the start of its
    SHA-256, "" on a server without tokens)."""

    alias: str
    previous: str
    archive: str
    moved: dt.datetime
    by: str

    @classmethod
    def of(cls, message: archives_pb2.AliasMove) -> "AliasMove":
        return cls(message.alias, message.previous, message.archive,
                   message.moved.ToDatetime(tzinfo=dt.timezone.utc), message.by)


def history_request(alias: str, limit: int | None) -> archives_pb2.HistoryRequest:
    if limit is not None and limit < 1:
        raise ValueError(f"Client.history({alias!r}): limit {limit} asks for no move; give 1 or more, or None for all")
    return archives_pb2.HistoryRequest(alias=alias, limit=limit or 0)


def back_move(alias: str, moves: Sequence[AliasMove]) -> tuple[str, str]:
    """``(previous, current)``: where ``tag --back`` moves ``alias`` (its target before its last
    move) and the target it must still have then (the compare-and-set). AliasError when the
    history has nowhere to go back to."""
    if not moves:
        raise errors.AliasError(f"alias {alias!r} has no recorded move (it was made before its server recorded "
                                "them): tag it to an archive by name (tannery tag ALIAS ARCHIVE)")
    last = moves[0]
    if not last.archive:
        raise errors.AliasError(f"alias {alias!r} was removed (it pointed at {last.previous!r}), so it has no "
                                f"target to go back from: tag it again by name (tannery tag {alias} ARCHIVE)")
    if not last.previous:
        raise errors.AliasError(f"alias {alias!r} was created pointing at {last.archive!r} and never moved: it has "
                                "no previous target to go back to")
    return last.previous, last.archive


__all__ = ["AliasMove", "back_move", "history_request"]
