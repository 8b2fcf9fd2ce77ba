"""Every client subcommand's arguments and help (push, pull, ls, show, get, union; rm, tag,
untag, resolve, watch, prune; publish, subscribe), apart from the code that runs them (:mod:`.archives`,
:mod:`.aliases`, :mod:`.channels`): building the parser imports none of those, and a command
imports the one module that runs it."""

from __future__ import annotations

import argparse
import functools
import importlib
from typing import Any

JSON = "print JSON (keys above)"

JSON_PUSH = ("push --json prints {name, entries, nbytes, payload_bytes, file_bytes, created (ISO 8601 UTC), "
             "already_stored, skipped: [{name, type}], files: [{name, size}]}: entries and nbytes count the tensors; "
             "files are the folder's files kept with the archive (file_bytes their bytes); already_stored is true "
             "when the archive already held exactly this content and nothing new was stored (created is then when "
             "it was first stored); skipped lists the torch checkpoint's non-tensor values left out.")
#: Archives ``tannery ls`` lists unless --limit says otherwise: a screenful's worth for people.
LS_LIMIT = 1000
JSON_LS = ("ls --json prints a list of {name, entries, nbytes, payload_bytes, files, file_bytes, created (ISO 8601 "
           "UTC), aliases: [the aliases that point at it]}: entries and the byte counts are the tensors'; files "
           "counts the files kept with the archive (a pushed folder's config.json...), file_bytes their bytes.")
JSON_SHOW = ("show --json prints {name, entries: [{name, dtype, shape, nbytes, payload_bytes, digest}], "
             "nbytes, payload_bytes, metadata: {key: value}} (sizes in bytes: nbytes of tensor data, "
             "payload_bytes with headers; metadata is the archive's string map, as safetensors' __metadata__), "
             "files: [{name, prefix, size, digest}] (the files kept with the archive, as a pushed folder's "
             "config.json; prefix is the one they were pushed under, digest their entry payload's SHA-256), "
             "archive (the archive's own name: NAME's target when NAME is an alias), aliases (those pointing at it), "
             "lost_entries: [name] (the entries whose bytes tannery scrub --repair found gone from the server).")
JSON_GET = ("get --json prints {archive, entry, dtype, shape, nbytes, stats: {count, of, min, max, mean, std, "
            "nan, inf}, preview}; statistics cover finite elements (of: 'values', or 'abs' for complex), std is "
            "the population std, nan/inf are null for dtypes without them.")
JSON_TAG = ("tag --json prints {alias, archive, previous, changed, moved (ISO 8601 UTC)}; previous is the archive "
            "it pointed at before (\"\" when created), changed is false when it already pointed at ARCHIVE.")
JSON_UNTAG = "untag --json prints {alias, archive}: the alias removed and the archive it pointed at."
JSON_RESOLVE = ("resolve --json prints {name, archive, alias}: the archive ALIAS denotes now, and whether ALIAS is "
                "an alias (false: it is that archive's own name).")
JSON_RM = ("rm --json prints a list of {name, blobs_removed, bytes_freed, aliases_removed (the first 1,000), "
           "aliases_removed_count}, one per archive "
           "deleted.")
JSON_PRUNE = ("prune --json prints {prefix, keep_last, dry_run, deleted: [archive], kept: [archive]}, each "
              "archive as ls --json shows it (with its aliases), newest first.")
JSON_WATCH = ("watch --json prints one JSON object per line: {alias, archive, moved (ISO 8601 UTC)}, the current "
              "target first, then one per move.")


def name_arg(text: str) -> str:
    """An archive, entry or channel name on the command line: not empty."""
    if not text:
        raise argparse.ArgumentTypeError("a name cannot be empty")
    return text


def name(dest: str, metavar: str, help: str, **more: Any) -> tuple[tuple[str, ...], dict[str, Any]]:
    """A positional name argument (not empty)."""
    return (dest,), {"metavar": metavar, "type": name_arg, "help": help, **more}


def flag(*flags: str, help: str) -> tuple[tuple[str, ...], dict[str, Any]]:
    """An option that is on or off."""
    return flags, {"action": "store_true", "help": help}


def option(*flags: str, **options: Any) -> tuple[tuple[str, ...], dict[str, Any]]:
    return flags, options


class _Run:
    """The function that runs a subcommand, named ``module.function`` under this package and
    imported when the command runs (so building the parser imports no command's code)."""

    def __init__(self, path: str) -> None:
        self.module, self.function = path.rsplit(".", 1)

    def __call__(self, args: argparse.Namespace, out: Any) -> Any:
        module = importlib.import_module(f"{__package__}.{self.module}")
        return getattr(module, self.function)(args, out)


