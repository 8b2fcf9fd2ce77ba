"""``tannery log ALIAS``: an alias's moves, newest first (where from, where to, when, by which
token), as a table or JSON. The server keeps them (:class:`tannery.calls.history.AliasMove`)."""

from __future__ import annotations

import argparse

from .connection import connect
from .errors import CommandError
from .output import Output, iso_time, local_time, shorten

#: Columns an archive's name takes at most in the table (--json has it whole).
NAME_COLUMNS = 50


def cmd_log(args: argparse.Namespace, out: Output) -> int:
    if args.count is not None and args.count < 1:
        raise CommandError(f"-n {args.count} shows no move", hint="give -n 1 or more, or leave it out for all")
    with connect(args) as client:
        moves = client.history(args.alias, args.count)
    if args.json:
        out.json([{"alias": m.alias, "previous": m.previous or None, "archive": m.archive or None,
                   "moved": iso_time(m.moved), "by": m.by or None} for m in moves])
        return 0
    if not moves:
        out.note(f"{args.alias}: no move recorded (it was made before its server recorded them)")
        return 0
    rows = [(local_time(m.moved), _what(m.previous, m.archive), shorten(m.previous, NAME_COLUMNS) or "-",
             shorten(m.archive, NAME_COLUMNS) or "-", m.by or "-") for m in moves]
    out.table([("MOVED", "left"), ("", "left"), ("FROM", "left"), ("TO", "left"), ("BY", "left")], rows)
    return 0


def _what(previous: str, archive: str) -> str:
    return "created" if not previous else "removed" if not archive else "moved"


__all__ = ["cmd_log"]
