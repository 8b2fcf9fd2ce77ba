"""The subcommands that move tensors: push (a checkpoint file or folder stored as an archive),
pull (an archive written to a file or a folder), get (one entry, its statistics).

Each ``cmd_*`` function runs one subcommand and returns its exit status; torch-facing modules
are imported inside them. Their arguments and help are in :mod:`.commands`; the files of a
model folder, in :mod:`.model_files`; the subcommands that move no tensor, in :mod:`.archives`.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from tannery_protocol.names import did_you_mean
from .archives import _entries, archive_json, entries_of, show_hint
from .connection import connect
from .errors import CommandError
from .output import Output, human_size


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
    Its entries are the tensors; the files kept with it are counted apart."""
    files = files or {}
    kept = sum(map(len, files.values()))
    size = f"{_entries(info.entries)}, {human_size(info.nbytes)}"
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
    from .plain_values import as_metadata, kept_values
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
        values = [] if names is not None else kept_values(description, args.prefix or "")
        if values and not folder and checkpoint_kind(output, writing=True) == "safetensors":
            metadata = {**metadata, **as_metadata(client, description.name, values)}  # as save_safetensors keeps them
        elif values:
            out.note(f"{args.name} keeps plain values, written only into a safetensors file (-o NAME.safetensors); "
                     "read them with tannery.Client.archive(name).to_value()")
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


def _split_names(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise CommandError("--names: no entry names given", hint="give them comma-separated: --names a.weight,a.bias")
    return names
