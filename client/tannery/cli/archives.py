"""The archive subcommands that move no tensor: ls, show, union (rm is with the aliases, in
``aliases``; push, pull and get, which move tensors, in :mod:`.transfers`).

Each ``cmd_*`` function runs one subcommand and returns its exit status. Their arguments and
help are in :mod:`.commands`.
"""

from __future__ import annotations

import argparse
import shlex
from typing import Any

from .alias_view import alias_line, aliases_by_archive
from .connection import connect
from .errors import CommandError
from .output import Output, human_size, iso_time, local_time, shorten

#: Columns a name takes at most in ls's table (longer ones end with an ellipsis; --json has them whole).
NAME_COLUMNS = 60


def cmd_ls(args: argparse.Namespace, out: Output) -> int:
    limit = args.limit
    if limit < 0:
        raise CommandError(f"ls: --limit {limit} is negative: give how many archives to list (0 for all)")
    with connect(args) as client:
        archives = list(client.list(prefix=args.prefix or "", limit=limit + 1 if limit else None))
        more = bool(limit) and len(archives) > limit
        archives = archives[:limit] if limit else archives
        named = aliases_by_archive(client, shown=[a.name for a in archives]) if archives else {}
    cut = _more_note(archives, args.prefix) if more else None
    if args.json:
        out.json([{**archive_json(info), "aliases": named.get(info.name, [])} for info in archives])
        if cut:
            out.warning(cut)
    elif not archives:
        out.note("no archives" + (f" named {args.prefix}..." if args.prefix else ""))
    else:
        aliased = any(a.name in named for a in archives)  # the columns only when they say something
        filed = any(getattr(a, "files", 0) for a in archives)
        rows = [(shorten(a.name, NAME_COLUMNS), str(a.entries), human_size(a.nbytes),
                 *([str(a.files) if a.files else ""] if filed else []), local_time(getattr(a, "created", None)),
                 *([", ".join(named.get(a.name, []))] if aliased else [])) for a in archives]
        out.table([("NAME", "left"), ("ENTRIES", "right"), ("SIZE", "right"), *([("FILES", "right")] if filed else []),
                   ("CREATED", "left"), *([("ALIASES", "left")] if aliased else [])], rows, cut)
    return 0


def _more_note(archives: list[Any], prefix: str) -> str:
    """What ``ls`` says when it stopped at its limit, and how to see the rest."""
    return (f"the first {len(archives):,} archives{f' named {prefix}...' if prefix else ''} are shown, and there are "
            f"more (the next after {archives[-1].name}): tannery ls --limit 0 lists them all, or give a longer "
            "PREFIX")


def cmd_show(args: argparse.Namespace, out: Output) -> int:
    from .plain_values import kept_values, lines, trees

    with connect(args) as client:
        description = client.describe(args.name)
        aliases = aliases_by_archive(client, description.name).get(description.name, [])
        values = trees(client, description.name, kept_values(description))
    entries = entries_of(description)
    metadata = dict(getattr(description, "metadata", {}) or {})
    nbytes = sum(e.nbytes for e in entries)
    payload = sum(e.payload_bytes for e in entries)
    lost = list(getattr(description, "lost_entries", ()) or ())
    from .model_files import count, files_json, files_rows

    if args.json:
        out.json({"name": args.name, "entries": [entry_json(e) for e in entries], "nbytes": nbytes,
                  "payload_bytes": payload, "metadata": metadata, "files": files_json(description),
                  "values": values, "archive": description.name, "aliases": aliases, "lost_entries": lost})
        return 0
    if alias_line(args.name, description.name, aliases):
        out.line(alias_line(args.name, description.name, aliases))
    if metadata:
        out.line("metadata: " + ", ".join(f"{key}={value}" for key, value in sorted(metadata.items())))
    if lost:
        out.line(lost_line(lost))
    from tannery_protocol.codec import format_shape

    rows = [(e.name, e.dtype, format_shape(e.shape), human_size(e.nbytes)) for e in entries]
    footer = f"{_entries(len(entries))}, {human_size(nbytes)} ({human_size(payload)} stored with headers)"
    out.table([("NAME", "left"), ("DTYPE", "left"), ("SHAPE", "left"), ("SIZE", "right")], rows, footer)
    kept = files_rows(description)
    if kept:
        out.line("")
        out.table([("FILE", "left"), ("SIZE", "right")], kept, f"{count(len(kept))} kept with the archive")
    if values:
        out.line("")
        for line in lines(values):
            out.line(line)
    return 0


