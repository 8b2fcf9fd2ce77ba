"""The subcommands that move, follow and remove names: tag, untag, watch, rm (which aliases hold back) and prune.

An alias is a name pointing at an archive, moved atomically (``tannery tag prod runs/7/step-2000``):
readers that name it read one archive whole, the old or the new, never a mix.
"""

from __future__ import annotations

import argparse
import functools
import json
from typing import Any

from .archives import archive_json, name_arg, subcommand
from .connection import connect
from .errors import CommandError
from .output import Output, human_size, iso_time, local_time, shorten

JSON_TAG = ("tag --json prints {alias, archive, previous, changed, moved (ISO 8601 UTC)}; previous is the archive "
            "it pointed at before (\"\" when created), changed is false when it already pointed at ARCHIVE.")
JSON_UNTAG = "untag --json prints {alias, archive}: the alias removed and the archive it pointed at."
JSON_RM = ("rm --json prints a list of {name, blobs_removed, bytes_freed, aliases_removed}, one per archive "
           "deleted.")
JSON_PRUNE = ("prune --json prints {prefix, keep_last, dry_run, deleted: [archive], kept: [archive]}, each "
              "archive as ls --json shows it (with its aliases), newest first.")


def cmd_tag(args: argparse.Namespace, out: Output) -> int:
    with connect(args) as client:
        tagged = client.tag(args.alias, args.archive, expect=args.expect)
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

JSON_WATCH = ("watch --json prints one JSON object per line: {alias, archive, moved (ISO 8601 UTC)}, the current "
              "target first, then one per move.")


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
                            "aliases_removed": list(deleted.aliases_removed)})
            if not args.json:
                untagged = f"; aliases removed: {', '.join(deleted.aliases_removed)}" if deleted.aliases_removed else ""
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


def add_commands(commands: Any, common: argparse.ArgumentParser, formatter: type) -> None:
    """Register rm, tag, untag and prune on ``commands`` (a subparsers action)."""
    command = functools.partial(subcommand, commands, common, formatter)

    rm = command(
        "rm", "delete archives",
        "Delete archives; the tensor data no other archive shares is removed from the server. An archive an "
        "alias points at is refused (naming the alias) unless --force, which removes those aliases too. "
        + JSON_RM,
        "  tannery rm resnet50\n  tannery rm old-1 old-2\n  tannery rm runs/7/step-1000 --force\n",
        cmd_rm,
    )
    rm.add_argument("names", metavar="NAME", type=name_arg, nargs="+", help="the archives to delete")
    rm.add_argument("--force", action="store_true",
                    help="also remove the aliases that point at an archive (default: refuse to delete it)")
    rm.add_argument("--json", action="store_true", help="print JSON (keys above)")

    tag = command(
        "tag", "point an alias at an archive (create or move it)",
        "Point ALIAS at ARCHIVE, creating the alias or moving it atomically: every read that names ALIAS "
        "(show, get, pull, a union's source, a client's archive() or load_state_dict) reads ARCHIVE whole from "
        "then on, and a read that began before reads the old archive whole. Aliases and archives share one "
        "namespace: ALIAS cannot be an archive's name, and ARCHIVE must be an archive, not another alias. "
        "--expect OLD moves the alias only if it points at OLD now (--expect '' only if it does not exist "
        "yet): two operators moving one alias at once cannot both win. " + JSON_TAG,
        "  tannery tag prod runs/7/step-2000\n"
        "  tannery tag prod runs/7/step-3000 --expect runs/7/step-2000\n",
        cmd_tag,
    )
    tag.add_argument("alias", metavar="ALIAS", type=name_arg, help="the alias to create or move")
    tag.add_argument("archive", metavar="ARCHIVE", type=name_arg, help="the archive it points at from now on")
    tag.add_argument("--expect", metavar="OLD",
                     help="move only if ALIAS points at OLD now ('' : only if ALIAS does not exist yet)")
    tag.add_argument("--json", action="store_true", help="print JSON (keys above)")

    untag = command(
        "untag", "remove an alias (the archive stays)",
        "Remove ALIAS; the archive it pointed at stays. " + JSON_UNTAG,
        "  tannery untag prod\n",
        cmd_untag,
    )
    untag.add_argument("alias", metavar="ALIAS", type=name_arg, help="the alias to remove")
    untag.add_argument("--json", action="store_true", help="print JSON (keys above)")

    watch = command(
        "watch", "follow an alias: its target now, then each move",
        "Print the archive ALIAS points at now, then a line each time it moves (on any replica; within about "
        "half a second), with the local time it moved, until Ctrl-C. A move made twice before the line is "
        "printed shows only where it ended. An alias removed while watched ends the command with an error. "
        + JSON_WATCH,
        "  tannery watch prod\n  tannery watch prod --json\n",
        cmd_watch,
    )
    watch.add_argument("alias", metavar="ALIAS", type=name_arg, help="the alias to follow")
    watch.add_argument("--json", action="store_true", help="print one JSON object per line (keys above)")

    prune = command(
        "prune", "delete all but the newest archives under a prefix",
        "Delete every archive whose name starts with PREFIX but the newest N (by creation time), never one an "
        "alias points at, and list what was deleted and what was kept. --dry-run deletes nothing and lists "
        "what would go. " + JSON_PRUNE,
        "  tannery prune runs/7/ --keep-last 3 --dry-run\n  tannery prune runs/7/ --keep-last 3\n",
        cmd_prune,
    )
    prune.add_argument("prefix", metavar="PREFIX", type=name_arg, help="the series: archives whose names start with it")
    prune.add_argument("--keep-last", metavar="N", type=int, required=True, help="how many of the newest to keep (1 or more)")
    prune.add_argument("--dry-run", action="store_true", help="delete nothing; list what would be deleted")
    prune.add_argument("--json", action="store_true", help="print JSON (keys above)")


__all__ = ["add_commands", "cmd_prune", "cmd_rm", "cmd_tag", "cmd_untag", "cmd_watch"]
