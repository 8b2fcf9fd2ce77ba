"""The archive subcommands: push, pull, ls, show, get, union (rm is with the aliases, in ``aliases``).

Each ``cmd_*`` function runs one subcommand and returns its exit status; torch-facing
modules are imported inside them, so building the parser imports no torch. Their arguments
and help are in :mod:`.commands`; the files of a model folder, in :mod:`.model_files`.
"""

from __future__ import annotations

import argparse
import os
import shlex
from pathlib import Path
from typing import Any

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
    files: dict[str, bytes] = {}
    what = args.file
    if Path(args.file).is_dir():
        from .hf import INDEX, read_folder
        from .model_files import count, read_files

        folder = read_folder(args.file)  # checked against its index before the call
        archive, metadata = folder.archive, folder.metadata
        if not args.no_files:  # the folder's other files (config, tokenizer), bounded, read before the call
            files, dirs = read_files(Path(args.file), [*folder.shards, Path(INDEX)], args.exclude or [])
            if dirs:
                out.note(f"left out {', '.join(dirs)}: only the folder's own files are kept, not its directories")
        kinds = [f"{len(folder.shards)} shards"] if len(folder.shards) > 1 else []
        kinds += [count(len(files))] if files else []
        what += f" ({', '.join(kinds)})" if kinds else ""
    elif args.no_files or args.exclude:
        raise CommandError("--no-files and --exclude: only for a folder (a model folder's files beside its weights)",
                           hint="push a folder, or leave them out")
    elif checkpoint_kind(args.file) == "safetensors":
        from .hf import read_shard

        archive, metadata = read_shard(Path(args.file))
    else:
        archive, skipped = read_checkpoint_skipping(args.file)
    total = payload_total(archive)
    with connect(args) as client, out.transfer(f"push {args.name}", total) as progress:
        info = client.store(args.name, archive, prefix=args.prefix, replace=args.replace, progress=progress,
                            metadata=metadata, files=files)
    if skipped:
        left = "1 value that is not a tensor" if len(skipped) == 1 else f"{len(skipped)} values that are not tensors"
        out.warning(f"left out {left} (an archive holds tensors only): {describe_skipped(skipped)}")
    if args.json:
        out.json({**archive_json(info), "already_stored": bool(getattr(info, "already_stored", False)),
                  "skipped": [{"name": name, "type": kind} for name, kind in skipped],
                  "files": [{"name": name, "size": len(data)} for name, data in sorted(files.items())]})
    else:
        out.result(push_line(what, info, files))
    return 0


def push_line(what: str, info: Any, files: dict[str, bytes] | None = None) -> str:
    """What ``push`` did: stored the archive, or found it already there with this very content.
    The files kept with it are entries on the server: counted apart from the tensors."""
    files = files or {}
    kept = sum(map(len, files.values()))
    size = f"{_entries(info.entries - len(files))}, {human_size(info.nbytes - kept)}"
    if files:
        size += f", and {len(files)} file{'s' if len(files) > 1 else ''} ({human_size(kept)})"
    if getattr(info, "already_stored", False):
        return f"{info.name} is already stored with this content ({what}: {size}): nothing new stored"
    return f"pushed {what} as {info.name}: {size}"


def _is_folder(output: str) -> bool:
    """Whether ``-o`` names a folder to write shards into: a trailing slash, or a directory."""
    return output.endswith(("/", os.sep)) or Path(output).is_dir()


def cmd_pull(args: argparse.Namespace, out: Output) -> int:
    from tannery_protocol.names import owns
    from .checkpoint_writer import CheckpointWriter
    from .model_files import count, kept_files, write_files
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
        kept = [] if args.no_files else kept_files(description, args.prefix or "")
        files: dict[str, bytes] = {}
        if folder:
            from .hf import ShardedWriter, check_dtypes, folder_outputs, plan_shards
            from .model_files import file_outputs

            check_dtypes(output, dtypes)
            plan = plan_shards([described[name] for name in selected], max_shard)
            weights = folder_outputs(output, len(plan))
            refuse_existing(weights + file_outputs(output, [file.name for file in kept], weights), args.force)
            output_directory(output)
            files = client.files(args.name, args.prefix or "") if kept else {}  # small: fetched first
            make_writer = lambda: ShardedWriter(output, plan, metadata)  # noqa: E731
        else:
            if kept:
                out.note(f"{args.name} keeps {count(len(kept))} ({', '.join(file.name for file in kept)}), written "
                         "only into a folder (-o DIR/)")
            check_writable(output, dtypes, args.force)
            make_writer = lambda: CheckpointWriter(  # noqa: E731
                args.output, [described[name] for name in selected], args.codes, metadata=metadata)
        total = sum(described[name].payload_bytes for name in selected)
        # The file is laid out from the description, then written piece by piece as the
        # messages arrive (one held at a time), and renamed into place when whole.
        with make_writer() as writer, out.transfer(f"pull {args.name}", total) as progress:
            for piece in client.fetch_pieces(description.name, names=names, prefix=args.prefix or None,
                                             progress=progress):
                writer.write(piece)
            paths = writer.finish()
    nbytes = sum(described[name].nbytes for name in selected)
    if folder:
        write_files(output, files)  # after the shards: a folder with a config has its weights
        shards = [p for p in paths if p.name.endswith(".safetensors")]
        index = " and the index" if len(paths) > len(shards) else ""
        also = f", {count(len(files))}" if files else ""
        into = f"{output} ({len(shards)} shard{'s' if len(shards) > 1 else ''}{index}{also})"
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
    from .model_files import count, files_json, files_rows

    if args.json:
        out.json({"name": args.name, "entries": [entry_json(e) for e in entries], "nbytes": nbytes,
                  "payload_bytes": payload, "metadata": metadata, "files": files_json(description),
                  "archive": description.name, "aliases": aliases})
        return 0
    if alias_line(args.name, description.name, aliases):
        out.line(alias_line(args.name, description.name, aliases))
    if metadata:
        out.line("metadata: " + ", ".join(f"{key}={value}" for key, value in sorted(metadata.items())))
    from tannery_protocol.codec import format_shape

    rows = [(e.name, e.dtype, format_shape(e.shape), human_size(e.nbytes)) for e in entries]
    footer = f"{_entries(len(entries))}, {human_size(nbytes)} ({human_size(payload)} stored with headers)"
    out.table([("NAME", "left"), ("DTYPE", "left"), ("SHAPE", "left"), ("SIZE", "right")], rows, footer)
    kept = files_rows(description)
    if kept:
        out.line("")
        out.table([("FILE", "left"), ("SIZE", "right")], kept, f"{count(len(kept))} kept with the archive")
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


def _entries(count: int) -> str:
    return f"{count} entr{'y' if count == 1 else 'ies'}"
