"""The archive subcommands: push, pull, ls, show, get, union (rm is with the aliases, in ``aliases``).

Each ``cmd_*`` function runs one subcommand and returns its exit status; torch-facing
modules are imported inside them, so building the parser imports no torch.
"""

from __future__ import annotations

import argparse
import functools
import os
import shlex
from typing import Any

from pathlib import Path

from tannery_protocol.codec import WRITER_CODES
from tannery_protocol.names import did_you_mean
from .alias_view import alias_line, aliases_by_archive
from .connection import connect
from .errors import CommandError
from .output import Output, human_size, iso_time, local_time, shorten

#: Columns a name takes at most in ls's table (longer ones end with an ellipsis; --json has them whole).
NAME_COLUMNS = 60


def cmd_push(args: argparse.Namespace, out: Output) -> int:
    from .tensorfiles import checkpoint_kind, describe_skipped, payload_total, read_checkpoint_skipping

    metadata: dict[str, str] = {}
    skipped: list[tuple[str, str]] = []
    what = args.file
    if Path(args.file).is_dir():
        from .hf import read_folder

        folder = read_folder(args.file)  # checked against its index before the call
        archive, metadata = folder.archive, folder.metadata
        if len(folder.shards) > 1:
            what = f"{args.file} ({len(folder.shards)} shards)"
    elif checkpoint_kind(args.file) == "safetensors":
        from .hf import read_shard

        archive, metadata = read_shard(Path(args.file))
    else:
        archive, skipped = read_checkpoint_skipping(args.file)
    total = payload_total(archive)
    with connect(args) as client, out.transfer(f"push {args.name}", total) as progress:
        info = client.store(args.name, archive, prefix=args.prefix, replace=args.replace, progress=progress,
                            metadata=metadata)
    if skipped:
        left = "1 value that is not a tensor" if len(skipped) == 1 else f"{len(skipped)} values that are not tensors"
        out.warning(f"left out {left} (an archive holds tensors only): {describe_skipped(skipped)}")
    if args.json:
        out.json({**archive_json(info), "already_stored": bool(getattr(info, "already_stored", False)),
                  "skipped": [{"name": name, "type": kind} for name, kind in skipped]})
    else:
        out.result(push_line(what, info))
    return 0


def push_line(what: str, info: Any) -> str:
    """What ``push`` did: stored the archive, or found it already there with this very content."""
    size = f"{_entries(info.entries)}, {human_size(info.nbytes)}"
    if getattr(info, "already_stored", False):
        return f"{info.name} is already stored with this content ({what}: {size}): nothing new stored"
    return f"pushed {what} as {info.name}: {size}"


def _is_folder(output: str) -> bool:
    """Whether ``-o`` names a folder to write shards into: a trailing slash, or a directory."""
    return output.endswith(("/", os.sep)) or Path(output).is_dir()


