"""``tannery diff A B``: how archive B differs from archive A, entry by entry, as a table or JSON.

The server compares (no tensor byte travels): this module only prints its answer
(:class:`tannery.calls.diff.ArchiveDiff`). Kept files are listed apart from the tensors.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from .connection import connect
from .output import Output, human_size, shorten

#: Columns an entry's name takes at most in the table (--json has it whole).
NAME_COLUMNS = 60
#: What each change is called in the table's CHANGE column.
CHANGE_WORDS = {"same": "same", "added": "added", "removed": "removed", "type": "dtype/shape", "value": "values"}


def cmd_diff(args: argparse.Namespace, out: Output) -> int:
    names = [n for n in args.names.split(",") if n] if args.names else None
    with connect(args) as client:
        diff = client.diff(args.a, args.b, names=names, prefix=args.prefix, same=args.all)
    if args.json:
        out.json(diff_json(diff))
        return 0
    out.line(f"A: {_named(args.a, diff.a)}")
    out.line(f"B: {_named(args.b, diff.b)}")
    tensors = [e for e in diff.entries if not e.file]
    files = [e for e in diff.entries if e.file]
    if tensors:
        out.table([("ENTRY", "left"), ("CHANGE", "left"), ("DTYPE", "left"), ("SHAPE", "left"),
                   ("DIFFER", "right"), ("MAX |B-A|", "right"), ("REL L2", "right"), ("NEW NAN/INF", "right")],
                  [_row(e) for e in tensors])
    for entry in files:
        out.line(f"file {entry.name}: {_file_change(entry)}")
    for key, (a, b) in diff.metadata.items():
        out.line(f"metadata {key}: {_value(a)} -> {_value(b)}")
    out.line(summary_line(diff))
    return 0


def _named(asked: str, archive: str) -> str:
    return archive if asked == archive else f"{archive} (alias {asked})"


def _value(text: str | None) -> str:
    return "(none)" if text is None else repr(text)


def _shape(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


def _row(entry: Any) -> tuple[str, ...]:
    name, change = shorten(entry.name, NAME_COLUMNS), CHANGE_WORDS[entry.change]
    if entry.change == "added":
        return name, change, entry.dtype_b, _shape(entry.shape_b), "", "", "", ""
    if entry.change in ("removed", "same"):
        return name, change, entry.dtype_a, _shape(entry.shape_a), "", "", "", ""
    if entry.change == "type":
        dtype = entry.dtype_a if entry.dtype_a == entry.dtype_b else f"{entry.dtype_a} -> {entry.dtype_b}"
        shape = (_shape(entry.shape_a) if entry.shape_a == entry.shape_b
                 else f"{_shape(entry.shape_a)} -> {_shape(entry.shape_b)}")
        return name, change, dtype, shape, "", "", "", ""
    values = entry.values
    appeared = f"{values.nan_appeared}/{values.inf_appeared}" if values.nan_appeared or values.inf_appeared else ""
    return (name, change, entry.dtype_a, _shape(entry.shape_a), f"{100 * values.fraction:.3g}%",
            f"{values.max_abs:.4g}", f"{values.relative_l2:.4g}", appeared)


def _file_change(entry: Any) -> str:
    if entry.change == "added":
        return f"added ({human_size(entry.nbytes_b)})"
    if entry.change == "removed":
        return f"removed ({human_size(entry.nbytes_a)})"
    if entry.change == "same":
        return "same"
    return f"changed ({human_size(entry.nbytes_a)} -> {human_size(entry.nbytes_b)})"


def summary_line(diff: Any) -> str:
    """One line: what differs, how many are the same, and what the server read to say so."""
    files = f", {diff.files_same} kept files" if diff.files_same else ""
    if diff.identical:
        return f"identical: {diff.same} tensors{files} and the metadata the same (nothing read)"
    parts = [f"{diff.value_changed} with other values", f"{diff.type_changed} with another dtype or shape",
             f"{diff.added} added", f"{diff.removed} removed", f"{diff.same} the same"]
    files = f"; kept files: {diff.files_changed} differ, {diff.files_same} the same" if diff.files_changed else ""
    count = len(diff.metadata)
    metadata = f"; {count} metadata {'key differs' if count == 1 else 'keys differ'}" if count else ""
    return (f"tensors: {', '.join(parts)}{files}{metadata}; the server read {human_size(diff.bytes_read)} to "
            "compare values")


def diff_json(diff: Any) -> dict:
    """``tannery diff --json``: numbers that JSON cannot hold (an infinite relative L2, when A's
    norm is 0) are null."""
    return {
        "a": diff.a, "b": diff.b,
        "entries": [{"name": e.name, "change": e.change, "file": e.file, "dtype_a": e.dtype_a, "dtype_b": e.dtype_b,
                     "shape_a": list(e.shape_a), "shape_b": list(e.shape_b), "nbytes_a": e.nbytes_a,
                     "nbytes_b": e.nbytes_b, "values": _values_json(e.values)} for e in diff.entries],
        "metadata": {key: {"a": a, "b": b} for key, (a, b) in diff.metadata.items()},
        "summary": {"same": diff.same, "added": diff.added, "removed": diff.removed,
                    "type_changed": diff.type_changed, "value_changed": diff.value_changed,
                    "bytes_read": diff.bytes_read, "files_same": diff.files_same,
                    "files_changed": diff.files_changed},
    }


def _values_json(values: Any) -> dict | None:
    if values is None:
        return None
    finite = (lambda x: x if math.isfinite(x) else None)
    return {"elements": values.elements, "differing": values.differing, "fraction": values.fraction,
            "max_abs": finite(values.max_abs), "relative_l2": finite(values.relative_l2),
            "nan_appeared": values.nan_appeared, "inf_appeared": values.inf_appeared}


__all__ = ["cmd_diff", "diff_json", "summary_line"]
