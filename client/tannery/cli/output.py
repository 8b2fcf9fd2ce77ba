"""What the command prints: human sizes and times, tables, JSON and transfer progress bars.

Tables, status lines and JSON go to stdout; progress bars and errors to stderr, so a
script can read stdout while a person watches the bar. Nothing here imports torch.
"""

from __future__ import annotations

import datetime as dt
import io
import json
import re
import sys
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")


def human_size(nbytes: float) -> str:
    """A size in binary units with one decimal: ``512 B``, ``1.5 MiB``."""
    value = float(nbytes)
    for unit in _UNITS:
        if abs(value) < 1024 or unit == _UNITS[-1]:
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def as_datetime(value: Any) -> dt.datetime | None:
    """A record's creation time as an aware UTC datetime (from a datetime, a protobuf
    Timestamp or seconds since the epoch); None when there is none."""
    if value is None:
        return None
    if isinstance(value, dt.datetime):
        return value if value.tzinfo else value.replace(tzinfo=dt.timezone.utc)
    if hasattr(value, "ToDatetime"):
        if not (value.seconds or value.nanos):
            return None
        return value.ToDatetime(tzinfo=dt.timezone.utc)
    if isinstance(value, (int, float)):
        return dt.datetime.fromtimestamp(value, dt.timezone.utc)
    return None


def iso_time(value: Any) -> str | None:
    """A creation time for JSON: ISO 8601 in UTC, ``2025-01-31T12:00:00Z``; None when unknown."""
    when = as_datetime(value)
    if when is None:
        return None
    return when.astimezone(dt.timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


def local_time(value: Any) -> str:
    """A creation time for people: local time to the second, ``-`` when unknown."""
    when = as_datetime(value)
    return "-" if when is None else when.astimezone().strftime("%Y-%m-%d %H:%M:%S")


#: A list of numbers that json.dumps spread over lines (a raw newline never occurs inside a JSON string).
_NUMBER_LIST = re.compile(r"\[\n\s*([-+0-9.eE,\s]*?)\n\s*\]")


def compact_json(value: Any) -> str:
    """``value`` as JSON indented by two, with lists of numbers such as shapes on one line."""
    text = json.dumps(value, indent=2, allow_nan=False)
    return _NUMBER_LIST.sub(lambda m: "[" + " ".join(m.group(1).split()) + "]", text)


class Output:
    """Where a command writes: stdout for results, stderr for progress and errors.

    ``quiet`` silences status lines and progress bars (never results or errors). Bars
    are shown only when stderr is a terminal.
    """

    def __init__(self, quiet: bool = False, stdout: Any = None, stderr: Any = None) -> None:
        self.quiet = quiet
        self.stdout = stdout if stdout is not None else sys.stdout
        self.stderr = stderr if stderr is not None else sys.stderr

    def line(self, text: str = "", flush: bool = False) -> None:
        """A result line on stdout (printed even with --quiet)."""
        print(text, file=self.stdout, flush=flush)

    def status(self, text: str) -> None:
        """A line saying what was done, on stdout; silent with --quiet."""
        if not self.quiet:
            print(text, file=self.stdout)

    def note(self, text: str) -> None:
        """A line about progress (not a result) on stderr; silent with --quiet."""
        if not self.quiet:
            print(text, file=self.stderr, flush=True)

    def json(self, value: Any) -> None:
        """``value`` as indented JSON on stdout, lists of numbers (shapes) on one line."""
        print(compact_json(value), file=self.stdout)

    def table(self, columns: Sequence[tuple[str, str]], rows: Sequence[Sequence[str]], footer: str | None = None) -> None:
        """A table on stdout: ``columns`` are (header, justify) pairs, ``rows`` strings.

        On a terminal rich fits it to the width; otherwise rows never wrap, so ``grep``
        and ``awk`` see one row per line.
        """
        from rich.table import Table

        table = Table(box=None, header_style="bold", pad_edge=False, show_edge=False)
        for header, justify in columns:
            table.add_column(header, justify=justify, no_wrap=True, overflow="fold")
        for row in rows:
            table.add_row(*row)
        if _isatty(self.stdout):
            console = self._console(self.stdout)
            console.print(table)
            if footer:
                console.print(footer, highlight=False, markup=False)
            return
        # Off a terminal: plain text, no trailing spaces, one row per line.
        console = self._console(io.StringIO())
        with console.capture() as captured:
            console.print(table)
        for line in captured.get().splitlines():
            print(line.rstrip(), file=self.stdout)
        if footer:
            print(footer, file=self.stdout)

    @staticmethod
    def _console(stream: Any) -> Any:
        from rich.console import Console

        terminal = _isatty(stream)
        # Off a terminal: no colours, and as wide as the content needs.
        return Console(file=stream, width=None if terminal else 100_000, no_color=not terminal,
                       highlight=False, soft_wrap=not terminal)

    @contextmanager
    def transfer(self, description: str, total: int | None) -> Iterator[Callable[[int], None]]:
        """A progress bar of bytes on stderr (bytes done, rate, time left); yields the
        callback to report each transferred amount. A no-op off a terminal or with --quiet."""
        if self.quiet or not _isatty(self.stderr):
            yield _ignore
            return
        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

        console = self._console(self.stderr)
        columns = [TextColumn("{task.description}"), BarColumn(), DownloadColumn(binary_units=True),
                   _rate_column(), TimeRemainingColumn()]
        with Progress(*columns, console=console, transient=False) as progress:
            task = progress.add_task(description, total=total)

            def advance(nbytes: int) -> None:
                progress.update(task, advance=nbytes)

            yield advance
            if total is not None:
                progress.update(task, completed=total)


def _ignore(nbytes: int) -> None:
    pass


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def _rate_column() -> Any:
    """A rich column showing the transfer rate in binary units, ``12.3 MiB/s``."""
    from rich.progress import ProgressColumn
    from rich.text import Text

    class BinaryRateColumn(ProgressColumn):
        def render(self, task: Any) -> Text:
            speed = task.finished_speed or task.speed
            return Text("?" if speed is None else f"{human_size(speed)}/s", style="progress.data.speed")

    return BinaryRateColumn()