def cmd_pull(args: argparse.Namespace, out: Output) -> int:
    from tannery_protocol.names import owns
    from .checkpoint_writer import CheckpointWriter
    from .tensorfiles import check_writable, checkpoint_kind, output_directory, refuse_existing

    names = _split_names(args.names) if args.names is not None else None
    output = Path(args.output)
    folder = _is_folder(args.output)
    if args.codes != "seed" and (folder or checkpoint_kind(output, writing=True) != "tannic"):
        raise CommandError(f"--codes {args.codes}: only a .tannic pair has dtype codes",
                           hint="pull into a .tannic pair (-o NAME.tannic), or leave out --codes")
    if folder:
        from .hf import DEFAULT_MAX_SHARD, parse_size

        max_shard = parse_size(args.max_shard_size or DEFAULT_MAX_SHARD)
    elif args.max_shard_size is not None:
        raise CommandError("--max-shard-size: only for a folder of shards (-o DIR/)",
                           hint="end -o with a slash to write a Hugging Face checkpoint folder")
    else:
        refuse_existing([output], args.force)  # before the call: nothing to wait for
    with connect(args) as client:
        description = client.describe(args.name)
        metadata = dict(getattr(description, "metadata", {}) or {})
        described = {entry.name: entry for entry in entries_of(description)}
        if names is not None:
            missing = [name for name in names if name not in described]
            if missing:
                raise CommandError(f"{args.name}: no entry {', '.join(map(repr, missing))} in the archive"
                                   + did_you_mean(missing[0], list(described)), hint=show_hint(args.name))
            selected = names
        else:
            selected = [name for name in described if owns(args.prefix or "", name)]
            if not selected:
                raise CommandError(f"{args.name}: no entry under the prefix {args.prefix!r}",
                                   hint=show_hint(args.name))
        dtypes = sorted({described[name].dtype for name in selected})
        if folder:
            from .hf import ShardedWriter, check_dtypes, folder_outputs, plan_shards

            check_dtypes(output, dtypes)
            plan = plan_shards([described[name] for name in selected], max_shard)
            refuse_existing(folder_outputs(output, len(plan)), args.force)
            output_directory(output)
            make_writer = lambda: ShardedWriter(output, plan, metadata)  # noqa: E731
        else:
            check_writable(output, dtypes, args.force)
            make_writer = lambda: CheckpointWriter(  # noqa: E731
                args.output, [described[name] for name in selected], args.codes, metadata=metadata)
        total = sum(described[name].payload_bytes for name in selected)
        # The file is laid out from the description, then written piece by piece as the
        # messages arrive (one held at a time), and renamed into place when whole.
        with make_writer() as writer, out.transfer(f"pull {args.name}", total) as progress:
            for piece in client.fetch_pieces(description.name, names=names, prefix=args.prefix or None, progress=progress):
                writer.write(piece)
            paths = writer.finish()
    nbytes = sum(described[name].nbytes for name in selected)
    if folder:
        shards = [p for p in paths if p.name.endswith(".safetensors")]
        index = " and the index" if len(paths) > len(shards) else ""
        into = f"{output} ({len(shards)} shard{'s' if len(shards) > 1 else ''}{index})"
    else:
        into = " and ".join(map(str, paths))
    out.result(f"pulled {args.name} into {into}: {_entries(len(selected))}, {human_size(nbytes)}")
    return 0


def cmd_ls(args: argparse.Namespace, out: Output) -> int:
    with connect(args) as client:
        archives = list(client.list(prefix=args.prefix or ""))
        named = aliases_by_archive(client)
    if args.json:
        out.json([{**archive_json(info), "aliases": named.get(info.name, [])} for info in archives])
    elif not archives:
        out.note("no archives" + (f" named {args.prefix}..." if args.prefix else ""))
    else:
        aliased = any(a.name in named for a in archives)  # the column only when it says something
        rows = [(shorten(a.name, NAME_COLUMNS), str(a.entries), human_size(a.nbytes), local_time(getattr(
            a, "created", None)), *([", ".join(named.get(a.name, []))] if aliased else [])) for a in archives]
        out.table([("NAME", "left"), ("ENTRIES", "right"), ("SIZE", "right"), ("CREATED", "left"),
                   *([("ALIASES", "left")] if aliased else [])], rows)
    return 0


def cmd_show(args: argparse.Namespace, out: Output) -> int:
    with connect(args) as client:
        description = client.describe(args.name)
        aliases = aliases_by_archive(client, description.name).get(description.name, [])
    entries = entries_of(description)
    metadata = dict(getattr(description, "metadata", {}) or {})
    nbytes = sum(e.nbytes for e in entries)
    payload = sum(e.payload_bytes for e in entries)
    if args.json:
        out.json({"name": args.name, "entries": [entry_json(e) for e in entries], "nbytes": nbytes,
                  "payload_bytes": payload, "metadata": metadata, "archive": description.name, "aliases": aliases})
        return 0
    if alias_line(args.name, description.name, aliases):
        out.line(alias_line(args.name, description.name, aliases))
    if metadata:
        out.line("metadata: " + ", ".join(f"{key}={value}" for key, value in sorted(metadata.items())))
    from tannery_protocol.codec import format_shape

    rows = [(e.name, e.dtype, format_shape(e.shape), human_size(e.nbytes)) for e in entries]
    footer = f"{_entries(len(entries))}, {human_size(nbytes)} ({human_size(payload)} stored with headers)"
    out.table([("NAME", "left"), ("DTYPE", "left"), ("SHAPE", "left"), ("SIZE", "right")], rows, footer)
    return 0


