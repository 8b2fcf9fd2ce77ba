"""The channel subcommands: publish tensors from files, subscribe and print or save them."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

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