def cmd_union(args: argparse.Namespace, out: Output) -> int:
    sources = union_sources(args.sources, args.prefixed or [])
    with connect(args) as client:
        info = client.union(args.target_name, sources, replace=args.replace)
    if getattr(info, "already_stored", False):
        out.result(f"{info.name} already holds this union: {_entries(info.entries)}, {human_size(info.nbytes)} "
                   "(nothing new stored)")
    else:
        out.result(f"created {info.name}: {_entries(info.entries)}, {human_size(info.nbytes)} "
                   "(no tensor bytes copied)")
    return 0


def union_sources(plain: list[str], prefixed: list[str]) -> dict[str, str] | list[str]:
    """The sources of a union as the client takes them: a list of names when none has a
    prefix, otherwise a mapping of prefix to name ("" for the one without)."""
    if not plain and not prefixed:
        raise CommandError("no sources", hint="give SRC archives, or --prefix P=SRC for each source under a prefix")
    if not prefixed:
        return list(plain)
    if len(plain) > 1:
        raise CommandError("with --prefix, at most one source may go without a prefix",
                           hint="give the others as --prefix P=SRC")
    sources: dict[str, str] = {"": plain[0]} if plain else {}
    for item in prefixed:
        prefix, sep, name = item.partition("=")
        if not sep or not prefix or not name:
            raise CommandError(f"--prefix {item!r}: expected PREFIX=SOURCE",
                               hint="for example --prefix encoder=bert-base")
        if prefix in sources:
            raise CommandError(f"--prefix {prefix}: given twice", hint="give each prefix once")
        sources[prefix] = name
    return sources


# -- records as the JSON output shows them (stable keys, documented in --help) ---------------


def archive_json(info: Any) -> dict:
    """An archive as ls --json shows it: its tensors (entries, nbytes, payload_bytes), the files kept
    with it counted apart (files, file_bytes), when it was created."""
    return {"name": info.name, "entries": int(info.entries), "nbytes": int(info.nbytes),
            "payload_bytes": int(info.payload_bytes), "files": int(getattr(info, "files", 0)),
            "file_bytes": int(getattr(info, "file_bytes", 0)), "created": iso_time(getattr(info, "created", None))}


def entry_json(entry: Any) -> dict:
    return {"name": entry.name, "dtype": entry.dtype, "shape": [int(d) for d in entry.shape],
            "nbytes": int(entry.nbytes), "payload_bytes": int(entry.payload_bytes), "digest": entry.digest}


def entries_of(description: Any) -> list[Any]:
    """The entry records of what ``Client.describe`` returns (a list, or a record with ``entries``)."""
    entries = getattr(description, "entries", description)
    return list(entries.values() if isinstance(entries, dict) else entries)


def show_hint(archive: str) -> str:
    """The remedy of a name that is not in an archive: the command that lists its entries, the
    archive's name quoted for the shell (``tannery show 'my model'``), ready to paste."""
    return f"tannery show {shlex.quote(archive)} lists its entries"


def lost_line(lost: list[str], most: int = 8) -> str:
    """What ``show`` says of the entries whose bytes scrub found gone (the first ``most`` named)."""
    named = ", ".join(lost[:most]) + (f" and {len(lost) - most} more" if len(lost) > most else "")
    whose = "1 entry's bytes are" if len(lost) == 1 else f"{len(lost)} entries' bytes are"
    return (f"{whose} gone (tannery scrub found them): {named}; fetch them from a backup, "
            "or delete the archive")


def _entries(count: int) -> str:
    return f"{count} entr{'y' if count == 1 else 'ies'}"