def cmd_get(args: argparse.Namespace, out: Output) -> int:
    from tannery_protocol.codec import format_shape
    from .stats import format_number, preview, statistics
    from .tensorfiles import check_npy_dtype, output_directory, refuse_existing, save_tensor, to_numpy

    if args.output is not None:
        if not args.output.endswith((".npy", ".pt")):
            raise CommandError(f"-o {args.output}: cannot tell the format from the extension",
                               hint="write a .npy (numpy) or .pt (torch.save) file")
        refuse_existing([Path(args.output)], args.force)
        output_directory(Path(args.output).parent)
    with connect(args) as client:
        remote = client.archive(args.name)
        if args.entry not in remote:
            raise CommandError(f"{args.name}: no entry {args.entry!r} in the archive{did_you_mean(args.entry, remote.names())}",
                               hint=show_hint(args.name))
        info = remote.info(args.entry)
        if args.output is not None:
            check_npy_dtype(args.output, info.dtype)  # before the transfer
        tensor = remote.find(args.entry)
    if args.output is not None:
        save_tensor(args.output, tensor)
    array = to_numpy(tensor)
    stats = statistics(array)
    shown = preview(array)
    if args.json:
        out.json({"archive": args.name, "entry": args.entry, "dtype": info.dtype, "shape": list(info.shape),
                  "nbytes": info.nbytes, "stats": stats.as_dict(), "preview": shown})
    else:
        rows = [("archive", args.name), ("entry", args.entry), ("dtype", info.dtype),
                ("shape", format_shape(info.shape)), ("size", human_size(info.nbytes)),
                ("count", str(stats.count))]
        suffix = " |x|" if stats.of == "abs" else ""
        rows += [(key + suffix, format_number(getattr(stats, key))) for key in ("min", "max", "mean", "std")]
        rows += [(key, str(getattr(stats, key))) for key in ("nan", "inf") if getattr(stats, key) is not None]
        width = max(len(key) for key, _ in rows)
        for key, value in rows:
            out.line(f"{key:<{width}}  {value}")
        out.line(shown)
    if args.output is not None:
        (out.note if args.json else out.result)(f"wrote {args.output}")  # stdout stays JSON only
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
    return {"name": info.name, "entries": int(info.entries), "nbytes": int(info.nbytes),
            "payload_bytes": int(info.payload_bytes), "created": iso_time(getattr(info, "created", None))}


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


