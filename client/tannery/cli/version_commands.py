"""The subcommands that compare and trace versions (diff, log), their arguments and help, apart
from the code that runs them (:mod:`.diffs`, :mod:`.history`), as :mod:`.commands` keeps the others."""

from __future__ import annotations

import argparse
import functools
from typing import Any

from .commands import JSON, name, option, subcommand

JSON_DIFF = ("diff --json prints {a, b (the archives compared: an alias's target), entries: [{name, change "
             "(same, added, removed, type: another dtype or shape, value), file (a kept file, not a tensor), "
             "dtype_a, dtype_b, shape_a, shape_b, nbytes_a, nbytes_b, values: {elements, differing, fraction, "
             "max_abs, relative_l2, nan_appeared, inf_appeared} or null}], metadata: {key: {a, b}} (the keys "
             "whose values differ; null where absent), summary: {same, added, removed, type_changed, "
             "value_changed (tensors), bytes_read, files_same, files_changed (kept files)}}; max_abs and relative_l2 cover the elements finite in both, "
             "relative_l2 is ||B-A|| / ||A|| (null when A's norm is 0).")

JSON_LOG = ("log --json prints a list of {alias, previous, archive, moved (ISO 8601 UTC), by}, newest first; "
            "previous is null when the move created the alias, archive null when it removed it (untag, rm "
            "--force), by the token that moved it (its role and the start of its SHA-256; null on a server "
            "without tokens).")


def add_version_commands(commands: Any, common: argparse.ArgumentParser, formatter: type) -> None:
    """Register diff and log on ``commands`` (a subparsers action)."""
    command = functools.partial(subcommand, commands, common, formatter)
    diff = command(
        "diff", "how archive B differs from archive A, entry by entry",
        "Compare two archives (or aliases, each resolved once) entry by entry, on the server: entries with "
        "the same SHA-256 are the same (no byte read), an entry in B only is added, in A only removed, one "
        "with another dtype or shape is listed so; for the others the server reads both, block by block, and "
        "reports the fraction of elements that differ, max |B-A|, the L2 norm of B-A relative to A's, and "
        "NaN or Inf appearing in B (no tensor byte is sent). The files kept with the archives (config.json, "
        "tokenizer files) that differ are listed apart, then the metadata keys that differ, then a summary. "
        + JSON_DIFF,
        "  tannery diff runs/7/step-1000 runs/7/step-2000\n"
        "  tannery diff prod runs/7/step-3000 --prefix model.layers.0\n"
        "  tannery diff a b --json | jq '.entries[] | select(.change == \"value\")'\n",
        "diffs.cmd_diff",
        name("a", "A", "the archive (or alias) compared from"),
        name("b", "B", "the archive (or alias) compared to"),
        option("--all", action="store_true", help="also list the entries that are the same"),
        json=JSON,
    )
    which = diff.add_mutually_exclusive_group()
    which.add_argument("--prefix", metavar="P", help="only the entries under P (P itself and P.*)")
    which.add_argument("--names", metavar="A,B", help="only these entries, comma-separated")
    command(
        "log", "an alias's moves: where from, where to, when, by whom",
        "List the moves of ALIAS, newest first: each tag that created or moved it, each untag or rm --force "
        "that removed it, with the local time and the token that did it (its role and the start of its "
        "SHA-256, never the token). The server keeps the newest 1,000 moves of each alias (its "
        "--alias-history). tannery tag ALIAS --back moves it back one step. " + JSON_LOG,
        "  tannery log prod\n  tannery log prod -n 5 --json\n",
        "history.cmd_log",
        name("alias", "ALIAS", "the alias"),
        option("-n", dest="count", metavar="N", type=int, help="only the newest N moves"),
        json=JSON,
    )


__all__ = ["add_version_commands"]
