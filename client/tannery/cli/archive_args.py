"""The arguments and help of the archive subcommands (push, pull, ls, show, get, union),
apart from the code that runs them (:mod:`.archives`), so that each module stays short."""

from __future__ import annotations

import argparse
import functools
from typing import Any

from tannery_protocol.codec import WRITER_CODES
from .archives import cmd_get, cmd_ls, cmd_pull, cmd_push, cmd_show, cmd_union, name_arg, subcommand

JSON_PUSH = ("push --json prints {name, entries, nbytes, payload_bytes, created (ISO 8601 UTC), already_stored, "
             "skipped: [{name, type}]}; already_stored is true when the archive already held exactly this content "
             "and nothing new was stored (created is then when it was first stored); skipped lists the torch "
             "checkpoint's non-tensor values left out; files: [{name, size}] the files of a folder kept with the "
             "archive (entries and nbytes count them too, as ls does).")
JSON_LS = ("ls --json prints a list of {name, entries, nbytes, payload_bytes, created (ISO 8601 UTC), aliases: "
           "[the aliases that point at it]}.")
JSON_SHOW = ("show --json prints {name, entries: [{name, dtype, shape, nbytes, payload_bytes, digest}], "
             "nbytes, payload_bytes, metadata: {key: value}} (sizes in bytes: nbytes of tensor data, "
             "payload_bytes with headers; metadata is the archive's string map, as safetensors' __metadata__), "
             "files: [{name, prefix, size, digest}] (the files kept with the archive, as a pushed folder's "
             "config.json; prefix is the one they were pushed under, digest their entry payload's SHA-256), "
             "archive (the archive's own name: NAME's target when NAME is an alias), aliases (those pointing at it).")
JSON_GET = ("get --json prints {archive, entry, dtype, shape, nbytes, stats: {count, of, min, max, mean, std, "
            "nan, inf}, preview}; statistics cover finite elements (of: 'values', or 'abs' for complex), std is "
            "the population std, nan/inf are null for dtypes without them.")


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
        "the first entry that differs. A folder's other files (config.json, generation_config.json, the "
        "tokenizer's files, a README: every file beside the index and the shards, not its directories) are kept "
        "with the archive, stored in the same call, at most 32 MiB each and 64 MiB in all, and pull -o DIR/ writes "
        "them back; --exclude leaves some out, --no-files all of them. " + JSON_PUSH,
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
    push.add_argument("--exclude", metavar="GLOB", action="append",
                      help="a folder: leave out the files matching GLOB (as the shell matches: '*.bin'; repeat for "
                           "more)")
    push.add_argument("--no-files", action="store_true",
                      help="a folder: keep only its weights, none of its other files (config, tokenizer)")
    push.add_argument("--json", action="store_true", help="print JSON (keys above)")

    pull = command(
        "pull", "write an archive (or part of it) to a file",
        "Fetch an archive's entries and write them to FILE: a .safetensors file, or a .tannic pair "
        "(FILE.tannic and FILE.metadata.tannic), by the extension; or, when FILE ends with a slash or is a "
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
        "  tannery pull llama3 -o ./llama-3-8b/ --max-shard-size 5GB\n",
        cmd_pull,
    )
    pull.add_argument("name", metavar="NAME", type=name_arg, help="the archive")
    pull.add_argument("-o", "--output", metavar="FILE", required=True,
                      help="the file to write (.safetensors or .tannic); missing directories are created")
    pull.add_argument("-f", "--force", action="store_true", help="replace FILE if it exists (default: refuse)")
    pull.add_argument("--no-files", action="store_true",
                      help="a folder: write the weights only, not the files kept with the archive")
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
        "Show the archive's metadata, every entry (name, dtype, shape, size) and the totals, then the files kept "
        "with it (a pushed folder's config.json, tokenizer files: name and size); NAME may be an alias (the "
        "archive it points at is shown, and named). " + JSON_SHOW,
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