def subcommand(commands: Any, common: argparse.ArgumentParser, formatter: type, name: str, help: str,
               description: str, examples: str, run: str, *arguments: tuple[tuple[str, ...], dict[str, Any]],
               json: str | None = None) -> argparse.ArgumentParser:
    """Register subcommand ``name`` on ``commands`` (a subparsers action): its help line, its
    description, its examples, what runs it (``module.function``), its ``arguments`` in order and,
    last, ``--json`` with its help; the parser, for any other arguments."""
    parser = commands.add_parser(name, help=help, description=description, parents=[common],
                                 epilog="examples:\n" + examples, formatter_class=formatter)
    parser.set_defaults(run=_Run(run))
    for flags, options in arguments:
        parser.add_argument(*flags, **options)
    if json is not None:
        parser.add_argument("--json", action="store_true", help=json)
    return parser


def add_commands(commands: Any, common: argparse.ArgumentParser, formatter: type) -> None:
    """Register every client subcommand on ``commands`` (a subparsers action)."""
    command = functools.partial(subcommand, commands, common, formatter)

    command(
        "push", "store a checkpoint file as an archive",
        "Store FILE as an archive of named tensors: a .safetensors file (its __metadata__ kept), a .tannic pair "
        "(model.tannic beside model.metadata.tannic; stored 1-D), a torch checkpoint (.pt, .pth, .bin, read "
        "with torch.load(weights_only=True); entries named by path, model.layers.0.weight) or a Hugging Face "
        "folder (the index and its shards, checked against each other; its other files, config.json and the "
        "tokenizer's, kept with the archive: --exclude, --no-files). A torch checkpoint's values that are not "
        "tensors cannot be entries: push stores the tensors and lists the values it left out, with their "
        "types, on stderr (and under \"skipped\" with --json). The same content pushed again to the same name "
        "stores nothing new; other content there is refused unless --replace. " + JSON_PUSH,
        "  tannery push model.safetensors --as resnet50\n"
        "  tannery push ./llama-3-8b/ --as llama3\n"
        "  tannery push encoder.pt --as bert --prefix encoder --replace\n",
        "transfers.cmd_push",
        option("file", metavar="FILE", help="the checkpoint file, or a Hugging Face checkpoint folder"),
        option("--as", dest="name", metavar="NAME", type=name_arg, required=True, help="the archive's name"),
        option("--prefix", metavar="P", default="", help="store every entry under P (w becomes P.w)"),
        flag("--replace", help="replace an archive of that name (default: refuse it unless it holds this very content)"),
        option("--exclude", metavar="GLOB", action="append",
               help="a folder: leave out the files matching GLOB (as the shell matches: '*.bin'; repeat for more)"),
        flag("--no-files", help="a folder: keep only its weights, none of its other files (config, tokenizer)"),
        json=JSON,
    )
    pull = command(
        "pull", "write an archive (or part of it) to a file",
        "Fetch an archive's entries and write them to FILE: a .safetensors file, a .tannic pair "
        "(FILE.tannic and FILE.metadata.tannic) or a torch checkpoint (.pt, .pth, .bin: torch.save of "
        "{name: tensor}, which needs the whole archive in memory), by the extension; or, when FILE ends with a slash or is a "
        "directory, a Hugging Face checkpoint folder: shards model-00001-of-0000N.safetensors of at most "
        "--max-shard-size (whole entries in name order; an entry over it gets a shard of its own) and "
        "model.safetensors.index.json, or a single model.safetensors when everything fits in one, as "
        "save_pretrained writes them, and the files kept with the archive (a pushed folder's config.json, "
        "tokenizer files: those under --prefix when given), each checked against the SHA-256 recorded when it "
        "was pushed. Entries keep their full names; safetensors files get the archive's "
        "metadata as their __metadata__.",
        "  tannery pull resnet50 -o resnet50.safetensors\n"
        "  tannery pull bert -o encoder.safetensors --prefix encoder\n"
        "  tannery pull bert -o two.tannic --names encoder.w,encoder.b\n"
        "  tannery pull head -o back.pt\n"
        "  tannery pull llama3 -o ./llama-3-8b/ --max-shard-size 5GB\n",
        "transfers.cmd_pull",
        name("name", "NAME", "the archive"),
        option("-o", "--output", metavar="FILE", required=True,
               help="the file to write (.safetensors, .tannic or .pt); missing directories are created"),
        flag("-f", "--force", help="replace FILE if it exists (default: refuse)"),
        flag("--no-files", help="a folder: write the weights only, not the files kept with the archive"),
        option("--max-shard-size", metavar="SIZE", help="a folder's largest shard, as 5GB (the default), 500MB or 2GiB"),
    )
    which = pull.add_mutually_exclusive_group()
    which.add_argument("--prefix", metavar="P", help="only the entries under P (P itself and P.*)")
    which.add_argument("--names", metavar="A,B", help="only these entries, comma-separated")
    pull.add_argument("--codes", choices=("seed", "cpp"), default="seed",  # codec.WRITER_CODES, which check_codes holds to
                      help="dtype codes of a .tannic pair: 'seed' (default; pytannic's, complex64/128 as 37/38) "
                           "or 'cpp' (Tannic C++'s, complex64/128 as 35/36, what a C++ Tannic program reads)")

    command(
        "ls", "list archives",
        "List the archives on the server (name, entries: the tensors, their size, the files kept with it when "
        "any archive has some, creation time), optionally only those whose names start with PREFIX; the first "
        "1,000 by name unless --limit says otherwise (it says when there are more). " + JSON_LS,
        "  tannery ls\n  tannery ls resnet --json\n  tannery ls runs/ --limit 0\n",
        "archives.cmd_ls",
        option("prefix", metavar="PREFIX", nargs="?", default="", help="only archives whose names start with this"),
        option("--limit", metavar="N", type=int, default=LS_LIMIT,
               help=f"list at most N archives (default {LS_LIMIT:,}; 0 for all)"),
        json=JSON,
    )
    command(
        "show", "list an archive's entries",
        "Show the archive's metadata, every entry (name, dtype, shape, size) and the totals, then the files kept "
        "with it (a pushed folder's config.json, tokenizer files: name and size); NAME may be an alias (the "
        "archive it points at is shown, and named). " + JSON_SHOW,
        "  tannery show resnet50\n  tannery show resnet50 --json | jq '.entries[].name'\n",
        "archives.cmd_show",
        name("name", "NAME", "the archive"),
        json=JSON,
    )
    command(
        "get", "fetch one entry: dtype, shape, statistics, a preview",
        "Fetch one entry by name and print its dtype, shape, size, statistics (min, max, mean, std of the "
        "finite elements; NaN and Inf counts for floats) and a short preview; -o also writes it to a .npy "
        "(numpy) or .pt (torch.save) file. Only that entry is transferred. " + JSON_GET,
        "  tannery get resnet50 fc.weight\n  tannery get resnet50 fc.bias -o bias.npy --json\n",
        "transfers.cmd_get",
        name("name", "NAME", "the archive"),
        name("entry", "ENTRY", "the entry's full name"),
        option("-o", "--output", metavar="FILE",
               help="also write the tensor to FILE.npy or FILE.pt; missing directories are created"),
        flag("-f", "--force", help="replace FILE if it exists (default: refuse)"),
        json=JSON,
    )
    command(
        "union", "make an archive of other archives' entries",
        "Create TARGET from the entries of the SRC archives, each source's entries under its prefix when "
        "given with --prefix P=SRC. No tensor bytes are copied on the server. Entry names must not clash.",
        "  tannery union model encoder-v2 decoder-v1\n"
        "  tannery union model --prefix encoder=bert --prefix decoder=gpt2\n",
        "archives.cmd_union",
        name("target_name", "TARGET", "the new archive"),
        name("sources", "SRC", "source archives, entries kept as named", nargs="*"),
        option("--prefix", dest="prefixed", metavar="P=SRC", action="append",
               help="a source whose entries go under P (repeat for several)"),
        flag("--replace", help="replace an archive named TARGET (default: refuse)"),
    )
    command(
        "rm", "delete archives",
        "Delete archives; the tensor data no other archive shares is removed from the server. An archive an "
        "alias points at is refused (naming the alias) unless --force, which removes those aliases too. "
        + JSON_RM,
        "  tannery rm resnet50\n  tannery rm old-1 old-2\n  tannery rm runs/7/step-1000 --force\n",
        "aliases.cmd_rm",
        name("names", "NAME", "the archives to delete", nargs="+"),
        flag("--force", help="also remove the aliases that point at an archive (default: refuse to delete it)"),
        json=JSON,
    )
    command(
        "tag", "point an alias at an archive (create or move it)",
        "Point ALIAS at ARCHIVE, creating the alias or moving it atomically: every read that names ALIAS "
        "(show, get, pull, a union's source, a client's archive() or load_state_dict) reads ARCHIVE whole from "
        "then on, and a read that began before reads the old archive whole. Aliases and archives share one "
        "namespace: ALIAS cannot be an archive's name, and ARCHIVE must be an archive, not another alias. "
        "--expect OLD moves the alias only if it points at OLD now (--expect '' only if it does not exist "
        "yet): two operators moving one alias at once cannot both win. --back (no ARCHIVE) moves ALIAS back "
        "to where it pointed before its last move (tannery log ALIAS shows them), only if no one moved it "
        "meanwhile. " + JSON_TAG,
        "  tannery tag prod runs/7/step-2000\n"
        "  tannery tag prod runs/7/step-3000 --expect runs/7/step-2000\n"
        "  tannery tag prod --back\n",
        "aliases.cmd_tag",
        name("alias", "ALIAS", "the alias to create or move"),
        name("archive", "ARCHIVE", "the archive it points at from now on (none with --back)", nargs="?"),
        option("--expect", metavar="OLD",
               help="move only if ALIAS points at OLD now ('' : only if ALIAS does not exist yet)"),
        option("--back", action="store_true",
               help="move ALIAS back to its target before its last move (compare-and-set against its target now)"),
        json=JSON,
    )
    command(
        "untag", "remove an alias (the archive stays)",
        "Remove ALIAS; the archive it pointed at stays. " + JSON_UNTAG,
        "  tannery untag prod\n",
        "aliases.cmd_untag",
        name("alias", "ALIAS", "the alias to remove"),
        json=JSON,
    )
    command(
        "resolve", "print the archive an alias points at",
        "Print the archive ALIAS points at now, the one a read naming ALIAS would read (an archive's own name "
        "prints itself; a name that is neither is not found). Before tag --expect, it says what to expect. " + JSON_RESOLVE,
        "  tannery resolve prod\n  tannery resolve prod --json\n",
        "aliases.cmd_resolve",
        name("alias", "ALIAS", "the alias (or an archive's name)"),
        json=JSON,
    )
    command(
        "watch", "follow an alias: its target now, then each move",
        "Print the archive ALIAS points at now, then a line each time it moves (on any replica; within about "
        "half a second), with the local time it moved, until Ctrl-C. A move made twice before the line is "
        "printed shows only where it ended. An alias removed while watched ends the command with an error. "
        + JSON_WATCH,
        "  tannery watch prod\n  tannery watch prod --json\n",
        "aliases.cmd_watch",
        name("alias", "ALIAS", "the alias to follow"),
        json="print one JSON object per line (keys above)",
    )
    command(
        "prune", "delete all but the newest archives under a prefix",
        "Delete every archive whose name starts with PREFIX but the newest N (by creation time), never one an "
        "alias points at, and list what was deleted and what was kept. --dry-run deletes nothing and lists "
        "what would go. " + JSON_PRUNE,
        "  tannery prune runs/7/ --keep-last 3 --dry-run\n  tannery prune runs/7/ --keep-last 3\n",
        "aliases.cmd_prune",
        name("prefix", "PREFIX", "the series: archives whose names start with it"),
        option("--keep-last", metavar="N", type=int, required=True, help="how many of the newest to keep (1 or more)"),
        flag("--dry-run", help="delete nothing; list what would be deleted"),
        json=JSON,
    )
    command(
        "publish", "send tensors from files on a channel",
        "Publish tensors on CHANNEL, in order, as one stream: each FILE is a .npy or .pt tensor, "
        "or a checkpoint (.pt/.pth/.bin, .safetensors, .tannic) whose every tensor is sent (in the order of "
        "a torch checkpoint's structure, in name order for the others). Only subscribers already subscribed "
        "receive them. Every file is opened before the first tensor is sent.",
        "  tannery publish activations x.npy y.npy\n  tannery publish weights model.safetensors\n",
        "channels.cmd_publish",
        name("channel", "CHANNEL", "the channel's name (any name is a channel)"),
        option("files", metavar="FILE", nargs="+", help="tensor or checkpoint files"),
    )
    command(
        "subscribe", "receive tensors from a channel",
        "Subscribe to CHANNEL and print a line per tensor received (index, dtype, shape, size, "
        "min, max, mean), or, with -o DIR, write each to DIR/000000.npy, DIR/000001.npy, ... (bfloat16 and "
        "float8 tensors, which .npy cannot record, as .pt). Runs until COUNT tensors arrived, or Ctrl-C. "
        "'subscribed to CHANNEL' goes to stderr once the subscription is registered.",
        "  tannery subscribe activations\n  tannery subscribe activations -n 2 -o received/\n",
        "channels.cmd_subscribe",
        name("channel", "CHANNEL", "the channel's name"),
        option("-n", "--count", metavar="COUNT", type=int, help="stop after COUNT tensors"),
        option("-o", "--output", metavar="DIR", help="write each tensor to DIR (created if missing)"),
        flag("-f", "--force", help="overwrite the tensor files an earlier subscribe left in DIR (default: refuse)"),
    )


__all__ = ["add_commands", "flag", "name", "name_arg", "option", "subcommand"]
