"""The subcommands that move, follow and remove names: tag, untag, resolve, watch, rm (which aliases hold back) and prune.

An alias is a name pointing at an archive, moved atomically (``tannery tag prod runs/7/step-2000``):
readers that name it read one archive whole, the old or the new, never a mix.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from .archives import archive_json
from .connection import connect
from .errors import CommandError
from .output import Output, human_size, iso_time, local_time, shorten

def cmd_tag(args: argparse.Namespace, out: Output) -> int:
    if args.back and (args.archive is not None or args.expect is not None):
        raise CommandError(f"tag {args.alias} --back moves the alias to its previous target, checked against its "
                           "target now: it takes no ARCHIVE and no --expect",
                           hint=f"tannery tag {args.alias} --back, or tannery tag {args.alias} ARCHIVE")
    if not args.back and args.archive is None:
        raise CommandError(f"tag {args.alias}: which archive? give ARCHIVE, or --back for its previous target",
                           hint=f"tannery log {args.alias} lists where it pointed")
    with connect(args) as client:
        tagged = client.tag_back(args.alias) if args.back else client.tag(args.alias, args.archive, expect=args.expect)
    alias = tagged.alias
    if args.json:
        out.json({"alias": alias.alias, "archive": alias.archive, "previous": tagged.previous,
                  "changed": tagged.changed, "moved": iso_time(alias.moved)})
    elif not tagged.changed:
        out.result(f"{alias.alias} already points at {alias.archive} (nothing changed)")
    elif tagged.previous:
        out.result(f"moved {alias.alias}: {tagged.previous} -> {alias.archive}")
    else:
        out.result(f"tagged {alias.archive} as {alias.alias}")
    return 0


def cmd_untag(args: argparse.Namespace, out: Output) -> int:
    with connect(args) as client:
        removed = client.untag(args.alias).alias
    if args.json:
        out.json({"alias": removed.alias, "archive": removed.archive})
    else:
        out.result(f"removed alias {removed.alias}" + (f" (it pointed at {removed.archive})" if removed.archive else ""))
    return 0


def cmd_resolve(args: argparse.Namespace, out: Output) -> int:
    """The archive NAME denotes now: an alias's target (what a read naming it would read), or NAME itself."""
    with connect(args) as client:
        archive = client.resolve(args.alias)
    if args.json:
        out.json({"name": args.alias, "archive": archive, "alias": archive != args.alias})
    else:
        out.result(archive)
    return 0


def cmd_watch(args: argparse.Namespace, out: Output) -> int:
    with connect(args) as client:
        with client.watch(args.alias) as watch:
            first = True
            for moved in watch:
                if args.json:
                    out.line(json.dumps({"alias": moved.alias, "archive": moved.archive,
                                         "moved": iso_time(moved.moved)}), flush=True)
                else:
                    what = "points at" if first else "moved to"
                    out.line(f"{local_time(moved.moved)}  {moved.alias} {what} {moved.archive}", flush=True)
                if first:
                    out.note(f"watching {args.alias}; Ctrl-C to stop")
                    first = False
    return 0


def cmd_rm(args: argparse.Namespace, out: Output) -> int:
    results = []
    with connect(args) as client:
        for name in args.names:
            deleted = client.delete(name, force=args.force)
            results.append({"name": name, "blobs_removed": deleted.blobs_removed, "bytes_freed": deleted.bytes_freed,
                            "aliases_removed": list(deleted.aliases_removed),
                            "aliases_removed_count": deleted.aliases_removed_count})
            if not args.json:
                more = deleted.aliases_removed_count - len(deleted.aliases_removed)
                untagged = (f"; aliases removed: {', '.join(deleted.aliases_removed)}{f' and {more} more' if more else ''}"
                            if deleted.aliases_removed else "")
                out.result(f"deleted {name} ({human_size(deleted.bytes_freed)} freed{untagged})")
    if args.json:
        out.json(results)
    return 0


def cmd_prune(args: argparse.Namespace, out: Output) -> int:
    if args.keep_last < 1:
        raise CommandError(f"--keep-last {args.keep_last} keeps nothing: prune keeps the newest N archives",
                           hint="give --keep-last 1 or more; to delete every archive of the series, tannery rm them")
    with connect(args) as client:
        pruned = client.prune(args.prefix, keep_last=args.keep_last, dry_run=args.dry_run)

    def shown(info: Any) -> dict:
        return {**archive_json(info), "aliases": list(pruned.aliased.get(info.name, ()))}

    if args.json:
        out.json({"prefix": args.prefix, "keep_last": args.keep_last, "dry_run": pruned.dry_run,
                  "deleted": [shown(i) for i in pruned.deleted], "kept": [shown(i) for i in pruned.kept]})
        return 0
    verb = "would delete" if pruned.dry_run else "deleted"
    rows = [(shorten(i.name, 60), verb, local_time(i.created), ", ".join(pruned.aliased.get(i.name, ())))
            for i in pruned.deleted]
    rows += [(shorten(i.name, 60), "kept", local_time(i.created), ", ".join(pruned.aliased.get(i.name, ())))
             for i in pruned.kept]
    if not rows:
        out.note(f"no archives named {args.prefix}...")
        return 0
    footer = (f"{len(pruned.deleted)} {verb}, {len(pruned.kept)} kept (the newest {args.keep_last}, and any an "
              "alias points at)" + ("; nothing was deleted (--dry-run)" if pruned.dry_run else ""))
    out.table([("ARCHIVE", "left"), ("", "left"), ("CREATED", "left"), ("ALIASES", "left")], rows, footer)
    return 0


__all__ = ["cmd_prune", "cmd_resolve", "cmd_rm", "cmd_tag", "cmd_untag", "cmd_watch"]
