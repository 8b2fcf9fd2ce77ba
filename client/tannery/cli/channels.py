"""The channel subcommands: publish tensors from files, subscribe and print or save them."""

from __future__ import annotations

import argparse
import functools
import re
from pathlib import Path
from typing import Any

from .archives import name_arg, subcommand
from .connection import connect
from .errors import CommandError
from .output import Output, human_size


def cmd_publish(args: argparse.Namespace, out: Output) -> int:
    from .tensorfiles import read_tensors

    # Every file is opened (memory-mapped where it can be) before the first tensor is sent,
    # so a bad file fails the command before anything is published.
    tensors = [tensor for path in args.files for _, tensor in read_tensors(path)]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    with connect(args) as client:
        result = client.publish(args.channel, iter(tensors))
    out.result(f"published {_tensors(len(tensors))} ({human_size(nbytes)}) on {args.channel}")
    dropped = getattr(result, "dropped_subscribers", 0) or 0
    if dropped:
        out.note(f"warning: {dropped} subscriber(s) fell behind and were dropped by the server")
    return 0


def cmd_subscribe(args: argparse.Namespace, out: Output) -> int:
    from tannery_protocol.codec import format_shape
    from tannery.torch import short_name
    from .stats import format_number, statistics
    from .tensorfiles import output_directory, save_tensor, to_numpy

    if args.count is not None and args.count < 1:
        raise CommandError(f"-n {args.count}: not a count of tensors", hint="give -n 1 or more (or leave -n out)")
    directory = Path(args.output) if args.output is not None else None
    if directory is not None:
        _refuse_earlier_tensors(directory, args.force)
        output_directory(directory)
    with connect(args) as client:
        stream = client.subscribe(args.channel)
        try:
            out.note(f"subscribed to {args.channel}" + (f"; waiting for {_tensors(args.count)}" if args.count else
                                                         "; Ctrl-C to stop"))
            received = 0
            for tensor in stream:
                dtype = short_name(tensor.dtype)
                line = (f"{received:06d}  {dtype}  {format_shape(tensor.shape)}  "
                        f"{human_size(tensor.numel() * tensor.element_size())}")
                if directory is not None:
                    path = directory / f"{received:06d}.{'pt' if dtype in _NOT_NPY else 'npy'}"
                    save_tensor(path, tensor)
                    line += f"  {path}"
                else:
                    stats = statistics(to_numpy(tensor))
                    line += "".join(f"  {key}={format_number(getattr(stats, key))}" for key in ("min", "max", "mean"))
                out.line(line, flush=True)
                received += 1
                if args.count is not None and received >= args.count:
                    break
        finally:
            close = getattr(stream, "close", None)
            if close is not None:
                close()
    return 0


def _refuse_earlier_tensors(directory: Path, force: bool) -> None:
    """CommandError when ``directory`` holds tensors an earlier subscribe wrote (000000.npy,
    ...), which this one would overwrite, unless ``force``: checked before subscribing."""
    if force or not directory.is_dir():
        return
    earlier = sorted(path.name for path in directory.iterdir() if _RECEIVED.fullmatch(path.name))
    if earlier:
        shown = ", ".join(earlier[:3]) + (", ..." if len(earlier) > 3 else "")
        raise CommandError(f"-o {directory}: holds {len(earlier)} received tensor file(s) ({shown}); nothing was received",
                           hint="give --force to overwrite them, or another directory with -o")


#: The names subscribe -o gives the files it writes.
_RECEIVED = re.compile(r"[0-9]{6}\.(npy|pt)")
#: Dtypes a .npy file cannot record: subscribe -o writes these as .pt.
_NOT_NPY = frozenset({"bfloat16", "float8_e4m3fn", "float8_e5m2"})


def _tensors(count: int) -> str:
    return f"{count} tensor{'' if count == 1 else 's'}"


def add_commands(commands: Any, common: argparse.ArgumentParser, formatter: type) -> None:
    """Register the channel subcommands on ``commands`` (a subparsers action)."""
    command = functools.partial(subcommand, commands, common, formatter)
    publish = command(
        "publish", "send tensors from files on a channel",
        "Publish tensors on CHANNEL, in order, as one stream: each FILE is a .npy or .pt tensor, "
        "or a checkpoint (.pt/.pth/.bin, .safetensors, .tannic) whose every tensor is sent (in the order of "
        "a torch checkpoint's structure, in name order for the others). Only subscribers already subscribed "
        "receive them. Every file is opened before the first tensor is sent.",
        "  tannery publish activations x.npy y.npy\n  tannery publish weights model.safetensors\n",
        cmd_publish,
    )
    publish.add_argument("channel", metavar="CHANNEL", type=name_arg, help="the channel's name (any name is a channel)")
    publish.add_argument("files", metavar="FILE", nargs="+", help="tensor or checkpoint files")

    subscribe = command(
        "subscribe", "receive tensors from a channel",
        "Subscribe to CHANNEL and print a line per tensor received (index, dtype, shape, size, "
        "min, max, mean), or, with -o DIR, write each to DIR/000000.npy, DIR/000001.npy, ... (bfloat16 and "
        "float8 tensors, which .npy cannot record, as .pt). Runs until COUNT tensors arrived, or Ctrl-C. "
        "'subscribed to CHANNEL' goes to stderr once the subscription is registered.",
        "  tannery subscribe activations\n  tannery subscribe activations -n 2 -o received/\n",
        cmd_subscribe,
    )
    subscribe.add_argument("channel", metavar="CHANNEL", type=name_arg, help="the channel's name")
    subscribe.add_argument("-n", "--count", metavar="COUNT", type=int, help="stop after COUNT tensors")
    subscribe.add_argument("-o", "--output", metavar="DIR", help="write each tensor to DIR (created if missing)")
    subscribe.add_argument("-f", "--force", action="store_true",
                           help="overwrite the tensor files an earlier subscribe left in DIR (default: refuse)")