def _split_names(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise CommandError("--names: no entry names given", hint="give them comma-separated: --names a.weight,a.bias")
    return names


def name_arg(text: str) -> str:
    """An archive, entry or channel name on the command line: not empty."""
    if not text:
        raise argparse.ArgumentTypeError("a name cannot be empty")
    return text


def _entries(count: int) -> str:
    return f"{count} entr{'y' if count == 1 else 'ies'}"


# -- the parser ----------------------------------------------------------------------------------

JSON_PUSH = ("push --json prints {name, entries, nbytes, payload_bytes, created (ISO 8601 UTC), already_stored, "
             "skipped: [{name, type}]}; already_stored is true when the archive already held exactly this content "
             "and nothing new was stored (created is then when it was first stored); skipped lists the torch "
             "checkpoint's non-tensor values left out.")
JSON_LS = ("ls --json prints a list of {name, entries, nbytes, payload_bytes, created (ISO 8601 UTC), aliases: "
           "[the aliases that point at it]}.")
JSON_SHOW = ("show --json prints {name, entries: [{name, dtype, shape, nbytes, payload_bytes, digest}], "
             "nbytes, payload_bytes, metadata: {key: value}} (sizes in bytes: nbytes of tensor data, "
             "payload_bytes with headers; metadata is the archive's string map, as safetensors' __metadata__; "
             "archive is the archive's own name, NAME's target when NAME is an alias; aliases, those pointing at it).")
JSON_GET = ("get --json prints {archive, entry, dtype, shape, nbytes, stats: {count, of, min, max, mean, std, "
            "nan, inf}, preview}; statistics cover finite elements (of: 'values', or 'abs' for complex), std is "
            "the population std, nan/inf are null for dtypes without them.")


def subcommand(commands: Any, common: argparse.ArgumentParser, formatter: type,
               name: str, help: str, description: str, examples: str, run: Any) -> argparse.ArgumentParser:
    """Register subcommand ``name`` on ``commands`` (a subparsers action): its help line, its
    description, its examples and the function that runs it; the parser, for its arguments."""
    parser = commands.add_parser(name, help=help, description=description, parents=[common],
                                 epilog="examples:\n" + examples, formatter_class=formatter)
    parser.set_defaults(run=run)
    return parser


def add_commands(commands: Any, common: argparse.ArgumentParser, formatter: type) -> None:
    """Register the archive subcommands on ``commands`` (a subparsers action)."""
    command = functools.partial(subcommand, commands, common, formatter)

    push = command(
        "push", "store a checkpoint file as an archive",
        "Store a checkpoint file on the server as an archive of named tensors. FILE is a Hugging Face "
        "checkpoint folder (model.safetensors.index.json and the shards it names, checked against each other, "
        "or a model.safetensors), a .safetensors file, "
        "a .tannic pair (model.tannic with model.metadata.tannic beside it; it stores no shapes, so its "
        "entries are stored 1-D) or a torch checkpoint (.pt, .pth, .bin) read with "
        "torch.load(weights_only=True): every tensor of its dicts and lists becomes an entry named by its "
        "path (model.layers.0.weight). A safetensors file's __metadata__ (a folder's: its first shard's) is "
        "kept as the archive's metadata. A torch checkpoint's values that are not tensors (a step count, a "
        "name, None) cannot be entries: push stores the tensors and lists the values it left out, with their "
        "types, on stderr (and under \"skipped\" with --json). A progress bar shows bytes, rate and time left. "
        "Pushing again to a name that holds exactly this content (entries, bytes, metadata) succeeds and stores "
        "nothing new (\"is already stored with this content\"); other content under that name is refused, naming "
        "the first entry that differs. " + JSON_PUSH,
        "  tannery push model.safetensors --as resnet50\n"
        "  tannery push ./llama-3-8b/ --as llama3\n"
        "  tannery push encoder.pt --as bert --prefix encoder --replace\n",
        cmd_push,
    )
    push.add_argument("file", metavar="FILE", help="the checkpoint file, or a Hugging Face checkpoint folder")
    push.add_argument("--as", dest="name", metavar="NAME", type=name_arg, required=True, help="the archive's name")
    push.add_argument("--prefix", metavar="P", default="", help="store every entry under P (w becomes P.w)")
    push.add_argument("--replace", action="store_true",
                      help="replace an archive of that name (default: refuse it unless it holds this very content)")
    push.add_argument("--json", action="store_true", help="print JSON (keys above)")

    pull = command(
        "pull", "write an archive (or part of it) to a file",
        "Fetch an archive's entries and write them to FILE: a .safetensors file, or a .tannic pair "
        "(FILE.tannic and FILE.metadata.tannic), by the extension; or, when FILE ends with a slash or is a "
        "directory, a Hugging Face checkpoint folder: shards model-00001-of-0000N.safetensors of at most "
        "--max-shard-size (whole entries in name order; an entry over it gets a shard of its own) and "
        "model.safetensors.index.json, or a single model.safetensors when everything fits in one, as "
        "save_pretrained writes them. Entries keep their full names; safetensors files get the archive's "
        "metadata as their __metadata__.",
        "  tannery pull resnet50 -o resnet50.safetensors\n"
        "  tannery pull bert -o encoder.safetensors --prefix encoder\n"
        "  tannery pull bert -o two.tannic --names encoder.w,encoder.b\n"
        "  tannery pull llama3 -o ./llama-3-8b/ --max-shard-size 5GB\n",
        cmd_pull,
    )
    pull.add_argument("name", metavar="NAME", type=name_arg, help="the archive")
    pull.add_argument("-o", "--output", metavar="FILE", required=True,
                      help="the file to write (.safetensors or .tannic); missing directories are created")
    pull.add_argument("-f", "--force", action="store_true", help="replace FILE if it exists (default: refuse)")
    pull.add_argument("--max-shard-size", metavar="SIZE",
                      help="a folder's largest shard, as 5GB (the default), 500MB or 2GiB")
    which = pull.add_mutually_exclusive_group()
    which.add_argument("--prefix", metavar="P", help="only the entries under P (P itself and P.*)")
    which.add_argument("--names", metavar="A,B", help="only these entries, comma-separated")
    pull.add_argument("--codes", choices=WRITER_CODES, default="seed",
                      help="dtype codes of a .tannic pair: 'seed' (default; pytannic's, complex64/128 as 37/38) "
                           "or 'cpp' (Tannic C++'s, complex64/128 as 35/36, what a C++ Tannic program reads)")

    ls = command(
        "ls", "list archives",
        "List the archives on the server (name, entries, size, creation time), optionally only those whose "
        "names start with PREFIX. " + JSON_LS,
        "  tannery ls\n  tannery ls resnet --json\n",
        cmd_ls,
    )
    ls.add_argument("prefix", metavar="PREFIX", nargs="?", default="", help="only archives whose names start with this")
    ls.add_argument("--json", action="store_true", help="print JSON (keys above)")

    show = command(
        "show", "list an archive's entries",
        "Show the archive's metadata, every entry (name, dtype, shape, size) and the totals; NAME may be an "
        "alias (the archive it points at is shown, and named). " + JSON_SHOW,
        "  tannery show resnet50\n  tannery show resnet50 --json | jq '.entries[].name'\n",
        cmd_show,
    )
    show.add_argument("name", metavar="NAME", type=name_arg, help="the archive")
    show.add_argument("--json", action="store_true", help="print JSON (keys above)")

    get = command(
        "get", "fetch one entry: dtype, shape, statistics, a preview",
        "Fetch one entry by name and print its dtype, shape, size, statistics (min, max, mean, std of the "
        "finite elements; NaN and Inf counts for floats) and a short preview; -o also writes it to a .npy "
        "(numpy) or .pt (torch.save) file. Only that entry is transferred. " + JSON_GET,
        "  tannery get resnet50 fc.weight\n  tannery get resnet50 fc.bias -o bias.npy --json\n",
        cmd_get,
    )
    get.add_argument("name", metavar="NAME", type=name_arg, help="the archive")
    get.add_argument("entry", metavar="ENTRY", type=name_arg, help="the entry's full name")
    get.add_argument("-o", "--output", metavar="FILE",
                     help="also write the tensor to FILE.npy or FILE.pt; missing directories are created")
    get.add_argument("-f", "--force", action="store_true", help="replace FILE if it exists (default: refuse)")
    get.add_argument("--json", action="store_true", help="print JSON (keys above)")

    union = command(
        "union", "make an archive of other archives' entries",
        "Create TARGET from the entries of the SRC archives, each source's entries under its prefix when "
        "given with --prefix P=SRC. No tensor bytes are copied on the server. Entry names must not clash.",
        "  tannery union model encoder-v2 decoder-v1\n"
        "  tannery union model --prefix encoder=bert --prefix decoder=gpt2\n",
        cmd_union,
    )
    union.add_argument("target_name", metavar="TARGET", type=name_arg, help="the new archive")
    union.add_argument("sources", metavar="SRC", type=name_arg, nargs="*", help="source archives, entries kept as named")
    union.add_argument("--prefix", dest="prefixed", metavar="P=SRC", action="append",
                       help="a source whose entries go under P (repeat for several)")
    union.add_argument("--replace", action="store_true", help="replace an archive named TARGET (default: refuse)")
